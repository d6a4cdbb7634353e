"""A model's own lightning attention layers (MiniMax) carry their state between tokens
(rnnify/cells/lightning.py, rnnify/compiler/recurrences/lightning.py,
rnnify/compiler/passes/rewrite_scans.py): the stand-in against transformers' own layer, and what
only this family has; tests/test_own_layers.py holds the loop against the equations, the cell's
forms against the loop and converted MiniMax against the original model, with the cell, loop,
equations, inputs and tiny model defined here."""

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
from rnnify.cells import LightningAttentionCell, build_cell
from rnnify.cells.lightning import CHUNK, naive_recurrent_lightning_attention  # noqa: F401 - CHUNK: test_own_layers
from rnnify.compiler.recurrences.lightning import LIGHTNING

HEADS, HEAD_DIM = 3, 4
MODELS = ["minimax"]


def draw_inputs(gen, batch, length):
    """q, k, v ``[b, t, H, D]``, a slope per head as the source keeps it (``[H, 1, 1]``: decays from
    0.37 to 0.98 a token) and a state ``[b, H, D, D]``."""
    draw = standard_normal(gen)
    slope = torch.tensor([1.0, 0.2, 0.02], dtype=torch.float64)[:, None, None]
    q, k, v = (0.5 * draw(batch, length, HEADS, HEAD_DIM) for _ in range(3))
    return (q, k, v, slope), draw(batch, HEADS, HEAD_DIM, HEAD_DIM)


def new_cell():
    return build_cell("lightning_attention", LightningAttentionCell.spec_for(HEADS, HEAD_DIM), {})


reference_loop = naive_recurrent_lightning_attention


def textbook(q, k, v, slope, mask, state):
    """The unrolled sum, per real token: o_i = q_i (λ^n S_0 + Σ_{j≤i real} λ^(n-m_j) k_jᵀ v_j), n the
    real tokens up to i and m_j those up to j; fp64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    S = state.clone().double()
    for row in range(q.shape[0]):
        real = mask[row].nonzero().flatten().tolist()
        for h in range(HEADS):
            decay = float(torch.exp(-slope[h]))
            for n, i in enumerate(real, start=1):
                total = decay**n * state[row, h].double()
                for m, j in enumerate(real[:n], start=1):
                    total = total + decay ** (n - m) * torch.outer(k[row, j, h], v[row, j, h]).double()
                out[row, i, h] = q[row, i, h].double() @ total
            if real:
                S[row, h] = total
    return out, S


def _layer(block_size: int):
    from transformers import AutoConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = AutoConfig.for_model("minimax", **TINY_HYBRID, hidden_size=32, head_dim=8, block_size=block_size)
    torch.manual_seed(1)
    return MiniMaxLightningAttention(config, layer_idx=0).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stand_in_equals_transformers_layer(dtype):
    """The stand-in (projections, the op through the cell, norm and gate) against transformers' own
    forward, whose loop runs blocks of 16 tokens: 40 tokens cross two block boundaries."""
    layer = _layer(block_size=16).to(dtype)
    hidden = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    args = [torch.randn(2, 5, 4, 8, dtype=dtype) for _ in range(3)] + [layer.slope_rate]
    torch.library.opcheck(
        torch.ops.rnnify.lightning_attention.default, args, test_utils=("test_schema", "test_faketensor")
    )
    with torch.no_grad():
        want, _ = layer(hidden, None, None)
        got, state = LIGHTNING.stand_in(layer, hidden, None, None)
    assert state is None and got.dtype == want.dtype == dtype and got.shape == want.shape
    assert rel_diff(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(rnnify.RnnifyError, match="cache during capture"):
        LIGHTNING.stand_in(layer, hidden, None, None, cache=object())


def tiny_model(model_type: str):
    """Three layers, lightning attention around softmax attention, with blocks of 16 tokens: the
    tests' prompts cross the source's block boundaries."""
    assert model_type == "minimax"
    sizes = dict(hidden_size=32, intermediate_size=64, head_dim=8, block_size=16, num_local_experts=2)
    layer_types = ["linear_attention", "full_attention", "linear_attention"]
    return tiny_causal_lm(model_type, **{**TINY_HYBRID, "num_hidden_layers": 3}, **sizes, layer_types=layer_types)


def test_converted_model_round_trips_a_save(tmp_path):
    source = tiny_model("minimax")
    model = rnnify.convert(source, to="exact")
    ids = torch.randint(3, 320, (2, 30), generator=torch.Generator().manual_seed(4))
    assert rel_diff(model.prefill(ids)[0], original_logits(source, ids)) < 1e-4
    back = assert_round_trips_a_save(model, tmp_path / "minimax", ids)
    assert [cell.target for cell in back.cells] == [cell.target for cell in model.cells]


@pytest.mark.parametrize("length", [1, CHUNK + 9])
def test_fused_forms_equal_the_own_forms(length):
    """``use_kernels``: the prefill and the step run the linear attention ops (Triton, interpreted
    here) with the scalar gate, from a nonzero state, with a left-padded row."""
    (q, k, v, slope), state = draw_inputs(torch.Generator().manual_seed(7), 2, length)
    q, k, v, state = q.float(), k.float(), v.float(), state.float()
    mask = padding_mask(length, [0, max(1, length // 3)])  # one token: a padded step
    want = new_cell()(q, k, v, slope, mask, state)
    cell = new_cell()
    assert cell.use_kernels("triton") == {"prefill": "chunk_linear_attn", "decode": "fused_recurrent_linear_attn"}
    assert_outputs_and_state_close(cell(q, k, v, slope, mask, state), want, mask, tol=1e-4)
