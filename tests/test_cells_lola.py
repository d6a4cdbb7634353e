"""The LoLA cell (``lola``: sinks + window + K tokens kept by a linear memory's recall error, the rest
in that memory) against a reference written here.

The reference (docs/math.md §LoLA: selection by memory error) is a float64 loop over sets of
positions, per row and kv head, counting each row's real tokens only: query i of the chunk starting
at c reads A(i) = {j < S} ∪ {c - W < j <= i} ∪ P by softmax and the set M of every other past token
through kv = sum_M phi(k_j)^T v_j, z = sum_M phi(k_j) (the two cover j <= i once: checked); at each
boundary p the tokens {j >= S : p - C - W < j <= p - W} and P compete by ||v_j - phi(k_j) kv /
(phi(k_j) . z + eps)||^2 with M as it was, the K highest (ties: the newer) are the next P and the
rest join M. It knows nothing of rings, slots or sums kept between boundaries.

Every form (naive loop, chunked prefill, step) must equal the naive loop, and the naive loop the
reference; a prefill split anywhere equals the whole; with no chunk and no kept tokens the cell is
the hybrid; a converted tiny Llama steps as it prefills.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
    random_qkv,
)
from window_support import mask_of_kind

import rnnify
from rnnify.cells import CELLS, CellSpec, build_cell, gate_parameters
from rnnify.cells.hybrid import HybridCell
from rnnify.cells.lola import (
    LolaCell,
    chunk_lola_attn,
    naive_recurrent_lola_attn,
    step_lola_attn,
)
from rnnify.errors import RnnifyError

# float64 forms against the float64 loop: only the order of sums differs
TIGHT = 1e-9
# fp32 computation against float64 on O(1) inputs (the memory sums up to ~100 tokens' features)
RTOL = ATOL = 1e-5
# bf16 inputs, fp32 accumulation, the output rounded once to bf16 (relative error <= 2**-9)
BF16_TOL = 2**-7
CPU = torch.device("cpu")
BUFFERS = ("keys", "values", "sink_keys", "sink_values", "selected_keys", "selected_values")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spec(num_kv_heads=2, group=2, head_dim=8, value_dim=None) -> CellSpec:
    return CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim or head_dim, head_dim**-0.5)


def _cell(spec, gen=None, gate=None, **options) -> LolaCell:
    """A cell whose f (window_logit) is random when ``gen`` is given and whose g is ``gate`` ("random":
    uniform per head), else ``memory_init``."""
    cell = LolaCell(spec, **options)
    with torch.no_grad():
        if gen is not None:
            cell.window_logit.copy_(torch.randn(spec.num_heads, generator=gen))
        if gate == "random":
            cell.memory_gate.copy_(torch.rand(spec.num_heads, generator=gen))
    return cell


# --------------------------------------------------------------------------- the reference


def reference_lola_attention(cell: LolaCell, q, k, v, mask):
    """float64 outputs ``[B, H, T, d_v]`` (0 for padding queries), the softmax part alone, and the
    selected positions at the end, a sorted list per row and kv head."""
    rule, spec = cell.rule, cell.spec
    window, sinks, keep, chunk = rule.window, rule.sinks, rule.keep, rule.chunk
    q, k, v = q.double(), k.double(), v.double()
    batch, num_heads, length, _ = q.shape
    num_kv_heads, group = spec.num_kv_heads, spec.group_size
    factor, gate = cell.mixing_factor().double(), cell.memory_gate.detach().double().reshape(num_kv_heads, group)
    with torch.no_grad():
        phi_q = cell.phi(q.reshape(batch, num_kv_heads, group, length, -1))  # [B, Hkv, G, T, F]
        phi_k = cell.phi(k)  # [B, Hkv, T, F]
    out = torch.zeros(batch, num_heads, length, v.shape[-1], dtype=torch.float64)
    softmax_part = torch.zeros_like(out)
    selections = []
    for b in range(batch):
        real = [t for t in range(length) if mask[b, t]]
        selections.append([])
        for h in range(num_kv_heads):
            keys, values, features = k[b, h, real], v[b, h, real], phi_k[b, h, real]  # by real token
            selected, memory = set(), set()
            for i, t in enumerate(real):
                start = i - i % chunk
                read = [j for j in range(i + 1) if j < sinks or j > start - window or j in selected]
                assert memory.isdisjoint(read) and memory | set(read) == set(range(i + 1))
                kv, z = _memory(features, values, memory)
                for g in range(group):
                    head = h * group + g
                    s = spec.scale * keys[read] @ q[b, head, t]
                    p = torch.exp(s - s.max())
                    w, u = p @ values[read], p.sum()
                    y = (factor[h, g] * w + phi_q[b, h, g, t] @ kv) / (factor[h, g] * u + phi_q[b, h, g, t] @ z)
                    softmax_part[b, head, t] = w / u
                    out[b, head, t] = w / u + gate[h, g] * (y - w / u)
                boundary = i + 1
                if boundary % chunk:
                    continue
                leaving = range(max(sinks, boundary - chunk - window + 1), boundary - window + 1)
                error = {j: _recall_error(features[j], values[j], kv, z, rule.eps) for j in selected | set(leaving)}
                ranked = sorted(error, key=lambda j: (error[j], j), reverse=True)
                selected, memory = set(ranked[:keep]), memory | set(ranked[keep:])
            selections[b].append(sorted(selected))
    return out, softmax_part, selections


def _memory(features, values, tokens):
    """kv ``[F, d_v]`` and z ``[F]`` of the (real) tokens ``tokens``."""
    stored = sorted(tokens)
    return features[stored].T @ values[stored], features[stored].sum(0)


def _recall_error(feature, value, kv, z, eps: float) -> float:
    return float(((value - feature @ kv / (feature @ z + eps)) ** 2).sum())


# --------------------------------------------------------------------------- helpers


def _grouped(q, spec):
    batch, _, length, _ = q.shape
    return q.reshape(batch, spec.num_kv_heads, spec.group_size, length, -1)


def _garbage_buffers(cell, state, gen):
    """Key/value buffers filled with large junk: slots not written must never be read."""
    return tuple(
        100 * torch.randn(t.shape, generator=gen) if name in BUFFERS else t for t, name in zip(state, cell.state_names)
    )


def _cast(state, dtype):
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in state)


def _form_args(cell, dtype):
    spec = cell.spec
    gate = cell.memory_gate.detach().reshape(spec.num_kv_heads, spec.group_size)
    return {
        "phi": cell.phi,
        "factor": cell.mixing_factor().detach().to(dtype),
        "gate": gate.to(dtype),
        "scale": spec.scale,
        "rule": cell.rule,
    }


def _step_loop(q, k, v, mask, *state, **kwargs):
    outs = []
    for t in range(q.shape[3]):
        out, *state = step_lola_attn(
            q[:, :, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state, **kwargs
        )
        outs.append(out)
    return torch.cat(outs, dim=3), *state


FORMS = {"chunk": chunk_lola_attn, "step_loop": _step_loop}


def _assert_states_close(got, want, names, tol=RTOL):
    for name, a, b in zip(names, got, want):
        if a.is_floating_point():
            torch.testing.assert_close(
                a.double(), b.double(), rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}"
            )
        else:
            assert torch.equal(a, b), name


@torch.no_grad()
def _run(cell, q, k, v, mask, state, splits=()):
    """The cell over the tokens in calls split at ``splits`` (one token a call: a decode step)."""
    bounds = [0, *splits, q.shape[2]]
    outs = []
    for a, b in itertools.pairwise(bounds):
        out, *state = cell(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], mask[:, a:b], *state)
        outs.append(out)
    return torch.cat(outs, dim=2), state


def _real(mask, out):
    return mask[:, None, :, None].expand_as(out)


# --------------------------------------------------------------------------- the forms


@st.composite
def lola_problems(draw):
    return {
        "batch": draw(st.integers(1, 3)),
        "num_kv_heads": draw(st.integers(1, 2)),
        "group": draw(st.sampled_from([1, 2])),
        "head_dim": draw(st.sampled_from([4, 8])),
        "value_dim": draw(st.sampled_from([4, 8])),
        "window": draw(st.integers(1, 6)),
        "sinks": draw(st.integers(0, 3)),
        "keep": draw(st.integers(0, 4)),
        "chunk": draw(st.sampled_from([1, 2, 3, 4])),
        "feature_map": draw(st.sampled_from(["taylor", "elu", "hedgehog"])),
        "gate": draw(st.sampled_from([0.0, 1.0, "random"])),
        "prefix": draw(st.integers(0, 10)),
        "length": draw(st.one_of(st.just(1), st.integers(1, 20))),
        "padding": draw(st.sampled_from(["none", "left", "random"])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lola_problems())
def test_forms_equal_the_naive_loop_and_the_reference(p):
    """In float64, where the decisions of every form see the same errors to the last bits."""
    spec = _spec(p["num_kv_heads"], p["group"], p["head_dim"], p["value_dim"])
    gen = _gen(p["seed"])
    gate = p["gate"] if p["gate"] == "random" else None
    cell = _cell(
        spec,
        gen,
        gate,
        **{name: p[name] for name in ("window", "sinks", "keep", "chunk", "feature_map")},
        memory_init=0.0 if gate else p["gate"],
    )
    P, length = p["prefix"], p["prefix"] + p["length"]
    q, k, v = (t.double() for t in random_qkv(p["batch"], spec, length, gen))
    mask = mask_of_kind(p["padding"], p["batch"], length, gen)
    kwargs = _form_args(cell, torch.float64)
    state = _cast(_garbage_buffers(cell, cell.init_state(p["batch"], CPU, torch.float32), gen), torch.float64)
    gq = _grouped(q, spec)
    with torch.no_grad():
        _, *state = naive_recurrent_lola_attn(gq[:, :, :, :P], k[:, :, :P], v[:, :, :P], mask[:, :P], *state, **kwargs)
        args = (gq[:, :, :, P:], k[:, :, P:], v[:, :, P:], mask[:, P:])
        want, *want_state = naive_recurrent_lola_attn(*args, *state, **kwargs)
        ref, _, selections = reference_lola_attention(cell, q, k, v, mask)
        real = mask[:, None, None, P:, None].expand_as(want)
        torch.testing.assert_close(want[real], ref[:, :, P:].reshape(want.shape)[real], rtol=TIGHT, atol=TIGHT)
        positions = want_state[cell.state_names.index("selected_positions")]
        assert [[sorted(j for j in head.tolist() if j >= 0) for head in row] for row in positions] == selections
        for name, form in FORMS.items():
            out, *new_state = form(*args, *state, **kwargs)
            assert torch.isfinite(out).all(), name
            torch.testing.assert_close(
                out[real], want[real], rtol=TIGHT, atol=TIGHT, msg=lambda m, name=name: f"{name}: {m}"
            )
            _assert_states_close(new_state, want_state, [f"{name} {n}" for n in cell.state_names], TIGHT)


@pytest.mark.parametrize(
    "options, gate, padding, seed",
    [
        ({"window": 3, "sinks": 1, "keep": 2, "chunk": 3}, 1.0, "left", 0),
        ({"window": 4, "sinks": 0, "keep": 3, "chunk": 2}, "random", "random", 1),
        ({"window": 2, "sinks": 2, "keep": 0, "chunk": 4}, 1.0, "none", 2),
        ({"window": 5, "sinks": 2, "keep": 4, "chunk": 1, "feature_map": "hedgehog"}, 0.0, "left", 3),
    ],
)
def test_fp32_forms_equal_the_float64_loop(options, gate, padding, seed):
    """The model's path: fp32 state and scores against the float64 loop (fixed draws: an fp32 decision
    could only differ from float64's where two errors tie to rounding, which these do not)."""
    spec = _spec(value_dim=6)
    gen = _gen(seed)
    cell = _cell(
        spec, gen, gate if gate == "random" else None, **options, memory_init=0.0 if gate == "random" else gate
    )
    q, k, v = random_qkv(3, spec, 40, gen)
    mask = mask_of_kind(padding, 3, 40, gen)
    state = _garbage_buffers(cell, cell.init_state(3, CPU, torch.float32), gen)
    with torch.no_grad():
        want, *want_state = naive_recurrent_lola_attn(
            _grouped(q, spec).double(),
            k.double(),
            v.double(),
            mask,
            *_cast(state, torch.float64),
            **_form_args(cell, torch.float64),
        )
        real = mask[:, None, None, :, None].expand_as(want)
        for name, form in FORMS.items():
            out, *new_state = form(_grouped(q, spec), k, v, mask, *state, **_form_args(cell, torch.float32))
            assert out.dtype == torch.float32, name
            torch.testing.assert_close(
                out.double()[real], want[real], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}"
            )
            _assert_states_close(new_state, want_state, [f"{name} {n}" for n in cell.state_names])


