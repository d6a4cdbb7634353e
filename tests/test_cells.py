"""Recurrent cells against references written here, independently of rnnify.

Exact cell: a float64 softmax attention with explicit scores and masks (causal over cache
positions, padding, sliding window). Linear cell: a float64 loop over the equations of
docs/math.md §Linear attention (S_t = S_{t-1} + phi(k_t)^T v_t, z_t = z_{t-1} + phi(k_t),
o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)). Every form the package has must agree with them.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import random_qkv

from rnnify.cells import CELLS, CellSpec, build_cell
from rnnify.cells.base import every_token_real
from rnnify.cells.exact import ExactCell, sdpa_softmax_attn, softmax_attention_rnn
from rnnify.cells.linear import (
    LinearCell,
    chunk_feature_attn,
    naive_recurrent_feature_attn,
    parallel_feature_attn,
    step_feature_attn,
)
from rnnify.errors import RnnifyError

# fp32 computation against a float64 reference on O(1) inputs: 1e-5 relative, and the same
# absolute floor for entries that happen to be near zero.
RTOL = ATOL = 1e-5

HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- references


def reference_softmax_attention(q, keys, values, valid, scale, window=None):
    """float64 softmax attention of the queries at cache positions N-T..N-1.

    q [B, H, T, d]; keys/values [B, Hkv, N, *]; valid [B, N]. Query head h reads kv head h // G.
    Rows with no allowed key give 0.
    """
    q, keys, values = q.double(), keys.double(), values.double()
    batch, num_heads, length, _ = q.shape
    num_kv_heads, total = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(batch, num_heads, length, values.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(num_heads):
            kv = h // group
            for t in range(length):
                i = total - length + t  # cache position of this query
                allowed = [
                    j for j in range(total) if j <= i and bool(valid[b, j]) and (window is None or i - j < window)
                ]
                if not allowed:
                    continue
                scores = torch.stack([scale * torch.dot(q[b, h, t], keys[b, kv, j]) for j in allowed])
                weights = torch.exp(scores - scores.max())
                weights = weights / weights.sum()
                out[b, h, t] = sum(w * values[b, kv, j] for w, j in zip(weights, allowed))
    return out


def reference_linear_attention(phi_q, phi_k, v, kv0, z0, eps=1e-6):
    """float64 loop over the equations; phi_q [B, Hkv, G, T, F], phi_k [B, Hkv, T, F]."""
    phi_q, phi_k, v = phi_q.double(), phi_k.double(), v.double()
    S, z = kv0.double().clone(), z0.double().clone()
    batch, num_kv_heads, group, length, _ = phi_q.shape
    out = torch.zeros(batch, num_kv_heads, group, length, v.shape[-1], dtype=torch.float64)
    for t in range(length):
        for b in range(batch):
            for h in range(num_kv_heads):
                S[b, h] += torch.outer(phi_k[b, h, t], v[b, h, t])
                z[b, h] += phi_k[b, h, t]
                for g in range(group):
                    qt = phi_q[b, h, g, t]
                    out[b, h, g, t] = (qt @ S[b, h]) / (torch.dot(qt, z[b, h]) + eps)
    return out, S, z


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """Katharopoulos' feature map written out: x + 1 for x > 0, exp(x) otherwise."""
    x = x.double()
    return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))


def reference_linear_cell(q, k, v, mask, kv0, z0, eps=1e-6):
    """The LinearCell contract from first principles: [B, H, T, d] in, padding keys ignored."""
    batch, num_heads, length, _ = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    phi_q = elu_plus_one(q).reshape(batch, num_kv_heads, group, length, -1)
    phi_k = elu_plus_one(k) * mask[:, None, :, None].double()
    out, S, z = reference_linear_attention(phi_q, phi_k, v, kv0, z0, eps)
    return out.reshape(batch, num_heads, length, -1), S, z


# --------------------------------------------------------------------------- exact: the function


