"""Tiny models converted to window and hybrid targets: against the original (Mistral, whose own
sliding window the window cell reproduces) and against themselves (step = prefill, save and load,
left-padded rows, older manifests, the donated step)."""

from __future__ import annotations

import json

import pytest
import torch
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
    decode,
    padding_mask,
    rel_diff,
    reseal,
)
from transformers import AutoModelForCausalLM
from window_support import (
    seeded,
)

import rnnify
from rnnify.cells import parameters
from rnnify.kernels import slots
from rnnify.runtime.agreement import rounding_dtype, tolerance
from rnnify.runtime.manifest import MANIFEST_FILE

# --------------------------------------------------------------------------- converted models


VARIANTS = {
    "window": ("window", {"window": 8, "sinks": 2}),
    "hybrid": ("hybrid", {"window": 8, "sinks": 3, "memory_init": 0.5}),  # without sinks: the tests below
}


@pytest.fixture(scope="module")
def converted(tiny_model_dir):
    cache = {}

    def get(arch: str, target: str, **options):
        key = (arch, target, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = rnnify.convert(tiny_model_dir(arch), to=target, **options)
        return cache[key]

    return get


def test_window_equals_mistral_with_its_own_sliding_window(tiny_model_dir, converted):
    """Mistral (sliding_window=16), 80 tokens, batch 2: the original's full forward, eager attention."""
    path = tiny_model_dir("mistral")
    model = converted("mistral", "window")
    assert all(cell.window == 16 and cell.sinks == 0 for cell in model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 80), generator=seeded(11))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()(input_ids=ids).logits
    one_shot, state = model.prefill(ids)
    assert rel_diff(one_shot, expected) < 1e-4
    stepped, stepped_state = decode(model, ids, 8)
    assert rel_diff(stepped, expected) < 1e-4
    assert torch.equal(stepped.argmax(-1), expected.argmax(-1))
    assert state.nbytes == stepped_state.nbytes == model.prefill(ids[:, :20])[1].nbytes == model.state_nbytes(80, 2)


@pytest.mark.parametrize("kv_dtype, tolerance", [("float16", 1e-3), ("int8", 1e-2)])
def test_a_window_storing_fewer_bytes_stays_near_mistral(tiny_model_dir, converted, kv_dtype, tolerance):
    """Mistral's own sliding window with slots of float16 or int8 (``rnnify.kernels.slots``): near the
    original's logits, stepped as prefilled, in half or (d + 1) / 4d of fp32's bytes."""
    path = tiny_model_dir("mistral")
    full, stored = converted("mistral", "window"), converted("mistral", "window", kv_dtype=kv_dtype)
    ids = torch.randint(0, stored.manifest.vocab_size, (2, 80), generator=seeded(11))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()(input_ids=ids).logits
    one_shot, _ = stored.prefill(ids)
    assert 0 < rel_diff(one_shot, expected) < tolerance
    stepped, _ = decode(stored, ids, 8)
    assert rel_diff(stepped, one_shot) < tolerance
    head_dim = stored.cells[0].spec.head_dim
    ratio = 0.5 if kv_dtype == "float16" else (head_dim + 1) / (4 * head_dim)
    held = [sum(t.nbytes for t in m.init_state(1).tensors if t.dtype != torch.long) for m in (full, stored)]
    assert held[1] == ratio * held[0]  # the keys and values; the token counters are as before


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_a_window_storing_fewer_bits_steps_as_it_prefills_at_its_rounding(arch, kv_dtype, converted, tmp_path):
    """Stepped, split, left-padded and reloaded, a window whose slots round its keys and values agrees
    with its one-shot prefill within half precision's tolerance (``agreement.rounding_dtype``: a key's
    last-bit difference between two routes may cross a rounding boundary), and its state reads back
    as close; saved and loaded, it computes the same logits bit for bit, in the same bytes."""
    model = converted(arch, "window", window=8, sinks=2, kv_dtype=kv_dtype)
    limit = tolerance(rounding_dtype(model))
    assert rounding_dtype(model) == torch.bfloat16 and limit == 2e-2
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=seeded(13))
    full, full_state = model.prefill(ids)
    assert rel_diff(decode(model, ids, 1)[0], full) < limit
    first, state = model.prefill(ids[:, :23])
    second, state = model.prefill(ids[:, 23:], state)
    assert rel_diff(torch.cat([first, second], 1), full) < limit
    for a, b in zip(state.tensors, full_state.tensors):  # slots as the values they hold; counters equal
        if a.dtype == torch.long:
            assert torch.equal(a, b)
        else:
            assert rel_diff(slots.decode(a), slots.decode(b)) < limit
    assert_left_padded_rows_equal_rows_alone(model, [14, 9, 3], seeded(15), tol=limit)
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert torch.equal(loaded.prefill(ids)[0], full) and loaded.state_nbytes(40) == model.state_nbytes(40)


