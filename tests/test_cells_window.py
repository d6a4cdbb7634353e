"""Sliding-window (+ sinks) and LoLCATs hybrid cells against references written here.

References, float64 loops straight from the equations, counting each row's real tokens only:

- window (docs/math.md §Sliding window and sinks): query i attends by softmax to A(i) = {j <= i : i - j < W or j < S}.
- hybrid (docs/math.md §Hybrid window and linear, LoLCATs, with sinks): with s_ij = scale q_i.k_j, A(i) as for the window,
  M(i) = {j : S <= j <= i - W} the other older tokens, m_i the max over A(i),
  y_i = (f_h sum_{j in A(i)} e^{s_ij-m_i} v_j + sum_{j in M(i)} phi(q_i).phi(k_j) v_j)
        / (f_h sum_{j in A(i)} e^{s_ij-m_i} + sum_{j in M(i)} phi(q_i).phi(k_j)),  phi = elu + 1.

Every form (naive loop, parallel, chunked, step) must equal the naive loop, and the naive loop the
reference; converted tiny models are checked against the original (Mistral, whose own window the
`window` cell reproduces exactly) and against themselves (step = prefill, save/load).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
    decode,
    draw_heads,
    padding_mask,
    random_qkv,
    rel_diff,
    reseal,
)
from transformers import AutoModelForCausalLM

import rnnify
from rnnify.bench import OpCount
from rnnify.cells import CELLS, CellSpec, build_cell, parameters
from rnnify.cells.hybrid import HybridCell
from rnnify.cells.hybrid_window import (
    chunked_window_and_leaving,
    prompt_window_and_leaving,
)
from rnnify.cells.linear import FEATURE_MAPS, build_feature_map
from rnnify.cells.linear_memory import (
    chunk_hybrid_attn,
    fused_hybrid_attn,
    naive_recurrent_hybrid_attn,
    parallel_hybrid_attn,
    step_hybrid_attn,
)
from rnnify.cells.window import (
    WindowCell,
    chunk_window_attn,
    naive_recurrent_window_attn,
    parallel_window_attn,
    step_window_attn,
)
from rnnify.errors import RnnifyError
from rnnify.runtime.manifest import MANIFEST_FILE

# fp32 computation against float64 on O(1) inputs: 1e-5 relative, the same absolute floor.
RTOL = ATOL = 1e-5
# bf16 inputs, fp32 accumulation, the output rounded once to bf16 (relative error <= 2**-9):
# held to 2**-7 relative/absolute against float64 from the very same bf16 numbers.
BF16_TOL = 2**-7

HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CELL_HYPOTHESIS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- references


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """Katharopoulos' feature map written out: x + 1 for x > 0, exp(x) otherwise."""
    x = x.double()
    return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))


def _real_tokens(mask: torch.Tensor, b: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[b, t])]


def _per_query_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """kv-head tensor [Hkv, ...] -> [H, ...]: query head h reads kv head h // group."""
    return x.repeat_interleave(group, dim=0)


