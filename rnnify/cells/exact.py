"""Exact softmax attention as an RNN ("Attention as an RNN", Feng et al. 2024).

The math: docs/math.md §Softmax attention as an RNN.

For a query q and keys k_1..k_n with scores s_i = scale * q . k_i, softmax attention is the
many-to-one recurrence over (running max m, denominator u, numerator w):

    m_i = max(m_{i-1}, s_i)
    u_i = u_{i-1} exp(m_{i-1} - m_i) + exp(s_i - m_i)
    w_i = w_{i-1} exp(m_{i-1} - m_i) + v_i exp(s_i - m_i)
    o   = w_n / u_n

Causal self-attention has a new query every token, so the state that makes this exact is every
past key and value (per kv head): memory grows with the context. Each call appends the new keys
and reads the cache through ``F.scaled_dot_product_attention`` (``sdpa_softmax_attn``: the fused
kernel the original ran, which computes this recurrence blockwise), queries in blocks, so scores
for the whole context are never materialised at once. A model's own sliding window keeps only the
last ``window`` keys, and then the state is bounded; so does its own chunked attention (``chunk``,
Llama 4's), whose cache keeps valid only the keys of the current chunk (``_current_chunk``).

Where an indexer chooses the keys (DeepSeek-V3.2's sparse attention, ``CellSpec.index_topk``), the
state keeps its index keys too and each query reads only its selection
(``selected_softmax_attn``, ranking by ``rnnify.cells.index_select``; docs/math.md §Indexer selection);
where it ranks pools of keys (Qwen4-Exp's QSA, GLM-5-Next's: ``CellSpec.index_pool``),
``pooled_selected_softmax_attn``.

A model's score terms (``CellSpec.softcap``, ``alibi_slopes``, ``sink_logits``, and what each
query brings: ``relative_extent``, ``query_sinks``; docs/math.md §Score terms) change the scores
SDPA would compute, so a cell whose site carries any runs ``scored_softmax_attn``: the same blocks
of queries, the scores computed here. The terms each query brings are inputs of the call with the
queries: ``relative`` ``[B, H, T, E]`` (Inkling's relative bias) and ``sinks`` ``[B, H, T(, 1)]``
(Inkling 2's sink logits).

Forms, all computing the same thing: ``naive_recurrent_softmax_attn`` (the recurrence one key at
a time: the ground truth), ``parallel_softmax_attn`` (masked quadratic softmax over the cache) and
``softmax_attention_rnn`` (the recurrence a block of keys at a time, in PyTorch) and
``sdpa_softmax_attn`` (the cell's path, prefill and decode). All take queries ``[B, H, T, d]`` of
cache positions ``N-T .. N-1``, keys/values ``[B, Hkv, N, *]`` and ``valid [B, N]``, return
``[B, H, T, Dv]`` in the values' dtype, and give 0 where no key is allowed; all but the SDPA form
accumulate in fp32 (SDPA accumulates as the original did). The naive, parallel and scored forms
also take ``terms`` (``ScoreTerms``, None: none) and what the queries bring (``relative``, ``sinks``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rnnify.cells.base import SCORE_TERMS, Cell, CellSpec
from rnnify.cells.index_select import BlockRanking, index_scores, selection, visible_keys
from rnnify.cells.online_softmax import (
    ScoreTerms,
    chunk_of,
    finite_or_zero,
    online_softmax_init,
    online_softmax_update,
    readout,
    real_positions,
    score_terms,
)
from rnnify.cells.pool_select import PoolRanking
from rnnify.errors import check_int


def _distance(valid: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, 1, 1, T, N]``: j - i in real tokens from the query at cache position N-T+t to key j (ALiBi's)."""
    position = real_positions(valid)
    return (position[:, None, :] - position[:, -length:, None])[:, None, None]


