"""LoLA: sinks, a recent window and K tokens the memory recalls worst by softmax, every other past
token in a linear-attention memory (McDermott, Heath & Parhi 2025, "LoLA: Low-Rank Linear
Attention With Sparse Caching", arXiv 2505.23666).

The math: docs/math.md §LoLA: selection by memory error; the layout is ``cells/select.py``'s
(docs/math.md §Token-selection caches), the normalised sum and the memory gate ``cells/hybrid.py``'s
(docs/math.md §Hybrid window and linear).

Why: a window with a linear memory (the hybrid) writes every token that leaves the window into
one sum of phi(k)^T v, where keys that resemble each other blur their values together ("memory
collisions"); a token-selection cache (``select``) keeps a few past tokens exactly but drops the
rest. LoLA does both: of the tokens leaving the recent set it keeps by exact softmax those the
memory would recall worst, and writes the others, which it already recalls, into the memory. So
nothing is dropped, and a key/value pair the memory cannot hold keeps its own slot.

The layout is the ``select`` cell's: counting only a row's real tokens (left padding is skipped),
with chunk C, window W, S sinks and K selected tokens, query i of the chunk that starts at
c(i) = C floor(i / C) reads by softmax

    A(i) = { j < S } ∪ R(i) ∪ P_c(i),          R(i) = { j : c(i) - W < j <= i },

and every other past token j >= S through the memory (kv [F, d_v], z [F] per kv head, feature map
phi, ``taylor`` by default: phi(q) . phi(k) = 1 + s + s^2 / 2, exp's second-order Taylor series,
with no training). The memory changes at boundaries only. At every boundary p (a multiple of C) the tokens
leaving the recent set, L_p = { j >= S : p - C - W < j <= p - W }, and the K selected P_{p-C} are
the candidates; each one's merit is the memory's self-recall error on it, with the memory as it is
at the boundary, before this boundary's writes:

    e_j = || v_j - phi(k_j) kv / (phi(k_j) . z + eps) ||^2          (an empty memory recalls 0: e_j = ||v_j||^2)

The K of highest error are P_p (ties: the newer token); the others are written (in position order
in the loop, as one sum in the vectorised forms: the order changes rounding only):

    kv += phi(k_j)^T v_j,      z += phi(k_j).

So every token j <= i is read by query i exactly once, by the softmax (A(i)) or by the memory. Query
i's output is the hybrid's normalised sum, blended with the softmax alone by the memory gate:

    s_ij = scale q_i . k_j,     m_i = max_{j in A(i)} s_ij,
    w_i = sum_{j in A(i)} exp(s_ij - m_i) v_j,     u_i = sum_{j in A(i)} exp(s_ij - m_i)
    y_i = (f_h w_i + phi(q_i) kv) / (f_h u_i + phi(q_i) . z),       f_h = sigmoid(``window_logit``_h)
    out_i = w_i / u_i + g_h (y_i - w_i / u_i),                       g_h = ``memory_gate``_h (``memory_init``)

per query head h. At g = 0 (the default) the converted model, training-free, is the ``select``
layout with the tokens chosen by recall error, and distillation can grow g (and train f and a
trainable feature map) to let the memory speak; at g = 1 it is the one normalised sum of both.

Why step == prefill and split == whole: boundaries and the tokens that leave are functions of
positions alone, the queries of a chunk read a held set that is fixed inside the chunk (plus the
chunk's own tokens, causally), and the decision reads only the state (the candidates' keys and
values, kv and z), never the attention: every form decides with the same numbers on the same
boundaries, in position order. A prefill runs chunk by chunk of absolute positions (a prompt that
starts mid-chunk finishes that chunk first); a decode step is a chunk read one query at a time.

State per kv head, constant from the first token on: ``select``'s buffers without its attention
scores (a ring of the last W + C - 1 keys/values, token n in slot n mod (W + C - 1), the oldest C
of them the next boundary's leaving tokens; the S sinks; the K selected keys/values with their
positions, -1 and zeros where empty, in position order, empty slots first) and per row ``length``,
the real tokens read, then the memory ``kv [F, d_v]`` and ``k_sum`` (z) ``[F]`` in fp32. Keys and
values keep the model dtype. Padding is never written and never advances ``length``.

Forms (tests hold them to ``naive_recurrent_lola_attn``):

- ``naive_recurrent_*``: a plain loop over tokens, rows, heads and query heads, decisions by
  Python's ``sorted``; the ground truth, in the dtype it is given (float64 in the tests).
- ``chunk_*``: the prefill path: the tokens laid out by absolute position, then per chunk one masked
  softmax of its queries over what they read plus the memory's readout (``read_chunk``) and the
  boundary's decision and writes (``lola_at_boundary``), vectorised over rows and heads.
- ``step_*``: one token: ``read_chunk`` of one query, and the decision where it ends a chunk.

Shapes: q ``[B, Hkv, G, T, d]`` (fp32, or float64), k/v ``[B, Hkv, T, d]``, mask ``[B, T]``; state
``keys/values [B, Hkv, W + C - 1, d]``, ``sink_keys/sink_values [B, Hkv, S, d]``,
``selected_keys/selected_values [B, Hkv, K, d]``, ``selected_positions [B, Hkv, K]`` and ``length
[B]`` int64, ``kv [B, Hkv, F, d_v]``, ``k_sum [B, Hkv, F]``; ``factor`` f and ``gate`` g ``[Hkv, G]``;
``phi`` maps ``[B, Hkv, ..., d] -> [B, Hkv, ..., F]``. Every form returns ``(out [B, Hkv, G, T,
d_v], *new_state)``, out in q's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.linear import build_feature_map
from rnnify.cells.online_softmax import finite_or_zero, readout
from rnnify.cells.select import (
    CacheLayout,
    best_candidates,
    boundary_candidates,
    candidate_entries,
    chosen_entries,
    chunk_by_position,
    chunk_read_set,
    decided,
    naive_arrivals,
    naive_read_set,
    step_by_position,
    token_slots,
    with_tokens_written,
)
from rnnify.errors import check_int

FeatureMap = Callable[[torch.Tensor], torch.Tensor]
# exp's second-order Taylor series: a memory that approximates softmax with no training (LoLA's
# training-free setting); a trainable map (hedgehog, t2r) may be chosen for distillation
DEFAULT_FEATURE_MAP = "taylor"
DEFAULT_SINKS = 4  # StreamingLLM's, as select's and the hybrid's


@dataclass(frozen=True)
class Retention(CacheLayout):
    """The ``select`` cell's layout (the module docstring's W, S, K, C) and the eps of the recall error."""

    eps: float


class LolaState(NamedTuple):
    """The LoLA cell's state, in its ``state_names`` order (shapes: the module docstring)."""

    keys: torch.Tensor
    values: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    selected_keys: torch.Tensor
    selected_values: torch.Tensor
    selected_positions: torch.Tensor
    length: torch.Tensor
    kv: torch.Tensor
    k_sum: torch.Tensor