def reference_window_attention(q, k, v, mask, window, sinks, scale):
    """float64; q [B, H, T, d], k/v [B, Hkv, T, *], mask [B, T]. Padding queries give 0."""
    q, k, v = q.double(), k.double(), v.double()
    batch, num_heads, length, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(batch, num_heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        real = _real_tokens(mask, b)
        for i, t in enumerate(real):
            attended = [real[j] for j in range(i + 1) if i - j < window or j < sinks]
            keys = _per_query_head(k[b][:, attended], group)  # [H, n, d]
            values = _per_query_head(v[b][:, attended], group)
            scores = scale * torch.einsum("hnd,hd->hn", keys, q[b, :, t])
            weights = torch.softmax(scores, dim=-1)
            out[b, :, t] = torch.einsum("hn,hnd->hd", weights, values)
    return out


def reference_hybrid_attention(q, k, v, mask, window, factor, scale, phi=elu_plus_one, sinks=0):
    """float64; factor [H] is f_h. Padding queries give 0."""
    q, k, v, factor = q.double(), k.double(), v.double(), factor.double()
    batch, num_heads, length, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(batch, num_heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        real = _real_tokens(mask, b)
        for i, t in enumerate(real):
            recent = [real[j] for j in range(i + 1) if i - j < window or j < sinks]
            older = [real[j] for j in range(sinks, i - window + 1)]
            keys, values = _per_query_head(k[b][:, recent], group), _per_query_head(v[b][:, recent], group)
            scores = scale * torch.einsum("hnd,hd->hn", keys, q[b, :, t])
            e = torch.exp(scores - scores.max(-1, keepdim=True).values)
            num = factor[:, None] * torch.einsum("hn,hnd->hd", e, values)
            den = factor * e.sum(-1)
            if older:
                old_keys, old_values = _per_query_head(k[b][:, older], group), _per_query_head(v[b][:, older], group)
                a = torch.einsum("hnf,hf->hn", phi(old_keys), phi(q[b, :, t]))
                num = num + torch.einsum("hn,hnd->hd", a, old_values)
                den = den + a.sum(-1)
            out[b, :, t] = num / den[:, None]
    return out


def reference_gated_hybrid_attention(q, k, v, mask, window, factor, gate, scale, phi=elu_plus_one, sinks=0):
    """float64 window output + g_h (LoLCATs output - window output); gate [H] is g_h."""
    windowed = reference_window_attention(q, k, v, mask, window, sinks=sinks, scale=scale)
    hybrid = reference_hybrid_attention(q, k, v, mask, window, factor, scale, phi, sinks)
    return windowed + gate.double()[:, None, None] * (hybrid - windowed)


def reference_linear_state(k, v, mask, window, phi=elu_plus_one, sinks=0):
    """float64 S = sum phi(k_j)^T v_j and z = sum phi(k_j) over the tokens other than the first
    ``sinks`` that left the window."""
    batch, num_kv_heads = k.shape[:2]
    S = torch.zeros(batch, num_kv_heads, phi(k[:1, :, :1]).shape[-1], v.shape[-1], dtype=torch.float64)
    z = torch.zeros(S.shape[:-1], dtype=torch.float64)
    for b in range(batch):
        real = _real_tokens(mask, b)
        for t in real[sinks : max(0, len(real) - window)]:
            phi_k = phi(k[b, :, t].double())
            S[b] += phi_k[:, :, None] * v[b, :, t, None, :].double()
            z[b] += phi_k
    return S, z


# --------------------------------------------------------------------------- helpers


def _spec(num_kv_heads=2, group=2, head_dim=8, value_dim=None, window=None) -> CellSpec:
    return CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim or head_dim, head_dim**-0.5, window)


def _padding_mask(kind: str, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "none":
        return torch.ones(batch, length, dtype=torch.bool)
    if kind == "left":
        pads = torch.randint(0, length + 1, (batch,), generator=gen)
        return torch.arange(length)[None, :] >= pads[:, None]
    return torch.rand(batch, length, generator=gen) < 0.7


def _garbage_buffers(cell, state, gen):
    """Ring and sink buffers filled with large junk: slots not written yet must never be attended."""
    buffers = ("keys", "values", "sink_keys", "sink_values")
    return tuple(
        100 * torch.randn(t.shape, generator=gen) if name in buffers else t for t, name in zip(state, cell.state_names)
    )


def _grouped(q, spec):
    batch, _, length, _ = q.shape
    return q.float().reshape(batch, spec.num_kv_heads, spec.group_size, length, -1)


def _step_loop(step, q, k, v, mask, *state, **kwargs):
    """``step`` token by token; ``kwargs`` are passed to every step."""
    outs = []
    for t in range(q.shape[3]):
        one = (q[:, :, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1])
        out, *state = step(*one, *state, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=3), *state


def _assert_states_close(got, want, what):
    for name, a, b in zip(what, got, want):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(a, b), name


def _assert_forms_agree(forms, want, want_state, real, state_names) -> None:
    """Each form (a thunk returning ``(out, *state)``) gives the naive loop's outputs on real queries
    (padding queries: anything finite, fp32) and its state."""
    for name, form in forms.items():
        out, *new_state = form()
        assert out.shape == want.shape and out.dtype == torch.float32, name
        assert torch.isfinite(out).all(), name
        torch.testing.assert_close(out[real], want[real], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
        _assert_states_close(new_state, want_state, [f"{name} {n}" for n in state_names])


def _splits(sizes: list[int], length: int) -> list[tuple[int, int]]:
    """[a, b) bounds of chunks of the given sizes, then single tokens until ``length``."""
    bounds, start = [], 0
    for size in sizes + [1] * length:
        if start >= length:
            break
        bounds.append((start, min(length, start + size)))
        start += size
    return bounds


# --------------------------------------------------------------------------- window: the forms


@st.composite
def window_problems(draw):
    return dict(
        **draw_heads(draw),
        window=draw(st.integers(1, 12)),
        sinks=draw(st.integers(0, 4)),
        prefix=draw(st.integers(0, 14)),
        length=draw(st.one_of(st.just(1), st.integers(1, 24))),
        chunk=draw(st.sampled_from([1, 2, 3, 5, 64])),
        padding=draw(st.sampled_from(["none", "left", "random"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _form_inputs(p, cell):
    """Inputs of the forms: a prefix read by the naive loop into the state, then ``length`` new tokens."""
    gen, spec = _gen(p["seed"]), cell.spec
    total = p["prefix"] + p["length"]
    q, k, v = random_qkv(p["batch"], spec, total, gen)
    mask = _padding_mask(p["padding"], p["batch"], total, gen)
    state = _garbage_buffers(cell, cell.init_state(p["batch"], CPU, torch.float32), gen)
    return q, k, v, mask, state


@HYPOTHESIS
@given(window_problems())
def test_window_forms_equal_the_naive_loop_and_the_reference(p):
    spec = _spec(p["num_kv_heads"], p["group"], p["head_dim"], p["value_dim"])
    cell = WindowCell(spec, window=p["window"], sinks=p["sinks"])
    q, k, v, mask, state = _form_inputs(p, cell)
    P, scale = p["prefix"], spec.scale
    gq = _grouped(q, spec)
    if P:
        _, *state = naive_recurrent_window_attn(gq[:, :, :, :P], k[:, :, :P], v[:, :, :P], mask[:, :P], *state, scale)
    args = (gq[:, :, :, P:], k[:, :, P:], v[:, :, P:], mask[:, P:])
    before = [t.clone() for t in (*args, *state)]

    want, *want_state = naive_recurrent_window_attn(*args, *state, scale)
    ref = reference_window_attention(q, k, v, mask, p["window"], p["sinks"], scale)[:, :, P:]
    real = mask[:, None, P:, None].expand_as(ref)
    torch.testing.assert_close(want.reshape(ref.shape).double()[real], ref[real], rtol=RTOL, atol=ATOL)
    real = real.reshape(want.shape)  # the same, grouped per kv head

    forms = {
        "parallel": lambda: parallel_window_attn(*args, *state, scale),
        "chunk": lambda: chunk_window_attn(*args, *state, scale, block_size=p["chunk"]),
        "step_loop": lambda: _step_loop(step_window_attn, *args, *state, scale=scale),
    }
    _assert_forms_agree(forms, want, want_state, real, WindowCell.state_names)
    assert all(torch.equal(a, b) for a, b in zip(before, (*args, *state)))  # inputs untouched


@pytest.mark.parametrize("sinks", [0, 2])
def test_window_decode_off_triton_takes_the_lean_step(sinks, monkeypatch):
    """A decode token with kernels auto off Triton runs ``step_window_attn`` (the ring write and read of
    the hybrid's ``window_step``) instead of the fused op's PyTorch reference: the same output and
    state token by token (19 tokens through a window of 3, a left-padded row) in fewer than half the
    aten ops (53 against 116 here with 2 sinks)."""
    from rnnify.kernels import utils

    monkeypatch.setattr(utils, "FORCE_TRITON", False)  # kernels auto off Triton, whatever the environment
    spec, steps = _spec(), 19
    lean, fused = (WindowCell(spec, window=3, sinks=sinks) for _ in range(2))
    fused.use_kernels("reference")
    gen = torch.Generator().manual_seed(0)
    q, k, v = random_qkv(2, spec, steps, gen)
    mask = torch.ones(2, steps, dtype=torch.bool)
    mask[1, :4] = False
    lean_state, fused_state = lean.init_state(2, q.device, q.dtype), fused.init_state(2, q.device, q.dtype)
    counts = {}
    with torch.no_grad():
        for t in range(steps):
            token = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1])
            for name, cell in (("lean", lean), ("fused", fused)):
                with OpCount() as count:
                    out, *state = cell(*token, *(lean_state if name == "lean" else fused_state))
                counts[name] = count.ops
                if name == "lean":
                    lean_out, lean_state = out, state
                else:
                    fused_state = state
            real = mask[:, t]
            torch.testing.assert_close(lean_out[real], out[real], rtol=1e-5, atol=1e-6)
            for a, b in zip(lean_state, fused_state):
                torch.testing.assert_close(a, b)
    assert counts["lean"] * 2 < counts["fused"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("length", [1, 4, 19, 40])
def test_window_whole_prompt_takes_the_band_path(length, sinks, dtype, monkeypatch):
    """A whole unpadded prompt from the empty state runs ``prompt_window_attn`` (every query block at
    once, the state from the prompt's tail): the chunked form's output and state, and the step after
    it continues alike, and the naive loop's output; prompts shorter than the window and the sinks
    included."""
    import rnnify.cells.window as window_cells

    spec = _spec()
    cell = WindowCell(spec, window=5, sinks=sinks)
    gen = torch.Generator().manual_seed(length)
    q, k, v = random_qkv(2, spec, length + 1, gen)
    mask = torch.ones(2, length + 1, dtype=torch.bool)
    runs = []
    for banded in (True, False):
        with torch.no_grad(), monkeypatch.context() as patch:
            if not banded:
                patch.setattr(window_cells, "whole_prompt", lambda mask, length: False)
            out, *state = cell(
                q[:, :, :length],
                k[:, :, :length],
                v[:, :, :length],
                mask[:, :length],
                *cell.init_state(2, q.device, dtype),
            )
            step, *state = cell(q[:, :, length:], k[:, :, length:], v[:, :, length:], mask[:, length:], *state)
        runs.append((out, step, state))
    (fast, fast_step, fast_state), (chunked, chunked_step, chunked_state) = runs
    naive, *_ = naive_recurrent_window_attn(
        _grouped(q[:, :, :length], spec),
        k[:, :, :length],
        v[:, :, :length],
        mask[:, :length],
        *cell.init_state(2, q.device, dtype),
        spec.scale,
    )
    torch.testing.assert_close(fast, naive.reshape(fast.shape), rtol=1e-5, atol=1e-6)  # the loop, independently
    torch.testing.assert_close(fast, chunked, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_step, chunked_step, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast_state, chunked_state):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- window: the cell


# what the window and hybrid cells' property tests draw alike
CELL_DRAWS = {
    "window": st.integers(1, 12),
    "length": st.integers(1, 24),
    "splits": st.lists(st.integers(1, 20), max_size=3),
    "group": st.sampled_from([1, 2, 4]),
    "left_pad": st.integers(0, 6),
    "seed": st.integers(0, 2**31 - 1),
}


def _check_cell(cell, reference, length, splits, left_pad, gen) -> None:
    """One call over ``length`` tokens (batch 2, row 1 left-padded by ``left_pad``, possibly all
    padding) matches ``reference(q, k, v, mask)`` on the real tokens; calls over the pieces cut by
    ``splits``, each continuing from the last state, give the same outputs and state."""
    spec, batch = cell.spec, 2
    q, k, v = random_qkv(batch, spec, length, gen)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, :left_pad] = False
    with torch.no_grad():
        init = cell.init_state(batch, CPU, torch.float32)
        one_shot, *final = cell(q, k, v, mask, *init)
        ref = reference(q, k, v, mask)
        real = mask[:, None, :, None].expand_as(ref)
        torch.testing.assert_close(one_shot.double()[real], ref[real], rtol=RTOL, atol=ATOL)
        assert torch.isfinite(one_shot).all()
        outs, state = [], init
        for a, b in _splits(splits, length):
            out, *state = cell(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], mask[:, a:b], *state)
            outs.append(out)
            assert [t.shape for t in state] == [t.shape for t in init]  # constant size
    torch.testing.assert_close(torch.cat(outs, dim=2), one_shot, rtol=RTOL, atol=ATOL)
    _assert_states_close(state, final, cell.state_names)


@CELL_HYPOTHESIS
@given(**CELL_DRAWS, sinks=st.integers(0, 4), block_size=st.sampled_from([1, 3, 64]))
def test_window_cell_chunked_and_stepped_equal_one_shot_and_reference(
    window, sinks, length, splits, block_size, group, left_pad, seed
):
    cell = WindowCell(_spec(group=group), window=window, sinks=sinks, block_size=block_size)
    _check_cell(
        cell,
        lambda q, k, v, mask: reference_window_attention(q, k, v, mask, window, sinks, cell.spec.scale),
        length,
        splits,
        left_pad,
        _gen(seed),
    )


def test_window_cell_ring_holds_the_last_window_tokens_and_the_sinks():
    gen = _gen(1)
    cell = WindowCell(_spec(), window=5, sinks=2)
    spec = cell.spec
    q, k, v = random_qkv(2, spec, 30, gen)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :7] = False
    state = cell.init_state(2, CPU, torch.float32)
    for t in range(30):
        _, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
        keys, values, sink_keys, sink_values, length = state
        for b in range(2):
            real = _real_tokens(mask[:, : t + 1], b)
            assert int(length[b]) == len(real)
            for n in range(max(0, len(real) - 5), len(real)):  # token n in slot n mod W
                assert torch.equal(keys[b, :, n % 5], k[b, :, real[n]])
                assert torch.equal(values[b, :, n % 5], v[b, :, real[n]])
            for n in range(min(2, len(real))):
                assert torch.equal(sink_keys[b, :, n], k[b, :, real[n]])
                assert torch.equal(sink_values[b, :, n], v[b, :, real[n]])


def test_window_cell_window_comes_from_the_model_or_the_option():
    assert WindowCell(_spec(window=16)).window == 16  # the model's own
    assert WindowCell(_spec(window=16), window=4).window == 4  # the option wins
    cell = WindowCell(_spec(), window=6, sinks=3, block_size=7)
    assert cell.options() == {"window": 6, "sinks": 3, "block_size": 7}
    assert type(cell)(cell.spec, **cell.options()).options() == cell.options()
    with pytest.raises(ValueError, match="window=N"):
        WindowCell(_spec())
    with pytest.raises(RnnifyError, match="'window'.*no sliding window"):
        build_cell("window", _spec())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"window": 0}, "window must be a positive integer"),
        ({"window": 2.5}, "window must be"),
        ({"window": True}, "window must be"),
        ({"window": 4, "sinks": -1}, "sinks must be an integer >= 0"),
        ({"window": 4, "block_size": 0}, "block_size must be"),
        ({"window": 4, "chunk_size": 3}, "chunk_size"),
    ],
)
def test_window_cell_rejects_bad_options(options, message):
    with pytest.raises(RnnifyError, match=message):
        build_cell("window", _spec(), options)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"window": 0}, "window must be a positive integer"),
        ({"chunk_size": 0}, "chunk_size must be"),
        ({"feature_map": "cosine"}, "unknown feature map 'cosine'"),
        ({"feature_options": [1]}, "feature_options must be a dict"),
        ({"feature_options": {"bogus": 1}}, "bogus"),
        ({"sinks": -1}, "sinks must be an integer >= 0"),
        ({"sinks": 1.5}, "sinks must be an integer"),
    ],
)
def test_hybrid_cell_rejects_bad_options(options, message):
    with pytest.raises(RnnifyError, match=message):
        build_cell("hybrid", _spec(), options)


