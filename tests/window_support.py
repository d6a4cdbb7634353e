"""What the window and hybrid cell tests share: the draws of their property tests, the checks
every form and cell passes, and the references, float64 loops straight from the equations that
count each row's real tokens only:

- window (docs/math.md §Sliding window and sinks): query i attends by softmax to A(i) = {j <= i : i - j < W or j < S}.
- hybrid (docs/math.md §Hybrid window and linear, LoLCATs, with sinks): with s_ij = scale q_i.k_j, A(i) as for the window,
  M(i) = {j : S <= j <= i - W} the other older tokens, m_i the max over A(i),
  y_i = (f_h sum_{j in A(i)} e^{s_ij-m_i} v_j + sum_{j in M(i)} phi(q_i).phi(k_j) v_j)
        / (f_h sum_{j in A(i)} e^{s_ij-m_i} + sum_{j in M(i)} phi(q_i).phi(k_j)),  phi = elu + 1.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from support import (
    draw_heads,
    random_qkv,
)

from rnnify.cells import CellSpec
from rnnify.kernels.slots import decode, encode

# fp32 computation against float64 on O(1) inputs: 1e-5 relative, the same absolute floor.
RTOL = ATOL = 1e-5
# bf16 inputs, fp32 accumulation, the output rounded once to bf16 (relative error <= 2**-9):
# held to 2**-7 relative/absolute against float64 from the very same bf16 numbers.
BF16_TOL = 2**-7

HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CELL_HYPOTHESIS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CPU = torch.device("cpu")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- references


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """Katharopoulos' feature map written out: x + 1 for x > 0, exp(x) otherwise."""
    x = x.double()
    return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))


def real_tokens(mask: torch.Tensor, b: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[b, t])]


def per_query_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """kv-head tensor [Hkv, ...] -> [H, ...]: query head h reads kv head h // group."""
    return x.repeat_interleave(group, dim=0)


def reference_window_attention(q, k, v, mask, window, sinks, scale):
    """float64; q [B, H, T, d], k/v [B, Hkv, T, *], mask [B, T]. Padding queries give 0."""
    q, k, v = q.double(), k.double(), v.double()
    batch, num_heads, length, _ = q.shape
    group = num_heads // k.shape[1]
    out = torch.zeros(batch, num_heads, length, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        real = real_tokens(mask, b)
        for i, t in enumerate(real):
            attended = [real[j] for j in range(i + 1) if i - j < window or j < sinks]
            keys = per_query_head(k[b][:, attended], group)  # [H, n, d]
            values = per_query_head(v[b][:, attended], group)
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
        real = real_tokens(mask, b)
        for i, t in enumerate(real):
            recent = [real[j] for j in range(i + 1) if i - j < window or j < sinks]
            older = [real[j] for j in range(sinks, i - window + 1)]
            keys, values = per_query_head(k[b][:, recent], group), per_query_head(v[b][:, recent], group)
            scores = scale * torch.einsum("hnd,hd->hn", keys, q[b, :, t])
            e = torch.exp(scores - scores.max(-1, keepdim=True).values)
            num = factor[:, None] * torch.einsum("hn,hnd->hd", e, values)
            den = factor * e.sum(-1)
            if older:
                old_keys, old_values = per_query_head(k[b][:, older], group), per_query_head(v[b][:, older], group)
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
        real = real_tokens(mask, b)
        for t in real[sinks : max(0, len(real) - window)]:
            phi_k = phi(k[b, :, t].double())
            S[b] += phi_k[:, :, None] * v[b, :, t, None, :].double()
            z[b] += phi_k
    return S, z


# --------------------------------------------------------------------------- helpers


def make_spec(num_kv_heads=2, group=2, head_dim=8, value_dim=None, window=None) -> CellSpec:
    return CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim or head_dim, head_dim**-0.5, window)


def mask_of_kind(kind: str, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "none":
        return torch.ones(batch, length, dtype=torch.bool)
    if kind == "left":
        pads = torch.randint(0, length + 1, (batch,), generator=gen)
        return torch.arange(length)[None, :] >= pads[:, None]
    return torch.rand(batch, length, generator=gen) < 0.7


def garbage_buffers(cell, state, gen):
    """Ring and sink buffers filled with large junk: slots not written yet must never be attended."""
    buffers = ("keys", "values", "sink_keys", "sink_values")

    def junk(t: torch.Tensor) -> torch.Tensor:  # stored as the buffer stores a vector (``kernels.slots``)
        return encode(100 * torch.randn(decode(t).shape, generator=gen), t.dtype)

    return tuple(junk(t) if name in buffers else t for t, name in zip(state, cell.state_names))


def grouped_queries(q, spec):
    batch, _, length, _ = q.shape
    return q.float().reshape(batch, spec.num_kv_heads, spec.group_size, length, -1)


def step_loop(step, q, k, v, mask, *state, **kwargs):
    """``step`` token by token; ``kwargs`` are passed to every step."""
    outs = []
    for t in range(q.shape[3]):
        one = (q[:, :, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1])
        out, *state = step(*one, *state, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=3), *state


def assert_states_close(got, want, what):
    for name, a, b in zip(what, got, want):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(a, b), name


def assert_forms_agree(forms, want, want_state, real, state_names) -> None:
    """Each form (a thunk returning ``(out, *state)``) gives the naive loop's outputs on real queries
    (padding queries: anything finite, fp32) and its state."""
    for name, form in forms.items():
        out, *new_state = form()
        assert out.shape == want.shape and out.dtype == torch.float32, name
        assert torch.isfinite(out).all(), name
        torch.testing.assert_close(out[real], want[real], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
        assert_states_close(new_state, want_state, [f"{name} {n}" for n in state_names])


def split_bounds(sizes: list[int], length: int) -> list[tuple[int, int]]:
    """[a, b) bounds of chunks of the given sizes, then single tokens until ``length``."""
    bounds, start = [], 0
    for size in sizes + [1] * length:
        if start >= length:
            break
        bounds.append((start, min(length, start + size)))
        start += size
    return bounds


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
        kv_dtype=draw(st.sampled_from([None, "float16", "bfloat16", "int8"])),  # how the window's slots store
    )


def form_inputs(p, cell):
    """Inputs of the forms: a prefix read by the naive loop into the state, then ``length`` new tokens."""
    gen, spec = seeded(p["seed"]), cell.spec
    total = p["prefix"] + p["length"]
    q, k, v = random_qkv(p["batch"], spec, total, gen)
    mask = mask_of_kind(p["padding"], p["batch"], total, gen)
    state = garbage_buffers(cell, cell.init_state(p["batch"], CPU, torch.float32), gen)
    return q, k, v, mask, state


# what the window and hybrid cells' property tests draw alike
CELL_DRAWS = {
    "window": st.integers(1, 12),
    "length": st.integers(1, 24),
    "splits": st.lists(st.integers(1, 20), max_size=3),
    "group": st.sampled_from([1, 2, 4]),
    "left_pad": st.integers(0, 6),
    "seed": st.integers(0, 2**31 - 1),
}


def check_cell(cell, reference, length, splits, left_pad, gen) -> None:
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
        for a, b in split_bounds(splits, length):
            out, *state = cell(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], mask[:, a:b], *state)
            outs.append(out)
            assert [t.shape for t in state] == [t.shape for t in init]  # constant size
    torch.testing.assert_close(torch.cat(outs, dim=2), one_shot, rtol=RTOL, atol=ATOL)
    assert_states_close(state, final, cell.state_names)
