"""A model's own Mamba-1 layers carry their state between tokens (rnnify/cells/selective_scan.py,
rnnify/compiler/recurrences/mamba.py, rnnify/compiler/passes/rewrite_scans.py): the captured op
against transformers' own scan, and what only this family has; tests/test_own_layers.py holds the
loop against the equations, the cell's forms against the loop and converted Jamba and Zamba against
the original models, with the cell, loop, equations, inputs and tiny models defined here."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from support import (
    TINY_HYBRID,
    assert_round_trips_a_save,
    original_logits,
    rel_diff,
    standard_normal,
    tiny_causal_lm,
)

import rnnify
from rnnify.cells import OWN_LAYERS, SelectiveScanCell, build_cell
from rnnify.cells.selective_scan import CHUNK, chunk_selective_scan, naive_recurrent_selective_scan
from rnnify.compiler.recurrences.mamba import MAMBA_SELECTIVE_SCAN

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

CHANNELS, STATE = 6, 5
MODELS = ["jamba", "zamba"]


def draw_inputs(gen, batch, length):
    """x, dt (before dt_bias and softplus), A, B, C, D, z, dt_bias, in the cell's layout, and a state."""
    draw = standard_normal(gen)
    args = (
        draw(batch, length, CHANNELS),
        draw(batch, length, CHANNELS),
        -torch.exp(draw(CHANNELS, STATE)),
        draw(batch, length, STATE),
        draw(batch, length, STATE),
        draw(CHANNELS),
        draw(batch, length, CHANNELS),
        draw(CHANNELS),
    )
    return args, draw(batch, CHANNELS, STATE)


def new_cell():
    return build_cell("selective_scan", SelectiveScanCell.spec_for(CHANNELS, STATE), {})


reference_loop = naive_recurrent_selective_scan


def textbook(x, dt, A, B, C, D, z, dt_bias, mask, state):
    """The equations written once more, per real token, channel and state entry, in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    h = state.clone().double()
    for row, t in mask.nonzero().tolist():
        for d in range(CHANNELS):
            step = F.softplus(dt[row, t, d] + dt_bias[d])
            for n in range(STATE):
                h[row, d, n] = torch.exp(step * A[d, n]) * h[row, d, n] + step * B[row, t, n] * x[row, t, d]
            y = (h[row, d] * C[row, t]).sum() + D[d] * x[row, t, d]
            out[row, t, d] = y * z[row, t, d] * torch.sigmoid(z[row, t, d])
    return out, h


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunk_sizes_agree(chunk):
    """The doubling scan within chunks of any size (powers of 2 or not, the last one short)."""
    gen = torch.Generator().manual_seed(chunk)
    x, dt, A, B, C = (a.float() for a in draw_inputs(gen, 2, 37)[0][:5])
    dt = F.softplus(dt)
    state = torch.randn(2, CHANNELS, STATE, generator=gen)
    want, want_state = chunk_selective_scan(x, dt, A, B, C, state, chunk=CHUNK)
    out, got_state = chunk_selective_scan(x, dt, A, B, C, state, chunk=chunk)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_scan_equals_transformers_scan(dtype):
    """The stand-in (the op, through the cell) against transformers' own ``mamba_selective_scan``, in
    the source's channels-first layout, with its output dtype (fp32 for bf16 inputs: the skip
    weights are fp32)."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    gen = torch.Generator().manual_seed(6)
    x, dt, A, B, C, D, z, dt_bias = (a.float() for a in draw_inputs(gen, 2, 40)[0])
    x, dt, B, C, z = (v.to(dtype) for v in (x, dt, B, C, z))
    op_args = (x, dt, A, B, C, D, z, dt_bias)
    torch.library.opcheck(
        torch.ops.rnnify.selective_scan.default, op_args, test_utils=("test_schema", "test_faketensor")
    )
    x, dt, B, C, z = (v.transpose(1, 2) for v in (x, dt, B, C, z))  # the source's layout
    kwargs = dict(D=D, z=z, delta_bias=dt_bias, delta_softplus=True)
    want = mamba_selective_scan(x, dt, A, B, C, **kwargs)
    got = MAMBA_SELECTIVE_SCAN.stand_in(x, dt, A, B, C, **kwargs)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == x.shape
    assert rel_diff(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


def tiny_model(model_type: str):
    """Two layers (Jamba: a Mamba layer, then attention; Zamba: two hybrid layers, each its Mamba
    layer of 2 heads after the shared attention), with weights drawn wide enough (and decays, steps
    and skip weights redrawn) that the scan moves the logits: zeroing its state does, by far more
    than the tests' tolerance."""
    mamba = dict(mamba_d_state=8, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=4)
    layouts = {
        "jamba": dict(attn_layer_period=2, attn_layer_offset=1, num_experts=1),
        "zamba": dict(n_mamba_heads=2, layers_block_type=["hybrid", "hybrid"]),
    }
    sizes = dict(hidden_size=32, intermediate_size=64, initializer_range=0.3)
    model = tiny_causal_lm(model_type, **TINY_HYBRID, **sizes, **mamba, **layouts[model_type])
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("A_log"):
                weight.uniform_(-1.0, 1.0)
            elif name.endswith((".D", "dt_proj.bias", "dt_proj_bias")):
                weight.normal_()
    return model


def test_window_keeps_the_scans_and_saves(tmp_path):
    """A window target replaces the attention and keeps the model's own layers where they were; the
    window model equals the original on a prompt no longer than the window, and round-trips a save."""
    source = tiny_model("jamba")
    exact = rnnify.convert(source, to="exact")
    model = rnnify.convert(source, to="window", window=4)
    assert [cell.target for cell in model.cells] == [
        "window" if cell.target == "exact" else cell.target for cell in exact.cells
    ]

    def own(m):
        return [dataclasses.replace(entry, module="") for entry in m.manifest.cells if entry.target in OWN_LAYERS]

    assert own(model) == own(exact) and len(own(model)) == 2
    ids = torch.randint(3, 320, (2, 30), generator=torch.Generator().manual_seed(4))
    assert rel_diff(model.prefill(ids[:, :4])[0], original_logits(source, ids[:, :4])) < 1e-4
    back = assert_round_trips_a_save(model, tmp_path / "jamba", ids)
    assert [cell.options() for cell in back.cells] == [cell.options() for cell in model.cells]