def _cells():
    return [
        WindowCell(_spec(num_kv_heads=2, group=2, head_dim=4, value_dim=6), window=5, sinks=2),
        HybridCell(_spec(num_kv_heads=2, group=2, head_dim=4, value_dim=6), window=5, feature_map="elu", sinks=0),
        HybridCell(
            _spec(num_kv_heads=2, group=2, head_dim=4, value_dim=6),
            window=5,
            sinks=2,
            memory_init=0.5,
            feature_map="elu",
        ),
    ]


def _cell_id(cell) -> str:
    return f"{cell.target}-sinks{cell.sinks}"


@pytest.mark.parametrize("cell", _cells(), ids=_cell_id)
def test_padding_tokens_do_not_change_the_state(cell):
    gen = _gen(2)
    spec = cell.spec
    q, k, v = random_qkv(1, spec, 9, gen)
    mask = torch.ones(1, 9, dtype=torch.bool)
    _, *state = cell(q, k, v, mask, *cell.init_state(1, CPU, torch.float32))
    pq, pk, pv = random_qkv(1, spec, 5, gen)
    padding = torch.zeros(1, 5, dtype=torch.bool)
    out, *after = cell(pq, pk, pv, padding, *state)  # a prefill of padding only
    assert torch.isfinite(out).all() and all(torch.equal(a, b) for a, b in zip(after, state))
    out, *after = cell(pq[:, :, :1], pk[:, :, :1], pv[:, :, :1], padding[:, :1], *state)  # a padding step
    assert torch.isfinite(out).all() and all(torch.equal(a, b) for a, b in zip(after, state))

    # left padding in front of a sequence: same outputs and final state as without it
    lq, lk, lv = (torch.cat([p, x], dim=2) for p, x in ((pq, q), (pk, k), (pv, v)))
    init = cell.init_state(1, CPU, torch.float32)
    out_padded, *state_padded = cell(lq, lk, lv, torch.cat([padding, mask], dim=1), *init)
    out_plain, *state_plain = cell(q, k, v, mask, *init)
    torch.testing.assert_close(out_padded[:, :, 5:], out_plain, rtol=RTOL, atol=ATOL)
    _assert_states_close(state_padded, state_plain, cell.state_names)