@st.composite
def attention_problems(draw):
    batch = draw(st.integers(1, 3))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    total = draw(st.integers(1, 40))
    length = draw(st.one_of(st.just(1), st.just(total), st.integers(1, total)))
    block_size = draw(st.sampled_from([1, 3, 5, 8, 512]))
    window = draw(st.one_of(st.none(), st.integers(1, total)))
    padding = draw(st.sampled_from(["none", "left", "random"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, num_kv_heads, group, head_dim, total, length, block_size, window, padding, seed


def _padding_mask(kind: str, batch: int, total: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "none":
        return torch.ones(batch, total, dtype=torch.bool)
    if kind == "left":
        pads = torch.randint(0, total, (batch,), generator=gen)
        return torch.arange(total)[None, :] >= pads[:, None]
    return torch.rand(batch, total, generator=gen) < 0.7  # may leave rows with no key at all


@HYPOTHESIS
@given(attention_problems())
def test_softmax_attention_rnn_matches_float64_reference(problem):
    batch, num_kv_heads, group, head_dim, total, length, block_size, window, padding, seed = problem
    gen = _gen(seed)
    num_heads = num_kv_heads * group
    q = torch.randn(batch, num_heads, length, head_dim, generator=gen)
    keys = torch.randn(batch, num_kv_heads, total, head_dim, generator=gen)
    values = torch.randn(batch, num_kv_heads, total, head_dim, generator=gen)
    valid = _padding_mask(padding, batch, total, gen)
    scale = 1 / math.sqrt(head_dim)

    ref = reference_softmax_attention(q, keys, values, valid, scale, window)
    for form in (softmax_attention_rnn, sdpa_softmax_attn):  # the recurrence, and the cell's SDPA path
        out = form(q, keys, values, valid, scale, window=window, block_size=block_size)
        assert out.shape == (batch, num_heads, length, head_dim) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)


def test_softmax_attention_rnn_fully_masked_rows_are_zero_not_nan():
    gen = _gen(0)
    q = torch.randn(2, 2, 4, 8, generator=gen)
    keys, values = torch.randn(2, 1, 6, 8, generator=gen), torch.randn(2, 1, 6, 8, generator=gen)
    valid = torch.tensor([[False] * 6, [False, False, False, True, True, True]])
    for form in (softmax_attention_rnn, sdpa_softmax_attn):
        out = form(q, keys, values, valid, 0.3, block_size=2)
        assert torch.isfinite(out).all()
        assert torch.equal(out[0], torch.zeros_like(out[0]))  # no valid key at all
        # row 1: queries at cache positions 2..5; position 2 sees keys 0..2, all padding
        assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
        assert out[1, :, 1:].abs().sum() > 0
        torch.testing.assert_close(out.double(), reference_softmax_attention(q, keys, values, valid, 0.3))


def test_softmax_attention_rnn_is_stable_for_huge_scores():
    # scores of several thousand overflow a naive exp(); the running max must keep them finite
    gen = _gen(1)
    q = 200 * torch.randn(1, 2, 5, 8, generator=gen)
    keys, values = torch.randn(1, 2, 11, 8, generator=gen), torch.randn(1, 2, 11, 8, generator=gen)
    valid = torch.ones(1, 11, dtype=torch.bool)
    out = softmax_attention_rnn(q, keys, values, valid, 1.0, block_size=3)
    assert torch.isfinite(out).all()
    ref = reference_softmax_attention(q, keys, values, valid, 1.0)
    # fp32 scores of magnitude ~1e3 carry absolute error ~1e-4, hence the looser tolerance
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3)


def test_softmax_attention_rnn_keeps_value_dtype():
    gen = _gen(2)
    q = torch.randn(1, 2, 3, 8, generator=gen).bfloat16()
    keys, values = torch.randn(1, 1, 5, 8, generator=gen).bfloat16(), torch.randn(1, 1, 5, 8, generator=gen).bfloat16()
    valid = torch.ones(1, 5, dtype=torch.bool)
    out = softmax_attention_rnn(q, keys, values, valid, 0.35)
    assert out.dtype == torch.bfloat16
    ref = reference_softmax_attention(q, keys, values, valid, 0.35)  # from the same bf16 numbers
    # fp32 accumulation, one bf16 rounding of the result: relative 2**-8
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=2**-7)


# --------------------------------------------------------------------------- exact: the cell


def _exact_cell(num_kv_heads=2, group=2, head_dim=8, window=None, block_size=4) -> ExactCell:
    spec = CellSpec(num_kv_heads * group, num_kv_heads, head_dim, head_dim, 1 / math.sqrt(head_dim), window)
    return ExactCell(spec, block_size=block_size)


@HYPOTHESIS
@given(
    window=st.one_of(st.none(), st.integers(1, 12)),
    length=st.integers(1, 20),
    splits=st.lists(st.integers(1, 20), max_size=3),
    block_size=st.sampled_from([1, 3, 512]),
    left_pad=st.integers(0, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_exact_cell_chunked_and_stepped_equal_one_shot_and_reference(
    window, length, splits, block_size, left_pad, seed
):
    gen = _gen(seed)
    cell = _exact_cell(window=window, block_size=block_size)
    batch, spec = 2, cell.spec
    q, k, v = random_qkv(batch, spec, length, gen)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, : min(left_pad, length - 1)] = False  # row 1 left-padded, keeps at least one token

    state = cell.init_state(batch, torch.device("cpu"), torch.float32)
    one_shot, *final = cell(q, k, v, mask, *state)
    ref = reference_softmax_attention(q, k, v, mask, spec.scale, window)
    torch.testing.assert_close(one_shot.double(), ref, rtol=RTOL, atol=ATOL)

    # the same tokens in chunks of hypothesis-chosen sizes (size 1 = token by token)
    bounds, start = [], 0
    for size in splits + [1] * length:
        if start >= length:
            break
        bounds.append((start, min(length, start + size)))
        start += size
    outs = []
    state = cell.init_state(batch, torch.device("cpu"), torch.float32)
    for a, b in bounds:
        out, *state = cell(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], mask[:, a:b], *state)
        outs.append(out)
        if window is not None:
            assert state[0].shape[2] <= window and state[1].shape[2] <= window and state[2].shape[1] <= window
        else:
            assert state[0].shape[2] == b
    torch.testing.assert_close(torch.cat(outs, dim=2), one_shot, rtol=RTOL, atol=ATOL)
    for got, want in zip(state, final):
        assert torch.equal(got, want)


def test_exact_cell_windowed_state_is_bounded_over_a_long_stream():
    gen = _gen(3)
    cell = _exact_cell(window=5, block_size=2)
    spec = cell.spec
    q, k, v = random_qkv(1, spec, 30, gen)
    mask = torch.ones(1, 30, dtype=torch.bool)
    state = cell.init_state(1, torch.device("cpu"), torch.float32)
    outs = []
    for t in range(30):
        out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
        outs.append(out)
        assert state[0].shape[2] == min(t + 1, 5)
        assert torch.equal(state[0], k[:, :, max(0, t - 4) : t + 1])  # the last 5 keys, in order
    ref = reference_softmax_attention(q, k, v, mask, spec.scale, window=5)
    torch.testing.assert_close(torch.cat(outs, dim=2).double(), ref, rtol=RTOL, atol=ATOL)


def test_exact_cell_does_not_mutate_its_state():
    gen = _gen(4)
    cell = _exact_cell()
    spec = cell.spec
    q, k, v = random_qkv(1, spec, 3, gen)
    mask = torch.ones(1, 3, dtype=torch.bool)
    _, *state = cell(q, k, v, mask, *cell.init_state(1, torch.device("cpu"), torch.float32))
    before = [t.clone() for t in state]
    cell(q[:, :, :1], k[:, :, :1], v[:, :, :1], mask[:, :1], *state)
    assert all(torch.equal(a, b) for a, b in zip(state, before))


# --------------------------------------------------------------------------- linear: the forms


@st.composite
def linear_problems(draw):
    batch = draw(st.integers(1, 2))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    feature_dim = draw(st.sampled_from([4, 8]))
    value_dim = draw(st.sampled_from([4, 8]))
    length = draw(st.integers(1, 70))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, num_kv_heads, group, feature_dim, value_dim, length, seed


def _linear_inputs(batch, num_kv_heads, group, feature_dim, value_dim, length, seed):
    """Positive features (as any phi gives), values of both signs, a random nonzero state."""
    gen = _gen(seed)
    phi_q = torch.rand(batch, num_kv_heads, group, length, feature_dim, generator=gen) + 0.05
    phi_k = torch.rand(batch, num_kv_heads, length, feature_dim, generator=gen) + 0.05
    v = torch.randn(batch, num_kv_heads, length, value_dim, generator=gen)
    kv0 = torch.randn(batch, num_kv_heads, feature_dim, value_dim, generator=gen)
    z0 = torch.rand(batch, num_kv_heads, feature_dim, generator=gen) + 0.5
    return phi_q, phi_k, v, kv0, z0


def _step_loop(phi_q, phi_k, v, kv, k_sum):
    outs = []
    for t in range(phi_k.shape[2]):
        out, kv, k_sum = step_feature_attn(
            phi_q[:, :, :, t : t + 1], phi_k[:, :, t : t + 1], v[:, :, t : t + 1], kv, k_sum
        )
        outs.append(out)
    return torch.cat(outs, dim=3), kv, k_sum


LINEAR_FORMS = {
    "naive_recurrent": naive_recurrent_feature_attn,
    "parallel": parallel_feature_attn,
    "chunk_1": lambda *a: chunk_feature_attn(*a, chunk_size=1),
    "chunk_3": lambda *a: chunk_feature_attn(*a, chunk_size=3),
    "chunk_64": lambda *a: chunk_feature_attn(*a, chunk_size=64),
    "step_loop": _step_loop,
}


@pytest.mark.parametrize("form", list(LINEAR_FORMS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=linear_problems())
def test_linear_forms_match_float64_reference(form, problem):
    phi_q, phi_k, v, kv0, z0 = _linear_inputs(*problem)
    kv0_copy, z0_copy = kv0.clone(), z0.clone()
    out, kv, k_sum = LINEAR_FORMS[form](phi_q, phi_k, v, kv0, z0)
    ref, ref_kv, ref_z = reference_linear_attention(phi_q, phi_k, v, kv0, z0)

    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(kv.double(), ref_kv, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(k_sum.double(), ref_z, rtol=RTOL, atol=ATOL)
    assert torch.equal(kv0, kv0_copy) and torch.equal(z0, z0_copy)  # functional: inputs untouched


def test_linear_chunk_form_lengths_around_the_chunk_size():
    for length in (1, 2, 3, 4, 5, 6, 7, 63, 64, 65, 130):
        phi_q, phi_k, v, kv0, z0 = _linear_inputs(1, 2, 2, 4, 4, length, seed=length)
        ref, ref_kv, ref_z = reference_linear_attention(phi_q, phi_k, v, kv0, z0)
        for chunk in (1, 3, 64):
            out, kv, k_sum = chunk_feature_attn(phi_q, phi_k, v, kv0, z0, chunk_size=chunk)
            torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL, msg=f"T={length} C={chunk}")
            torch.testing.assert_close(kv.double(), ref_kv, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(k_sum.double(), ref_z, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- linear: the cell


def _linear_cell(num_kv_heads=2, group=2, head_dim=8, value_dim=8, chunk_size=4) -> LinearCell:
    spec = CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim, 1 / math.sqrt(head_dim))
    return LinearCell(spec, chunk_size=chunk_size)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_linear_cell_matches_reference_with_gqa_and_padding(group):
    gen = _gen(group)
    cell = _linear_cell(num_kv_heads=2, group=group)
    spec = cell.spec
    q, k, v = random_qkv(2, spec, 11, gen)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :4] = False
    state = cell.init_state(2, torch.device("cpu"), torch.float32)
    out, kv, k_sum = cell(q, k, v, mask, *state)
    ref, ref_kv, ref_z = reference_linear_cell(q, k, v, mask, state[0], state[1], cell.eps)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert kv.shape == (2, 2, 8, 8) and k_sum.shape == (2, 2, 8)
    # padding positions' outputs are never used; the real tokens' outputs and the state must match
    torch.testing.assert_close(out[0].double(), ref[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out[1, :, 4:].double(), ref[1, :, 4:], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(kv.double(), ref_kv, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(k_sum.double(), ref_z, rtol=RTOL, atol=ATOL)


def test_every_token_real_reads_the_mask_only_where_that_costs_no_op(monkeypatch):
    """Eager on a CPU the mask is read on the host (cells then skip zeroing padding); on another
    device, or while compiling or exporting (one graph for every mask), it is not read: False."""
    assert every_token_real(torch.ones(2, 3, dtype=torch.bool)) and every_token_real(torch.ones(2, 1, dtype=torch.bool))
    assert not every_token_real(torch.tensor([[True, True], [False, True]]))
    assert not every_token_real(torch.tensor([[True], [False]]))  # a decode step with a padded row
    assert not every_token_real(torch.ones(2, 1, dtype=torch.bool, device="meta"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not every_token_real(torch.ones(2, 3, dtype=torch.bool))


def test_linear_cell_padding_tokens_do_not_change_the_state():
    gen = _gen(5)
    cell = _linear_cell()
    spec = cell.spec
    q, k, v = random_qkv(1, spec, 9, gen)
    mask = torch.ones(1, 9, dtype=torch.bool)
    _, *state = cell(q, k, v, mask, *cell.init_state(1, torch.device("cpu"), torch.float32))
    pq, pk, pv = random_qkv(1, spec, 5, gen)
    padding = torch.zeros(1, 5, dtype=torch.bool)
    _, *after = cell(pq, pk, pv, padding, *state)  # a prefill of padding only
    assert torch.equal(after[0], state[0]) and torch.equal(after[1], state[1])
    _, *after = cell(pq[:, :, :1], pk[:, :, :1], pv[:, :, :1], padding[:, :1], *state)  # a padding step
    assert torch.equal(after[0], state[0]) and torch.equal(after[1], state[1])

    # left padding in front of a sequence: same final state and same outputs as without it
    lq, lk, lv = (torch.cat([p, x], dim=2) for p, x in ((pq, q), (pk, k), (pv, v)))
    lmask = torch.cat([padding, mask], dim=1)
    init = cell.init_state(1, torch.device("cpu"), torch.float32)
    out_padded, *state_padded = cell(lq, lk, lv, lmask, *init)
    out_plain, *state_plain = cell(q, k, v, mask, *init)
    torch.testing.assert_close(state_padded[0], state_plain[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(state_padded[1], state_plain[1], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out_padded[:, :, 5:], out_plain, rtol=RTOL, atol=ATOL)


@HYPOTHESIS
@given(
    length=st.integers(1, 30),
    chunk_size=st.sampled_from([1, 3, 64]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_cell_step_by_step_equals_one_shot(length, chunk_size, group, seed):
    gen = _gen(seed)
    cell = _linear_cell(group=group, chunk_size=chunk_size)
    spec = cell.spec
    q, k, v = random_qkv(2, spec, length, gen)
    mask = torch.ones(2, length, dtype=torch.bool)
    init = cell.init_state(2, torch.device("cpu"), torch.float32)
    one_shot, *final = cell(q, k, v, mask, *init)
    state, outs = init, []
    for t in range(length):
        out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
        outs.append(out)
        assert state[0].shape == init[0].shape and state[1].shape == init[1].shape  # constant size
    torch.testing.assert_close(torch.cat(outs, dim=2), one_shot, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(state[0], final[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(state[1], final[1], rtol=RTOL, atol=ATOL)


def test_linear_cell_state_size_does_not_depend_on_length():
    cell = _linear_cell(num_kv_heads=3, group=2, head_dim=4, value_dim=6)
    shapes = set()
    for length in (1, 7, 100):
        q = torch.randn(1, 6, length, 4)
        k = torch.randn(1, 3, length, 4)
        v = torch.randn(1, 3, length, 6)
        _, kv, k_sum = cell(
            q, k, v, torch.ones(1, length, dtype=torch.bool), *cell.init_state(1, torch.device("cpu"), torch.float32)
        )
        shapes.add((tuple(kv.shape), tuple(k_sum.shape)))
    assert shapes == {((1, 3, 4, 6), (1, 3, 4))}
    assert cell.state_nbytes(1) == cell.state_nbytes(10**6) == (3 * 4 * 6 + 3 * 4) * 4


def test_linear_cell_bf16_inputs_keep_an_fp32_state():
    gen = _gen(6)
    cell = _linear_cell(chunk_size=3)
    spec = cell.spec
    q, k, v = random_qkv(2, spec, 10, gen, dtype=torch.bfloat16)
    mask = torch.ones(2, 10, dtype=torch.bool)
    init = cell.init_state(2, torch.device("cpu"), torch.bfloat16)
    assert init[0].dtype == init[1].dtype == torch.float32
    out, kv, k_sum = cell(q, k, v, mask, *init)
    assert out.dtype == torch.bfloat16 and kv.dtype == k_sum.dtype == torch.float32
    # Reference in fp64 from the very same bf16 numbers. The state is accumulated in fp32 from
    # exactly representable inputs: held to the fp32 tolerance. The output is rounded once to
    # bf16 (8 significant bits, relative error <= 2**-9), so it is held to 2**-7 relative/absolute.
    ref, ref_kv, ref_z = reference_linear_cell(q, k, v, mask, init[0], init[1], cell.eps)
    torch.testing.assert_close(kv.double(), ref_kv, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(k_sum.double(), ref_z, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=2**-7)
    # and decoding on: many bf16 steps do not drift, because the state never leaves fp32
    state, outs = (kv, k_sum), []
    q2, k2, v2 = random_qkv(2, spec, 40, gen, dtype=torch.bfloat16)
    for t in range(40):
        o, *state = cell(q2[:, :, t : t + 1], k2[:, :, t : t + 1], v2[:, :, t : t + 1], mask[:, :1], *state)
        outs.append(o)
    ref2, ref_kv2, _ = reference_linear_cell(q2, k2, v2, torch.ones(2, 40, dtype=torch.bool), ref_kv, ref_z, cell.eps)
    torch.testing.assert_close(state[0].double(), ref_kv2, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.cat(outs, dim=2).double(), ref2, rtol=2**-7, atol=2**-7)


# --------------------------------------------------------------------------- build_cell


def test_build_cell_builds_each_target_with_its_options():
    spec = CellSpec(4, 2, 8, 8, 0.125, None)
    exact = build_cell("exact", spec, {"block_size": 7})
    assert isinstance(exact, ExactCell) and exact.block_size == 7 and exact.spec == spec
    linear = build_cell("linear", spec, {"feature_map": "elu", "chunk_size": 5})
    assert isinstance(linear, LinearCell) and linear.chunk_size == 5
    assert CELLS["exact"] is ExactCell and CELLS["linear"] is LinearCell


def test_build_cell_rejects_unknown_target():
    with pytest.raises(RnnifyError, match="unknown target 'softmax2'"):
        build_cell("softmax2", CellSpec(4, 2, 8, 8, 0.125))


def test_build_cell_rejects_unknown_feature_map():
    with pytest.raises(RnnifyError, match="unknown feature map 'cosine'"):
        build_cell("linear", CellSpec(4, 2, 8, 8, 0.125), {"feature_map": "cosine"})


def test_build_cell_rejects_unknown_option():
    with pytest.raises(RnnifyError, match="'exact'"):
        build_cell("exact", CellSpec(4, 2, 8, 8, 0.125), {"chunk_size": 3})


@pytest.mark.parametrize("window", [None, 5])
def test_state_nbytes_counts_the_state_actually_held(window):
    gen = _gen(7)
    spec = CellSpec(4, 2, 8, 6, 0.3, window)
    for cell in (ExactCell(spec), LinearCell(spec)):
        for length in (1, 3, 9):
            q = torch.randn(3, 4, length, 8, generator=gen).bfloat16()
            k = torch.randn(3, 2, length, 8, generator=gen).bfloat16()
            v = torch.randn(3, 2, length, 6, generator=gen).bfloat16()
            init = cell.init_state(3, torch.device("cpu"), torch.bfloat16)
            _, *state = cell(q, k, v, torch.ones(3, length, dtype=torch.bool), *init)
            held = sum(t.numel() * t.element_size() for t in state)
            assert cell.state_nbytes(length, 3, torch.bfloat16) == held, (type(cell).__name__, length)
