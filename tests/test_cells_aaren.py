"""The Aaren cell against references written here, independently of rnnify.

Aaren (docs/math.md §Aaren): one learned query q^ per layer and head; the output at t is the softmax
attention of q^ over the real keys 1..t, continued from a state (m, u, w) that stands for a past
with sum_i e^{s_i} = u e^m and sum_i e^{s_i} v_i = w e^m. The float64 references below compute
that directly, o_t = (w e^{m-M} + sum_i e^{s_i-M} v_i) / (u e^{m-M} + sum_i e^{s_i-M}) with M the
largest exponent, one (b, head, t) at a time.

Tolerances: fp32 computation of O(1) outputs against float64 is held to 1e-5 relative with the
same absolute floor (RTOL/ATOL), as in tests/test_cells.py.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import (
    HEAD_DRAWS,
    random_qkv,
    rel_diff,
)
from test_cells import _padding_mask

from rnnify.cells import CELLS, CellSpec, build_cell, parameters
from rnnify.cells.aaren import (
    AarenCell,
    chunk_aaren,
    naive_recurrent_aaren,
    parallel_aaren,
    scan_aaren,
    step_aaren,
)
from rnnify.errors import RnnifyError

RTOL = ATOL = 1e-5
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NEG_INF = float("-inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- references


def reference_prefix_softmax(s, v, m0, u0, w0):
    """float64: outputs and final state of softmax over the prefix 1..t, continued from (m0, u0, w0).

    s [B, Hkv, G, T] (-inf = padding), v [B, Hkv, T, Dv], m0/u0 [B, Hkv, G], w0 [B, Hkv, G, Dv].
    """
    s, v, m0, u0, w0 = (x.double() for x in (s, v, m0, u0, w0))
    batch, num_kv_heads, group, length = s.shape
    out = torch.zeros(batch, num_kv_heads, group, length, v.shape[-1], dtype=torch.float64)
    m, u, w = m0.clone(), u0.clone(), w0.clone()
    for b in range(batch):
        for h in range(num_kv_heads):
            for g in range(group):
                for t in range(length + 1):  # t = length: the final state
                    real = [i for i in range(t + 1) if i < length and math.isfinite(float(s[b, h, g, i]))]
                    exponents = [float(m0[b, h, g])] + [float(s[b, h, g, i]) for i in real]
                    big = max(exponents)
                    if big == NEG_INF:  # nothing read at all
                        top, num, den = NEG_INF, torch.zeros(v.shape[-1], dtype=torch.float64), 0.0
                    else:
                        carry = math.exp(float(m0[b, h, g]) - big)
                        den = float(u0[b, h, g]) * carry + sum(math.exp(float(s[b, h, g, i]) - big) for i in real)
                        num = w0[b, h, g] * carry + sum(
                            (math.exp(float(s[b, h, g, i]) - big) * v[b, h, i] for i in real),
                            torch.zeros(v.shape[-1], dtype=torch.float64),
                        )
                        top = big
                    if t < length:
                        out[b, h, g, t] = num / den if den > 0 else 0.0
                    else:
                        m[b, h, g], u[b, h, g], w[b, h, g] = top, den, num
    return out, m, u, w


def reference_aaren_cell(query, k, v, mask, scale):
    """float64 Aaren from an empty state: softmax of scale * query[h] . k_i over real i <= t.

    query [H, d]; k/v [B, Hkv, T, *]; mask [B, T]. Query head h reads kv head h // G; 0 where no key.
    """
    query, k, v = query.double(), k.double(), v.double()
    batch, num_kv_heads, length, _ = k.shape
    num_heads = query.shape[0]
    group = num_heads // num_kv_heads
    out = torch.zeros(batch, num_heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(num_heads):
            for t in range(length):
                keys = [i for i in range(t + 1) if bool(mask[b, i])]
                if not keys:
                    continue
                scores = torch.stack([scale * torch.dot(query[h], k[b, h // group, i]) for i in keys])
                weights = torch.softmax(scores, dim=0)
                out[b, h, t] = sum(wt * v[b, h // group, i] for wt, i in zip(weights, keys))
    return out


# --------------------------------------------------------------------------- aaren: the forms


def _step_loop(s, v, m, u, w):
    outs = []
    for t in range(s.shape[-1]):
        out, m, u, w = step_aaren(s[..., t : t + 1], v[:, :, t : t + 1], m, u, w)
        outs.append(out)
    return torch.cat(outs, dim=3), m, u, w


def aaren_forms(chunk_size: int) -> dict:
    return {
        "parallel": parallel_aaren,
        "scan": scan_aaren,
        f"chunk_{chunk_size}": lambda *a: chunk_aaren(*a, chunk_size=chunk_size),
        "step_loop": _step_loop,
    }


@st.composite
def aaren_problems(draw):
    batch = draw(st.integers(1, 3))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    value_dim = draw(st.sampled_from([4, 8, 16]))
    length = draw(st.one_of(st.just(1), st.integers(1, 70)))
    chunk_size = draw(st.sampled_from([1, 3, 5, 16, 64]))
    padding = draw(st.sampled_from(["none", "left", "random"]))
    initial = draw(st.sampled_from(["empty", "random"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, num_kv_heads, group, value_dim, length, chunk_size, padding, initial, seed


def _aaren_inputs(batch, num_kv_heads, group, value_dim, length, padding, initial, seed, score_scale=2.0):
    """Scores (-inf on padding), values (0 on padding, as the cell passes them) and a state."""
    gen = _gen(seed)
    s = score_scale * torch.randn(batch, num_kv_heads, group, length, generator=gen)
    v = torch.randn(batch, num_kv_heads, length, value_dim, generator=gen)
    mask = _padding_mask(padding, batch, length, gen)
    s = s.masked_fill(~mask[:, None, None, :], NEG_INF)
    v = v * mask[:, None, :, None]
    if initial == "empty":
        m = torch.full((batch, num_kv_heads, group), NEG_INF)
        u = torch.zeros(batch, num_kv_heads, group)
        w = torch.zeros(batch, num_kv_heads, group, value_dim)
    else:  # a past of a few tokens: u >= 1 (its max term is e^0), w/u a mean of O(1) values
        m = score_scale * torch.randn(batch, num_kv_heads, group, generator=gen)
        u = 1 + 5 * torch.rand(batch, num_kv_heads, group, generator=gen)
        w = u[..., None] * torch.randn(batch, num_kv_heads, group, value_dim, generator=gen)
        m[0, 0, 0], u[0, 0, 0], w[0, 0, 0] = NEG_INF, 0.0, 0.0  # one head that has read nothing
    return s, v, m, u, w


def _assert_state_close(got, want, rtol=RTOL, atol=ATOL):
    m, u, w = got
    ref_m, ref_u, ref_w = want
    torch.testing.assert_close(m.double(), ref_m, rtol=rtol, atol=atol)  # -inf where nothing was read
    torch.testing.assert_close(u.double(), ref_u, rtol=rtol, atol=atol)
    torch.testing.assert_close(w.double(), ref_w, rtol=rtol, atol=atol)


@HYPOTHESIS
@given(aaren_problems())
def test_aaren_forms_equal_the_naive_loop_and_float64(problem):
    batch, num_kv_heads, group, value_dim, length, chunk_size, padding, initial, seed = problem
    s, v, m, u, w = _aaren_inputs(batch, num_kv_heads, group, value_dim, length, padding, initial, seed)
    inputs = [x.clone() for x in (s, v, m, u, w)]
    ref_out, *ref_state = reference_prefix_softmax(s, v, m, u, w)
    naive_out, *naive_state = naive_recurrent_aaren(s, v, m, u, w)
    assert naive_out.shape == (batch, num_kv_heads, group, length, value_dim)
    torch.testing.assert_close(naive_out.double(), ref_out, rtol=RTOL, atol=ATOL)
    _assert_state_close(naive_state, ref_state)
    for name, form in aaren_forms(chunk_size).items():
        out, *state = form(s, v, m, u, w)
        assert out.dtype == torch.float32 and all(x.dtype == torch.float32 for x in state), name
        torch.testing.assert_close(out, naive_out, rtol=RTOL, atol=ATOL, msg=lambda e: f"{name}: {e}")
        for got, want in zip(state, naive_state):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda e: f"{name} state: {e}")
    assert all(torch.equal(a, b) for a, b in zip(inputs, (s, v, m, u, w)))  # functional


@pytest.mark.parametrize("length", [1, 2, 3, 5, 6, 7, 9, 13, 31, 33, 63, 65, 100])
def test_aaren_scan_equals_the_naive_loop_for_lengths_that_are_not_powers_of_two(length):
    s, v, m, u, w = _aaren_inputs(2, 2, 2, 8, length, "left", "random", seed=length)
    naive_out, *naive_state = naive_recurrent_aaren(s, v, m, u, w)
    out, *state = scan_aaren(s, v, m, u, w)
    torch.testing.assert_close(out, naive_out, rtol=RTOL, atol=ATOL)
    for got, want in zip(state, naive_state):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_aaren_chunk_form_lengths_around_the_chunk_size():
    for length in (1, 2, 3, 4, 5, 6, 7, 63, 64, 65, 130):
        s, v, m, u, w = _aaren_inputs(1, 2, 2, 4, length, "none", "random", seed=length)
        naive_out, *naive_state = naive_recurrent_aaren(s, v, m, u, w)
        for chunk in (1, 3, 64):
            out, *state = chunk_aaren(s, v, m, u, w, chunk_size=chunk)
            torch.testing.assert_close(out, naive_out, rtol=RTOL, atol=ATOL, msg=f"T={length} C={chunk}")
            for got, want in zip(state, naive_state):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("magnitude", [1e3, 3e3])
def test_aaren_huge_scores_stay_finite_in_every_form(magnitude):
    # e^{1000} overflows fp32 (and fp64); every form must subtract a running max first
    s, v, m, u, w = _aaren_inputs(2, 2, 2, 8, 37, "left", "random", seed=11, score_scale=magnitude)
    ref_out, *ref_state = reference_prefix_softmax(s, v, m, u, w)
    forms = {"naive": naive_recurrent_aaren, **aaren_forms(5)}
    for name, form in forms.items():
        out, *state = form(s, v, m, u, w)
        assert torch.isfinite(out).all(), name
        assert torch.isfinite(state[1]).all() and torch.isfinite(state[2]).all(), name
        # differences of fp32 exponents of ~1e3 round by up to ~1e-4, hence 1e-3
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-3, atol=1e-3, msg=lambda e: f"{name}: {e}")
        _assert_state_close(state, ref_state, rtol=1e-3, atol=1e-3)


def test_aaren_forms_have_the_same_gradients():
    """The query's gradient is the same through the naive loop, the scan and the chunks."""
    gen = _gen(12)
    k = torch.randn(2, 2, 19, 8, generator=gen)
    v = torch.randn(2, 2, 19, 4, generator=gen)
    mask = torch.ones(2, 19, dtype=torch.bool)
    mask[1, :6] = False
    target = torch.randn(2, 2, 2, 19, 4, generator=gen)
    grads = {}
    for name, form in {"naive": naive_recurrent_aaren, **aaren_forms(4)}.items():
        query = torch.randn(2, 2, 8, generator=_gen(13)).requires_grad_()
        s = torch.einsum("hgd,bhtd->bhgt", query, k).masked_fill(~mask[:, None, None], NEG_INF)
        m, u, w = torch.full((2, 2, 2), NEG_INF), torch.zeros(2, 2, 2), torch.zeros(2, 2, 2, 4)
        out, *_ = form(s, v * mask[:, None, :, None], m, u, w)
        ((out - target) ** 2).mean().backward()
        assert torch.isfinite(query.grad).all(), name
        grads[name] = query.grad
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads["naive"], rtol=1e-4, atol=1e-6, msg=lambda e: f"{name}: {e}")