def test_hybrid_with_a_window_over_the_whole_context_equals_the_original(tiny_model_dir, converted):
    path = tiny_model_dir("llama")
    model = converted("llama", "hybrid", window=64)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 48), generator=seeded(12))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()(input_ids=ids).logits
    stepped, _ = decode(model, ids, 16)
    assert rel_diff(stepped, expected) < 1e-4


@pytest.mark.parametrize("arch, sinks", [("gpt2", 0), ("gpt2", 2), ("llama", 2)])  # window: as VARIANTS
def test_training_free_hybrid_model_computes_its_window_target(arch, sinks, converted):
    """A freshly converted hybrid is never worse than its window alone: it is the window target
    with the same window and sinks, in a prefill and in decode."""
    hybrid = converted(arch, "hybrid", window=8, sinks=sinks)
    window = converted(arch, "window", window=8, sinks=sinks)
    ids = torch.randint(0, hybrid.manifest.vocab_size, (2, 40), generator=seeded(15))
    assert rel_diff(hybrid.prefill(ids)[0], window.prefill(ids)[0]) < 1e-5
    assert rel_diff(decode(hybrid, ids, 30)[0], decode(window, ids, 30)[0]) < 1e-5


def test_hybrid_saved_before_sinks_existed_loads_without_sinks(converted, tmp_path):
    """A manifest whose hybrid options lack ``sinks`` (saves from before the option) loads as S = 0,
    with the five state tensors its saved graph threads."""
    model = converted("gpt2", "hybrid", window=8, sinks=0)
    model.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / MANIFEST_FILE).read_text())
    for entry in manifest["cells"]:
        del entry["options"]["sinks"]
    reseal(tmp_path / "m", cells=manifest["cells"])
    loaded = rnnify.load(tmp_path / "m")
    assert [c.sinks for c in loaded.cells] == [0] * len(model.cells)
    assert [c.state_names for c in loaded.cells] == [("keys", "values", "length", "kv", "k_sum")] * len(model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 30), generator=seeded(16))
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])
    assert rel_diff(decode(loaded, ids, 20)[0], decode(model, ids, 20)[0]) < 1e-6


