"""Softmax read as a stream: attention over keys seen one at a time, or a block at a time, without
holding their scores (the online softmax of Milakov & Gimelshein 2018, as "Attention as an RNN"
and flash attention use it).

The math: docs/math.md §Softmax attention as an RNN.

The state per query is (m, u, w): the largest score read, sum exp(s - m) and sum exp(s - m) v.
Every exponent is taken against the running max, so no score overflows however large; a new max
rescales what was read by exp(m_old - m_new) <= 1. The exact cell's references, the window's and
the hybrid's window part all read keys this way, so the update lives here once: the references
that hold the other forms to account stay one recurrence, not copies that could drift apart.

A model may add terms to its scores (``ScoreTerms``; docs/math.md §Score terms): a softcap and
an ALiBi bias change each score before it is read, and a learned sink is one more score in the
denominator with no value, merged in after the keys.

Nothing read is (m, u, w) = (-inf, 0, 0), and a key not attended has score -inf: its weight is
exp(-inf) = 0, with the max's reference point 0 while nothing has been read (``finite_or_zero``),
so -inf - -inf never occurs. Everything keeps the dtype it is given (float64 references stay
float64).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from rnnify.cells.base import CellSpec


def finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """m where finite, else 0: the reference point for exp() when nothing has been read (m = -inf),
    so -inf - -inf never occurs."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def readout(u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """o = w / u, and 0 where nothing has been read (u = 0)."""
    return torch.where(u[..., None] > 0, w / u.clamp_min(torch.finfo(u.dtype).tiny)[..., None], 0.0)


def online_softmax_init(
    like: torch.Tensor, shape: tuple[int, ...], value_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state with nothing read, ``(m = -inf, u = 0 [*shape], w = 0 [*shape, value_dim])``, in
    ``like``'s dtype and on its device."""
    return like.new_full(shape, float("-inf")), like.new_zeros(shape), like.new_zeros((*shape, value_dim))