def _grouped(q, num_kv_heads: int, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Queries ``[B, H, T, d]`` as ``[B, Hkv, G, T, d]`` (the G query heads of a kv head together, as
    they read its keys), times ``scale``, in ``dtype``."""
    batch, num_heads, length, _ = q.shape
    return q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, length, -1).to(dtype) * scale


def _per_query(relative, sinks, num_kv_heads: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What queries bring (``ScoreTerms``): a relative bias ``[B, H, T, E]`` as ``[B, Hkv, G, T, E]``,
    sink logits ``[B, H, T]`` (or ``[B, H, T, 1]``) as ``[B, Hkv, G, T]``; None stays None."""
    if relative is not None:
        batch, num_heads, length, extent = relative.shape
        relative = relative.reshape(batch, num_kv_heads, num_heads // num_kv_heads, length, extent)
    if sinks is not None:
        batch, num_heads, length = sinks.shape[:3]
        sinks = sinks.reshape(batch, num_kv_heads, num_heads // num_kv_heads, length)
    return relative, sinks


def _by_query_head(out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out [B, Hkv, G, T, d_v]`` back in the forms' layout ``[B, H, T, d_v]``, in the values' dtype."""
    batch, num_kv_heads, group, length, _ = out.shape
    return out.reshape(batch, num_kv_heads * group, length, -1).to(values.dtype)


def _query_blocks(length: int, total: int, window: int | None, block_size: int):
    """The blocks of ``block_size`` queries of cache positions ``N-T .. N-1`` and the keys each may
    see: ``(start, end, first, stop)``, queries ``start:end`` of the T and keys ``first:stop`` of
    the N (none after the block's last query, none before its first query's window)."""
    for start in range(0, length, block_size):
        end = min(start + block_size, length)
        first = 0 if window is None else max(0, total - length + start - window + 1)
        yield start, end, first, total - length + end


def _block_allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[t, n]``: may the query at cache position ``q_pos[i]`` see the key at ``k_pos[j]`` (causal, window)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
    return allowed


def _chunk_allowed(of: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[B, 1, t, n]``: is the key at cache position ``k_pos[j]`` in the chunk of the query at
    ``q_pos[i]`` (``of``: ``chunk_of``)."""
    return (of[:, q_pos, None] == of[:, None, k_pos])[:, None]


def _chunk_start(of: torch.Tensor, q_first: int) -> int:
    """The first cache position that any row's query at ``q_first`` may read: its chunk's start (the
    chunks grow along the cache, so that is the count of positions in earlier chunks)."""
    return int((of < of[:, q_first : q_first + 1]).sum(1).min())


def _queries_and_mask(q, keys, valid, scale: float, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the references over the whole cache start from: the queries grouped and scaled
    (``_grouped``) and ``[B, 1, 1, T, N]``, may the query at cache position N-T+t see key j (causal,
    window, padding)."""
    length, total = q.shape[2], keys.shape[2]
    q_pos, k_pos = torch.arange(total - length, total, device=q.device), torch.arange(total, device=q.device)
    return _grouped(q, keys.shape[1], scale), _block_allowed(q_pos, k_pos, window) & valid[:, None, None, None, :]


def naive_recurrent_softmax_attn(
    q, keys, values, valid, scale: float, window: int | None = None, terms: ScoreTerms | None = None,
    relative=None, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """The (m, u, w) recurrence one cached key at a time, for every query at once."""
    q, allowed = _queries_and_mask(q, keys, valid, scale, window)
    distance = _distance(valid, q.shape[3])
    relative, sinks = _per_query(relative, sinks, keys.shape[1])
    m, u, w = online_softmax_init(q, q.shape[:-1], values.shape[-1])
    for j in range(keys.shape[2]):
        s = (q * keys[:, :, None, None, j].float()).sum(-1)[..., None]  # [B, Hkv, G, T, 1]
        if terms is not None:
            s = terms.scores(s, distance[..., j : j + 1], relative)
        s = s.masked_fill(~allowed[..., j : j + 1], float("-inf"))
        m, u, w = online_softmax_update(m, u, w, s, values[:, :, None, j : j + 1].float())
    if terms is not None:
        m, u, w = terms.finish(m, u, w, sinks)
    return _by_query_head(readout(u, w), values)


def parallel_softmax_attn(
    q, keys, values, valid, scale: float, window: int | None = None, terms: ScoreTerms | None = None,
    relative=None, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """Masked quadratic softmax: all ``[T, N]`` scores at once."""
    q, allowed = _queries_and_mask(q, keys, valid, scale, window)
    s = torch.einsum("bhgtd,bhnd->bhgtn", q, keys.float())
    if terms is not None:
        relative, sinks = _per_query(relative, sinks, keys.shape[1])
        s = terms.scores(s, _distance(valid, q.shape[3]), relative).masked_fill(~allowed, float("-inf"))
        return _by_query_head(terms.readout(s, values[:, :, None].float(), sinks), values)
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - finite_or_zero(m))
    u = p.sum(-1, keepdim=True)
    out = torch.where(u > 0, (p / u.clamp_min(torch.finfo(u.dtype).tiny)) @ values[:, :, None].float(), 0.0)
    return _by_query_head(out, values)


def softmax_attention_rnn(
    q, keys, values, valid, scale: float, window: int | None = None, block_size: int = 512
) -> torch.Tensor:
    """Causal softmax attention of the last T cached positions, by the (m, u, w) recurrence.

    q ``[B, H, T, d]`` are the queries of cache positions ``N-T .. N-1``; keys/values
    ``[B, Hkv, N, d]``; valid ``[B, N]`` marks real (not padding) keys. Accumulates in fp32.
    """
    length, total = q.shape[2], keys.shape[2]
    q = _grouped(q, keys.shape[1], scale)
    m, u, w = online_softmax_init(q, q.shape[:-1], values.shape[-1])
    q_pos = torch.arange(total - length, total, device=q.device)
    first = 0 if window is None else max(0, total - length - window + 1)
    for start in range(first - first % block_size, total, block_size):
        end = min(start + block_size, total)
        allowed = _block_allowed(q_pos, torch.arange(start, end, device=q.device), window)
        allowed = allowed & valid[:, None, None, None, start:end]  # [B, 1, 1, T, n]
        s = torch.einsum("bhgtd,bhnd->bhgtn", q, keys[:, :, start:end].float())
        s = s.masked_fill(~allowed, float("-inf"))
        m, u, w = online_softmax_update(m, u, w, s, values[:, :, None, start:end].float())
    return _by_query_head(readout(u, w), values)


def sdpa_softmax_attn(
    q, keys, values, valid, scale: float, window: int | None = None, block_size: int = 512, chunk: int | None = None
) -> torch.Tensor:
    """``softmax_attention_rnn``'s result through ``F.scaled_dot_product_attention``, the fused kernel
    the original model ran: the cell's path (a few ops a layer where the recurrence dispatches
    dozens, docs/performance.md §Where a decode step's time goes).

    Queries go in blocks of ``block_size``, each over the keys it may see (none after its last
    query, none before its window), so the boolean mask is at most ``block_size`` x N, as the
    original's. Rows with no key allowed are 0, as in the recurrence (SDPA would give NaN). With
    ``chunk``, a query reads only the keys of its own chunk (``_chunk_allowed``).
    """
    length, total = q.shape[2], keys.shape[2]
    gqa = q.shape[1] != keys.shape[1]
    if length == total > 1 and window is None and (chunk is None or total <= chunk) and bool(valid.all()):
        # a whole unpadded prompt: plain causal attention, which the kernel computes without any
        # mask and skips the blocks above the diagonal (one check a prompt, not a step)
        out = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), is_causal=True, scale=scale, enable_gqa=gqa
        )
        return out.to(values.dtype)
    # a decode token reads its chunk's keys, the only valid ones ExactCell keeps: no chunk mask then
    of = chunk_of(valid, chunk) if chunk is not None and length > 1 else None
    outs = []
    for start, end, first, stop in _query_blocks(length, total, window, block_size):
        if of is not None:
            first = _chunk_start(of, total - length + start)
        allowed = valid[:, None, None, first:stop]  # [B, 1, t, n]
        if length > 1:  # one decode token sees every key of its block (which starts at its window): only padding
            q_pos = torch.arange(total - length + start, stop, device=q.device)
            k_pos = torch.arange(first, stop, device=q.device)
            allowed = _block_allowed(q_pos, k_pos, window) & allowed
            if of is not None:
                allowed = allowed & _chunk_allowed(of, q_pos, k_pos)
        out = F.scaled_dot_product_attention(
            _span(q, start, end),
            _span(keys, first, stop).to(q.dtype),
            _span(values, first, stop).to(q.dtype),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=gqa,
        )
        outs.append(torch.where(allowed.any(-1, keepdim=True), out, 0.0))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.to(values.dtype)


def scored_softmax_attn(
    q,
    keys,
    values,
    valid,
    scale: float,
    terms: ScoreTerms,
    window: int | None = None,
    block_size: int = 512,
    chunk: int | None = None,
    relative: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sdpa_softmax_attn``'s blocks of queries with the scores computed here, so that ``terms``
    change them: the cell's path, prefill and decode, where its site carries score terms. Each block
    of ``block_size`` queries reads the keys it may see, its ``[t, n]`` scores at once (fp32, or the
    queries' dtype if wider); with ``chunk``, those of its own chunk; ``relative`` ``[B, H, T, E]``
    and ``sinks`` ``[B, H, T]``: each query's relative bias and sink logit (``ScoreTerms``)."""
    length, total = q.shape[2], keys.shape[2]
    q = _grouped(q, keys.shape[1], scale, torch.promote_types(q.dtype, torch.float32))
    relative, sinks = _per_query(relative, sinks, keys.shape[1])
    position = real_positions(valid)
    # a decode token reads its chunk's keys, the only valid ones ExactCell keeps: no chunk mask then
    of = chunk_of(valid, chunk) if chunk is not None and length > 1 else None
    outs = []
    for start, end, first, stop in _query_blocks(length, total, window, block_size):
        if of is not None:
            first = _chunk_start(of, total - length + start)
        q_pos, k_pos = (
            torch.arange(total - length + start, stop, device=q.device),
            torch.arange(first, stop, device=q.device),
        )
        allowed = _block_allowed(q_pos, k_pos, window)
        allowed = allowed & valid[:, None, None, None, first:stop]  # [B, 1, 1, t, n]
        if of is not None:
            allowed = allowed & _chunk_allowed(of, q_pos, k_pos)[:, None]
        s = torch.einsum("bhgtd,bhnd->bhgtn", q[:, :, :, start:end], keys[:, :, first:stop].to(q.dtype))
        distance = position[:, None, first:stop] - position[:, total - length + start : stop, None]
        near = None if relative is None else relative[:, :, :, start:end]
        s = terms.scores(s, distance[:, None, None], near).masked_fill(~allowed, float("-inf"))
        block_sinks = None if sinks is None else sinks[..., start:end]
        outs.append(terms.readout(s, values[:, :, None, first:stop].to(q.dtype), block_sinks))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return _by_query_head(out, values)


# the most bytes of fp32 index scores a block of queries holds at once in ``selected_softmax_attn``
# (the source ranks a whole prompt at once: [B, T, Hi, T])
_SCORES_BYTES = 1 << 28


def selected_softmax_attn(
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
    block_size: int = 512,
    terms: ScoreTerms | None = None,
) -> torch.Tensor:
    """Softmax attention of each query over the keys its indexer selects (``rnnify.cells.index_select``):
    the cell's path where its spec has an indexer. ``block_size`` queries at a time, fewer where a
    block's fp32 index scores ``[B, t, Hi, N]`` would pass ``_SCORES_BYTES``; each ranks the whole
    cache. With ``terms`` (sink logits, HY-V4's) the scores are computed here and the sinks join each
    denominator."""
    total = keys.shape[2]
    block_size = max(1, min(block_size, _SCORES_BYTES // (q.shape[0] * index_q.shape[2] * total * 4)))

    def reads(start: int, end: int, q_pos: torch.Tensor) -> torch.Tensor:
        allowed = visible_keys(valid, q_pos)  # [B, t, N]
        scores = index_scores(index_q[:, start:end], index_keys, index_weights[:, start:end], index_scale)
        return selection(scores, allowed, topk)

    return _attend_selected(q, keys, values, scale, reads, block_size, terms)


def pooled_selected_softmax_attn(
    q,
    keys,
    values,
    valid,
    spec: CellSpec,
    index_q,
    index_keys,
    index_weights,
    pool_weight,
    block_size: int = 512,
    terms: ScoreTerms | None = None,
) -> torch.Tensor:
    """``selected_softmax_attn`` for an indexer that ranks pools of ``spec.index_block`` keys
    (``spec.index_pool``: Qwen4-Exp's QSA, ``rnnify.cells.index_select.BlockRanking``, or GLM-5-Next's,
    ``rnnify.cells.pool_select.PoolRanking``; ``pool_weight`` the pool keys' learned tensor): the
    pools made once, ranked by each block of queries."""
    head_dim, topk, pool = index_q.shape[-1], spec.index_topk, spec.index_block
    if spec.index_pool == "mean":
        ranking = BlockRanking(index_keys, valid, head_dim, pool_weight, spec.index_eps, pool, topk)
        count = ranking.capacity

        def reads(start: int, end: int, q_pos: torch.Tensor) -> torch.Tensor:
            return ranking.read(index_q[:, start:end], q_pos)
    else:
        pools = PoolRanking(index_keys, valid, pool_weight, head_dim, pool)
        count = pools.keys.shape[1]

        def reads(start: int, end: int, q_pos: torch.Tensor) -> torch.Tensor:
            return pools.read(index_q[:, start:end], index_weights[:, start:end], q_pos, spec.index_scale, topk)

    block_size = max(1, min(block_size, _SCORES_BYTES // (q.shape[0] * index_q.shape[2] * max(1, count) * 4)))
    return _attend_selected(q, keys, values, spec.scale, reads, block_size, terms)


def _attend_selected(q, keys, values, scale: float, reads, block_size: int, terms: ScoreTerms | None) -> torch.Tensor:
    """Softmax attention over the keys ``reads(start, end, q_pos)`` gives the queries ``start:end``
    (``[B, t, N]``), ``block_size`` queries at a time."""
    length, total = q.shape[2], keys.shape[2]
    gqa = q.shape[1] != keys.shape[1]
    outs = []
    for start in range(0, length, block_size):
        end = min(start + block_size, length)
        q_pos = torch.arange(total - length + start, total - length + end, device=q.device)
        read = reads(start, end, q_pos)[:, None]  # [B, 1, t, N]
        if terms is not None:
            dtype = torch.promote_types(q.dtype, torch.float32)
            s = torch.einsum(
                "bhgtd,bhnd->bhgtn", _grouped(q[:, :, start:end], keys.shape[1], scale, dtype), keys.to(dtype)
            )
            s = terms.scores(s, torch.zeros((), dtype=dtype)).masked_fill(~read[:, :, None], float("-inf"))
            outs.append(_by_query_head(terms.readout(s, values[:, :, None].to(dtype)), values))
            continue
        out = F.scaled_dot_product_attention(
            q[:, :, start:end], keys.to(q.dtype), values.to(q.dtype), attn_mask=read, scale=scale, enable_gqa=gqa
        )
        outs.append(torch.where(read.any(-1, keepdim=True), out, 0.0))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.to(values.dtype)


def _span(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``x[:, :, start:stop]``, or x itself when that is all of it (a whole slice is still an op a step)."""
    return x if (start, stop) == (0, x.shape[2]) else x[:, :, start:stop]


class ExactCell(Cell):
    """Softmax attention, unchanged, as an RNN over a growing key/value state."""

    target = "exact"
    state_names = ("keys", "values", "valid")
    grows_with_context = True

    score_terms = frozenset(SCORE_TERMS)
    computes_chunks = True
    computes_selection = True

    def __init__(self, spec: CellSpec, block_size: int = 512):
        super().__init__(spec)
        self.block_size = check_int("block_size", block_size)
        self.terms = score_terms(spec)
        if spec.selects:  # the indexer's keys too (rnnify.cells.index_select)
            self.state_names = (*type(self).state_names, "index_keys")

    def options(self) -> dict[str, Any]:
        return {"block_size": self.block_size}

    def init_state(self, batch_size, device, dtype):
        spec = self.spec
        index = (torch.zeros(batch_size, 0, spec.index_dim, device=device, dtype=dtype),) if spec.selects else ()
        return (
            torch.zeros(batch_size, spec.num_kv_heads, 0, spec.head_dim, device=device, dtype=dtype),
            torch.zeros(batch_size, spec.num_kv_heads, 0, spec.value_dim, device=device, dtype=dtype),
            torch.zeros(batch_size, 0, device=device, dtype=torch.bool),
            *index,
        )

    def _bytes_per_token(self, dtype):
        spec = self.spec
        index = spec.index_dim * dtype.itemsize if spec.selects else 0
        return spec.num_kv_heads * (spec.head_dim + spec.value_dim) * dtype.itemsize + 1 + index

    def forward(
        self,
        q, k, v, mask, keys, values, valid, index_keys=None,
        *, index_q=None, index_k=None, index_weights=None, pool_weight=None, relative=None, sinks=None,
    ):  # fmt: skip
        keys = torch.cat([keys, k.to(keys.dtype)], dim=2)
        values = torch.cat([values, v.to(values.dtype)], dim=2)
        valid = torch.cat([valid, mask.to(torch.bool)], dim=1)
        spec = self.spec
        if spec.selects:  # an indexer chooses the keys (the spec allows no window or chunk with it, sinks at most)
            index_keys = torch.cat([index_keys, index_k.to(index_keys.dtype)], dim=1)
            if spec.index_pool is not None:
                out = pooled_selected_softmax_attn(
                    q, keys, values, valid, spec, index_q, index_keys, index_weights, pool_weight,
                    self.block_size, self.terms,
                )  # fmt: skip
            else:
                out = selected_softmax_attn(
                    q, keys, values, valid, spec.scale, index_q, index_keys, index_weights,
                    spec.index_topk, spec.index_scale, self.block_size, self.terms,
                )  # fmt: skip
            return out, keys, values, valid, index_keys
        if self.terms is None:
            out = sdpa_softmax_attn(q, keys, values, valid, spec.scale, spec.window, self.block_size, spec.chunk)
        else:
            out = scored_softmax_attn(
                q, keys, values, valid, spec.scale, self.terms, spec.window, self.block_size, spec.chunk,
                relative, sinks,
            )  # fmt: skip
        if spec.chunk is not None:
            valid = _current_chunk(valid, spec.chunk)
            if keys.shape[2] > spec.chunk:  # fewer than chunk valid: packed last, keeping the last chunk keeps them
                keys, values, valid = _valid_last(keys, values, valid)
        kept = spec.keys_read
        if kept is not None and keys.shape[2] > kept:
            keys, values, valid = keys[:, :, -kept:], values[:, :, -kept:], valid[:, -kept:]
        return out, keys, values, valid

    def describe(self) -> str:
        spec = self.spec
        if spec.index_block is not None:
            pools = spec.index_topk // spec.index_block
            return f"reads the {pools} pools of {spec.index_block} keys its indexer selects and its latest keys"
        return f"reads the {spec.index_topk} keys its indexer selects" if spec.selects else ""

    def state_nbytes(self, length, batch_size=1, dtype=torch.float32):
        if self.spec.keys_read is not None:
            length = min(length, self.spec.keys_read)
        return super().state_nbytes(length, batch_size, dtype)


def _valid_last(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor):
    """Each row's cache with its valid entries moved after the others, in their order: padding between
    them (a later prompt left-padded) would otherwise spread a chunk over more positions than it has
    keys."""
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices
    index = order[:, None, :, None]
    return (
        keys.gather(2, index.expand_as(keys)),
        values.gather(2, index.expand_as(values)),
        valid.gather(1, order),
    )


def _current_chunk(valid: torch.Tensor, chunk: int) -> torch.Tensor:
    """``valid`` with only the keys of each row's unfinished chunk left valid (none once its last
    chunk is full): the keys a later token may read, counted from a chunk's start, so that the
    count of valid keys is the next token's place in its chunk."""
    last = real_positions(valid)[:, -1:]  # each row's last real token (-1: none yet)
    unfinished = (last + 1) % chunk != 0
    return valid & (chunk_of(valid, chunk) == last.clamp_min(0) // chunk) & unfinished