def combine(w, u, num, den, factor, gate):
    """``w / u + g (y - w / u)``, y = (f w + num) / (f u + den): the softmax part ``(w [..., d_v], u)``
    and the memory's readout ``(num, den)`` of queries ``[B, Hkv, G, (T,)]``, f and g ``[Hkv, G]``. The
    hybrid's blend (``linear_memory``) reads the softmax part from f w / f u; here it is w / u itself,
    so that with g = 0 the output is exactly the softmax over the kept tokens."""
    shape = (*factor.shape, *(1,) * (u.dim() - 3))
    factor, gate = factor.to(u.dtype).reshape(shape), gate.to(u.dtype).reshape(shape)
    softmax = readout(u, w)
    hybrid = readout(factor * u + den, factor[..., None] * w + num)
    return softmax + gate[..., None] * (hybrid - softmax)


def recall_error(phi_k, values, kv, k_sum, eps: float) -> torch.Tensor:
    """``||v - phi(k) kv / (phi(k) . z + eps)||^2`` of keys ``phi_k [..., N, F]`` and ``values [..., N,
    d_v]`` against the memory ``kv [..., F, d_v]``, ``k_sum [..., F]``: ``[..., N]``."""
    recalled = (phi_k @ kv) / ((phi_k @ k_sum[..., None]) + eps)
    return (values - recalled).square().sum(-1)


# --------------------------------------------------------------------------- the reference