@settings(max_examples=10, deadline=None)
@given(
    chunk=st.integers(1, 5),
    keep=st.integers(0, 3),
    splits=st.lists(st.integers(1, 36), min_size=1, max_size=3, unique=True),
    seed=st.integers(0, 2**16),
)
def test_a_prefill_split_anywhere_equals_the_whole(chunk, keep, splits, seed):
    """Outputs and state, splits on chunk boundaries or not, and every token a call (decode)."""
    spec = _spec()
    cell = _cell(spec, _gen(seed), "random", window=4, sinks=1, keep=keep, chunk=chunk)
    q, k, v = random_qkv(2, spec, 37, _gen(seed))
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :3] = False
    init = cell.init_state(2, CPU, torch.float32)
    whole, whole_state = _run(cell, q, k, v, mask, init)
    for cuts in (sorted(splits), range(1, 37)):
        out, state = _run(cell, q, k, v, mask, init, cuts)
        torch.testing.assert_close(out[_real(mask, out)], whole[_real(mask, whole)], rtol=RTOL, atol=ATOL)
        _assert_states_close(state, whole_state, cell.state_names)


# --------------------------------------------------------------------------- what it reduces to


@pytest.mark.parametrize("padding", ["none", "left"])
def test_without_the_memory_gate_it_is_the_softmax_over_the_kept_tokens(padding):
    """memory_init=0: the softmax over sinks, recent and the tokens kept by recall error (the
    reference's kept set), whatever f; the memory still decides what is kept."""
    spec = _spec()
    gen = _gen(4)
    cell = _cell(spec, gen, window=3, sinks=1, keep=2, chunk=3)
    q, k, v = random_qkv(2, spec, 40, gen)
    mask = mask_of_kind(padding, 2, 40, gen)
    out, _ = _run(cell, q, k, v, mask, cell.init_state(2, CPU, torch.float32), (17, 18, 19))
    with torch.no_grad():
        ref, softmax_part, _ = reference_lola_attention(cell, q, k, v, mask)
    real = _real(mask, out)
    torch.testing.assert_close(softmax_part[real], ref[real], rtol=0, atol=0)
    torch.testing.assert_close(out.double()[real], softmax_part[real], rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        cell.window_logit.fill_(3.0)
    assert torch.equal(_run(cell, q, k, v, mask, cell.init_state(2, CPU, torch.float32), (17, 18, 19))[0], out)
    with torch.no_grad():
        cell.memory_gate.fill_(1.0)
    assert (_run(cell, q, k, v, mask, cell.init_state(2, CPU, torch.float32))[0] - out).abs().max() > 1e-3


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("gate", [0.5, 1.0])
def test_with_no_kept_tokens_and_chunk_one_it_is_the_hybrid(sinks, gate):
    """keep=0, chunk=1: every token leaving the window joins the memory, the hybrid's rule (its own
    forms, another file), with the same map, f and g."""
    spec = _spec()
    lola = _cell(spec, _gen(5), window=5, sinks=sinks, keep=0, chunk=1, memory_init=gate)
    hybrid = HybridCell(spec, window=5, sinks=sinks, feature_map="taylor", memory_init=gate)
    with torch.no_grad():
        hybrid.window_logit.copy_(lola.window_logit)
    q, k, v = random_qkv(3, spec, 30, _gen(6))
    mask = mask_of_kind("left", 3, 30, _gen(7))
    for splits in ((), (11, 12, 13)):
        got, _ = _run(lola, q, k, v, mask, lola.init_state(3, CPU, torch.float32), splits)
        want, _ = _run(hybrid, q, k, v, mask, hybrid.init_state(3, CPU, torch.float32), splits)
        torch.testing.assert_close(got[_real(mask, got)], want[_real(mask, want)], rtol=RTOL, atol=ATOL)


def test_a_cache_that_holds_every_token_is_softmax_attention():
    """W + S + K >= T: no query's memory holds a token, so it reads 0 and y is the softmax, for any g and f."""
    spec = _spec()
    cell = _cell(spec, _gen(8), window=6, sinks=2, keep=16, chunk=4, memory_init=1.0)
    q, k, v = random_qkv(2, spec, 24, _gen(9))
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


def test_the_memory_holds_every_token_neither_sink_recent_nor_kept():
    """After boundary p: z = sum phi(k_j) over S <= j <= p - W not selected (state read directly)."""
    spec = _spec()
    cell = _cell(spec, window=4, sinks=2, keep=3, chunk=4)
    q, k, v = random_qkv(1, spec, 50, _gen(10))  # last boundary: p = 48
    _, state = _run(cell, q, k, v, torch.ones(1, 50, dtype=torch.bool), cell.init_state(1, CPU, torch.float32), (9,))
    selected = state[cell.state_names.index("selected_positions")][0]
    with torch.no_grad():
        phi_k = cell.phi(k)[0]
    for h in range(spec.num_kv_heads):
        stored = [j for j in range(2, 48 - 4 + 1) if j not in selected[h].tolist()]
        assert len(stored) == 43 - 3
        torch.testing.assert_close(state[cell.state_names.index("k_sum")][0, h], phi_k[h, stored].sum(0))
        torch.testing.assert_close(state[cell.state_names.index("kv")][0, h], phi_k[h, stored].T @ v[0, h, stored])


def test_a_value_the_memory_cannot_recall_is_kept():
    """Token 10 of 160 carries a value of 5s, which a memory of ordinary values recalls as about 0: its
    error stays the largest, so it is kept through every boundary while the ordinary ones are written."""
    spec = _spec()
    cell = _cell(spec, window=8, sinks=2, keep=2, chunk=4)
    q, k, v = random_qkv(1, spec, 160, _gen(11))
    v[0, 0, 10] = 5.0
    _, state = _run(cell, q, k, v, torch.ones(1, 160, dtype=torch.bool), cell.init_state(1, CPU, torch.float32))
    assert 10 in state[cell.state_names.index("selected_positions")][0, 0].tolist()


# --------------------------------------------------------------------------- batches, padding, dtypes, state


def test_rows_that_evict_different_tokens_equal_the_rows_alone():
    """Each row keeps its own tokens (per-row gathers, no row loop), and left padding is never read."""
    spec = _spec()
    cell = _cell(spec, _gen(12), "random", window=4, sinks=1, keep=2, chunk=3)
    mask = torch.ones(3, 50, dtype=torch.bool)
    mask[1, :6], mask[2, :17] = False, False
    q, k, v = random_qkv(3, spec, 50, _gen(13))
    out, state = _run(cell, q, k, v, mask, cell.init_state(3, CPU, torch.float32), (20, 21, 30))
    kept = state[cell.state_names.index("selected_positions")].tolist()
    assert kept[0] != kept[1] != kept[2] != kept[0]
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
    cell = _cell(spec, window=3, sinks=2, keep=2, chunk=2, memory_init=1.0)
    q, k, v = random_qkv(2, spec, 9, _gen(14))
    state = cell.init_state(2, CPU, torch.float32)
    _, after = _run(cell, q, k, v, torch.zeros(2, 9, dtype=torch.bool), state, (4, 5))
    assert all(torch.equal(a, b) for a, b in zip(after, state))


def test_bf16_inputs_keep_the_state_of_an_fp32_run():
    """bf16 keys and values are stored as given; scores, errors and the memory are fp32, so only the
    output is rounded."""
    spec = _spec(value_dim=6)
    cell = _cell(spec, _gen(15), "random", window=4, sinks=2, keep=3, chunk=4)
    q, k, v = (t.bfloat16().float() for t in random_qkv(2, spec, 41, _gen(16)))
    mask = torch.ones(2, 41, dtype=torch.bool)
    mask[1, :3] = False
    runs = {
        dtype: _run(cell, q.to(dtype), k.to(dtype), v.to(dtype), mask, cell.init_state(2, CPU, dtype), (17, 18))
        for dtype in (torch.bfloat16, torch.float32)
    }
    (out16, state16), (out32, state32) = runs[torch.bfloat16], runs[torch.float32]
    assert out16.dtype == torch.bfloat16
    for name, got, want in zip(cell.state_names, state16, state32):
        if got.is_floating_point():
            assert got.dtype == (torch.bfloat16 if name in BUFFERS else torch.float32), name
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(out16.float(), out32, rtol=BF16_TOL, atol=1e-5)


def test_state_is_constant_from_the_first_token():
    spec = _spec(value_dim=4)
    cell = _cell(spec, window=5, sinks=2, keep=3, chunk=4, memory_init=1.0)
    q, k, v = random_qkv(2, spec, 300, _gen(17))
    mask = torch.ones(2, 300, dtype=torch.bool)
    shapes = [[t.shape for t in cell.init_state(2, CPU, torch.float32)]]
    for length in (1, 2, 4, 5, 31, 32, 33, 100, 300):
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
    features = 1 + 8 + 8 * 8  # taylor
    per_head = (5 + 4 - 1 + 2 + 3) * (8 + 4) * 4 + 3 * 8 + features * (4 + 1) * 4
    assert shapes[0][0] == (2, 2, 5 + 4 - 1, 8)
    assert cell.state_nbytes(10**6, 1) == 2 * per_head + 8


# --------------------------------------------------------------------------- options, parameters


def test_options_round_trip_and_describe():
    spec = _spec()
    cell = build_cell("lola", spec, {"window": 16, "keep": 8, "chunk": 8})
    assert cell.options() == {
        "window": 16,
        "sinks": 4,
        "keep": 8,
        "chunk": 8,
        "feature_map": "taylor",
        "feature_options": {},
        "memory_init": 0.0,
        "eps": 1e-6,
    }
    assert build_cell("lola", spec, cell.options()).options() == cell.options()
    assert cell.describe() == (
        "16 tokens + 4 sinks + 8 selected by memory error every 8 tokens + a taylor linear memory (73 features)"
    )
    default = LolaCell(CellSpec(4, 2, 8, 8, 8**-0.5, window=32))
    assert (default.rule.window, default.rule.keep, default.rule.chunk) == (32, 32, 32)
    assert CELLS["lola"] is LolaCell


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "no sliding window of its own"),
        ({"window": 8, "feature_map": "cosine"}, "unknown feature map"),
        ({"window": 8, "memory_init": 2}, "memory_init must be a number in"),
        ({"window": 8, "eps": 0}, "eps must be a positive number"),
        ({"window": 8, "keep": -1}, "keep must be an integer >= 0"),
        ({"window": 8, "chunk": 0}, "chunk must be a positive integer"),
        ({"window": 8, "policy": "mass"}, "unexpected keyword"),
    ],
)
def test_bad_options_are_errors(options, message):
    with pytest.raises(RnnifyError, match=message):
        build_cell("lola", _spec(), options)