@pytest.mark.parametrize("cell", _cells(), ids=_cell_id)
def test_state_size_is_constant_and_counted(cell):
    gen, spec = _gen(3), cell.spec
    shapes, held = set(), set()
    for length in (1, 7, 16, 100):
        q, k, v = random_qkv(3, spec, length, gen, dtype=torch.bfloat16)
        _, *state = cell(q, k, v, torch.ones(3, length, dtype=torch.bool), *cell.init_state(3, CPU, torch.bfloat16))
        shapes.add(tuple(tuple(t.shape) for t in state))
        held.add(sum(t.numel() * t.element_size() for t in state))
        assert cell.state_nbytes(length, 3, torch.bfloat16) in held
    assert len(shapes) == len(held) == 1
    # per row, in fp32: Hkv = 2, d = 4, d_v = 6, 8 bytes of length
    if isinstance(cell, WindowCell):  # (W + S) = 7 slots of keys and values
        assert cell.state_nbytes(10**6) == 2 * 7 * (4 + 6) * 4 + 8
    else:  # W + S = 5 + S slots, and the linear state of elu (F = d = 4)
        assert cell.state_nbytes(10**6) == 2 * (5 + cell.sinks) * (4 + 6) * 4 + 2 * (4 * 6 + 4) * 4 + 8


@pytest.mark.parametrize("cell", _cells(), ids=_cell_id)
def test_cells_do_not_mutate_their_inputs(cell):
    gen, spec = _gen(4), cell.spec
    q, k, v = random_qkv(2, spec, 8, gen)
    mask = torch.ones(2, 8, dtype=torch.bool)
    _, *state = cell(q, k, v, mask, *cell.init_state(2, CPU, torch.float32))
    before = [t.clone() for t in (q, k, v, mask, *state)]
    cell(q[:, :, :3], k[:, :, :3], v[:, :, :3], mask[:, :3], *state)  # a prefill
    cell(q[:, :, :1], k[:, :, :1], v[:, :, :1], mask[:, :1], *state)  # a step
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, mask, *state), before))


def test_window_cell_bf16_inputs():
    gen = _gen(5)
    cell = WindowCell(_spec(), window=6, sinks=2, block_size=4)
    spec = cell.spec
    q, k, v = random_qkv(2, spec, 30, gen, dtype=torch.bfloat16)
    mask = torch.ones(2, 30, dtype=torch.bool)
    init = cell.init_state(2, CPU, torch.bfloat16)
    assert [t.dtype for t in init] == [torch.bfloat16] * 4 + [torch.long]  # caches in the model dtype
    out, *state = cell(q[:, :, :10], k[:, :, :10], v[:, :, :10], mask[:, :10], *init)
    outs = [out]
    for t in range(10, 30):
        out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
        outs.append(out)
    out = torch.cat(outs, dim=2)
    assert out.dtype == torch.bfloat16
    ref = reference_window_attention(q, k, v, mask, 6, 2, spec.scale)
    torch.testing.assert_close(out.double(), ref, rtol=BF16_TOL, atol=BF16_TOL)


# --------------------------------------------------------------------------- hybrid: the forms


@st.composite
def hybrid_problems(draw):
    return {**draw(window_problems()), "sinks": draw(st.sampled_from([0, 1, 3]))}


# the forms' state: the cell's, with (empty, when the cell has no sinks) sink buffers after the ring
FORM_STATE = ("keys", "values", "sink_keys", "sink_values", "length", "kv", "k_sum")


def _form_state(cell, state):
    if cell.sinks:
        return state
    keys, values, *rest = state
    return (keys, values, keys[:, :, :0], values[:, :, :0], *rest)


def _factor(spec, gen):
    return torch.sigmoid(2 * torch.randn(spec.num_heads, generator=gen))