def naive_recurrent_lola_attn(q, k, v, mask, *state, phi: FeatureMap, factor, gate, scale: float, rule: Retention):
    state = LolaState(*(t.clone() for t in state))
    out = q.new_zeros(*q.shape[:4], state.values.shape[-1])
    phi_q = phi(q)  # per token: [B, Hkv, G, T, F]
    for t, b, n in naive_arrivals(k, v, mask, state):
        for h in range(q.shape[1]):
            read = naive_read_set(state, b, h, n, rule)
            read_values = torch.stack([value.to(q.dtype) for _, value, _ in read])
            for g in range(q.shape[2]):
                logits = scale * torch.stack([q[b, h, g, t] @ key.to(q.dtype) for key, _, _ in read])
                p = torch.exp(logits - logits.max())
                w, u = p @ read_values, p.sum()
                num, den = phi_q[b, h, g, t] @ state.kv[b, h], phi_q[b, h, g, t] @ state.k_sum[b, h]
                f, gh = float(factor[h, g]), float(gate[h, g])
                softmax = w / u
                out[b, h, g, t] = softmax + gh * ((f * w + num) / (f * u + den) - softmax)
        if (n + 1) % rule.chunk == 0:
            _naive_decide(b, n + 1, state, phi, rule)
    return out, *state


def _naive_decide(b, p, state: LolaState, phi, rule: Retention) -> None:
    """``lola_at_boundary`` for row b at boundary p, by ``sorted``; in place."""
    ring = {p - 1 - (p - 1 - s) % rule.ring: s for s in range(rule.ring)}  # the ring holds (p - W - C, p)
    kv, k_sum = state.kv, state.k_sum
    phi_ring = phi(state.keys[b : b + 1].to(kv.dtype))[0]  # [Hkv, W + C - 1, F]
    phi_selected = phi(state.selected_keys[b : b + 1].to(kv.dtype))[0]
    for h in range(state.keys.shape[1]):
        # (position, key, value, phi(key)) of each candidate: the selected, then the tokens leaving
        candidates = [
            (
                int(state.selected_positions[b, h, s]),
                state.selected_keys[b, h, s].clone(),
                state.selected_values[b, h, s].clone(),
                phi_selected[h, s],
            )
            for s in range(rule.keep)
            if state.selected_positions[b, h, s] >= 0
        ]
        candidates += [
            (j, state.keys[b, h, s].clone(), state.values[b, h, s].clone(), phi_ring[h, s])
            for j, s in ring.items()
            if rule.sinks <= j <= p - rule.window
        ]
        error = {}
        for position, _, value, phi_k in candidates:  # against the memory before this boundary's writes
            recalled = (phi_k @ kv[b, h]) / (phi_k @ k_sum[b, h] + rule.eps)
            error[position] = float(((value.to(kv.dtype) - recalled) ** 2).sum())
        ranked = sorted(candidates, key=lambda c: (error[c[0]], c[0]), reverse=True)
        kept = sorted(ranked[: rule.keep], key=lambda c: c[0])
        for _, _, value, phi_k in sorted(ranked[rule.keep :], key=lambda c: c[0]):
            kv[b, h] += phi_k[:, None] * value.to(kv.dtype)[None, :]
            k_sum[b, h] += phi_k
        empty = rule.keep - len(kept)
        for slot in range(rule.keep):
            position, key, value, _ = kept[slot - empty] if slot >= empty else (-1, 0, 0, None)
            state.selected_positions[b, h, slot] = position
            state.selected_keys[b, h, slot], state.selected_values[b, h, slot] = key, value


# --------------------------------------------------------------------------- the vectorised forms


def read_chunk(q, k, v, positions, state: LolaState, phi: FeatureMap, factor, gate, scale: float, rule: Retention):
    """The new tokens at ``positions [B, T]`` (consecutive from each row's ``length`` inside one chunk;
    -1: none) read ``select.chunk_read_set`` by softmax, and the memory, in one normalised sum
    (``combine``); their keys and values are written: ``(out, state)`` (0 for the queries at -1). No
    decision: the caller makes the boundary's."""
    real, allowed, all_keys, all_values = chunk_read_set(q, k, v, positions, state, rule)
    all_keys, all_values = all_keys.to(q.dtype), all_values.to(q.dtype)  # (the model dtype: lola takes no kv_dtype)
    scores = (scale * torch.einsum("bhgtd,bhnd->bhgtn", q, all_keys)).masked_fill(~allowed[:, :, None], float("-inf"))
    p = torch.exp(scores - finite_or_zero(scores.amax(-1, keepdim=True)))  # exp(s - m), 0 where not read
    phi_q = phi(q)  # [B, Hkv, G, T, F]
    num = phi_q @ state.kv[:, :, None].to(q.dtype)
    den = (phi_q @ state.k_sum[:, :, None, :, None].to(q.dtype))[..., 0]
    out = combine(p @ all_values[:, :, None], p.sum(-1), num, den, factor, gate)
    out = torch.where(real[:, None, None, :, None], out, 0.0)
    return out, with_tokens_written(state, k, v, real, *token_slots(positions, real, rule))


