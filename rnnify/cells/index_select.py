"""Sparse attention by an indexer (DeepSeek-V3.2's DSA), exact: the selection ``ExactCell`` computes
where its spec has an indexer (``CellSpec.index_topk``).

The math: docs/math.md §Indexer selection. A small scorer of its own ranks every earlier key for
each query,

    I(t, n) = sum_h w_{t,h} relu(c q_{t,h} . k_n)

(index queries q ``[B, T, Hi, d]``, one index key k ``[B, N, d]`` per token, weights w ``[B, T, Hi]``,
c ``index_scale``), and the query reads, by softmax attention, only the ``index_topk`` earlier keys
ranked highest. The selection is a function of the index keys, so the state that keeps it exact is
every past index key beside every past key and value: the cell's state grows with the context as
the original's cache does, by ``index_dim`` numbers a token.

Here: the ranking (``index_scores``, ``selection``) and ``naive_selected_softmax_attn`` (one query
at a time: its keys ranked and softmax over the chosen ones, the ground truth). The cell's path is
``rnnify.cells.exact.selected_softmax_attn``: blocks of queries, each ranking the whole cache as the
source does and reading it through the exact cell's attention under the selection's mask. Both take
queries ``[B, H, T, d]`` of cache positions ``N-T .. N-1``, keys/values ``[B, Hkv, N, *]``,
``valid [B, N]`` and the index inputs above over the same cache, and give 0 where no key is allowed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def index_scores(index_q, index_keys, index_weights, index_scale: float) -> torch.Tensor:
    """``[B, T, N]``: I(t, n) for the T index queries over the N index keys, in fp32, computed as the
    source computes them, so that it ranks the keys as the source does."""
    scores = torch.matmul(index_q.float(), index_keys.transpose(-1, -2).float().unsqueeze(1)) * index_scale
    return torch.matmul(index_weights.float().unsqueeze(-2), F.relu(scores)).squeeze(-2)


def selection(scores: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """``[B, T, N]`` boolean: the keys each query reads, the ``topk`` allowed ones ranked highest by
    ``scores`` (all of them where fewer are allowed)."""
    ranked = scores.masked_fill(~allowed, float("-inf")).topk(min(topk, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(allowed).scatter(-1, ranked, True) & allowed


def naive_selected_softmax_attn(
    q,
    keys,
    values,
    valid,
    scale: float,
    index_q,
    index_keys,
    index_weights,
    topk: int,
    index_scale: float,
    sink_logits: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """One query at a time: I(t, n) head by head, the ``topk`` allowed keys ranked highest (a stable
    sort), softmax over them (``sink_logits``: exp(sink_h) in head h's denominator), in the inputs'
    precision (fp32 at least)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    batch, num_heads, length, _ = q.shape
    total, group = keys.shape[2], q.shape[1] // keys.shape[1]
    out = torch.zeros(batch, num_heads, length, values.shape[-1], dtype=dtype)
    for b in range(batch):
        for t in range(length):
            position = total - length + t
            candidates = [n for n in range(position + 1) if valid[b, n]]
            if not candidates:
                continue
            rank = []
            for n in candidates:
                dots = (index_q[b, t].to(dtype) @ index_keys[b, n].to(dtype)) * index_scale  # [Hi]
                rank.append(float((index_weights[b, t].to(dtype) * dots.clamp_min(0)).sum()))
            order = sorted(range(len(candidates)), key=lambda i: -rank[i])[:topk]
            chosen = torch.tensor(sorted(candidates[i] for i in order))
            for h in range(num_heads):
                s = (keys[b, h // group, chosen].to(dtype) @ q[b, h, t].to(dtype)) * scale
                sink = torch.tensor([] if sink_logits is None else [sink_logits[h]], dtype=dtype)
                p = torch.softmax(torch.cat([s, sink]), dim=0)[: len(chosen)]
                out[b, h, t] = p @ values[b, h // group, chosen].to(dtype)
    return out.to(values.dtype)
