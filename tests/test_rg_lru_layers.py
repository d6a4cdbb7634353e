"""A model's own RG-LRU layers (RecurrentGemma's Griffin blocks) carry their state between tokens
(rnnify/cells/rg_lru.py, rnnify/compiler/recurrences/rg_lru.py, rnnify/compiler/passes/rewrite_scans.py):
the captured op against transformers' own scan, and what only this family has;
tests/test_own_layers.py holds the loop against the equation, the cell's forms against the loop and
converted RecurrentGemma against the original model, with the cell, loop, equation, inputs and tiny
model defined here."""

from __future__ import annotations

import pytest
import torch
from support import (
    TINY_HYBRID,
    assert_outputs_and_state_close,
    assert_round_trips_a_save,
    original_logits,
    padding_mask,
    rel_diff,
    standard_normal,
    tiny_causal_lm,
)

import rnnify
from rnnify.cells import RGLRUCell, build_cell
from rnnify.cells.rg_lru import CHUNK, naive_recurrent_rg_lru  # noqa: F401 - CHUNK: for tests/test_own_layers.py
from rnnify.compiler.recurrences.rg_lru import RG_LRU

CHANNELS = 6
MODELS = ["recurrent_gemma"]


def draw_inputs(gen, batch, length):
    """u ``[b, t, D]`` and decays a in (0, 1) (a few exactly 0: a reset), and a state ``[b, D]``."""
    draw = standard_normal(gen)
    a = torch.sigmoid(3 * draw(batch, length, CHANNELS))
    a[:, length // 2, : CHANNELS // 2] = 0.0
    return (draw(batch, length, CHANNELS), a), draw(batch, CHANNELS)


def new_cell():
    return build_cell("rg_lru", RGLRUCell.spec_for(CHANNELS), {})


reference_loop = naive_recurrent_rg_lru


def textbook(u, a, mask, state):
    """The equation written once more, per real token and channel, in fp64."""
    out = torch.zeros(u.shape, dtype=torch.float64)
    h = state.clone().double()
    for row, t in mask.nonzero().tolist():
        for d in range(CHANNELS):
            h[row, d] = a[row, t, d] * h[row, d] + u[row, t, d]
            out[row, t, d] = h[row, d]
    return out, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_scan_equals_transformers_scan(dtype):
    """The stand-in (the op, through the cell) against transformers' own ``_rnn_scan``, with a reset
    (position 0) at the first token and in the middle, in the source's dtypes (its states fp32)."""
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    gen = torch.Generator().manual_seed(6)
    (u, a), _ = draw_inputs(gen, 2, 40)
    u, a = u.to(dtype), a.to(dtype)
    positions = torch.cat([torch.arange(25), torch.arange(15)])[None].expand(2, -1)
    reset = positions[:, :, None] == 0
    torch.library.opcheck(torch.ops.rnnify.rg_lru.default, (u, a), test_utils=("test_schema", "test_faketensor"))
    layer = RecurrentGemmaRglru.__new__(RecurrentGemmaRglru)  # _rnn_scan reads none of the layer's weights
    want, _ = RecurrentGemmaRglru._rnn_scan(layer, u, a, reset, None)
    got, final = RG_LRU.stand_in(layer, u, a, reset, None)
    assert final is None and got.dtype == want.dtype == dtype and got.shape == want.shape
    assert rel_diff(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    with pytest.raises(rnnify.RnnifyError, match="cache during capture"):
        RG_LRU.stand_in(layer, u, a, reset, torch.zeros(2, CHANNELS))


def tiny_model(model_type: str):
    """Three layers, Griffin's pattern: two recurrent blocks (a short convolution, then the RG-LRU),
    then local attention over a window shorter than the tests' prompts."""
    assert model_type == "recurrent_gemma"
    sizes = dict(hidden_size=32, intermediate_size=64, lru_width=32, head_dim=8, attention_window_size=16)
    return tiny_causal_lm(model_type, **{**TINY_HYBRID, "num_hidden_layers": 3}, **sizes)


def test_converted_model_round_trips_a_save(tmp_path):
    source = tiny_model("recurrent_gemma")
    model = rnnify.convert(source, to="exact")
    ids = torch.randint(3, 320, (2, 30), generator=torch.Generator().manual_seed(4))
    assert rel_diff(model.prefill(ids)[0], original_logits(source, ids)) < 1e-4
    back = assert_round_trips_a_save(model, tmp_path / "recurrent_gemma", ids)
    assert [cell.target for cell in back.cells] == [cell.target for cell in model.cells]


def test_fused_prefill_equals_the_doubling_form():
    """``use_kernels``: the prefill runs the Triton linear recurrence (interpreted here), from a nonzero
    state, with a left-padded row; "auto" off Triton keeps the doubling form."""
    (u, a), state = draw_inputs(torch.Generator().manual_seed(7), 2, 2 * CHUNK + 9)
    u, a, state = u.float(), a.float(), state.float()
    mask = padding_mask(u.shape[1], [0, 11])
    want = new_cell()(u, a, mask, state)
    cell = new_cell()
    assert cell.use_kernels("triton") == {"prefill": "linear_recurrence"}
    got = cell(u, a, mask, state)
    assert_outputs_and_state_close(got, want, mask, tol=1e-5)
    assert cell.use_kernels("auto") and cell.backend(u, u.shape[1]) is None  # a CPU tensor: the own form
