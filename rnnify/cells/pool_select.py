"""GLM-5-Next's k-pool indexer, exact: the selection ``ExactCell`` computes where its spec pools
gated (``CellSpec.index_pool == "gated"``).

The math: docs/math.md §Indexer selection, pooled forms. DeepSeek-V3.2's indexer, ranking pools
of ``pool`` keys instead of keys: each row's keys, from its first real one, fall into pools of
``pool`` slots; a pool of real keys only has the key

    K_b = Σ_{j ∈ b} softmax_j(g_j + a_{j - first(b)}) k_j

(g a token's gate logits, a learned logits a slot, per feature), a query scores it as DSA scores
a key, sum_h w_h relu(c q_h . K_b), and reads the ``topk // pool`` pools ranked highest whose last
key it sees, and every key of its unfinished pool. Its index keys are ``[k, g]`` a token.

``PoolRanking`` computes it as the source's ``Glm5NextTextIndexer.forward`` does: the cell's path
(pools made once a call, read by each block of queries) and, through ``pooled_selection`` (a
prompt's queries), the capture op's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rnnify.cells.index_select import visible_keys


def pooled_selection(
    index_q, index_keys, index_weights, valid, ape, scale: float, topk: int, pool: int
) -> torch.Tensor:
    """``[B, T, N]`` boolean: the keys each query at cache positions ``N-T .. N-1`` reads.
    ``index_q [B, T, Hi, d]``, ``index_keys [B, N, 2d]`` (``[k, g]``), ``index_weights [B, T, Hi]``
    (fp32), ``valid [B, N]`` (a query at an invalid position reads nothing), ``ape [pool, d]``."""
    total, length = valid.shape[1], index_q.shape[1]
    q_pos = torch.arange(total - length, total, device=valid.device)
    return PoolRanking(index_keys, valid, ape, index_q.shape[-1], pool).read(index_q, index_weights, q_pos, scale, topk)


class PoolRanking:
    """The pools of a cache (``index_keys [B, N, 2d]``, ``valid [B, N]``), made once a call and read
    by each block of queries (``read``). Every query ranks all the pools some row has whole in one
    vector, the source's, so that ties break as its do."""

    def __init__(self, index_keys, valid, ape, head_dim: int, pool: int):
        keys, gates = index_keys.split([head_dim, head_dim], dim=-1)
        batch, total = valid.shape
        self.valid, self.pool = valid, pool
        rows = torch.arange(batch, device=valid.device)[:, None, None]
        count = (total + pool - 1) // pool
        self.first = torch.where(valid.any(-1), valid.long().argmax(-1), total)  # each row's first real key
        members = self.first[:, None, None] + torch.arange(count * pool, device=valid.device).view(1, count, pool)
        safe = members.clamp(0, total - 1)
        real = valid[rows, safe] & (members < total)  # [B, P, pool]
        whole = real.all(-1)
        members = members.masked_fill(~real, -1)
        logits = (gates[rows, safe].float() + ape.float()[None, None]).masked_fill(~real[..., None], float("-inf"))
        weights = torch.nan_to_num(logits.softmax(dim=2)).to(keys.dtype)  # a pool of no real key: 0
        pooled = (weights * keys[rows, safe]).sum(dim=2)
        kept = whole.any(0)  # pools some row has whole
        self.keys, self.members, self.whole = pooled[:, kept], members[:, kept], whole[:, kept]

    def read(self, index_q, index_weights, q_pos: torch.Tensor, scale: float, topk: int) -> torch.Tensor:
        """``[B, t, N]`` boolean: the keys each query at ``q_pos`` reads (``index_q [B, t, Hi, d]``,
        ``index_weights [B, t, Hi]``)."""
        valid, pool = self.valid, self.pool
        (batch, total), length = valid.shape, q_pos.shape[0]
        visible = visible_keys(valid, q_pos)  # [B, t, N]
        rows = torch.arange(batch, device=valid.device)[:, None, None]
        scores = F.relu(torch.matmul(index_q.float(), self.keys.transpose(-1, -2).float().unsqueeze(1)) * scale)
        scores = torch.matmul(index_weights.float().unsqueeze(-2), scores).squeeze(-2)  # [B, t, P]
        last = self.members[..., -1].clamp(0, total - 1)
        candidate = visible.gather(-1, last[:, None, :].expand(batch, length, -1)) & self.whole[:, None]
        scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
        chosen = scores.topk(min(topk // pool, scores.shape[-1]), dim=-1).indices  # [B, t, K]
        read = self.members[rows, chosen].masked_fill(~candidate.gather(-1, chosen)[..., None], -1).flatten(-2)

        # the unfinished pool: the last (visible count mod pool) keys from the row's first
        seen = visible.long().sum(-1)
        unfinished = seen.remainder(pool)
        offsets = torch.arange(pool - 1, device=valid.device)
        tail = (self.first[:, None] + seen - unfinished)[..., None] + offsets
        tail_read = (offsets < unfinished[..., None]) & (tail < total) & visible.gather(-1, tail.clamp(0, total - 1))
        read = torch.cat([read, tail.masked_fill(~tail_read, -1)], dim=-1)

        slots = torch.where(read >= 0, read, total)  # -1 (nothing) lands past the cache and is dropped
        selected = torch.zeros(batch, length, total + 1, dtype=torch.bool, device=valid.device)
        selected = selected.scatter(-1, slots, True)[..., :total]
        return selected & valid.gather(1, q_pos[None, :].expand(batch, -1))[..., None]
