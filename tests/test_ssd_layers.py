"""A model's own Mamba-2 layers carry their state between tokens (rnnify/cells/ssd.py,
rnnify/compiler/recurrences/mamba2.py, rnnify/compiler/passes/rewrite_scans.py): the loop against
the equations, and what only this family has; tests/test_own_layers.py holds the cell's forms
against the loop and converted Granite 4 (GraniteMoeHybrid), Bamba and Falcon-H1 against the
original models, with the cell, loop, inputs and tiny models defined here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import (
    TINY_HYBRID,
    assert_outputs_and_state_close,
    assert_round_trips_a_save,
    padding_mask,
    standard_normal,
    tiny_causal_lm,
)

import rnnify
from rnnify.cells import OWN_LAYERS, SSDCell, build_cell
from rnnify.cells.ssd import CHUNK, naive_recurrent_ssd  # noqa: F401 - CHUNK: for tests/test_own_layers.py
from rnnify.original import attention_transfer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

HEADS, WIDTH, GROUPS, STATE = 4, 3, 2, 5
DT_LIMITS = {"dt_min": 0.01, "dt_max": 2.0}
MODELS = ["bamba", "granitemoehybrid", "falcon_h1"]


def draw_inputs(gen, batch, length):
    """x, B, C, dt (before dt_bias and softplus), A_log, D, dt_bias, and a state."""
    draw = standard_normal(gen)
    args = (
        draw(batch, length, HEADS * WIDTH),
        draw(batch, length, GROUPS * STATE),
        draw(batch, length, GROUPS * STATE),
        draw(batch, length, HEADS),
        draw(HEADS).abs().log(),
        draw(HEADS),
        draw(HEADS),
    )
    return args, draw(batch, HEADS, WIDTH, STATE)


def new_cell():
    """With dt limits, as ``reference_loop``."""
    return build_cell("ssd", SSDCell.spec_for(HEADS, WIDTH, STATE), {"groups": GROUPS, **DT_LIMITS})


def reference_loop(*args_mask_state):
    return naive_recurrent_ssd(*args_mask_state, HEADS, GROUPS, **DT_LIMITS)


def _textbook(x, B, C, dt, A_log, D, dt_bias, mask, state):
    """The equations written once more, per real token and head, in fp64."""
    out = torch.zeros(x.shape[0], x.shape[1], HEADS, WIDTH, dtype=torch.float64)
    state = state.clone().double()
    for row, t in mask.nonzero().tolist():
        for h in range(HEADS):
            g = h // (HEADS // GROUPS)
            step = F.softplus(dt[row, t, h] + dt_bias[h])
            b, c = B[row, t, g * STATE : (g + 1) * STATE], C[row, t, g * STATE : (g + 1) * STATE]
            xh = x[row, t, h * WIDTH : (h + 1) * WIDTH]
            state[row, h] = torch.exp(-step * torch.exp(A_log[h])) * state[row, h] + step * torch.outer(xh, b)
            out[row, t, h] = state[row, h] @ c + D[h] * xh
    return out.flatten(2), state


def test_naive_loop_equals_the_equations_with_padding():
    """Without dt limits; rows left-padded, all real, and with nothing real (the state stays)."""
    args, state = draw_inputs(torch.Generator().manual_seed(0), 3, 9)
    mask = padding_mask(9, [4, 0, 9])
    got = naive_recurrent_ssd(*args, mask, state, HEADS, GROUPS)
    assert_outputs_and_state_close(got, _textbook(*args, mask, state), mask, tol=1e-12)


def test_cell_options_are_checked():
    spec = SSDCell.spec_for(HEADS, WIDTH, STATE)
    with pytest.raises(rnnify.RnnifyError, match="num_heads"):
        build_cell("ssd", spec, {"groups": 3})
    with pytest.raises(rnnify.RnnifyError, match="dt_min"):
        build_cell("ssd", spec, {"groups": GROUPS, "dt_min": 1.0, "dt_max": 0.5})
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'ssd'"):
        rnnify.convert("unused", to="ssd")  # a layer's own scan, never a --to target
    assert {"ssd", "short_conv"} <= OWN_LAYERS


def tiny_model(model_type: str):
    """Two layers, a Mamba-2 layer then attention (Falcon-H1: both in each layer), with 2 heads of
    Mamba, a chunk of 16 and a 3-token convolution."""
    mamba = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=16)
    layouts = {
        "bamba": dict(attn_layer_indices=[1]),
        "granitemoehybrid": dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2),
        "falcon_h1": dict(head_dim=16, mamba_d_ssm=128),
    }
    sizes = dict(hidden_size=64, intermediate_size=128, mamba_d_conv=3)
    return tiny_causal_lm(model_type, **TINY_HYBRID, **sizes, **mamba, **layouts[model_type])


def test_other_targets_keep_the_scan_and_save(tmp_path):
    """A window target replaces the attention and keeps the model's own layers, which round-trip a
    save, and which attention transfer leaves out."""
    model = rnnify.convert(tiny_model("granitemoehybrid"), to="window", window=4)
    assert [cell.target for cell in model.cells] == ["short_conv", "ssd", "window"]  # in layer order
    ids = torch.randint(3, 320, (1, 30), generator=torch.Generator().manual_seed(4))
    back = assert_round_trips_a_save(model, tmp_path / "granite", ids)
    assert back.cells[1].options() == model.cells[1].options()
    with attention_transfer(model) as recorder:  # the scan is the source's own layer: not compared
        model(ids, model.init_state(1))
        assert [error.tokens for error in recorder.errors()] == [0, 0, 30]