def lola_at_boundary(state: LolaState, deciding: torch.Tensor, phi: FeatureMap, rule: Retention) -> LolaState:
    """The decision at boundary p = ``length`` for the rows ``deciding [B]``: the K selected and the C
    tokens leaving the recent set (``select.boundary_candidates``) compete by the memory's recall
    error on them (``recall_error``, the memory as it is before this boundary); the K of highest
    error stay, in position order (empty slots first, zeros), and the others are written into kv, z."""
    candidates, slot = boundary_candidates(state.length, state.selected_positions, rule)
    candidate_keys = candidate_entries(state.selected_keys, state.keys, slot)
    candidate_values = candidate_entries(state.selected_values, state.values, slot)
    kv, k_sum = state.kv, state.k_sum
    valid = candidates >= 0
    phi_k = phi(candidate_keys.to(kv.dtype))  # [B, Hkv, K + C, F]
    candidate_v = candidate_values.to(kv.dtype)
    error = recall_error(phi_k.detach(), candidate_v.detach(), kv.detach(), k_sum.detach(), rule.eps)
    best, kept_positions = best_candidates(candidates, error, rule.keep)
    kept = kept_positions >= 0
    chosen = torch.zeros_like(valid).scatter(2, best, True)
    written = (valid & ~chosen & deciding[:, None, None])[..., None]  # [B, Hkv, K + C, 1]
    phi_written = torch.where(written, phi_k, 0.0)
    return state._replace(
        selected_keys=chosen_entries(candidate_keys, best, kept, deciding, state.selected_keys),
        selected_values=chosen_entries(candidate_values, best, kept, deciding, state.selected_values),
        selected_positions=decided(deciding, kept_positions, state.selected_positions),
        kv=kv + phi_written.transpose(-1, -2) @ torch.where(written, candidate_v, 0.0),
        k_sum=k_sum + phi_written.sum(2),
    )


def chunk_lola_attn(q, k, v, mask, *state, phi: FeatureMap, factor, gate, scale: float, rule: Retention):
    """A prefill: ``select.chunk_by_position`` of ``read_chunk`` and ``lola_at_boundary``."""
    attend = partial(read_chunk, phi=phi, factor=factor, gate=gate, scale=scale, rule=rule)
    decide = partial(lola_at_boundary, phi=phi, rule=rule)
    return chunk_by_position(attend, decide, q, k, v, mask, LolaState(*state), rule.chunk)


def step_lola_attn(q, k, v, mask, *state, phi: FeatureMap, factor, gate, scale: float, rule: Retention):
    """One decode token: ``select.step_by_position`` of ``read_chunk`` and ``lola_at_boundary``."""
    attend = partial(read_chunk, phi=phi, factor=factor, gate=gate, scale=scale, rule=rule)
    decide = partial(lola_at_boundary, phi=phi, rule=rule)
    return step_by_position(attend, decide, q, k, v, mask, LolaState(*state), rule.chunk)


# --------------------------------------------------------------------------- the cell


