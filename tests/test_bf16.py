"""bfloat16 models: weights in bf16, every state that accumulates in fp32.

A cell fed bf16 q, k, v must keep the state an fp32 run on the same values keeps (so nothing is
summed or stored at bf16 precision) and round only its output; a converted bf16 model must step as
it prefills, and stay close to the fp32 model it was rounded from.
"""

from __future__ import annotations

import pytest
import torch
from support import TINY_MIXTRAL, decode, decode_from, random_qkv, rel_diff, tiny_causal_lm

import rnnify
from rnnify.cells import Cell, CellSpec, build_cell

SPEC = CellSpec(num_heads=4, num_kv_heads=2, head_dim=8, value_dim=6, scale=8**-0.5, hidden_size=12)
CACHES = ("keys", "values", "sink_keys", "sink_values")  # copies of bf16 keys/values: lossless in bf16

CELLS = [
    ("exact", {}),
    ("window", {"window": 16, "sinks": 2}),
    ("linear", {}),
    ("linear", {"feature_map": "hedgehog"}),
    ("gated", {"gate": "gla"}),
    ("aaren", {}),
    ("hybrid", {"window": 16}),
    ("hybrid", {"window": 16, "memory": "gated-delta"}),
    ("delta", {}),
    ("gated-delta", {}),
    ("gated-rnn", {}),
]


def _run(cell: Cell, inputs: list[tuple], dtype: torch.dtype):
    """Outputs and the last state of ``cell`` over ``inputs`` [(q, k, v, mask, x)], cast to ``dtype``."""
    state = cell.init_state(2, torch.device("cpu"), dtype)
    outs = []
    for q, k, v, mask, x in inputs:
        q, k, v, x = (t.to(dtype) for t in (q, k, v, x))
        out, *state = cell(q, k, v, mask, *state, **({"x": x} if cell.needs_input else {}))
        outs.append(out)
    return torch.cat(outs, 2), state


@pytest.mark.parametrize("kernels", ["none", "reference"])
@pytest.mark.parametrize(
    "target, options", CELLS, ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(map(str, v.values()))
)
def test_a_cell_fed_bf16_keeps_the_state_of_an_fp32_run(target, options, kernels):
    gen = torch.Generator().manual_seed(0)
    cell = build_cell(target, SPEC, options)
    cell.use_kernels(kernels)
    inputs = []
    for length in (40, 1, 1, 7, 1):  # a prefill, steps, a continued prefill, a step
        # bf16 values, so both runs read the same numbers
        q, k, v = (t.bfloat16().float() for t in random_qkv(2, SPEC, length, gen))
        x = torch.randn(2, length, SPEC.hidden_size, generator=gen).bfloat16().float()
        mask = torch.ones(2, length, dtype=torch.bool)
        mask[1, 0] = length < 2  # a padded token in the first prefill
        inputs.append((q, k, v, mask, x))
    out16, state16 = _run(cell, inputs, torch.bfloat16)
    out32, state32 = _run(cell, inputs, torch.float32)
    assert out16.dtype == torch.bfloat16
    for name, got, want in zip(cell.state_names, state16, state32):
        if got.is_floating_point():
            assert got.dtype == (torch.bfloat16 if name in CACHES else torch.float32), name
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-6, msg=name)
    # only the output is rounded: to the nearest bf16 of the fp32 result (one ulp either way)
    torch.testing.assert_close(out16.float(), out32, rtol=2**-7, atol=1e-6)


@pytest.fixture(scope="module")
def bf16_hybrid(tiny_model_dir):
    """A hybrid whose fp32 memory is summed in from the start (memory_init=1): both kinds of state count."""
    return rnnify.convert(tiny_model_dir("llama"), to="hybrid", window=8, memory_init=1, dtype="bfloat16")


def test_bf16_model_holds_bf16_weights_and_fp32_cell_parameters(bf16_hybrid):
    cells = [name for name, module in bf16_hybrid.graph.named_modules() if isinstance(module, Cell)]
    weights = dict(bf16_hybrid.graph.named_parameters())
    assert len(weights) > 2 * len(cells)
    for name, tensor in weights.items():
        in_cell = any(name.startswith(cell + ".") for cell in cells)
        assert tensor.dtype == (torch.float32 if in_cell else torch.bfloat16), name
    assert bf16_hybrid.manifest.dtype == "bfloat16"


def test_bf16_steps_match_bf16_prefill_and_stay_close_to_fp32(bf16_hybrid, tiny_model_dir):
    fp32 = rnnify.convert(tiny_model_dir("llama"), to="hybrid", window=8, memory_init=1)
    ids = torch.randint(1, bf16_hybrid.manifest.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits, state = bf16_hybrid.prefill(ids)
    stepped, step_state = decode(bf16_hybrid, ids, 1)
    assert logits.dtype == torch.bfloat16
    names = [name for cell in bf16_hybrid.cells for name in cell.state_names]
    for name, a, b in zip(names, state.tensors, step_state.tensors):
        if a.is_floating_point():
            assert a.dtype == b.dtype == (torch.bfloat16 if name in CACHES else torch.float32), name
    # bf16 rounds each product of the graph to 8 bits (2^-8 = 0.4%); the two paths round differently
    assert rel_diff(stepped, logits) < 2e-2
    assert rel_diff(logits, fp32.prefill(ids)[0]) < 3e-2


def test_a_bf16_mixture_of_experts_decodes_a_left_padded_batch_as_the_original_does():
    """In bfloat16 a left-padded batch rounds otherwise than its rows alone, and a router may send a
    token to another expert for it, in the original as in its conversion; so the conversion is held
    to the original decoding the same batch (its cache, mask and positions), far below that rounding."""
    source = tiny_causal_lm("mixtral", **{**TINY_MIXTRAL, "num_hidden_layers": 2}).to(torch.bfloat16)
    model = rnnify.convert(source, to="exact")
    ids = torch.randint(1, TINY_MIXTRAL["vocab_size"], (2, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    positions, prompt = (mask.cumsum(1) - 1).clamp(min=0), 10
    logits, state = model.prefill(ids[:, :prompt], attention_mask=mask[:, :prompt])
    got = torch.cat([logits, decode_from(model, ids[:, prompt:], state)[0]], 1)
    with torch.no_grad():
        out = source(ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=positions[:, :prompt])
        want, cache = [out.logits], out.past_key_values
        for t in range(prompt, ids.shape[1]):
            at = {"attention_mask": mask[:, : t + 1], "position_ids": positions[:, t : t + 1]}
            out = source(ids[:, t : t + 1], past_key_values=cache, **at)
            want.append(out.logits)
            cache = out.past_key_values
    want = torch.cat(want, 1)
    assert got.dtype == torch.bfloat16
    assert rel_diff(got[0], want[0]) < 1e-3 and rel_diff(got[1, 5:], want[1, 5:]) < 1e-3
