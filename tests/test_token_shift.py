"""Token shifts carry the previous token between steps (rnnify/cells/token_shift.py,
rnnify/compiler/passes/rewrite_token_shifts.py), and ZAYA, whose attention shifts half of each value
head and runs its queries and keys through a chain of convolutions (rnnify/cells/short_conv.py),
converts exactly: the cell against the shift written out per row, and converted ZAYA against the
original model."""

from __future__ import annotations

import collections

import pytest
import torch
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_round_trips_a_save,
    assert_steps_and_split_prefill_match,
    decode,
    exact_conversions,
    original_logits,
    padding_mask,
    rel_diff,
    standard_normal,
    tiny_causal_lm,
)

import rnnify
from rnnify.cells import OWN_LAYERS, TokenShiftCell, build_cell
from rnnify.cells.token_shift import naive_recurrent_token_shift, token_shift
from rnnify.errors import UnsupportedModelError

CHANNELS = 5


def _draw(gen, batch, length):
    """x ``[b, t, C]``, first ``[b, 1, C]``, and a state: the last x and whether a row has one (row 0
    has, the others not)."""
    draw = standard_normal(gen)
    seen = torch.zeros(batch, 1, dtype=torch.float64)
    seen[0] = 1.0
    return draw(batch, length, CHANNELS), draw(batch, 1, CHANNELS), draw(batch, CHANNELS), seen


def _shift_of_real_tokens(x, first, mask, previous, seen):
    """Each row's real tokens written out: the first reads the state's token, or ``first`` when the row
    has none; each later one reads the real token before it."""
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        before = previous[row] if seen[row] else first[row, 0]
        for t in mask[row].nonzero()[:, 0].tolist():
            out[row, t], before = before, x[row, t]
    return out


@pytest.mark.parametrize("form", [naive_recurrent_token_shift, token_shift])
def test_forms_equal_the_shift_of_the_real_tokens(form):
    """Left padding, padding between real tokens, all real, and nothing real (the state stays)."""
    x, first, previous, seen = _draw(torch.Generator().manual_seed(0), 4, 7)
    mask = padding_mask(7, [3, 0, 0, 7])
    mask[1, 4] = False
    out, got_previous, got_seen = form(x, first, mask, previous, seen)
    want = _shift_of_real_tokens(x, first, mask, previous, seen)
    torch.testing.assert_close(torch.where(mask[..., None], out, 0.0), want, rtol=0, atol=0)
    last = [x[row, mask[row]][-1] if mask[row].any() else previous[row] for row in range(4)]
    torch.testing.assert_close(got_previous, torch.stack(last), rtol=0, atol=0)
    assert got_seen[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0]


def test_cell_steps_and_split_prefill_equal_one_prefill():
    x, first, _, _ = _draw(torch.Generator().manual_seed(1), 2, 12)
    cell = build_cell("token_shift", TokenShiftCell.spec_for(CHANNELS), {})
    assert cell.options() == {} and cell.exact and "token_shift" in OWN_LAYERS
    mask = torch.ones(2, 12, dtype=torch.bool)
    state = cell.init_state(2, torch.device("cpu"), torch.float64)
    full, *full_state = cell(x, first, mask, *state)
    torch.testing.assert_close(full, torch.cat([first, x[:, :-1]], dim=1), rtol=0, atol=0)  # the source's form
    first_part, *mid = cell(x[:, :5], first, mask[:, :5], *state)
    steps = [first_part]
    for t in range(5, 12):
        out, *mid = cell(x[:, t : t + 1], first, mask[:, t : t + 1], *mid)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=0)
    for got, want in zip(mid, full_state, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'token_shift'"):
        rnnify.convert("unused", to="token_shift")  # a layer's own shift, never a --to target


class _Rotation(torch.nn.Module):
    """Hands each token the one before it and the first token the last one: not a shift a step can carry."""

    def forward(self, x):
        return torch.cat([x[:, -1:], x[:, :-1]], dim=1)


def test_a_shift_whose_first_value_reads_the_tokens_is_refused_naming_its_layer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    source.model.layers[1].mlp = _Rotation()
    with pytest.raises(UnsupportedModelError, match=r"layer 1 \(model\.layers\.1\.mlp\).*first value is computed"):
        rnnify.convert(source, to="exact")


def _zaya():
    """Two layers (the second over a sliding window of 8), the chain of a 3-token depthwise and a
    2-token grouped convolution (K = 4), one expert per token."""
    sizes = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1)
    layout = dict(layer_types=["hybrid", "hybrid_sliding"], sliding_window=8, cca_time0=3, cca_time1=2)
    config = dict(vocab_size=320, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return tiny_causal_lm("zaya", **config, **sizes, **layout, max_position_embeddings=128, pad_token_id=0)


@pytest.fixture(scope="module")
def converted():
    return exact_conversions(lambda name: _zaya())


def test_zaya_equals_the_original_prefill_and_steps(converted):
    """Past the window and the convolutions, then stepping: without the two cells a step reads every
    token as the first of its sequence."""
    source, model = converted("zaya")
    assert collections.Counter(cell.target for cell in model.cells) == {"short_conv": 2, "token_shift": 2, "exact": 2}
    convs = [cell for cell in model.cells if cell.target == "short_conv"]
    assert {cell.kernel_size for cell in convs} == {4} and {tuple(cell.groups) for cell in convs} == {(96, 6)}
    ids = torch.randint(3, 320, (2, 30), generator=torch.Generator().manual_seed(2))
    want = original_logits(source, ids)
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 10)[0], want) < 1e-4
    assert_steps_and_split_prefill_match(model, ids, split=7)


def test_zaya_left_padded_rows_equal_the_original_and_rows_alone(converted):
    source, model = converted("zaya")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 320, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0
    with torch.no_grad():
        want = source(input_ids=ids, attention_mask=mask, use_cache=False).logits
    got, _ = model.prefill(ids, attention_mask=mask)
    assert rel_diff(got[0, 5:], want[0, 5:]) < 1e-4 and rel_diff(got[1], want[1]) < 1e-4
    assert_left_padded_rows_equal_rows_alone(model, [3, 11, 7], gen, steps=6)


def test_zaya_round_trips_a_save(converted, tmp_path):
    _, model = converted("zaya")
    ids = torch.randint(3, 320, (2, 20), generator=torch.Generator().manual_seed(4))
    back = assert_round_trips_a_save(model, tmp_path / "zaya", ids)
    assert [cell.options() for cell in back.cells] == [cell.options() for cell in model.cells]
