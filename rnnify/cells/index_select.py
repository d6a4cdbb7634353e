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

Qwen4-Exp's QSA ranks blocks instead (docs/math.md §Indexer selection, pooled forms): each query's
visible keys, in order, fall into blocks of ``ratio``; a block's key is the mean of its tokens' raw
index keys, RMS-normed (weight ``1 + w``) and rotated to its first token's position; a query scores
block j by sum_h relu(q_h . K_j) / sqrt(d) and reads the ``budget // ratio`` complete blocks ranked
highest and every key of its unfinished block. Its index keys here are ``[raw, cos, sin]`` a token
(the raw key and the rotary table of the token's position), so a block's key is computed again from
the cache each call: ``naive_block_selection`` (the source's loop, the ground truth) and
``BlockRanking`` (the cell's path).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from rnnify.cells.online_softmax import real_positions


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


def visible_keys(valid: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """``[B, t, N]``: the keys a query at cache position ``q_pos`` may read before any selection (real, not later)."""
    k_pos = torch.arange(valid.shape[1], device=valid.device)
    return valid[:, None, :] & (k_pos[None, None, :] <= q_pos[None, :, None])


def key_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The block keys' RMS norm as QSA's source computes it: in fp32, times ``1 + weight``, back in x's dtype."""
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the first ``cos.shape[-1]`` features of x (rotate-half pairs), the rest as they are."""
    width = cos.shape[-1]
    part, rest = x[..., :width], x[..., width:]
    half = torch.cat((-part[..., width // 2 :], part[..., : width // 2]), dim=-1)
    return torch.cat([part * cos + half * sin, rest], dim=-1)


def split_block_keys(index_keys: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``index_keys [..., d + 2w]`` as (raw keys ``[..., d]``, cos ``[..., w]``, sin ``[..., w]``), w the rotary width."""
    width = (index_keys.shape[-1] - head_dim) // 2
    return torch.split(index_keys, [head_dim, width, width], dim=-1)


def naive_block_selection(
    index_q, index_keys, visible, norm_weight, eps: float, ratio: int, budget: int
) -> torch.Tensor:
    """``[B, T, N]`` boolean: QSA's selection one query at a time, as the source's loop computes it.
    ``index_q [B, T, Hi, d]`` (normed and rotated), ``index_keys [B, N, d + 2w]`` (module docstring),
    ``visible [B, T, N]`` the keys each query may read."""
    batch, length, _, head_dim = index_q.shape
    raw, cos, sin = split_block_keys(index_keys, head_dim)
    chosen = torch.zeros(visible.shape, dtype=torch.bool, device=visible.device)
    for b in range(batch):
        for t in range(length):
            seen = torch.nonzero(visible[b, t], as_tuple=False).flatten()
            blocks = seen.shape[-1] // ratio
            tail = seen[blocks * ratio :]
            chosen[b, t, tail] = True
            if blocks == 0:
                continue
            members = seen[: blocks * ratio].view(blocks, ratio)
            pooled = raw[b].index_select(0, members.flatten()).view(blocks, ratio, head_dim)
            pooled = key_norm(pooled.float().mean(dim=1).to(raw.dtype), norm_weight, eps)
            starts = members[:, 0]
            block_keys = _rotate(pooled, cos[b].index_select(0, starts), sin[b].index_select(0, starts))
            scores = torch.matmul(index_q[b, t].float(), block_keys.float().transpose(-1, -2)).transpose(-1, -2)
            scores = torch.relu(scores).sum(dim=-1) / math.sqrt(head_dim)
            top = scores.topk(min(budget // ratio, blocks), dim=0).indices
            chosen[b, t, members.index_select(0, top).flatten()] = True
    return chosen


class BlockRanking:
    """QSA's blocks over a cache (``index_keys [B, N, d + 2w]``, ``valid [B, N]``), pooled once a call
    and read by each block of queries (``read``). A row's valid keys form its blocks in order, the
    same for every query, which sees a prefix of them: block j is complete for a query at position p
    when its last key is at p or before."""

    def __init__(self, index_keys, valid, head_dim: int, norm_weight, eps: float, ratio: int, budget: int):
        raw, cos, sin = split_block_keys(index_keys, head_dim)
        batch, total = valid.shape
        self.capacity, self.head_dim, self.valid = total // ratio, head_dim, valid  # most blocks a row has
        self.top = budget // ratio  # blocks a query reads
        rank = real_positions(valid)
        # [B, N]: each key's block, at most ``capacity`` (a last block no query completes; padding's is
        # never read)
        self.block_of = torch.where(valid, rank // ratio, 0).clamp_max(self.capacity)
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # each row's valid keys first
        members = order[:, : self.capacity * ratio].reshape(batch, self.capacity, ratio)
        exists = torch.arange(self.capacity, device=valid.device) < (valid.sum(1, keepdim=True) // ratio)
        # the position of each block's last key; past every query where the block is not there
        self.end = torch.where(exists, members[..., -1], total)
        index = members.reshape(batch, -1, 1)
        pooled = raw.gather(1, index.expand(-1, -1, head_dim)).view(batch, self.capacity, ratio, head_dim)
        pooled = key_norm(pooled.float().mean(dim=2).to(raw.dtype), norm_weight, eps)
        starts = members[..., :1].expand(-1, -1, cos.shape[-1])
        self.keys = _rotate(pooled, cos.gather(1, starts), sin.gather(1, starts))  # [B, M, d]

    def read(self, index_q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """``[B, t, N]`` boolean: the keys each query at ``q_pos`` reads (``index_q [B, t, Hi, d]``)."""
        visible = visible_keys(self.valid, q_pos)
        if self.capacity == 0:
            return visible
        scores = torch.matmul(index_q.float(), self.keys.float().transpose(-1, -2).unsqueeze(1))  # [B, t, Hi, M]
        scores = torch.relu(scores).sum(dim=2) / math.sqrt(self.head_dim)
        complete = self.end[:, None, :] <= q_pos[None, :, None]  # [B, t, M]
        chosen = torch.zeros_like(complete)
        # each query ranks its complete blocks, a prefix of them, as a vector of that length: torch.topk
        # breaks ties (scores relu made 0) by the vector it is given, so the same one the source gives it
        counts = complete.sum(-1)
        for count in counts.unique().tolist():
            if count == 0 or not self.top:
                continue
            rows, queries = torch.nonzero(counts == count, as_tuple=True)
            ranked = scores[rows, queries, :count].topk(min(self.top, count), dim=-1).indices
            chosen[rows[:, None], queries[:, None], ranked] = True
        unfinished = torch.ones_like(complete[..., :1])  # block ``capacity``
        read = torch.cat([~complete | chosen, unfinished], dim=-1)
        return visible & read.gather(-1, self.block_of[:, None, :].expand(-1, q_pos.shape[0], -1))