@HYPOTHESIS
@given(hybrid_problems())
def test_hybrid_forms_equal_the_naive_loop_and_the_reference(p):
    spec = _spec(p["num_kv_heads"], p["group"], p["head_dim"], p["value_dim"])
    cell = HybridCell(spec, window=p["window"], sinks=p["sinks"], feature_map="elu")
    q, k, v, mask, state = _form_inputs(p, cell)
    state = _form_state(cell, state)
    factor = _factor(spec, _gen(p["seed"] + 1))
    gate = torch.rand(spec.num_heads, generator=_gen(p["seed"] + 2))
    P, scale, phi = p["prefix"], spec.scale, cell.phi
    grouped = (spec.num_kv_heads, spec.group_size)
    fixed = {"phi": phi, "factor": factor.reshape(grouped), "scale": scale, "gate": gate.reshape(grouped)}
    gq = _grouped(q, spec)
    if P:
        _, *state = naive_recurrent_hybrid_attn(gq[:, :, :, :P], k[:, :, :P], v[:, :, :P], mask[:, :P], *state, **fixed)
    args = (gq[:, :, :, P:], k[:, :, P:], v[:, :, P:], mask[:, P:])
    before = [t.clone() for t in (*args, *state)]

    want, *want_state = naive_recurrent_hybrid_attn(*args, *state, **fixed)
    ref = reference_gated_hybrid_attention(q, k, v, mask, p["window"], factor, gate, scale, sinks=p["sinks"])
    ref = ref[:, :, P:]
    real = mask[:, None, P:, None].expand_as(ref)
    torch.testing.assert_close(want.reshape(ref.shape).double()[real], ref[real], rtol=RTOL, atol=ATOL)
    real = real.reshape(want.shape)  # the same, grouped per kv head
    ref_kv, ref_z = reference_linear_state(k, v, mask, p["window"], sinks=p["sinks"])
    torch.testing.assert_close(want_state[5].double(), ref_kv, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(want_state[6].double(), ref_z, rtol=RTOL, atol=ATOL)

    forms = {
        "parallel": lambda: parallel_hybrid_attn(*args, *state, **fixed),
        "chunk": lambda: chunk_hybrid_attn(*args, *state, **fixed, chunk_size=p["chunk"]),
        "step_loop": lambda: _step_loop(step_hybrid_attn, *args, *state, **fixed),
    }
    _assert_forms_agree(forms, want, want_state, real, FORM_STATE)
    assert all(torch.equal(a, b) for a, b in zip(before, (*args, *state)))


@pytest.mark.parametrize(
    "window, sinks, length",
    [(3, 0, 1), (3, 2, 4), (3, 2, 5), (3, 2, 6), (4, 1, 23), (8, 0, 30), (2, 3, 17), (64, 0, 70)],
)
def test_whole_prompt_off_kernels_equals_the_naive_loop(window, sinks, length):
    """``fused_hybrid_attn`` off kernels on a whole unpadded prompt (``prompt_hybrid_attn``: the window
    part of all blocks at once, the memory read without the shift) gives the naive loop's output and
    state, prompts shorter than W + S included."""
    spec = _spec(2, 2, 8, 6)
    cell = HybridCell(spec, window=window, sinks=sinks, feature_map="elu")
    gen = _gen(length)
    q, k, v = random_qkv(2, spec, length, gen)
    mask = torch.ones(2, length, dtype=torch.bool)
    state = _form_state(cell, _garbage_buffers(cell, cell.init_state(2, CPU, torch.float32), gen))
    grouped = (spec.num_kv_heads, spec.group_size)
    gate = torch.rand(spec.num_heads, generator=gen).reshape(grouped)
    fixed = {"phi": cell.phi, "factor": _factor(spec, gen).reshape(grouped), "scale": spec.scale, "gate": gate}
    want, *want_state = naive_recurrent_hybrid_attn(_grouped(q, spec), k, v, mask, *state, **fixed)
    got, *got_state = fused_hybrid_attn(
        _grouped(q, spec), k, v, mask, *state, **fixed, chunk_size=cell.chunk_size, backend=None
    )
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for name, a, b in zip(FORM_STATE, got_state, want_state):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)