def test_the_gates_and_the_map_train():
    """memory_gate and window_logit are the cell's gates (distillation's ``gate_parameters``) and get
    gradients through a prefill, as do a trainable map's weights."""
    spec = _spec()
    cell = _cell(spec, window=3, sinks=1, keep=2, chunk=3, feature_map="hedgehog", memory_init=0.5)
    assert {id(p) for p in gate_parameters(cell)} == {id(cell.memory_gate), id(cell.window_logit)}
    q, k, v = random_qkv(2, spec, 20, _gen(18))
    out, *_ = cell(q, k, v, torch.ones(2, 20, dtype=torch.bool), *cell.init_state(2, CPU, torch.float32))
    out.square().sum().backward()
    for name, parameter in cell.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all() and parameter.grad.any(), name


# --------------------------------------------------------------------------- a converted model


def test_converted_llama_steps_as_it_prefills_and_saves(tiny_model_dir, tmp_path):
    """Steps == one prefill, a prefill split off a chunk boundary == the whole (state included), the
    state is constant, a saved model loads to the same logits, left-padded rows are the rows alone."""
    model = rnnify.convert(tiny_model_dir("llama"), to="lola", window=8, sinks=2, keep=4, chunk=4, memory_init=0.5)
    assert all(isinstance(cell, LolaCell) for cell in model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=_gen(19))
    full, state = assert_steps_and_split_prefill_match(model, ids, 17)
    assert state.nbytes == model.prefill(ids[:, :5])[1].nbytes == model.state_nbytes(40, batch_size=2)
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    assert torch.equal(loaded.prefill(ids)[0], full)
    assert_left_padded_rows_equal_rows_alone(model, [14, 9, 3], _gen(20))
