"""The exact cell's forms (the naive loop, the parallel form and ``softmax_attention_rnn``) against
each other and ``reference_softmax_attention`` of tests/test_cells.py (float64 softmax with explicit
causal, window and padding masks), within 1e-5 in fp32."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import HEAD_DRAWS
from test_cells import _padding_mask, reference_softmax_attention

from rnnify.cells import CellSpec
from rnnify.cells.exact import (
    ExactCell,
    naive_recurrent_softmax_attn,
    parallel_softmax_attn,
    softmax_attention_rnn,
)

RTOL = ATOL = 1e-5
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- exact: the forms

EXACT_FORMS = {  # (q, keys, values, valid, scale, window, block_size) -> out
    "naive_recurrent": lambda *a: naive_recurrent_softmax_attn(*a[:-1]),
    "parallel": lambda *a: parallel_softmax_attn(*a[:-1]),
    "chunk (softmax_attention_rnn)": lambda *a: softmax_attention_rnn(*a),
}


@HYPOTHESIS
@given(
    **HEAD_DRAWS,
    total=st.integers(1, 30),
    data=st.data(),
)
def test_exact_forms_equal_each_other_and_float64(batch, num_kv_heads, group, head_dim, total, data):
    length = data.draw(st.one_of(st.just(1), st.just(total), st.integers(1, total)))
    block_size = data.draw(st.sampled_from([1, 3, 5, 512]))
    window = data.draw(st.one_of(st.none(), st.integers(1, total)))
    padding = data.draw(st.sampled_from(["none", "left", "random"]))
    gen = _gen(data.draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(batch, num_kv_heads * group, length, head_dim, generator=gen)
    keys = torch.randn(batch, num_kv_heads, total, head_dim, generator=gen)
    values = torch.randn(batch, num_kv_heads, total, head_dim, generator=gen)
    valid = _padding_mask(padding, batch, total, gen)
    scale = 1 / math.sqrt(head_dim)
    ref = reference_softmax_attention(q, keys, values, valid, scale, window)
    outs = {name: form(q, keys, values, valid, scale, window, block_size) for name, form in EXACT_FORMS.items()}
    for name, out in outs.items():
        assert out.shape == ref.shape and out.dtype == torch.float32, name
        torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL, msg=lambda e: f"{name}: {e}")
        torch.testing.assert_close(out, outs["naive_recurrent"], rtol=RTOL, atol=ATOL, msg=lambda e: f"{name}: {e}")


def test_exact_forms_are_stable_for_huge_scores_and_empty_rows():
    gen = _gen(50)
    q = 200 * torch.randn(2, 4, 5, 8, generator=gen)
    keys, values = torch.randn(2, 2, 11, 8, generator=gen), torch.randn(2, 2, 11, 8, generator=gen)
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, :8] = False  # row 1: the first query (position 6) sees no key
    ref = reference_softmax_attention(q, keys, values, valid, 1.0, window=4)
    for name, form in EXACT_FORMS.items():
        out = form(q, keys, values, valid, 1.0, 4, 3)
        assert torch.isfinite(out).all(), name
        assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0])), name
        # fp32 scores of magnitude ~1e3 carry absolute error ~1e-4, hence the looser tolerance
        torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3, msg=lambda e: f"{name}: {e}")


def test_exact_forms_keep_the_value_dtype():
    gen = _gen(51)
    q = torch.randn(1, 2, 3, 8, generator=gen).bfloat16()
    keys, values = torch.randn(1, 1, 5, 8, generator=gen).bfloat16(), torch.randn(1, 1, 5, 8, generator=gen).bfloat16()
    valid = torch.ones(1, 5, dtype=torch.bool)
    ref = reference_softmax_attention(q, keys, values, valid, 0.35)  # from the same bf16 numbers
    for name, form in EXACT_FORMS.items():
        out = form(q, keys, values, valid, 0.35, None, 2)
        assert out.dtype == torch.bfloat16, name
        # fp32 accumulation, one bf16 rounding of the result: relative 2**-8
        torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=2**-7)


def test_exact_cell_step_is_its_chunked_form_with_one_query():
    """ExactCell's decode step (T = 1) and prefill (T > 1) both run ``softmax_attention_rnn``."""
    gen = _gen(52)
    spec = CellSpec(4, 2, 8, 8, 1 / math.sqrt(8))
    cell = ExactCell(spec, block_size=3)
    q = torch.randn(1, 4, 7, 8, generator=gen)
    k, v = torch.randn(1, 2, 7, 8, generator=gen), torch.randn(1, 2, 7, 8, generator=gen)
    mask = torch.ones(1, 7, dtype=torch.bool)
    init = cell.init_state(1, torch.device("cpu"), torch.float32)
    _, *state = cell(q[:, :, :6], k[:, :, :6], v[:, :, :6], mask[:, :6], *init)
    out, *_ = cell(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], mask[:, 6:], *state)
    for form in (naive_recurrent_softmax_attn, parallel_softmax_attn):
        torch.testing.assert_close(out, form(q[:, :, 6:], k, v, mask, spec.scale), rtol=RTOL, atol=ATOL)
