"""The `delta` and `gated-delta` targets (DeltaCell, GatedDeltaCell) against the float64 reference
of tests/delta_support.py: every form, the fused path, training, options and a converted model."""

from __future__ import annotations

import pytest
import torch
from delta_support import (
    SPEC,
    make_cell,
    make_inputs,
    reference,
    rel_diff,
)
from kernel_support import nan_buffers  # noqa: F401 - autouse: NaN-filled kernel outputs

import rnnify
from rnnify.cells import CellSpec, build_cell, parameters
from rnnify.cells.delta import (
    chunk_delta_attn,
    naive_recurrent_delta_attn,
    step_delta_attn,
)
from rnnify.errors import RnnifyError


@pytest.mark.parametrize("target", ["delta", "gated-delta"])
def test_cell_matches_float64_reference(target):
    cell = make_cell(target)
    q, k, v, x, mask = make_inputs(19)
    ref, ref_S = reference(cell, q, k, v, x, mask)
    out, S = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
    real = mask[:, None, :, None].expand_as(out)
    assert rel_diff(out[real], ref[real]) < 1e-5 and rel_diff(S, ref_S) < 1e-5
    # decode: one token at a time from the state the prefill of the first 7 left
    _, state = cell(
        q[:, :, :7], k[:, :, :7], v[:, :, :7], mask[:, :7], *cell.init_state(2, q.device, q.dtype), x=x[:, :7]
    )
    outs = []
    for t in range(7, 19):
        o, state = cell(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], state, x=x[:, t : t + 1]
        )
        outs.append(o)
    assert rel_diff(torch.cat(outs, 2), ref[:, :, 7:]) < 1e-5 and rel_diff(state, ref_S) < 1e-5


@pytest.mark.parametrize("gated", [False, True])
def test_forms_agree(gated):
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(2, 2, 3, 23, 8, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(2, 2, 23, 8, generator=gen), dim=-1)
    v, beta = torch.randn(2, 2, 23, 6, generator=gen), torch.rand(2, 2, 23, generator=gen)
    log_a = -torch.rand(2, 2, 23, generator=gen) if gated else None
    kv = torch.randn(2, 2, 8, 6, generator=gen)
    ref, ref_kv = naive_recurrent_delta_attn(q, k, v, beta, log_a, kv)
    for chunk in (1, 5, 64):
        out, new_kv = chunk_delta_attn(q, k, v, beta, log_a, kv, chunk)
        assert rel_diff(out, ref) < 1e-5 and rel_diff(new_kv, ref_kv) < 1e-5
    outs, state = [], kv
    for t in range(23):
        o, state = step_delta_attn(
            q[:, :, :, t : t + 1],
            k[:, :, t : t + 1],
            v[:, :, t : t + 1],
            beta[:, :, t : t + 1],
            None if log_a is None else log_a[:, :, t : t + 1],
            state,
        )
        outs.append(o)
    assert rel_diff(torch.cat(outs, 3), ref) < 1e-5 and rel_diff(state, ref_kv) < 1e-5


def test_initialisation_is_modest():
    """Training-free: beta = beta_init and alpha = decay_init for every token; outputs stay on the
    scale of the values (no normaliser needed)."""
    cell = build_cell("gated-delta", SPEC, {"beta_init": 0.3, "decay_init": 0.95})
    q, k, v, x, mask = make_inputs(100, pad=0)
    beta, log_a = cell.writer(x * 100, mask)
    torch.testing.assert_close(beta, torch.full_like(beta, 0.3))
    torch.testing.assert_close(log_a.exp(), torch.full_like(log_a, 0.95))
    for target in ("delta", "gated-delta"):
        cell = build_cell(target, SPEC)
        out, _ = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
        assert out.abs().max() <= v.abs().max()


def test_trainable_parameters_and_gradients():
    cell = make_cell("gated-delta")
    names = {n for n, _ in cell.named_parameters()}
    assert names == {
        "writer.beta_proj.weight",
        "writer.beta_proj.bias",
        "writer.gate_proj.weight",
        "writer.gate_proj.bias",
    }
    assert len(list(parameters(torch.nn.ModuleList([cell])))) == 4
    q, k, v, x, mask = make_inputs(9)
    out, _ = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in cell.parameters())


@pytest.mark.parametrize(
    "target, kernels",
    [
        ("delta", "reference"),
        ("gated-delta", "reference"),
        pytest.param("gated-delta", "triton", marks=pytest.mark.slow),
    ],
)
def test_fused_matches_own_forms(target, kernels):
    """The kernels' ops (the reference path; Triton through the interpreter, slow) against the cell's own forms: left-padded prefill then decode steps, outputs, state and
    gradients of q, k, v, x and the cell's parameters."""
    cell = make_cell(target)
    inputs = make_inputs(7, pad=2)

    def run(kernels):
        cell.use_kernels(kernels)
        q, k, v, x, mask = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
        state = cell.init_state(2, q.device, q.dtype)
        outs = []
        for t in (slice(0, 5), slice(5, 6), slice(6, 7)):
            out, *state = cell(q[:, :, t], k[:, :, t], v[:, :, t], mask[:, t], *state, x=x[:, t])
            outs.append(out)
        out = torch.cat(outs, 2)
        leaves = [q, k, v, x, *cell.parameters()]
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, 6)).sum() + state[0].square().sum(), leaves)
        return out.detach(), state[0].detach(), grads

    expected = run("none")
    assert cell.use_kernels("triton") == {"prefill": "chunk_delta_rule", "decode": "fused_recurrent_delta_rule"}
    out, state, grads = run(kernels)
    real = inputs[4][:, None, :, None].expand_as(out)
    assert rel_diff(out[real], expected[0][real]) < 1e-5 and rel_diff(state, expected[1]) < 1e-5
    for a, b in zip(grads, expected[2]):
        assert rel_diff(a, b) < 1e-4


def test_options_are_checked():
    with pytest.raises(RnnifyError, match="beta_init must be a number strictly between 0 and 1"):
        build_cell("delta", SPEC, {"beta_init": 1.0})
    with pytest.raises(RnnifyError, match="decay_init must be"):
        build_cell("gated-delta", SPEC, {"decay_init": 0})
    with pytest.raises(RnnifyError, match="unexpected keyword argument 'decay_init'"):
        build_cell("delta", SPEC, {"decay_init": 0.9})
    with pytest.raises(RnnifyError, match="hidden_size"):
        build_cell("delta", CellSpec(4, 2, 8, 6, 0.3))
    assert build_cell("gated-delta", SPEC).options() == {"beta_init": 0.5, "chunk_size": 64, "decay_init": 0.99}


@pytest.mark.slow
def test_convert_tiny_llama_left_padded(tiny_model_dir):
    """A converted model: a left-padded row gives the same logits as the same row unpadded."""
    model = rnnify.convert(tiny_model_dir("llama"), to="gated-delta", chunk_size=4)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    alone, _ = model.prefill(ids)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1).repeat(2, 1)
    padded[1, :3] = ids[0, :3]
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[0, :3] = False
    logits, _ = model.prefill(padded, attention_mask=mask)
    assert rel_diff(logits[0, 3:], alone[0]) < 1e-4
