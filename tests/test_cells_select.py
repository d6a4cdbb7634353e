"""The token-selection cell (``select``: sinks + window + K tokens chosen by attention) against a
reference written here.

The reference (docs/math.md §Token-selection caches) is a float64 loop over sets of positions, per
row and kv head, counting each row's real tokens only: query i of the chunk starting at c reads
A(i) = {j < S} ∪ {c - W < j <= i} ∪ P, the observing queries add their attention (summed over the
group's heads) to the score of every token they read, and at each boundary p the tokens
{j >= S : p - C - W < j <= p - W} compete with P by pooled score; the K best (ties: the newer) are
the next P, and ``snapkv`` restarts every score. It knows nothing of rings or slots.

Every form (naive loop, chunked prefill, step) must equal the naive loop, and the naive loop the
reference; a prefill split anywhere equals the whole; converted tiny models step as they prefill.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
    decode,
    draw_heads,
    random_qkv,
    rel_diff,
)
from window_support import mask_of_kind

import rnnify
from rnnify.cells import CELLS, CellSpec, build_cell
from rnnify.cells.select import (
    SelectCell,
    chunk_select_attn,
    naive_recurrent_select_attn,
    step_select_attn,
)
from rnnify.cells.window import WindowCell
from rnnify.errors import RnnifyError
from rnnify.kernels import slots
from rnnify.runtime.agreement import rounding_dtype, tolerance

# fp32 computation against float64 on O(1) inputs: 1e-5 relative, the same absolute floor.
RTOL = ATOL = 1e-5
# bf16 inputs, fp32 accumulation, the output rounded once to bf16 (relative error <= 2**-9)
BF16_TOL = 2**-7
HYPOTHESIS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CPU = torch.device("cpu")
BUFFERS = ("keys", "values", "sink_keys", "sink_values", "selected_keys", "selected_values")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spec(num_kv_heads=2, group=2, head_dim=8, value_dim=None) -> CellSpec:
    return CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim or head_dim, head_dim**-0.5)


# --------------------------------------------------------------------------- the reference


def reference_select_attention(
    q, k, v, mask, *, window, sinks, keep, chunk, scale, observation=None, policy="mass", pool=1, pooling="avg"
):
    """float64 outputs ``[B, H, T, d_v]`` (0 for padding queries) and the selected positions at the
    end, a sorted list per row and kv head."""
    q, k, v = q.double(), k.double(), v.double()
    batch, num_heads, length, _ = q.shape
    num_kv_heads = k.shape[1]
    group, observation = num_heads // num_kv_heads, observation or chunk
    out = torch.zeros(batch, num_heads, length, v.shape[-1], dtype=torch.float64)
    selections = []
    for b in range(batch):
        real = [t for t in range(length) if mask[b, t]]
        selections.append([])
        for h in range(num_kv_heads):
            heads = slice(h * group, (h + 1) * group)
            selected, score = set(), defaultdict(float)
            for i, t in enumerate(real):
                start = i - i % chunk
                read = [j for j in range(i + 1) if j < sinks or j > start - window or j in selected]
                tokens = [real[j] for j in read]
                p = torch.softmax(scale * q[b, heads, t] @ k[b, h, tokens].T, dim=-1)  # [G, n]
                out[b, heads, t] = p @ v[b, h, tokens]
                if i % chunk >= chunk - observation:
                    for j, mass in zip(read, p.sum(0).tolist()):
                        score[j] += mass
                boundary = i + 1
                if boundary % chunk or not keep:
                    continue
                leaving = range(max(sinks, boundary - chunk - window + 1), boundary - window + 1)
                held = selected | set(range(max(sinks, boundary - window - chunk + 1), boundary))

                def merit(j):
                    near = [score[n] for n in held if abs(n - j) <= pool // 2]
                    return sum(near) / pool if pooling == "avg" else max(near)

                selected = set(sorted(selected | set(leaving), key=lambda j: (merit(j), j), reverse=True)[:keep])
                if policy == "snapkv":
                    score = defaultdict(float)
            selections[b].append(sorted(selected))
    return out, selections


# --------------------------------------------------------------------------- helpers


def _grouped(q, spec):
    batch, _, length, _ = q.shape
    return q.float().reshape(batch, spec.num_kv_heads, spec.group_size, length, -1)


def _garbage_buffers(cell, state, gen):
    """Key/value buffers and scores filled with large junk: slots not written must never be read."""

    def junk(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.int8:  # any levels, at scales up to 2^10 (as large as the float junk, finite)
            junk = torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8)
            return torch.cat([junk[..., :-1], junk[..., -1:] % 11], dim=-1)
        return (100 * torch.randn(t.shape, generator=gen)).to(t.dtype)

    return tuple(
        junk(t) if name in (*BUFFERS, "scores", "selected_scores") else t for t, name in zip(state, cell.state_names)
    )


def _retyped(state, dtype, to):
    """``state`` with its ``dtype`` tensors in ``to``; the others (int8 or half-precision slots) as stored."""
    return tuple(t.to(to) if t.dtype == dtype else t for t in state)


def _as_stored(x: torch.Tensor, kv_dtype: str | None) -> torch.Tensor:
    """``x`` as slots of ``kv_dtype`` read it back (the reference's keys and values)."""
    return x if kv_dtype is None else slots.decode(slots.encode(x, slots.kv_dtype(kv_dtype))).to(x.dtype)


def _step_loop(q, k, v, mask, *state, **kwargs):
    outs = []
    for t in range(q.shape[3]):
        out, *state = step_select_attn(
            q[:, :, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state, **kwargs
        )
        outs.append(out)
    return torch.cat(outs, dim=3), *state


def _assert_states_close(got, want, names):
    for name, a, b in zip(names, got, want):
        if a.is_floating_point():
            torch.testing.assert_close(a.double(), b.double(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        else:
            assert torch.equal(a, b), name


def _run(cell, q, k, v, mask, state, splits=()):
    """The cell over the tokens in calls split at ``splits`` (one token a call: a decode step)."""
    bounds = [0, *splits, q.shape[2]]
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        out, *state = cell(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], mask[:, a:b], *state)
        outs.append(out)
    return torch.cat(outs, dim=2), state


# --------------------------------------------------------------------------- the forms


@st.composite
def select_problems(draw):
    chunk = draw(st.sampled_from([1, 2, 3, 4]))
    return dict(
        **draw_heads(draw),
        window=draw(st.integers(1, 6)),
        sinks=draw(st.integers(0, 3)),
        keep=draw(st.integers(0, 4)),
        chunk=chunk,
        observation=draw(st.integers(1, chunk)),
        policy=draw(st.sampled_from(["mass", "snapkv"])),
        pool=draw(st.sampled_from([1, 3, 5])),
        pooling=draw(st.sampled_from(["avg", "max"])),
        prefix=draw(st.integers(0, 10)),
        length=draw(st.one_of(st.just(1), st.integers(1, 20))),
        padding=draw(st.sampled_from(["none", "left", "random"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        kv_dtype=draw(st.sampled_from([None, None, "float16", "bfloat16", "int8"])),
    )


OPTIONS = ("window", "sinks", "keep", "chunk", "observation", "policy", "pool", "pooling")


@HYPOTHESIS
@given(select_problems())
def test_forms_equal_the_naive_loop_and_the_reference(p):
    """With ``kv_dtype`` every form stores the same bytes (int8 slots equal to the bit) and the
    reference reads the keys and values as they are stored."""
    spec = _spec(p["num_kv_heads"], p["group"], p["head_dim"], p["value_dim"])
    cell = SelectCell(spec, **{name: p[name] for name in OPTIONS}, kv_dtype=p["kv_dtype"])
    gen, rule, scale, P = _gen(p["seed"]), cell.rule, spec.scale, p["prefix"]
    q, k, v = random_qkv(p["batch"], spec, P + p["length"], gen)
    mask = mask_of_kind(p["padding"], p["batch"], P + p["length"], gen)
    state = _garbage_buffers(cell, cell.init_state(p["batch"], CPU, torch.float32), gen)
    state = _retyped(state, torch.float32, torch.float64)
    gq = _grouped(q, spec).double()
    _, *state = naive_recurrent_select_attn(
        gq[:, :, :, :P], k[:, :, :P].double(), v[:, :, :P].double(), mask[:, :P], *state, scale=scale, rule=rule
    )
    args = (gq[:, :, :, P:], k[:, :, P:].double(), v[:, :, P:].double(), mask[:, P:])
    want, *want_state = naive_recurrent_select_attn(*args, *state, scale=scale, rule=rule)

    stored_k, stored_v = (_as_stored(x, p["kv_dtype"]) for x in (k, v))
    ref, selections = reference_select_attention(
        q, stored_k, stored_v, mask, scale=scale, **{name: p[name] for name in OPTIONS}
    )
    real = mask[:, None, P:, None].expand(-1, spec.num_heads, -1, spec.value_dim)
    torch.testing.assert_close(want.reshape(ref[:, :, P:].shape)[real], ref[:, :, P:][real], rtol=RTOL, atol=ATOL)
    positions = want_state[cell.state_names.index("selected_positions")]
    assert [[sorted(j for j in head.tolist() if j >= 0) for head in row] for row in positions] == selections

    fp32 = (args[0].float(), args[1].float(), args[2].float(), args[3])
    state32 = _retyped(state, torch.float64, torch.float32)
    real = real.reshape(want.shape)
    for name, form in {"chunk": chunk_select_attn, "step_loop": _step_loop}.items():
        out, *new_state = form(*fp32, *state32, scale=scale, rule=rule)
        assert out.dtype == torch.float32 and torch.isfinite(out).all(), name
        torch.testing.assert_close(out.double()[real], want[real], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
        _assert_states_close(new_state, want_state, [f"{name} {n}" for n in cell.state_names])


@pytest.mark.parametrize("kv_dtype", [None, "float16", "int8"])
def test_the_forms_compute_in_the_queries_dtype(kv_dtype):
    """float64 queries (a reference's) give float64 outputs from every storage, equal to the naive loop's."""
    spec = _spec()
    cell = SelectCell(spec, window=3, sinks=1, keep=2, chunk=2, kv_dtype=kv_dtype)
    q, k, v = (t.double() for t in random_qkv(2, spec, 9, _gen(12)))
    mask = torch.ones(2, 9, dtype=torch.bool)
    state = _retyped(cell.init_state(2, CPU, torch.float32), torch.float32, torch.float64)
    want, *_ = naive_recurrent_select_attn(
        _grouped(q, spec).double(), k, v, mask, *state, scale=spec.scale, rule=cell.rule
    )
    for form in (chunk_select_attn, _step_loop):
        out, *_ = form(_grouped(q, spec).double(), k, v, mask, *state, scale=spec.scale, rule=cell.rule)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(
    chunk=st.integers(1, 5),
    policy=st.sampled_from(["mass", "snapkv"]),
    pool=st.sampled_from([1, 3]),
    splits=st.lists(st.integers(1, 36), min_size=1, max_size=3, unique=True),
    seed=st.integers(0, 2**16),
)
def test_a_prefill_split_anywhere_equals_the_whole(chunk, policy, pool, splits, seed):
    """Outputs and state, splits on chunk boundaries or not, and every token a call (decode)."""
    spec = _spec()
    cell = SelectCell(spec, window=4, sinks=1, keep=3, chunk=chunk, policy=policy, pool=pool)
    q, k, v = random_qkv(2, spec, 37, _gen(seed))
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :3] = False
    init = cell.init_state(2, CPU, torch.float32)
    whole, whole_state = _run(cell, q, k, v, mask, init)
    for cuts in (sorted(splits), range(1, 37)):
        out, state = _run(cell, q, k, v, mask, init, cuts)
        torch.testing.assert_close(
            out[mask[:, None, :, None].expand_as(out)],
            whole[mask[:, None, :, None].expand_as(whole)],
            rtol=RTOL,
            atol=ATOL,
        )
        _assert_states_close(state, whole_state, cell.state_names)


def test_deciding_every_call_changes_only_the_rows_at_a_boundary(monkeypatch):
    """Where the host cannot tell which rows end a chunk (CUDA, compiled graphs) every call runs the
    decision and the rows not at a boundary keep their selection: the same outputs and state."""
    import rnnify.cells.select as select

    spec = _spec()
    cell = SelectCell(spec, window=3, sinks=1, keep=2, chunk=3, pool=3)
    q, k, v = random_qkv(3, spec, 30, _gen(11))
    mask = torch.ones(3, 30, dtype=torch.bool)
    mask[1, :4], mask[2, :8] = False, False
    runs = []
    for always in (False, True):
        with monkeypatch.context() as patch:
            if always:
                patch.setattr(select, "may_decide", lambda deciding: True)
            runs.append(_run(cell, q, k, v, mask, cell.init_state(3, CPU, torch.float32), (13, *range(20, 30))))
    (out, state), (always_out, always_state) = runs
    assert torch.equal(out, always_out) and all(torch.equal(a, b) for a, b in zip(state, always_state))


# --------------------------------------------------------------------------- what it reduces to


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_without_selected_tokens_it_is_the_window_cell(sinks, padding):
    """keep=0, chunk=1: sinks and the last W tokens, the window target's set, to the last bit of its output."""
    spec = _spec()
    select = SelectCell(spec, window=5, sinks=sinks, keep=0, chunk=1)
    window = WindowCell(spec, window=5, sinks=sinks)
    q, k, v = random_qkv(3, spec, 30, _gen(1))
    mask = mask_of_kind(padding, 3, 30, _gen(2))
    for splits in ((), (11, 12, 13)):
        got, _ = _run(select, q, k, v, mask, select.init_state(3, CPU, torch.float32), splits)
        want, _ = _run(window, q, k, v, mask, window.init_state(3, CPU, torch.float32), splits)
        real = mask[:, None, :, None].expand_as(got)
        torch.testing.assert_close(got[real], want[real], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("policy", ["mass", "snapkv"])
def test_a_cache_that_holds_every_token_is_softmax_attention(policy):
    """W + S + K >= T: no token is ever dropped, so every query reads its whole past."""
    spec = _spec()
    cell = SelectCell(spec, window=6, sinks=2, keep=16, chunk=4, policy=policy)
    q, k, v = random_qkv(2, spec, 24, _gen(3))
    mask = torch.ones(2, 24, dtype=torch.bool)
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    full = torch.softmax(
        (spec.scale * q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)).masked_fill(
            ~causal, float("-inf")
        ),
        dim=-1,
    ) @ v.double().repeat_interleave(2, 1)
    for splits in ((), (7,), range(1, 24)):
        out, _ = _run(cell, q, k, v, mask, cell.init_state(2, CPU, torch.float32), splits)
        torch.testing.assert_close(out.double(), full, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- batches, padding, dtypes


def _planted(batch: int, spec, length: int, heavy: list[int], gen: torch.Generator):
    """Random q, k, v in which row b's token ``heavy[b]`` has a key every query of kv head 0 finds
    (its query heads all point along it) and a value of 5s."""
    q, k, v = random_qkv(batch, spec, length, gen)
    direction = torch.randn(spec.head_dim, generator=gen)
    direction = direction / direction.norm()
    q[:, : spec.group_size] += 4 * direction
    for b, j in enumerate(heavy):
        k[b, 0, j] = 8 * direction
        v[b, 0, j] = 5.0
    return q, k, v


@pytest.mark.parametrize("policy", ["mass", "snapkv"])
def test_a_planted_heavy_key_is_kept_where_the_window_drops_it(policy):
    """Token 10 of 160, a key every query attends to strongly: H2O's mass (and SnapKV's observation
    window, chunk after chunk) keeps it, and the last query still reads its value; the window
    target, holding the same sinks and more recent tokens, lost it 150 tokens ago."""
    spec = _spec()
    select = SelectCell(spec, window=8, sinks=2, keep=4, chunk=4, policy=policy)
    window = WindowCell(spec, window=12, sinks=2)
    q, k, v = _planted(1, spec, 160, [10], _gen(4))
    mask = torch.ones(1, 160, dtype=torch.bool)
    out, state = _run(select, q, k, v, mask, select.init_state(1, CPU, torch.float32))
    assert 10 in state[select.state_names.index("selected_positions")][0, 0].tolist()
    windowed, _ = _run(window, q, k, v, mask, window.init_state(1, CPU, torch.float32))
    last = slice(150, 160)  # kv head 0's query heads at the last tokens
    assert (out[0, :2, last] - 5).abs().mean() < 0.5  # the planted value, to within a few competing keys
    assert (windowed[0, :2, last] - 5).abs().min() > 4


def test_rows_that_evict_different_tokens_equal_the_rows_alone():
    """Each row keeps its own heavy token (per-row gathers, no row loop), and left padding is never read."""
    spec = _spec()
    cell = SelectCell(spec, window=4, sinks=1, keep=2, chunk=3, pool=3)
    mask = torch.ones(3, 50, dtype=torch.bool)
    mask[1, :6], mask[2, :17] = False, False
    q, k, v = _planted(3, spec, 50, [3, 6 + 6, 9 + 17], _gen(5))  # real tokens 3, 6 and 9 of their rows
    out, state = _run(cell, q, k, v, mask, cell.init_state(3, CPU, torch.float32), (20, 21, 30))
    kept = state[cell.state_names.index("selected_positions")][:, 0].tolist()
    assert 3 in kept[0] and 6 in kept[1] and 9 in kept[2]
    for b in range(3):
        real = mask[b]
        alone, alone_state = _run(
            cell,
            q[b : b + 1, :, real],
            k[b : b + 1, :, real],
            v[b : b + 1, :, real],
            mask[b : b + 1, real],
            cell.init_state(1, CPU, torch.float32),
        )
        torch.testing.assert_close(out[b : b + 1, :, real], alone, rtol=RTOL, atol=ATOL)
        _assert_states_close([t[b : b + 1] for t in state], alone_state, cell.state_names)


def test_left_padding_is_never_written():
    spec = _spec()
    cell = SelectCell(spec, window=3, sinks=2, keep=2, chunk=2)
    q, k, v = random_qkv(2, spec, 9, _gen(6))
    state = cell.init_state(2, CPU, torch.float32)
    _, after = _run(cell, q, k, v, torch.zeros(2, 9, dtype=torch.bool), state, (4, 5))
    assert all(torch.equal(a, b) for a, b in zip(after, state))


def test_bf16_inputs_keep_the_state_of_an_fp32_run():
    """bf16 keys and values are stored as given; scores and outputs are accumulated in fp32, so
    only the output is rounded."""
    spec = _spec(value_dim=6)
    cell = SelectCell(spec, window=4, sinks=2, keep=3, chunk=4, pool=3)
    q, k, v = (t.bfloat16().float() for t in random_qkv(2, spec, 41, _gen(7)))
    mask = torch.ones(2, 41, dtype=torch.bool)
    mask[1, :3] = False
    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        runs[dtype] = _run(
            cell, q.to(dtype), k.to(dtype), v.to(dtype), mask, cell.init_state(2, CPU, dtype), (17, 18, 19)
        )
    (out16, state16), (out32, state32) = runs[torch.bfloat16], runs[torch.float32]
    assert out16.dtype == torch.bfloat16
    for name, got, want in zip(cell.state_names, state16, state32):
        if got.is_floating_point():
            assert got.dtype == (torch.bfloat16 if name in BUFFERS else torch.float32), name
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(out16.float(), out32, rtol=BF16_TOL, atol=1e-6)


def test_state_is_constant_from_the_first_token():
    spec = _spec(value_dim=4)
    cell = SelectCell(spec, window=5, sinks=2, keep=3, chunk=4)
    q, k, v = random_qkv(2, spec, 40, _gen(8))
    mask = torch.ones(2, 40, dtype=torch.bool)
    shapes = [[t.shape for t in cell.init_state(2, CPU, torch.float32)]]
    for length in (1, 3, 4, 17, 40):
        _, state = _run(
            cell,
            q[:, :, :length],
            k[:, :, :length],
            v[:, :, :length],
            mask[:, :length],
            cell.init_state(2, CPU, torch.float32),
        )
        shapes.append([t.shape for t in state])
        assert sum(t.numel() * t.element_size() for t in state) == cell.state_nbytes(length, 2)
    assert all(s == shapes[0] for s in shapes)
    ring, per_head = 5 + 4 - 1, (5 + 4 - 1 + 2 + 3) * (8 + 4) * 4 + (5 + 4 - 1 + 3) * 4 + 3 * 8
    assert shapes[0][0] == (2, 2, ring, 8)
    assert cell.state_nbytes(10**6, 1) == 2 * per_head + 8


# --------------------------------------------------------------------------- options


def test_options_round_trip_and_describe():
    spec = _spec()
    cell = build_cell("select", spec, {"window": 16, "keep": 8, "policy": "snapkv", "observation": 8, "pool": 5})
    assert cell.options() == {
        "window": 16,
        "sinks": 4,
        "keep": 8,
        "chunk": 32,
        "observation": 8,
        "policy": "snapkv",
        "pool": 5,
        "pooling": "avg",
    }
    assert build_cell("select", spec, cell.options()).options() == cell.options()
    assert cell.describe() == "16 tokens + 4 sinks + 8 selected by SnapKV's observation window every 32 tokens"
    default = SelectCell(CellSpec(4, 2, 8, 8, 8**-0.5, window=32))
    assert (default.rule.window, default.rule.keep, default.rule.observation) == (32, 32, 32)
    assert default.describe() == "32 tokens + 4 sinks + 32 selected by attention mass every 32 tokens"
    assert CELLS["select"] is SelectCell
    stored = build_cell("select", spec, {"window": 16, "keep": 8, "kv_dtype": "int8"})
    assert stored.options()["kv_dtype"] == "int8" and build_cell("select", spec, stored.options()).storage == torch.int8
    assert stored.describe().endswith("every 32 tokens, stored as int8")


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "no sliding window of its own"),
        ({"window": 8, "policy": "lru"}, "policy must be one of"),
        ({"window": 8, "pooling": "sum"}, "pooling must be one of"),
        ({"window": 8, "chunk": 4, "observation": 5}, "must be at most chunk"),
        ({"window": 8, "pool": 4}, "pool must be odd"),
        ({"window": 8, "keep": -1}, "keep must be an integer >= 0"),
        ({"window": 0}, "window must be a positive integer"),
        ({"window": 8, "kv_dtype": "int4"}, "kv_dtype must be one of float16, bfloat16, int8"),
    ],
)
def test_bad_options_are_errors(options, message):
    with pytest.raises(RnnifyError, match=message):
        build_cell("select", _spec(), options)


# --------------------------------------------------------------------------- converted models


VARIANTS = {
    "mass": {"window": 8, "sinks": 2, "keep": 4, "chunk": 4},
    "snapkv": {"window": 8, "sinks": 2, "keep": 4, "chunk": 4, "policy": "snapkv", "observation": 2, "pool": 3},
    "int8": {"window": 8, "sinks": 2, "keep": 4, "chunk": 4, "kv_dtype": "int8"},
}


@pytest.fixture(scope="module")
def converted(tiny_model_dir):
    cache = {}

    def get(arch: str, variant: str):
        if (arch, variant) not in cache:
            cache[arch, variant] = rnnify.convert(tiny_model_dir(arch), to="select", **VARIANTS[variant])
        return cache[arch, variant]

    return get


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", ["mass", "snapkv"])
def test_converted_model_steps_as_it_prefills_and_saves(arch, variant, converted, tmp_path):
    """Steps == one prefill, a prefill split off a chunk boundary == the whole (state included), the
    state is constant, a saved model loads to the same logits, left-padded rows are the rows alone."""
    model = converted(arch, variant)
    assert all(isinstance(cell, SelectCell) for cell in model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=_gen(9))
    full, state = assert_steps_and_split_prefill_match(model, ids, 17)
    assert state.nbytes == model.prefill(ids[:, :5])[1].nbytes == model.state_nbytes(40, batch_size=2)
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    assert torch.equal(loaded.prefill(ids)[0], full)
    assert_left_padded_rows_equal_rows_alone(model, [14, 9, 3], _gen(10))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_cache_storing_int8_steps_as_it_prefills_at_its_rounding(arch, converted, tmp_path):
    """int8 slots (``kv_dtype``): stepped, split and left-padded within half precision's tolerance of
    the one-shot prefill (``agreement.rounding_dtype``: a key's last-bit difference between two routes
    may cross a rounding boundary), near the same cache in fp32, in (d + 1) / 4d of its key and value
    bytes; saved and loaded, the same logits bit for bit."""
    model, full_model = converted(arch, "int8"), converted(arch, "mass")
    limit = tolerance(rounding_dtype(model))
    assert rounding_dtype(model) == torch.bfloat16 and all(cell.storage == torch.int8 for cell in model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=_gen(9))
    full, _ = model.prefill(ids)
    assert 0 < rel_diff(full, full_model.prefill(ids)[0]) < limit
    assert rel_diff(decode(model, ids, 1)[0], full) < limit
    first, state = model.prefill(ids[:, :17])
    assert rel_diff(torch.cat([first, model.prefill(ids[:, 17:], state)[0]], 1), full) < limit
    assert_left_padded_rows_equal_rows_alone(model, [14, 9, 3], _gen(10), tol=limit)
    head_dim = model.cells[0].spec.head_dim
    held = [
        sum(
            t.nbytes
            for c in m.cells
            for name, t in zip(c.state_names, c.init_state(1, CPU, m.dtype))
            if name in BUFFERS
        )
        for m in (full_model, model)
    ]
    assert held[1] * 4 * head_dim == held[0] * (head_dim + 1)
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    assert torch.equal(loaded.prefill(ids)[0], full)