@HYPOTHESIS
@given(
    window=st.integers(1, 12),
    sinks=st.integers(0, 5),
    length=st.integers(2, 40),
    block=st.sampled_from([1, 3, 16, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_whole_prompt_window_part_equals_the_chunked_one(window, sinks, length, block, dtype, seed):
    """A whole unpadded prompt from the empty state: the window part of all query blocks at once, the
    leaving tokens shifted by W and the state written from the tail equal the general, chunked path
    (prompts shorter than the window or the sinks, any block size, a bf16 ring, junk in the buffers)."""
    gen, spec = _gen(seed), _spec(num_kv_heads=2, group=2, head_dim=4, value_dim=3)
    q, k, v = random_qkv(2, spec, length, gen)
    cell = HybridCell(spec, window=window, sinks=sinks, feature_map="elu")
    state = _garbage_buffers(cell, cell.init_state(2, CPU, dtype), gen)
    state = tuple(t.to(dtype) if t.is_floating_point() else t for t in _form_state(cell, state)[:5])
    args = (_grouped(q, spec), k, v)
    factor = _factor(spec, gen).reshape(2, 2)
    fast = prompt_window_and_leaving(*args, state, factor, spec.scale, block)
    general = chunked_window_and_leaving(
        *args, torch.ones(2, length, dtype=torch.bool), state, factor, spec.scale, 5, None
    )
    for a, b in zip(fast[:5], general[:5]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert all(torch.equal(a, b) for a, b in zip(fast[5], general[5]))


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
def test_hybrid_forms_agree_for_every_feature_map(feature_map):
    """Whatever phi is (trained, random or fixed), the four forms compute the same thing."""
    torch.manual_seed(0)  # feature maps with random weights
    spec = _spec(num_kv_heads=2, group=2, head_dim=4)
    phi = build_feature_map(feature_map, spec)
    for seed, window, sinks, chunk in ((0, 3, 0, 4), (1, 1, 0, 64), (2, 3, 2, 5)):
        gen = _gen(seed)
        q, k, v = random_qkv(2, spec, 19, gen)
        mask = _padding_mask("left", 2, 19, gen)
        cell = HybridCell(spec, window=window, sinks=sinks, feature_map="elu")
        init = _form_state(cell, cell.init_state(2, CPU, torch.float32))
        init = (*init[:5], torch.zeros(2, 2, phi.feature_dim, 4), torch.zeros(2, 2, phi.feature_dim))
        fixed = {"phi": phi, "factor": _factor(spec, gen).reshape(2, 2), "scale": spec.scale}
        with torch.no_grad():
            args = (_grouped(q, spec), k, v, mask, *init)
            want, *want_state = naive_recurrent_hybrid_attn(*args, **fixed)
            for name, (out, *state) in {
                "parallel": parallel_hybrid_attn(*args, **fixed),
                "chunk": chunk_hybrid_attn(*args, **fixed, chunk_size=chunk),
                "step_loop": _step_loop(step_hybrid_attn, *args, **fixed),
            }.items():
                assert torch.isfinite(out).all(), name
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
                for a, b in zip(state, want_state):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


# --------------------------------------------------------------------------- hybrid: the cell


@CELL_HYPOTHESIS
@given(**CELL_DRAWS, sinks=st.sampled_from([0, 1, 3]), chunk_size=st.sampled_from([1, 3, 64]))
def test_hybrid_cell_chunked_and_stepped_equal_one_shot_and_reference(
    window, sinks, length, splits, chunk_size, group, left_pad, seed
):
    gen = _gen(seed)
    cell = HybridCell(_spec(group=group), window=window, sinks=sinks, chunk_size=chunk_size, feature_map="elu")
    with torch.no_grad():
        cell.window_logit.copy_(2 * torch.randn(cell.spec.num_heads, generator=gen))
        cell.memory_gate.copy_(torch.rand(cell.spec.num_heads, generator=gen))

    def reference(q, k, v, mask):
        factor = torch.sigmoid(cell.window_logit)
        return reference_gated_hybrid_attention(
            q, k, v, mask, window, factor, cell.memory_gate, cell.spec.scale, sinks=sinks
        )

    _check_cell(cell, reference, length, splits, left_pad, gen)
    assert len(cell.state_names) == (7 if sinks else 5)


@pytest.mark.parametrize("window", [30, 31, 100])
def test_hybrid_with_a_window_covering_everything_is_softmax_attention(window):
    gen = _gen(6)
    cell = HybridCell(_spec(num_kv_heads=2, group=2), window=window, chunk_size=7, feature_map="elu", sinks=0)
    with torch.no_grad():
        cell.window_logit.copy_(torch.randn(4, generator=gen))  # f_h cancels out
        spec = cell.spec
        q, k, v = random_qkv(2, spec, 30, gen)
        mask = torch.ones(2, 30, dtype=torch.bool)
        init = cell.init_state(2, CPU, torch.float32)
        softmax = reference_window_attention(q, k, v, mask, window=10**9, sinks=0, scale=spec.scale)
        out, *_ = cell(q, k, v, mask, *init)
        torch.testing.assert_close(out.double(), softmax, rtol=RTOL, atol=ATOL)
        state, outs = init, []
        for t in range(30):
            o, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs, dim=2).double(), softmax, rtol=RTOL, atol=ATOL)
        assert not state[3].any() and not state[4].any()  # nothing has left the window


def test_hybrid_cell_bf16_inputs_keep_an_fp32_linear_state():
    gen = _gen(7)
    cell = HybridCell(_spec(), window=4, chunk_size=3, memory_init=1.0, feature_map="elu", sinks=0)
    spec = cell.spec
    q, k, v = random_qkv(2, spec, 30, gen, dtype=torch.bfloat16)
    mask = torch.ones(2, 30, dtype=torch.bool)
    with torch.no_grad():
        init = cell.init_state(2, CPU, torch.bfloat16)
        assert [t.dtype for t in init] == [torch.bfloat16, torch.bfloat16, torch.long, torch.float32, torch.float32]
        out, *state = cell(q[:, :, :12], k[:, :, :12], v[:, :, :12], mask[:, :12], *init)
        outs = [out]
        for t in range(12, 30):
            out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
            outs.append(out)
    out = torch.cat(outs, dim=2)
    assert out.dtype == torch.bfloat16
    ref = reference_hybrid_attention(q, k, v, mask, 4, torch.full((spec.num_heads,), 0.5), spec.scale)
    torch.testing.assert_close(out.double(), ref, rtol=BF16_TOL, atol=BF16_TOL)
    # the linear state is accumulated in fp32 from exactly representable bf16 inputs
    ref_kv, ref_z = reference_linear_state(k, v, mask, 4)
    torch.testing.assert_close(state[3].double(), ref_kv, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(state[4].double(), ref_z, rtol=RTOL, atol=ATOL)


def test_hybrid_cell_parameters_train():
    cell = HybridCell(_spec(), window=3, feature_map="elu", feature_options={}, sinks=0)
    assert isinstance(cell.window_logit, torch.nn.Parameter) and not cell.window_logit.any()  # theta = 0
    assert isinstance(cell.memory_gate, torch.nn.Parameter) and not cell.memory_gate.any()  # g = 0
    assert {"window_logit", "memory_gate"} <= set(cell.state_dict())
    assert cell.options() == {
        "window": 3,
        "sinks": 0,
        "feature_map": "elu",
        "feature_options": {},
        "chunk_size": 64,
        "memory_init": 0.0,
        "memory": "linear",
    }
    assert type(cell)(cell.spec, **cell.options()).options() == cell.options()
    gen = _gen(8)
    q, k, v = random_qkv(1, cell.spec, 12, gen)
    mask = torch.ones(1, 12, dtype=torch.bool)
    out, *_ = cell(q, k, v, mask, *cell.init_state(1, CPU, torch.float32))
    out.square().sum().backward()
    # at g = 0 only the gate itself moves the output; from there the mix and the map learn too
    assert cell.memory_gate.grad is not None and cell.memory_gate.grad.abs().sum() > 0
    assert cell.window_logit.grad.abs().max() < 1e-5  # f cancels in w / u (up to rounding)
    with torch.no_grad():
        cell.memory_gate.fill_(0.5)
    cell.zero_grad()
    out, *_ = cell(q, k, v, mask, *cell.init_state(1, CPU, torch.float32))
    out.square().sum().backward()
    assert cell.window_logit.grad.abs().sum() > 0


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0"])
def test_hybrid_memory_init_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="memory_init"):
        HybridCell(_spec(), window=3, memory_init=bad, sinks=0)


@pytest.mark.parametrize("sinks", [0, 3])
def test_training_free_hybrid_is_its_window_alone(sinks):
    """memory_init=0 (the default): every form equals softmax over the last W tokens and the first
    S, however far back the linear memory reaches and whatever the feature map says."""
    gen = _gen(10)
    cell = HybridCell(_spec(num_kv_heads=2, group=2), window=5, sinks=sinks, chunk_size=4, feature_map="hedgehog")
    spec = cell.spec
    q, k, v = random_qkv(2, spec, 40, gen)
    mask = _padding_mask("left", 2, 40, gen)
    window = reference_window_attention(q, k, v, mask, window=5, sinks=sinks, scale=spec.scale)
    real = mask[:, None, :, None].expand_as(window)
    with torch.no_grad():
        out, *state = cell(q, k, v, mask, *cell.init_state(2, CPU, torch.float32))
        torch.testing.assert_close(out.double()[real], window[real], rtol=RTOL, atol=ATOL)
        assert state[-1].any()  # the memory did fill: it is only gated off
        state, outs = cell.init_state(2, CPU, torch.float32), []
        for t in range(40):
            o, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs, 2).double()[real], window[real], rtol=RTOL, atol=ATOL)