# --------------------------------------------------------------------------- aaren: the cell


def _aaren_cell(num_kv_heads=2, group=2, head_dim=8, value_dim=8, chunk_size=4, prefill="chunk", seed=None):
    spec = CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim, 1 / math.sqrt(head_dim))
    cell = AarenCell(spec, chunk_size=chunk_size, prefill=prefill)
    if seed is not None:
        with torch.no_grad():
            cell.query.copy_(2 * torch.randn(cell.query.shape, generator=_gen(seed)))
    return cell


def _init(cell, batch, dtype=torch.float32):
    return cell.init_state(batch, torch.device("cpu"), dtype)


@HYPOTHESIS
@given(
    **HEAD_DRAWS,
    length=st.one_of(st.just(1), st.integers(1, 40)),
    chunk_size=st.sampled_from([1, 3, 5, 64]),
    prefill=st.sampled_from(["chunk", "scan"]),
    padding=st.sampled_from(["none", "left", "random"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_aaren_cell_prefill_and_steps_match_float64(
    batch, num_kv_heads, group, head_dim, length, chunk_size, prefill, padding, seed
):
    gen = _gen(seed)
    cell = _aaren_cell(num_kv_heads, group, head_dim, head_dim, chunk_size, prefill, seed=seed)
    q, k, v = random_qkv(batch, cell.spec, length, gen)
    mask = _padding_mask(padding, batch, length, gen)
    ref = reference_aaren_cell(cell.query.detach(), k, v, mask, cell.spec.scale)
    init = _init(cell, batch)
    one_shot, *final = cell(q, k, v, mask, *init)
    assert one_shot.shape == q.shape and one_shot.dtype == q.dtype
    real = mask[:, None, :, None].expand_as(one_shot)  # padding outputs may be anything finite
    assert torch.isfinite(one_shot).all()
    torch.testing.assert_close(one_shot[real].double(), ref[real], rtol=RTOL, atol=ATOL)
    state, outs = init, []
    for t in range(length):
        out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
        outs.append(out)
        assert [x.shape for x in state] == [x.shape for x in init]  # constant size
        assert all(x.dtype == torch.float32 for x in state)
    torch.testing.assert_close(torch.cat(outs, dim=2), one_shot, rtol=RTOL, atol=ATOL)
    for got, want in zip(state, final):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("prefill", ["chunk", "scan"])
def test_aaren_cell_prefill_continues_from_its_state(prefill):
    gen = _gen(20)
    cell = _aaren_cell(group=4, chunk_size=3, prefill=prefill, seed=20)
    q, k, v = random_qkv(2, cell.spec, 23, gen)
    mask = torch.ones(2, 23, dtype=torch.bool)
    full, *full_state = cell(q, k, v, mask, *_init(cell, 2))
    first, *state = cell(q[:, :, :10], k[:, :, :10], v[:, :, :10], mask[:, :10], *_init(cell, 2))
    second, *state = cell(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], mask[:, 10:], *state)
    torch.testing.assert_close(torch.cat([first, second], dim=2), full, rtol=RTOL, atol=ATOL)
    for got, want in zip(state, full_state):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_aaren_zero_query_gives_the_running_mean_of_the_real_values(group):
    gen = _gen(21 + group)
    cell = _aaren_cell(num_kv_heads=2, group=group, value_dim=6)
    assert torch.equal(cell.query, torch.zeros_like(cell.query))  # the default initialisation
    q, k, v = random_qkv(2, cell.spec, 12, gen)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False
    out, *_ = cell(q, k, v, mask, *_init(cell, 2))
    for b in range(2):
        for t in range(12):
            real = [i for i in range(t + 1) if mask[b, i]]
            if not real:
                continue
            mean = v[b, :, real].double().mean(1)  # [Hkv, Dv]
            torch.testing.assert_close(out[b, :, t].double(), mean.repeat_interleave(group, 0), rtol=RTOL, atol=ATOL)


def test_aaren_ignores_the_per_token_query():
    gen = _gen(25)
    cell = _aaren_cell(seed=25)
    q, k, v = random_qkv(1, cell.spec, 9, gen)
    mask = torch.ones(1, 9, dtype=torch.bool)
    a = cell(q, k, v, mask, *_init(cell, 1))
    b = cell(torch.randn_like(q), k, v, mask, *_init(cell, 1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_aaren_calibrate_sets_the_mean_query():
    gen = _gen(26)
    cell = _aaren_cell(num_kv_heads=2, group=2, head_dim=4)
    q = torch.randn(3, 4, 7, 4, generator=gen)
    assert cell.calibrate(q) is cell
    torch.testing.assert_close(cell.query.detach().double(), q.double().mean(dim=(0, 2)), rtol=RTOL, atol=ATOL)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, :4], mask[2, :6] = False, False
    q_masked = q.clone()
    q_masked[~mask[:, None, :, None].expand_as(q)] = float("inf")  # padding queries must not count
    cell.calibrate(q_masked, mask)
    rows = [q_masked[b, :, mask[b]].double() for b in range(3)]  # [H, n_b, d]
    expected = torch.cat(rows, dim=1).mean(1)
    torch.testing.assert_close(cell.query.detach().double(), expected, rtol=RTOL, atol=ATOL)
    assert cell.query.requires_grad and cell.query.dtype == torch.float32
    with pytest.raises(ValueError, match="no real token"):
        cell.calibrate(q, torch.zeros(3, 7, dtype=torch.bool))


def test_aaren_training_the_query_changes_the_output():
    gen = _gen(27)
    for prefill in ("chunk", "scan"):
        cell = _aaren_cell(chunk_size=3, prefill=prefill)
        q, k, v = random_qkv(2, cell.spec, 10, gen)
        mask = torch.ones(2, 10, dtype=torch.bool)
        target = torch.randn(2, cell.spec.num_heads, 10, cell.spec.value_dim, generator=gen)
        before, *_ = cell(q, k, v, mask, *_init(cell, 2))
        optimizer = torch.optim.SGD(list(parameters(cell)), lr=1.0)
        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            out, *_ = cell(q, k, v, mask, *_init(cell, 2))
            loss = ((out - target) ** 2).mean()
            loss.backward()
            assert cell.query.grad is not None and cell.query.grad.abs().sum() > 0
            optimizer.step()
            losses.append(loss.item())
        after, *_ = cell(q, k, v, mask, *_init(cell, 2))
        assert (after - before).abs().max() > 1e-3, prefill
        assert losses[-1] < losses[0], (prefill, losses)


def test_aaren_padding_tokens_do_not_change_the_state():
    gen = _gen(28)
    cell = _aaren_cell(seed=28)
    q, k, v = random_qkv(1, cell.spec, 9, gen)
    mask = torch.ones(1, 9, dtype=torch.bool)
    _, *state = cell(q, k, v, mask, *_init(cell, 1))
    pq, pk, pv = random_qkv(1, cell.spec, 5, gen)
    pk, pv = 1e3 * pk, 1e3 * pv  # padding of any size, even non-finite
    pk[..., 0, 0], pv[..., 1, 0] = float("inf"), float("nan")
    padding = torch.zeros(1, 5, dtype=torch.bool)
    for prefill in ("chunk", "scan"):
        cell.prefill = prefill
        out, *after = cell(pq, pk, pv, padding, *state)  # a prefill of padding only
        assert torch.isfinite(out).all()
        assert all(torch.equal(a, b) for a, b in zip(after, state))
    _, *after = cell(pq[:, :, :1], pk[:, :, :1], pv[:, :, :1], padding[:, :1], *state)  # a padding step
    assert all(torch.equal(a, b) for a, b in zip(after, state))
    _, *after = cell(pq, pk, pv, padding, *_init(cell, 1))  # padding into an empty state
    assert all(torch.equal(a, b) for a, b in zip(after, _init(cell, 1)))

    # left padding in front of a sequence: same final state and same outputs as without it
    cell.prefill = "chunk"
    lq, lk, lv = (torch.cat([p, x], dim=2) for p, x in ((pq, q), (pk, k), (pv, v)))
    out_padded, *state_padded = cell(lq, lk, lv, torch.cat([padding, mask], dim=1), *_init(cell, 1))
    out_plain, *state_plain = cell(q, k, v, mask, *_init(cell, 1))
    for got, want in zip(state_padded, state_plain):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out_padded[:, :, 5:], out_plain, rtol=RTOL, atol=ATOL)


def test_aaren_cell_does_not_mutate_its_inputs():
    gen = _gen(29)
    cell = _aaren_cell(seed=29)
    q, k, v = random_qkv(1, cell.spec, 6, gen)
    mask = torch.ones(1, 6, dtype=torch.bool)
    _, *state = cell(q, k, v, mask, *_init(cell, 1))
    before = [x.clone() for x in (q, k, v, mask, *state)]
    cell(q, k, v, mask, *state)
    cell(q[:, :, :1], k[:, :, :1], v[:, :, :1], mask[:, :1], *state)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, mask, *state), before))


