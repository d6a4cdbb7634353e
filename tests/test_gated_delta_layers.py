"""A model's own Gated DeltaNet layers carry their state between tokens (rnnify/cells/gated_delta.py,
rnnify/compiler/recurrences/gated_delta.py, rnnify/compiler/passes/rewrite_scans.py): the cell's
fp64 loop against transformers' own token loop, the cell's forms against that loop, and converted
Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid and Lara-mini against the original models."""

from __future__ import annotations

import pytest
import torch
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
    decode,
    exact_conversions,
    rel_diff,
)

import rnnify
from rnnify.cells import OWN_LAYERS, GatedDeltaRuleCell, build_cell
from rnnify.cells.gated_delta import naive_recurrent_gated_delta

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 5, 3


def _inputs(gen, batch, length, dtype=torch.float64):
    """q, k ``[b, t, H_k, d_k]``, v ``[b, t, H_v, d_v]``, g <= 0 and beta in (0, 2) ``[b, t, H_v]``."""

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return (
        draw(batch, length, KEY_HEADS, KEY_DIM),
        draw(batch, length, KEY_HEADS, KEY_DIM),
        draw(batch, length, VALUE_HEADS, VALUE_DIM),
        -draw(batch, length, VALUE_HEADS).abs(),
        2 * torch.sigmoid(draw(batch, length, VALUE_HEADS)),  # OLMo-hybrid's beta reaches 2
    )


def _state(gen, batch, dtype=torch.float64):
    return torch.randn(batch, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen, dtype=dtype)


def _cell(l2norm: bool = True):
    spec = GatedDeltaRuleCell.spec_for(VALUE_HEADS, KEY_DIM, VALUE_DIM)
    return build_cell("gated_delta_rule", spec, {"key_heads": KEY_HEADS, "l2norm": l2norm})


@pytest.mark.parametrize("l2norm", [True, False])
def test_naive_loop_equals_transformers_loop(l2norm):
    """Against transformers' own token loop (fp32), from a nonzero state; a padded token takes no
    step: a row with padding, before and among its tokens, equals its real tokens alone."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    args, state = _inputs(gen, 2, 11), _state(gen, 2)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = mask[1, 6] = False
    out, got_state = naive_recurrent_gated_delta(*args, mask, state, l2norm)
    for row in range(2):
        real = mask[row]
        q, k, v, g, beta = (a[row : row + 1, real].float() for a in args)
        want, want_state = torch_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=state[row : row + 1].float(), output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm,
        )  # fmt: skip
        torch.testing.assert_close(out[row : row + 1, real].float(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state[row : row + 1].float(), want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [1, 7, 64, 150])  # chunks of 64 tokens in the prefill
def test_prefill_and_step_equal_the_naive_loop(length):
    """The fp32 chunked prefill (across chunk boundaries) and the step, from a nonzero state, with a
    left-padded row, against the fp64 loop."""
    gen = torch.Generator().manual_seed(length)
    args, state = _inputs(gen, 2, length), _state(gen, 2)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, : length // 3] = False
    want, want_state = naive_recurrent_gated_delta(*args, mask, state, True)
    out, got_state = _cell()(*(a.float() for a in args), mask, state.float())
    assert out.dtype == got_state.dtype == torch.float32 and out.shape == want.shape
    real = mask[..., None, None]
    torch.testing.assert_close(torch.where(real, out.double(), 0.0), torch.where(real, want, 0.0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state.double(), want_state, rtol=1e-4, atol=1e-4)


def test_split_prefill_and_steps_equal_one_prefill():
    gen = torch.Generator().manual_seed(5)
    args = [a.float() for a in _inputs(gen, 2, 150)]
    cell = _cell()
    mask = torch.ones(2, 150, dtype=torch.bool)
    (state,) = cell.init_state(2, torch.device("cpu"), torch.float32)
    full, full_state = cell(*args, mask, state)
    out, mid = cell(*(a[:, :70] for a in args), mask[:, :70], state)
    pieces = [out]
    out, mid = cell(*(a[:, 70:140] for a in args), mask[:, 70:140], mid)
    pieces.append(out)
    for t in range(140, 150):
        out, mid = cell(*(a[:, t : t + 1] for a in args), mask[:, t : t + 1], mid)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mid, full_state, rtol=1e-5, atol=1e-5)


def test_cell_options_are_checked():
    spec = GatedDeltaRuleCell.spec_for(VALUE_HEADS, KEY_DIM, VALUE_DIM)
    with pytest.raises(rnnify.RnnifyError, match="key_heads"):
        build_cell("gated_delta_rule", spec, {"key_heads": 3, "l2norm": True})
    with pytest.raises(rnnify.RnnifyError, match="l2norm"):
        build_cell("gated_delta_rule", spec, {"key_heads": KEY_HEADS, "l2norm": "yes"})
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'gated_delta_rule'"):
        rnnify.convert("unused", to="gated_delta_rule")  # a layer's own recurrence, never a --to target
    assert "gated_delta_rule" in OWN_LAYERS
    cell = _cell(l2norm=False)
    assert type(cell)(cell.spec, **cell.options()).options() == {"key_heads": KEY_HEADS, "l2norm": False}


def _tiny(model_type: str):
    """Two layers, Gated DeltaNet then attention, with 2 key heads of width 16 serving 4 value heads of
    width 8 and a 3-token convolution (Lara-mini's attention layer slides over 8 tokens)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    attention = "sliding_attention" if model_type == "lara_mini" else "full_attention"
    config = CONFIG_MAPPING[model_type](
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["linear_attention", attention],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=3,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        sliding_window=8,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(config).eval()


# one per class: qwen3_5 and qwen3_5_moe load as the same classes as their text configs
_NAMES = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini"]


@pytest.fixture(scope="module")
def converted():
    return exact_conversions(_tiny)


@pytest.mark.parametrize("name", _NAMES)
def test_exact_equals_the_original_prefill_and_steps(name, converted):
    """Past a chunk of the source's and of the cell's prefill, then stepping."""
    source, model = converted(name)
    assert sorted(cell.target for cell in model.cells) == ["exact", "gated_delta_rule", "short_conv"]
    ids = torch.randint(3, 320, (2, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 80)[0], want) < 1e-4  # a prefill of 80, then 10 steps
    assert_steps_and_split_prefill_match(model, ids[:, :24], split=9)


def test_left_padded_rows_equal_rows_alone(converted):
    _, model = converted("qwen3_next")
    assert_left_padded_rows_equal_rows_alone(model, [3, 70, 9], torch.Generator().manual_seed(3), steps=5)


def test_other_targets_keep_the_layer_and_save(tmp_path):
    """A window target replaces the attention and keeps the model's own layers, which round-trip a save."""
    model = rnnify.convert(_tiny("olmo_hybrid"), to="window", window=4)
    assert sorted(cell.target for cell in model.cells) == ["gated_delta_rule", "short_conv", "window"]
    back = rnnify.load(model.save(tmp_path / "olmo"))
    ids = torch.randint(3, 320, (1, 30), generator=torch.Generator().manual_seed(4))
    assert rel_diff(back.prefill(ids)[0], model.prefill(ids)[0]) < 1e-6
    own = [cell for cell in back.cells if cell.target == "gated_delta_rule"]
    assert [cell.options() for cell in own] == [{"key_heads": 2, "l2norm": True}]