def test_hybrid_saved_without_a_memory_gate_loads_as_the_plain_lolcats_sum():
    cell = HybridCell(_spec(), window=3, feature_map="elu", sinks=0)
    old = {k: v for k, v in cell.state_dict().items() if k != "memory_gate"}
    fresh = HybridCell(_spec(), window=3, feature_map="elu", sinks=0)
    fresh.load_state_dict(old, strict=True)
    assert torch.equal(fresh.memory_gate.detach(), torch.ones(fresh.spec.num_heads))


@pytest.mark.skipif("hedgehog" not in FEATURE_MAPS, reason="no hedgehog feature map registered")
def test_hybrid_hedgehog_feature_map_weights_get_gradients():
    cell = HybridCell(_spec(), window=3, feature_map="hedgehog", sinks=0)
    trainable = list(cell.parameters())
    assert len(trainable) > 1  # window_logit and the feature map's weights
    q, k, v = random_qkv(1, cell.spec, 12, _gen(9))
    out, *_ = cell(q, k, v, torch.ones(1, 12, dtype=torch.bool), *cell.init_state(1, CPU, torch.float32))
    out.square().sum().backward()
    assert all(p.grad is not None for p in trainable)


# --------------------------------------------------------------------------- long decoding


def _long_decode(cell, steps: int):
    """``steps`` single steps on random fp32 inputs, and the chunked form over the same inputs."""
    gen, spec = _gen(10), cell.spec
    q, k, v = random_qkv(1, spec, steps, gen)
    mask = torch.ones(1, 1, dtype=torch.bool)
    outs = torch.empty(1, spec.num_heads, steps, spec.value_dim)
    start = time.perf_counter()
    with torch.no_grad():
        state = cell.init_state(1, CPU, torch.float32)
        for t in range(steps):
            one = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask)
            outs[:, :, t : t + 1], *state = cell(*one, *state)
        elapsed = time.perf_counter() - start
        assert torch.isfinite(outs).all() and all(torch.isfinite(t.float()).all() for t in state)
        init = cell.init_state(1, CPU, torch.float32)
        chunked, *chunked_state = cell(q, k, v, torch.ones(1, steps, dtype=torch.bool), *init)
    return (k, v), outs, state, chunked, chunked_state, elapsed


STABILITY_CELLS = {
    "window": lambda: WindowCell(_spec(num_kv_heads=1, group=2, head_dim=8), window=16, sinks=4),
    "hybrid": lambda: HybridCell(
        _spec(num_kv_heads=1, group=2, head_dim=8), window=16, sinks=4, memory_init=1.0, feature_map="elu"
    ),
}


def _check_long_decode(target: str, steps: int) -> float:
    cell = STABILITY_CELLS[target]()
    (k, v), outs, state, chunked, chunked_state, elapsed = _long_decode(cell, steps)
    if target == "window":  # both forms read the same stored keys: fp32 tolerance, identical buffers
        torch.testing.assert_close(outs[:, :, -64:], chunked[:, :, -64:], rtol=RTOL, atol=RTOL)
        _assert_states_close(state, chunked_state, cell.state_names)
        return elapsed
    # The hybrid's linear state sums steps - W outer products, in a different order in each form
    # (one at a time vs 64 at a time). Entries grow like sqrt(steps) (S) and steps (z), so fp32
    # rounding is held relative to the largest entry: 1e-5 against a float64 sum for both forms.
    ref_kv, ref_z = reference_linear_state(k, v, torch.ones(1, steps, dtype=torch.bool), cell.window, sinks=cell.sinks)
    for got in (state, chunked_state):
        assert rel_diff(got[-2], ref_kv) < 1e-5 and rel_diff(got[-1], ref_z) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(state[:-2], chunked_state[:-2]))  # ring, sinks and length
    # outputs are normalised: the state's rounding shows at ~1e-6, held to 1e-4
    torch.testing.assert_close(outs[:, :, -64:], chunked[:, :, -64:], rtol=1e-4, atol=1e-4)
    return elapsed


@pytest.mark.parametrize("target", list(STABILITY_CELLS))
def test_2000_steps_are_stable(target):
    _check_long_decode(target, 2_000)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(STABILITY_CELLS))
def test_100000_steps_are_stable(target):
    elapsed = _check_long_decode(target, 100_000)
    print(f"{target}: 100,000 steps in {elapsed:.1f} s")


# --------------------------------------------------------------------------- converted models


VARIANTS = {
    "window": ("window", {"window": 8, "sinks": 2}),
    "hybrid": ("hybrid", {"window": 8, "sinks": 3, "memory_init": 0.5}),  # without sinks: the tests below
}


@pytest.fixture(scope="module")
def converted(tiny_model_dir):
    cache = {}

    def get(arch: str, target: str, **options):
        key = (arch, target, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = rnnify.convert(tiny_model_dir(arch), to=target, **options)
        return cache[key]

    return get


def test_window_equals_mistral_with_its_own_sliding_window(tiny_model_dir, converted):
    """Mistral (sliding_window=16), 80 tokens, batch 2: the original's full forward, eager attention."""
    path = tiny_model_dir("mistral")
    model = converted("mistral", "window")
    assert all(cell.window == 16 and cell.sinks == 0 for cell in model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 80), generator=_gen(11))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()(input_ids=ids).logits
    one_shot, state = model.prefill(ids)
    assert rel_diff(one_shot, expected) < 1e-4
    stepped, stepped_state = decode(model, ids, 8)
    assert rel_diff(stepped, expected) < 1e-4
    assert torch.equal(stepped.argmax(-1), expected.argmax(-1))
    assert state.nbytes == stepped_state.nbytes == model.prefill(ids[:, :20])[1].nbytes == model.state_nbytes(80, 2)


def test_hybrid_with_a_window_over_the_whole_context_equals_the_original(tiny_model_dir, converted):
    path = tiny_model_dir("llama")
    model = converted("llama", "hybrid", window=64)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 48), generator=_gen(12))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()(input_ids=ids).logits
    stepped, _ = decode(model, ids, 16)
    assert rel_diff(stepped, expected) < 1e-4