def test_aaren_bf16_inputs_keep_an_fp32_state():
    gen = _gen(30)
    cell = _aaren_cell(chunk_size=3, seed=30)
    q, k, v = random_qkv(2, cell.spec, 10, gen, dtype=torch.bfloat16)
    mask = torch.ones(2, 10, dtype=torch.bool)
    init = _init(cell, 2, torch.bfloat16)
    assert all(x.dtype == torch.float32 for x in init)
    out, *state = cell(q, k, v, mask, *init)
    assert out.dtype == torch.bfloat16 and all(x.dtype == torch.float32 for x in state)
    # Reference in fp64 from the very same bf16 numbers (and the fp32 query). The state is computed
    # in fp32 from exactly representable inputs: fp32 tolerance. The output is rounded once to
    # bf16 (8 significant bits, relative error <= 2**-9): 2**-7 relative/absolute.
    ref = reference_aaren_cell(cell.query.detach(), k, v, mask, cell.spec.scale)
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=2**-7)
    grouped = (2, cell.spec.num_kv_heads, cell.spec.group_size)
    s = torch.einsum("hgd,bhtd->bhgt", cell.query.detach().double().reshape(2, 2, 8), k.double()) * cell.spec.scale
    _, *ref_state = reference_prefix_softmax(
        s, v.double(), torch.full(grouped, NEG_INF), torch.zeros(grouped), torch.zeros(*grouped, 8)
    )
    m, u, w = state[0].reshape(grouped), state[1].reshape(grouped), state[2].reshape(*grouped, 8)
    _assert_state_close((m, u, w), ref_state)
    # and decoding on: many bf16 steps do not drift, because the state never leaves fp32
    q2, k2, v2 = random_qkv(2, cell.spec, 40, gen, dtype=torch.bfloat16)
    outs = []
    for t in range(40):
        o, *state = cell(q2[:, :, t : t + 1], k2[:, :, t : t + 1], v2[:, :, t : t + 1], mask[:, :1], *state)
        outs.append(o)
    k_all, v_all, mask_all = torch.cat([k, k2], 2), torch.cat([v, v2], 2), torch.ones(2, 50, dtype=torch.bool)
    ref2 = reference_aaren_cell(cell.query.detach(), k_all, v_all, mask_all, cell.spec.scale)
    torch.testing.assert_close(torch.cat(outs, dim=2).double(), ref2[:, :, 10:], rtol=2**-7, atol=2**-7)