def online_softmax_update(
    m: torch.Tensor, u: torch.Tensor, w: torch.Tensor, scores: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state ``(m [...], u [...], w [..., d_v])`` with a block of n keys merged in:

        m' = max(m, max_j s_j),   u' = u exp(m - m') + sum_j exp(s_j - m'),
        w' = w exp(m - m') + sum_j exp(s_j - m') v_j

    ``scores [..., n]`` (-inf: not attended; one key: n = 1). The weights exp(s_j - m') are summed
    over the values by a matmul, ``p @ values``: ``values [..., n, d_v]``, whose leading dimensions
    broadcast against the scores' leading dimensions but their last (the matmul's rows). Returns
    ``(m', u', w')``."""
    m_new = torch.maximum(m, scores.amax(-1))
    m_safe = finite_or_zero(m_new)
    decay = torch.exp(m - m_safe)
    p = torch.exp(scores - m_safe[..., None])
    dtype = torch.promote_types(p.dtype, values.dtype)  # as p * v would: a float64 query keeps the sum float64
    return m_new, u * decay + p.sum(-1), w * decay[..., None] + p.to(dtype) @ values.to(dtype)


class ScoreTerms(nn.Module):
    """The terms a site's scores carry (``CellSpec.softcap``, ``alibi_slopes``, ``sink_logits``,
    ``relative_extent``), laid out for queries grouped by kv head, ``[B, Hkv, G, T, ·]``. The per-head
    values are buffers rebuilt from the spec (not saved), so they move with the cell; they are read in
    the scores' dtype. A relative bias and sink logits per query come with the queries (``scores``'
    ``relative``, ``readout``'s and ``finish``'s ``sinks``)."""

    def __init__(self, spec: CellSpec):
        super().__init__()
        self.softcap, self.extent, self.query_sinks = spec.softcap, spec.relative_extent, spec.query_sinks
        heads = (spec.num_kv_heads, spec.group_size)

        def per_head(values, trailing: int) -> torch.Tensor | None:
            return None if values is None else torch.tensor(values, dtype=torch.float32).view(*heads, *[1] * trailing)

        self.register_buffer("slopes", per_head(spec.alibi_slopes, 2), persistent=False)  # [Hkv, G, 1, 1]
        self.register_buffer("sinks", per_head(spec.sink_logits, 1), persistent=False)  # [Hkv, G, 1]

    def scores(
        self, scores: torch.Tensor, distance: torch.Tensor, relative: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``scores [B, Hkv, G, T, N]`` (scale q . k) with the softcap c tanh(s / c), then the ALiBi bias
        slope_h (j - i), then each query's relative bias ``relative [B, Hkv, G, T, E]`` at the distance
        i - j where that is below E (0 elsewhere); ``distance`` (j - i, in real tokens) broadcasts to
        ``[B, 1, 1, T, N]``."""
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if self.slopes is not None:
            scores = scores + self.slopes.to(scores.dtype) * distance.to(scores.dtype)
        if self.extent is not None:
            if relative is None:
                raise ValueError("this attention adds a relative bias per query: pass each query's (relative=)")
            back = -distance.expand(*scores.shape[:1], 1, 1, *scores.shape[3:])
            near = (back >= 0) & (back < self.extent)
            index = back.clamp(0, self.extent - 1).expand(scores.shape)
            bias = relative.to(scores.dtype).gather(-1, index)
            scores = scores + bias.masked_fill(~near, 0.0)
        return scores

    def _sinks(self, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """The sink logits: the spec's per head ``[Hkv, G, 1]``, or the queries' own ``sinks [B, Hkv, G, T]``."""
        if self.query_sinks and sinks is None:
            raise ValueError("this attention's queries bring their own sink logits: pass them (sinks=)")
        return sinks if self.query_sinks else self.sinks

    def readout(self, scores: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(scores) @ values, the sinks in the denominator: ``scores [..., T, N]`` (-inf: not
        attended, already ``self.scores``), ``values [..., N, d_v]``; rows with nothing read give 0.
        ``sinks [B, Hkv, G, T]``: the queries' own sink logits, where the spec says they bring them."""
        sinks = self._sinks(sinks)
        m = scores.amax(-1)
        if sinks is not None:
            m = torch.maximum(m, sinks.to(m.dtype))
        m = finite_or_zero(m)
        p = torch.exp(scores - m[..., None])
        u = p.sum(-1)
        if sinks is not None:
            u = u + torch.exp(sinks.to(m.dtype) - m)
        return readout(u, p.to(values.dtype) @ values)

    def finish(
        self, m: torch.Tensor, u: torch.Tensor, w: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The online state ``(m, u, w)`` of ``[B, Hkv, G, T]`` queries with the sinks merged in: each a
        key of score sink_h (or the query's own, ``sinks``) and value 0."""
        sinks = self._sinks(sinks)
        if sinks is None:
            return m, u, w
        sink = sinks.to(m.dtype).expand(m.shape)[..., None]
        return online_softmax_update(m, u, w, sink, w.new_zeros((1, w.shape[-1])))


def score_terms(spec: CellSpec) -> ScoreTerms | None:
    """The spec's ``ScoreTerms``, or None when its scores carry none."""
    return ScoreTerms(spec) if spec.score_terms else None


def real_positions(valid: torch.Tensor) -> torch.Tensor:
    """``[B, N]``: each entry's index among its row's real tokens (``valid``), the i and j of ALiBi's
    slope (j - i): left padding shifts no distance."""
    return valid.long().cumsum(1) - 1


def chunk_of(valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B, N]``: each entry's chunk of ``chunk`` real tokens (``valid``), counted from the first
    (chunked attention: a query reads the keys of its own chunk;
    docs/math.md §Softmax attention as an RNN)."""
    return real_positions(valid).clamp_min(0) // chunk