class LolaCell(Cell):
    """Softmax over sinks, a recent window and the K past tokens a linear memory recalls worst, the
    other past tokens through that memory (LoLA), with constant memory.

    ``window=None`` takes the model's own sliding window (``spec.window``); ``sinks`` are kept for
    good (4 by default); ``keep=None`` selects as many tokens as the window holds; decisions every
    ``chunk`` tokens. ``feature_map`` (any name in ``rnnify.cells.linear.FEATURE_MAPS``, default
    ``taylor``, built with ``feature_options``) is the memory's phi; ``eps`` the recall error's.
    ``memory_init`` is the initial memory gate (0: the softmax over the kept tokens alone).
    Trainable: ``window_logit`` (f_h = sigmoid of it, per query head), ``memory_gate`` (g_h, per query
    head) and the feature map's parameters. The module docstring has the rule.
    """

    target = "lola"
    gates = ("memory_gate", "window_logit")
    state_names = LolaState._fields

    def __init__(
        self,
        spec: CellSpec,
        window: int | None = None,
        sinks: int = DEFAULT_SINKS,
        keep: int | None = None,
        chunk: int = 32,
        feature_map: str = DEFAULT_FEATURE_MAP,
        feature_options: dict[str, Any] | None = None,
        memory_init: float = 0.0,
        eps: float = 1e-6,
    ):
        super().__init__(spec)
        if window is None and spec.window is None:
            raise ValueError(
                "this attention has no sliding window of its own: give window=N (--window N) "
                "(the number of recent tokens each query attends to)"
            )
        if feature_options is not None and not isinstance(feature_options, dict):
            raise ValueError(f"feature_options must be a dict of feature-map options, got {feature_options!r}")
        if isinstance(memory_init, bool) or not isinstance(memory_init, (int, float)) or not 0 <= memory_init <= 1:
            raise ValueError(f"memory_init must be a number in [0, 1] (0: the softmax part alone), got {memory_init!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < float("inf"):
            raise ValueError(f"eps must be a positive number, got {eps!r}")
        window = check_int("window", spec.window if window is None else window, 1)
        keep = check_int("keep", window if keep is None else keep, 0)
        self.rule = Retention(window, check_int("sinks", sinks, 0), keep, check_int("chunk", chunk, 1), float(eps))
        self.feature_map, self.feature_options = feature_map, dict(feature_options or {})
        self.memory_init = float(memory_init)
        self.phi = build_feature_map(feature_map, spec, **self.feature_options)
        self.memory_gate = nn.Parameter(torch.full((spec.num_heads,), self.memory_init))
        self.window_logit = nn.Parameter(torch.zeros(spec.num_heads))

    def options(self) -> dict[str, Any]:
        rule = self.rule
        return {
            "window": rule.window,
            "sinks": rule.sinks,
            "keep": rule.keep,
            "chunk": rule.chunk,
            "feature_map": self.feature_map,
            "feature_options": self.phi.options(),
            "memory_init": self.memory_init,
            "eps": rule.eps,
        }

    @property
    def exact_span(self) -> int:
        return self.rule.exact_span

    def describe(self) -> str:
        rule = self.rule
        return (
            f"{rule.window} tokens"
            + (f" + {rule.sinks} sinks" if rule.sinks else "")
            + f" + {rule.keep} selected by memory error every {rule.chunk} tokens"
            + f" + a {self.feature_map} linear memory ({self.phi.feature_dim} features)"
        )

    def init_state(self, batch_size, device, dtype):
        spec, rule = self.spec, self.rule

        def zeros(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(batch_size, spec.num_kv_heads, *shape, device=device, dtype=dtype)

        features = self.phi.feature_dim
        return (
            zeros(rule.ring, spec.head_dim),
            zeros(rule.ring, spec.value_dim),
            zeros(rule.sinks, spec.head_dim),
            zeros(rule.sinks, spec.value_dim),
            zeros(rule.keep, spec.head_dim),
            zeros(rule.keep, spec.value_dim),
            torch.full((batch_size, spec.num_kv_heads, rule.keep), -1, device=device, dtype=torch.long),
            torch.zeros(batch_size, device=device, dtype=torch.long),
            zeros(features, spec.value_dim, dtype=torch.float32),
            zeros(features, dtype=torch.float32),
        )

    def mixing_factor(self) -> torch.Tensor:
        """f_h = sigmoid(theta_h), grouped per kv head ``[Hkv, G]``, fp32."""
        return torch.sigmoid(self.window_logit.float()).reshape(self.spec.num_kv_heads, self.spec.group_size)

    def forward(self, q, k, v, mask, *state):
        batch, _, steps, _ = q.shape
        spec = self.spec
        grouped = q.float().reshape(batch, spec.num_kv_heads, spec.group_size, steps, -1)
        gate = self.memory_gate.float().reshape(spec.num_kv_heads, spec.group_size)
        form = step_lola_attn if steps == 1 else chunk_lola_attn
        out, *state = form(
            grouped,
            k,
            v,
            mask.to(torch.bool),
            *state,
            phi=self.phi,
            factor=self.mixing_factor(),
            gate=gate,
            scale=spec.scale,
            rule=self.rule,
        )
        return out.reshape(batch, spec.num_heads, steps, -1).to(q.dtype), *state
