"""Softmax read as a stream: attention over keys seen one at a time, or a block at a time, without
holding their scores (the online softmax of Milakov & Gimelshein 2018, as "Attention as an RNN"
and flash attention use it).

The math: docs/math.md §Softmax attention as an RNN.

The state per query is (m, u, w): the largest score read, sum exp(s - m) and sum exp(s - m) v.
Every exponent is taken against the running max, so no score overflows however large; a new max
rescales what was read by exp(m_old - m_new) <= 1. The exact cell's references, the window's and
the hybrid's window part all read keys this way, so the update lives here once: the references
that hold the other forms to account stay one recurrence, not copies that could drift apart.

Nothing read is (m, u, w) = (-inf, 0, 0), and a key not attended has score -inf: its weight is
exp(-inf) = 0, with the max's reference point 0 while nothing has been read (``finite_or_zero``),
so -inf - -inf never occurs. Everything keeps the dtype it is given (float64 references stay
float64).
"""

from __future__ import annotations

import torch


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
