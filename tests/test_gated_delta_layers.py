"""A model's own Gated DeltaNet layers carry their state between tokens (rnnify/cells/gated_delta.py,
rnnify/compiler/recurrences/gated_delta.py, rnnify/compiler/passes/rewrite_scans.py): what only this
family has; tests/test_own_layers.py holds the cell's fp64 loop against transformers' own token loop,
the cell's forms against that loop, and converted Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid and
Lara-mini against the original models, with the cell, loop, inputs and tiny models defined here."""

from __future__ import annotations

import pytest
import torch
from support import TINY_HYBRID, assert_round_trips_a_save, standard_normal, tiny_causal_lm

import rnnify
from rnnify.cells import OWN_LAYERS, GatedDeltaRuleCell, build_cell
from rnnify.cells.gated_delta import naive_recurrent_gated_delta

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 5, 3
CHUNK = 64  # the prefill's chunk (rnnify.kernels.delta_rule.naive.chunk_delta_rule_reference's chunk_size)
# one per class: qwen3_5 and qwen3_5_moe load as the same classes as their text configs
MODELS = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini"]


def draw_inputs(gen, batch, length):
    """q, k ``[b, t, H_k, d_k]``, v ``[b, t, H_v, d_v]``, g <= 0 and beta in (0, 2) ``[b, t, H_v]``,
    and a state."""
    draw = standard_normal(gen)
    args = (
        draw(batch, length, KEY_HEADS, KEY_DIM),
        draw(batch, length, KEY_HEADS, KEY_DIM),
        draw(batch, length, VALUE_HEADS, VALUE_DIM),
        -draw(batch, length, VALUE_HEADS).abs(),
        2 * torch.sigmoid(draw(batch, length, VALUE_HEADS)),  # OLMo-hybrid's beta reaches 2
    )
    return args, draw(batch, VALUE_HEADS, KEY_DIM, VALUE_DIM)


def new_cell(l2norm: bool = True):
    spec = GatedDeltaRuleCell.spec_for(VALUE_HEADS, KEY_DIM, VALUE_DIM)
    return build_cell("gated_delta_rule", spec, {"key_heads": KEY_HEADS, "l2norm": l2norm})


def reference_loop(*args_mask_state, l2norm: bool = True):
    return naive_recurrent_gated_delta(*args_mask_state, l2norm)


def test_cell_options_are_checked():
    spec = GatedDeltaRuleCell.spec_for(VALUE_HEADS, KEY_DIM, VALUE_DIM)
    with pytest.raises(rnnify.RnnifyError, match="key_heads"):
        build_cell("gated_delta_rule", spec, {"key_heads": 3, "l2norm": True})
    with pytest.raises(rnnify.RnnifyError, match="l2norm"):
        build_cell("gated_delta_rule", spec, {"key_heads": KEY_HEADS, "l2norm": "yes"})
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'gated_delta_rule'"):
        rnnify.convert("unused", to="gated_delta_rule")  # a layer's own recurrence, never a --to target
    assert "gated_delta_rule" in OWN_LAYERS
    cell = new_cell(l2norm=False)
    assert type(cell)(cell.spec, **cell.options()).options() == {"key_heads": KEY_HEADS, "l2norm": False}


def tiny_model(model_type: str):
    """Two layers, Gated DeltaNet then attention, with 2 key heads of width 16 serving 4 value heads of
    width 8 and a 3-token convolution (Lara-mini's attention layer slides over 8 tokens)."""
    attention = "sliding_attention" if model_type == "lara_mini" else "full_attention"
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
    experts = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    sizes = dict(hidden_size=64, intermediate_size=96, head_dim=16, linear_conv_kernel_dim=3, sliding_window=8)
    return tiny_causal_lm(
        model_type, **TINY_HYBRID, **linear, **experts, **sizes, layer_types=["linear_attention", attention]
    )


def test_other_targets_keep_the_layer_and_save(tmp_path):
    """A window target replaces the attention and keeps the model's own layers, which round-trip a save."""
    model = rnnify.convert(tiny_model("olmo_hybrid"), to="window", window=4)
    assert sorted(cell.target for cell in model.cells) == ["gated_delta_rule", "short_conv", "window"]
    ids = torch.randint(3, 320, (1, 30), generator=torch.Generator().manual_seed(4))
    back = assert_round_trips_a_save(model, tmp_path / "olmo", ids)
    own = [cell for cell in back.cells if cell.target == "gated_delta_rule"]
    assert [cell.options() for cell in own] == [{"key_heads": 2, "l2norm": True}]