def test_hybrid_part_of_a_head_split_saved_before_sinks_existed_loads_without_sinks(converted, tmp_path):
    """A head split's hybrid part whose manifest options lack ``sinks`` loads as S = 0, as a whole
    hybrid cell does (``Cell.manifest_defaults`` apply to the parts too), not with today's default."""
    model = converted("llama", "hybrid", layers="0-:heads(1=exact;*=hybrid(window=8,sinks=0))")
    model.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / MANIFEST_FILE).read_text())
    for entry in manifest["cells"]:
        del entry["options"]["groups"][1]["options"]["sinks"]
    reseal(tmp_path / "m", cells=manifest["cells"])
    loaded = rnnify.load(tmp_path / "m")
    assert [cell.parts[1].sinks for cell in loaded.cells] == [0] * len(model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 30), generator=seeded(17))
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_step_equals_prefill_and_prefill_continues(arch, variant, converted):
    target, options = VARIANTS[variant]
    model = converted(arch, target, **options)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=seeded(13))
    assert_steps_and_split_prefill_match(model, ids, 23)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_state_is_constant_and_saves(arch, variant, converted, tmp_path):
    target, options = VARIANTS[variant]
    model = converted(arch, target, **options)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 100), generator=seeded(14))
    _, short = model.prefill(ids[:, :16])
    logits, long = model.prefill(ids)
    assert short.nbytes == long.nbytes == model.state_nbytes(16) == model.state_nbytes(100)
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    assert torch.equal(loaded.prefill(ids)[0], logits)
    if target == "hybrid":
        assert [c.sinks for c in loaded.cells] == [options.get("sinks", 0)] * len(model.cells)
        assert {n for n, _ in loaded.named_parameters() if "window_logit" in n}
        assert len(list(parameters(loaded))) == len(list(parameters(model))) >= len(model.cells)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_left_padded_rows_equal_rows_alone(arch, variant, converted):
    target, options = VARIANTS[variant]
    model = converted(arch, target, **options)
    assert_left_padded_rows_equal_rows_alone(model, [14, 9, 3], seeded(15))


@pytest.mark.parametrize("layers", [None, "0:heads(0=window(window=4,sinks=1);1=linear)"])
def test_a_donated_step_writes_the_ring_in_place_and_equals_the_step(tiny_model_dir, layers):
    """``step(donate=True)`` writes each window's ring into the state it was given (a whole window
    cell, and a head split's window part) and returns what the step that copies returns, bit for bit:
    logits and every state tensor, over rows that read prompts of different lengths."""
    from rnnify.runtime.state import RecurrentState

    options = {"layers": layers} if layers else {}
    model = rnnify.convert(str(tiny_model_dir("llama")), to="window", window=6, sinks=2, **options)
    ids = torch.randint(1, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = padding_mask(11, [0, 4, 9])
    _, state = model.prefill(ids, attention_mask=mask)
    for token in range(5):  # through the ring's wrap
        tok = torch.full((3, 1), 7 + token)
        copy = RecurrentState(tuple(t.clone() for t in state.tensors), state.positions.clone(), state.model_uid)
        want_logits, want = model.step(tok, copy)
        ring = state.tensors[0]
        logits, state = model.step(tok, state, donate=True)
        assert state.tensors[0] is ring  # written in place, not copied
        assert torch.equal(logits, want_logits)
        assert all(torch.equal(a, b) for a, b in zip(state.tensors, want.tensors))


def test_a_donated_step_keeps_the_compiled_step_where_that_is_faster(tiny_model_dir):
    """A donated step writes a window's ring in place only from ``IN_PLACE_FROM_ROWS`` rows when the
    model has a compiled step: below that, and at any rows where no cell writes in place (the fused
    op's window here), it runs the compiled step and leaves the state it was given as it was."""
    from rnnify.runtime.model import IN_PLACE_FROM_ROWS

    model = rnnify.convert(str(tiny_model_dir("llama")), to="window", window=6, sinks=2)
    calls = []

    class Compiled:  # stands in for a step compiled ahead of time: the eager step, its calls counted
        def serves(self, _model):
            return True

        def __call__(self, *inputs):
            calls.append(1)
            return model._direct_forward()(model.graph, *inputs)

    model._step_package = Compiled()
    for kernels, rows, in_place in (
        ("none", IN_PLACE_FROM_ROWS - 1, False),
        ("none", IN_PLACE_FROM_ROWS, True),
        ("reference", IN_PLACE_FROM_ROWS, False),
    ):
        model.use_kernels(kernels)
        _, state = model.prefill(torch.randint(1, 200, (rows, 9), generator=torch.Generator().manual_seed(rows)))
        ring, calls[:] = state.tensors[0], []
        before = ring.clone()
        _, new = model.step(torch.full((rows, 1), 5), state, donate=True)
        assert (new.tensors[0] is ring) == in_place and bool(calls) != in_place, (kernels, rows)
        if not in_place:
            assert torch.equal(ring, before)
