"""A model's own Kimi Delta Attention layers carry their state between tokens (rnnify/cells/kda.py,
rnnify/compiler/recurrences/kda.py, rnnify/compiler/passes/rewrite_scans.py): what only this family
has; tests/test_own_layers.py holds the cell's fp64 loop against transformers' own token loop, the
cell's forms against that loop, and converted Kimi-Linear and Bailing-hybrid (the tiny models of
benchmarks/arch_sweep.py) against the original models, with the cell, loop, inputs and tiny models
defined here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support import (
    assert_outputs_and_state_close,
    assert_round_trips_a_save,
    original_logits,
    rel_diff,
    standard_normal,
)

import rnnify
from rnnify.cells import OWN_LAYERS, KimiDeltaAttentionCell, build_cell
from rnnify.cells.kda import CHUNK, naive_recurrent_kda  # noqa: F401 - CHUNK: for tests/test_own_layers.py

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

HEADS, KEY_DIM, VALUE_DIM = 3, 5, 4
MODELS = ["kimi_linear", "bailing_hybrid"]


def draw_inputs(gen, batch, length):
    """q, k ``[b, t, H, d_k]``, v ``[b, t, H, d_v]``, g <= 0 ``[b, t, H, d_k]`` (a decay per key
    channel, some near 1 and some near 0) and beta in (0, 1) ``[b, t, H]``, and a state."""
    draw = standard_normal(gen)
    args = (
        draw(batch, length, HEADS, KEY_DIM),
        draw(batch, length, HEADS, KEY_DIM),
        draw(batch, length, HEADS, VALUE_DIM),
        -2 * draw(batch, length, HEADS, KEY_DIM).abs() * torch.rand(KEY_DIM, generator=gen, dtype=torch.float64),
        torch.sigmoid(draw(batch, length, HEADS)),
    )
    return args, draw(batch, HEADS, KEY_DIM, VALUE_DIM)


def new_cell(l2norm: bool = True):
    return build_cell("kda", KimiDeltaAttentionCell.spec_for(HEADS, KEY_DIM, VALUE_DIM), {"l2norm": l2norm})


def reference_loop(*args_mask_state, l2norm: bool = True):
    return naive_recurrent_kda(*args_mask_state, l2norm)


def test_strong_decays_stay_finite():
    """Decays that empty a channel within a chunk (log decay -30 a token) leave no inf or nan: every
    exponent of the chunked form is a masked difference, never positive."""
    (q, k, v, g, beta), state = draw_inputs(torch.Generator().manual_seed(9), 1, 100)
    g[..., 0] = -30.0
    args, mask = (q, k, v, g, beta), torch.ones(1, 100, dtype=torch.bool)
    got = new_cell()(*(a.float() for a in args), mask, state.float())
    assert_outputs_and_state_close(got, reference_loop(*args, mask, state), mask, tol=1e-4)


def test_cell_options_are_checked():
    spec = KimiDeltaAttentionCell.spec_for(HEADS, KEY_DIM, VALUE_DIM)
    with pytest.raises(rnnify.RnnifyError, match="l2norm"):
        build_cell("kda", spec, {"l2norm": "yes"})
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'kda'"):
        rnnify.convert("unused", to="kda")  # a layer's own recurrence, never a --to target
    assert "kda" in OWN_LAYERS
    cell = new_cell(l2norm=False)
    assert type(cell)(cell.spec, **cell.options()).options() == {"l2norm": False}


def tiny_model(model_type: str):
    """The sweep's tiny model: a KDA layer (2 heads of width 16, a 4-token convolution) then attention."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import arch_sweep

    return arch_sweep.build(model_type)[0]


def test_other_targets_keep_the_layer_and_save(tmp_path):
    """A window target replaces the attention and keeps the model's own layers, which round-trip a
    save: within the window the converted model is still the original."""
    source = tiny_model("bailing_hybrid")
    model = rnnify.convert(source, to="window", window=4)
    assert sorted(cell.target for cell in model.cells) == ["kda", "short_conv", "window"]
    ids = torch.randint(3, source.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    back = assert_round_trips_a_save(model, tmp_path / "bailing", ids)
    assert rel_diff(back.prefill(ids[:, :4])[0], original_logits(source, ids[:, :4])) < 1e-4
    own = [cell for cell in back.cells if cell.target == "kda"]
    assert [cell.options() for cell in own] == [{"l2norm": True}]