def test_aaren_state_size_does_not_depend_on_length():
    cell = _aaren_cell(num_kv_heads=3, group=2, head_dim=4, value_dim=6)
    for length in (1, 7, 100):
        q, k, v = torch.randn(2, 6, length, 4), torch.randn(2, 3, length, 4), torch.randn(2, 3, length, 6)
        _, m, u, w = cell(q, k, v, torch.ones(2, length, dtype=torch.bool), *_init(cell, 2))
        assert (m.shape, u.shape, w.shape) == ((2, 6), (2, 6), (2, 6, 6))
        assert cell.state_nbytes(length, 2, torch.bfloat16) == sum(x.numel() * x.element_size() for x in (m, u, w))
    assert cell.state_nbytes(1) == cell.state_nbytes(10**6) == 6 * (1 + 1 + 6) * 4


def test_aaren_options_rebuild_and_are_validated():
    spec = CellSpec(4, 2, 8, 8, 0.125)
    cell = build_cell("aaren", spec, {"chunk_size": 7, "prefill": "scan"})
    assert isinstance(cell, AarenCell) and CELLS["aaren"] is AarenCell
    assert cell.options() == {"chunk_size": 7, "prefill": "scan"}
    rebuilt = type(cell)(spec, **cell.options())
    assert rebuilt.options() == cell.options() and rebuilt.query.shape == (4, 8)
    assert list(cell.state_dict()) == ["query"] and list(cell.buffers()) == []
    assert "learned query" in cell.describe()
    with pytest.raises(RnnifyError, match="chunk_size must be a positive integer"):
        build_cell("aaren", spec, {"chunk_size": 0})
    with pytest.raises(RnnifyError, match="unknown prefill form 'tree'"):
        build_cell("aaren", spec, {"prefill": "tree"})
    with pytest.raises(RnnifyError, match="'aaren'"):
        build_cell("aaren", spec, {"feature_map": "elu"})