@pytest.mark.parametrize("arch, sinks", [("gpt2", 0), ("gpt2", 2), ("llama", 2)])  # window: as VARIANTS
def test_training_free_hybrid_model_computes_its_window_target(arch, sinks, converted):
    """A freshly converted hybrid is never worse than its window alone: it is the window target
    with the same window and sinks, in a prefill and in decode."""
    hybrid = converted(arch, "hybrid", window=8, sinks=sinks)
    window = converted(arch, "window", window=8, sinks=sinks)
    ids = torch.randint(0, hybrid.manifest.vocab_size, (2, 40), generator=_gen(15))
    assert rel_diff(hybrid.prefill(ids)[0], window.prefill(ids)[0]) < 1e-5
    assert rel_diff(decode(hybrid, ids, 30)[0], decode(window, ids, 30)[0]) < 1e-5


def test_hybrid_saved_before_sinks_existed_loads_without_sinks(converted, tmp_path):
    """A manifest whose hybrid options lack ``sinks`` (saves from before the option) loads as S = 0,
    with the five state tensors its saved graph threads."""
    model = converted("gpt2", "hybrid", window=8, sinks=0)
    model.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / MANIFEST_FILE).read_text())
    for entry in manifest["cells"]:
        del entry["options"]["sinks"]
    reseal(tmp_path / "m", cells=manifest["cells"])
    loaded = rnnify.load(tmp_path / "m")
    assert [c.sinks for c in loaded.cells] == [0] * len(model.cells)
    assert [c.state_names for c in loaded.cells] == [("keys", "values", "length", "kv", "k_sum")] * len(model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 30), generator=_gen(16))
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])
    assert rel_diff(decode(loaded, ids, 20)[0], decode(model, ids, 20)[0]) < 1e-6


def test_hybrid_part_of_a_head_split_saved_before_sinks_existed_loads_without_sinks(converted, tmp_path):
    """A head split's hybrid part whose manifest options lack ``sinks`` loads as S = 0, as a whole
    hybrid cell does (``Cell.manifest_defaults`` apply to the parts too), not with today's default."""
    model = converted("llama", "hybrid", layers="0-:heads(1=exact;*=hybrid(window=8,sinks=0))")
    model.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / MANIFEST_FILE).read_text())
    for entry in manifest["cells"]:
        del entry["options"]["groups"][1]["options"]["sinks"]
    reseal(tmp_path / "m", cells=manifest["cells"])
    loaded = rnnify.load(tmp_path / "m")
    assert [cell.parts[1].sinks for cell in loaded.cells] == [0] * len(model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 30), generator=_gen(17))
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_step_equals_prefill_and_prefill_continues(arch, variant, converted):
    target, options = VARIANTS[variant]
    model = converted(arch, target, **options)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=_gen(13))
    assert_steps_and_split_prefill_match(model, ids, 23)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_state_is_constant_and_saves(arch, variant, converted, tmp_path):
    target, options = VARIANTS[variant]
    model = converted(arch, target, **options)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 100), generator=_gen(14))
    _, short = model.prefill(ids[:, :16])
    logits, long = model.prefill(ids)
    assert short.nbytes == long.nbytes == model.state_nbytes(16) == model.state_nbytes(100)
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    assert torch.equal(loaded.prefill(ids)[0], logits)
    if target == "hybrid":
        assert [c.sinks for c in loaded.cells] == [options.get("sinks", 0)] * len(model.cells)
        assert {n for n, _ in loaded.named_parameters() if "window_logit" in n}
        assert len(list(parameters(loaded))) == len(list(parameters(model))) >= len(model.cells)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_left_padded_rows_equal_rows_alone(arch, variant, converted):
    target, options = VARIANTS[variant]
    model = converted(arch, target, **options)
    assert_left_padded_rows_equal_rows_alone(model, [14, 9, 3], _gen(15))


def test_registered():
    assert CELLS["window"] is WindowCell and CELLS["hybrid"] is HybridCell


@pytest.mark.parametrize("layers", [None, "0:heads(0=window(window=4,sinks=1);1=linear)"])
def test_a_donated_step_writes_the_ring_in_place_and_equals_the_step(tiny_model_dir, layers):
    """``step(donate=True)`` writes each window's ring into the state it was given (a whole window
    cell, and a head split's window part) and returns what the step that copies returns, bit for bit:
    logits and every state tensor, over rows that read prompts of different lengths."""
    from rnnify.runtime.state import RecurrentState

    options = {"layers": layers} if layers else {}
    model = rnnify.convert(str(tiny_model_dir("llama")), to="window", window=6, sinks=2, **options)
    ids = torch.randint(1, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = padding_mask(11, [0, 4, 9])
    _, state = model.prefill(ids, attention_mask=mask)
    for token in range(5):  # through the ring's wrap
        tok = torch.full((3, 1), 7 + token)
        copy = RecurrentState(tuple(t.clone() for t in state.tensors), state.positions.clone(), state.model_uid)
        want_logits, want = model.step(tok, copy)
        ring = state.tensors[0]
        logits, state = model.step(tok, state, donate=True)
        assert state.tensors[0] is ring  # written in place, not copied
        assert torch.equal(logits, want_logits)
        assert all(torch.equal(a, b) for a, b in zip(state.tensors, want.tensors))


def test_a_donated_step_keeps_the_compiled_step_where_that_is_faster(tiny_model_dir):
    """A donated step writes a window's ring in place only from ``IN_PLACE_FROM_ROWS`` rows when the
    model has a compiled step: below that, and at any rows where no cell writes in place (the fused
    op's window here), it runs the compiled step and leaves the state it was given as it was."""
    from rnnify.runtime.model import IN_PLACE_FROM_ROWS

    model = rnnify.convert(str(tiny_model_dir("llama")), to="window", window=6, sinks=2)
    calls = []

    class Compiled:  # stands in for a step compiled ahead of time: the eager step, its calls counted
        def serves(self, _model):
            return True

        def __call__(self, *inputs):
            calls.append(1)
            return model._direct_forward()(model.graph, *inputs)

    model._step_package = Compiled()
    for kernels, rows, in_place in (
        ("none", IN_PLACE_FROM_ROWS - 1, False),
        ("none", IN_PLACE_FROM_ROWS, True),
        ("reference", IN_PLACE_FROM_ROWS, False),
    ):
        model.use_kernels(kernels)
        _, state = model.prefill(torch.randint(1, 200, (rows, 9), generator=torch.Generator().manual_seed(rows)))
        ring, calls[:] = state.tensors[0], []
        before = ring.clone()
        _, new = model.step(torch.full((rows, 1), 5), state, donate=True)
        assert (new.tensors[0] is ring) == in_place and bool(calls) != in_place, (kernels, rows)
        if not in_place:
            assert torch.equal(ring, before)