# --------------------------------------------------------------------------- aaren: stability


def _stability(steps: int):
    """``steps`` single steps from random inputs: finite, and the last outputs equal the other forms."""
    gen = _gen(31)
    cell = _aaren_cell(num_kv_heads=1, group=2, head_dim=8, value_dim=8, chunk_size=64, seed=31)
    q, k, v = random_qkv(1, cell.spec, steps, gen)
    mask = torch.ones(1, steps, dtype=torch.bool)
    state = _init(cell, 1)
    start = time.perf_counter()
    with torch.no_grad():
        for t in range(steps):
            out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
            if t % 1000 == 0:
                assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in state), t
        elapsed = time.perf_counter() - start
        assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in state)
        chunked, *chunk_state = cell(q, k, v, mask, *_init(cell, 1))
        cell.prefill = "scan"
        scanned, *_ = cell(q, k, v, mask, *_init(cell, 1))
    # the last output directly in float64: softmax of the learned query over all keys
    s = torch.einsum("hd,td->ht", cell.query.detach().double(), k[0, 0].double()) * cell.spec.scale
    last = torch.softmax(s, dim=-1) @ v[0, 0].double()
    # fp32 sums over 1e5 terms: measured ~5e-6 relative (to the largest entry) at 1e5 steps; 1e-4 is held
    assert rel_diff(out[0, :, 0].double(), last) < 1e-4
    assert rel_diff(chunked[:, :, -1], out[:, :, 0]) < 1e-4
    assert rel_diff(scanned[:, :, -1], out[:, :, 0]) < 1e-4
    torch.testing.assert_close(state[0], chunk_state[0])  # m: the same running max
    assert rel_diff(state[1], chunk_state[1]) < 1e-4 and rel_diff(state[2], chunk_state[2]) < 1e-4
    return elapsed


def test_aaren_2000_steps_are_stable():
    _stability(2000)


@pytest.mark.slow
def test_aaren_100000_steps_are_stable():
    elapsed = _stability(100_000)
    print(f"100,000 aaren steps: {elapsed:.1f} s")
