"""Sliding-window softmax attention with attention sinks (StreamingLLM, Xiao et al. 2023).

The math: docs/math.md §Sliding window and sinks.

Counting only a row's real tokens (left padding is skipped), query i attends with ordinary
softmax to the last W tokens, itself included, and to the first S tokens of the sequence (the
"attention sinks"):

    A(i) = { j <= i : i - j < W  or  j < S }
    o_i  = sum_{j in A(i)} exp(s_ij) v_j / sum_{j in A(i)} exp(s_ij),      s_ij = scale * q_i . k_j

With S = 0 this is the sliding window of models trained with one (Mistral's ``sliding_window``),
for which the cell is exact; for other models it approximates full attention, and a few sinks
improve the approximation markedly.

The state is fixed in size from the first token on, per kv head: a ring buffer of the last W
keys/values (token n lives in slot n mod W), the S sink keys/values, and per row ``length``, the
number of real tokens read. ``length`` is the write position and says which slots hold a token
yet (the validity masks). Padding never advances it and is never written: it leaves the state as
it was. A sink still inside the window is counted once, as a window key.

Forms, all computing the same thing (tests hold them to ``naive_recurrent_window_attn``):

- ``naive_recurrent_*``: a plain loop over tokens, the softmax key by key with the (m, u, w)
  recurrence of docs/math.md §Softmax attention as an RNN (``naive_window_read``, which the hybrid's
  loop shares); the ground truth.
- ``parallel_*``: one masked quadratic softmax over sinks + ring + new tokens.
- ``chunk_*``: the parallel form over blocks of queries (``by_chunks``); the prefill path, but for
  the whole prompts of the next form.
- ``prompt_window_attn``: a whole unpadded prompt from the empty state through torch's
  ``scaled_dot_product_attention`` (``sdpa_window_prompt``: one causal call over the first W
  tokens, then blocks of queries over their bands), the state written from the prompt's tail. The
  hybrid's prompt, which needs each softmax's denominator too, reads every block of queries at once
  over its band of keys (``band_window_part``).
- ``step_*``: one token; ``write_step`` writes it into its ring slot and ``read_held`` reads sinks +
  ring, about 40 aten ops (a CPU step's time is its op count, docs/performance.md); the decode path off
  Triton, which the hybrid's step shares.
- ``fused_*``: the step through ``rnnify.kernels.window_attn_step``, which writes with the ring
  helpers of ``rnnify/kernels/ring.py`` and reads in one kernel; with kernels "triton", "auto" on
  CUDA, or "reference".

A model's score terms (``CellSpec.softcap``, ``alibi_slopes``, ``sink_logits``;
docs/math.md §Score terms) change the scores: the naive, parallel, chunk and step forms take them
(``terms``, None: none), distances counted in token indices; the whole-prompt and fused forms do
not, so a cell whose site carries any prefills by chunks and steps by ``step_window_attn``.

Shapes: q ``[B, Hkv, G, T, d]`` (G query heads per kv head, fp32), k/v ``[B, Hkv, T, d]``, mask
``[B, T]``; state ``keys/values [B, Hkv, W, d]`` and ``sink_keys/sink_values [B, Hkv, S, d]`` in
the model dtype, or as ``kv_dtype`` stores them (``rnnify.kernels.slots``: int8 slots are d + 1
wide), ``length [B]`` int64. Every form writes through ``slots.encode`` and reads through
``slots.decode``, new tokens included, so all of them attend to the same stored numbers. Every form
returns ``(out [B, Hkv, G, T, d_v] fp32, *new_state)``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from rnnify import kernels
from rnnify.cells.base import PER_QUERY_TERMS, SCORE_TERMS, Cell, CellSpec, every_token_real
from rnnify.cells.online_softmax import (
    ScoreTerms,
    finite_or_zero,
    online_softmax_init,
    online_softmax_update,
    readout,
    score_terms,
)
from rnnify.errors import check_int
from rnnify.kernels.ring import held_index, prompt_write, ring_index, token_index, window_write
from rnnify.kernels.slots import decode, encode, levels_and_scales, slot_width, vector_width
from rnnify.kernels.slots import kv_dtype as kv_dtype_of

# queries per block of a whole prompt's window part: each block also reads the W keys before it, so
# small blocks waste fewer masked scores (16: a 4,096-token prompt's window part in half the time of 64)
PROMPT_BLOCK = 16
# queries per call of ``sdpa_window_prompt`` past the first W: W / 8 within these bounds. Each call
# also reads the W - 1 keys before its block, so a block small against W wastes few masked scores
# (at most about 1 in 9 from W = 512 on); large enough that a call's fixed cost and the kernel's
# tiles are spread over many queries
SDPA_BLOCKS = (64, 256)


def masked_softmax_attention(
    scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor, terms: ScoreTerms | None = None
) -> torch.Tensor:
    """softmax(scores) @ values over the allowed keys (with ``terms``' sinks in the denominator); rows
    with nothing read give 0."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    if terms is not None:
        return terms.readout(scores, values)
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - finite_or_zero(m))
    return readout(p.sum(-1), p @ values)


# --------------------------------------------------------------------------- the forms


def naive_ring_write(b: int, key, value, keys, values, sink_keys, sink_values, length) -> int:
    """The naive loops' write of row b's next real token (``key``, ``value`` ``[Hkv, d]``), in place:
    token n = ``length[b]`` into ring slot n mod R (R the ring's slots) and, while n < S, sink slot
    n; ``length[b]`` advances. Returns n."""
    n = int(length[b])
    slot = n % keys.shape[2]
    key, value = encode(key, keys.dtype), encode(value, values.dtype)
    keys[b, :, slot], values[b, :, slot] = key, value
    if n < sink_keys.shape[2]:
        sink_keys[b, :, n], sink_values[b, :, n] = key, value
    length[b] += 1
    return n


def naive_window_read(q, keys, values, sink_keys, sink_values, length, scale: float, terms: ScoreTerms | None = None):
    """One query per row ``q [B, Hkv, G, d]``, the row's last token read, over what the window holds
    for it: the (m, u, w) recurrence one key at a time over the sinks no longer in the ring, then the
    ring, with per row whether it attends to each; ``terms``' sinks merged in last. Returns ``(m, u
    [B, Hkv, G], w [B, Hkv, G, d_v])``."""
    window, sinks = keys.shape[2], sink_keys.shape[2]
    slots = ring_index(length, window)
    # the held keys with, per row, whether the query attends to them and their token index
    held = [(sink_keys[:, :, j], sink_values[:, :, j], j < length - window, j) for j in range(sinks)]
    held += [(keys[:, :, s], values[:, :, s], s < length, slots[:, s]) for s in range(window)]
    m, u, w = online_softmax_init(q, q.shape[:3], vector_width(values))
    for key, value, attended, index in held:
        s = scale * (q * decode(key)[:, :, None]).sum(-1)
        if terms is not None:
            distance = torch.as_tensor(index, device=q.device) - (length - 1)
            s = terms.scores(s[..., None, None], distance.reshape(-1, 1, 1, 1, 1))[..., 0, 0]
        s = torch.where(attended[:, None, None], s, float("-inf"))
        m, u, w = online_softmax_update(m, u, w, s[..., None], decode(value)[:, :, None])
    if terms is not None:
        m, u, w = (x[:, :, :, None] for x in (m, u, w))  # [B, Hkv, G, 1]: the layout of the terms
        m, u, w = (x[:, :, :, 0] for x in terms.finish(m, u, w))
    return m, u, w


def naive_recurrent_window_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float, terms: ScoreTerms | None = None
):
    keys, values, sink_keys, sink_values, length = (t.clone() for t in (keys, values, sink_keys, sink_values, length))
    outs = []
    for t in range(q.shape[3]):
        for b in range(q.shape[0]):
            if mask[b, t]:  # padding leaves the state as it was
                naive_ring_write(b, k[b, :, t], v[b, :, t], keys, values, sink_keys, sink_values, length)
        _, u, w = naive_window_read(q[:, :, :, t], keys, values, sink_keys, sink_values, length, scale, terms)
        outs.append(readout(u, w))
    return torch.stack(outs, dim=3), keys, values, sink_keys, sink_values, length


def parallel_window_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float, terms: ScoreTerms | None = None
):
    window, sinks = keys.shape[2], sink_keys.shape[2]
    q_index = token_index(length, mask)
    # every key a new query might see: the sinks, the ring, the new tokens; each with its token index
    key_index = torch.cat([held_index(length, window, sinks), q_index], dim=1)  # [B, N]
    k, v = encode(k, keys.dtype), encode(v, values.dtype)  # as the slots store them, once
    all_keys = decode(torch.cat([sink_keys, keys, k], dim=2))
    all_values = decode(torch.cat([sink_values, values, v], dim=2))
    i, j = q_index[:, :, None], key_index[:, None, :]
    allowed = (j >= 0) & (j <= i) & ((i - j < window) | (j < sinks))  # [B, T, N]
    scores = scale * torch.einsum("bhgtd,bhnd->bhgtn", q, all_keys)
    if terms is not None:
        scores = terms.scores(scores, (j - i)[:, None, None])
    out = masked_softmax_attention(scores, allowed[:, None, None], all_values[:, :, None], terms)
    return out, *window_write(k, v, mask, keys, values, sink_keys, sink_values, length)


def by_chunks(parallel_form, q, k, v, mask, state, chunk_size: int, *options):
    """``parallel_form(q, k, v, mask, *state, *options) -> (out, *new_state)`` run over blocks of
    ``chunk_size`` queries, each block from the state the one before left: the chunked forms of the
    window family. Returns ``(out, *new_state)``."""
    outs = []
    for start in range(0, q.shape[3], chunk_size):
        end = start + chunk_size
        out, *state = parallel_form(
            q[:, :, :, start:end], k[:, :, start:end], v[:, :, start:end], mask[:, start:end], *state, *options
        )
        outs.append(out)
    return torch.cat(outs, dim=3), *state


def chunk_window_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float, block_size: int = 64, terms=None
):
    window_state = (keys, values, sink_keys, sink_values, length)
    return by_chunks(parallel_window_attn, q, k, v, mask, window_state, block_size, scale, terms)


def whole_prompt(mask: torch.Tensor, length: torch.Tensor) -> bool:
    """Is this call a whole unpadded prompt read from the empty state? (One check a prompt, not a step.)"""
    return mask.shape[1] > 1 and bool(mask.all() & (length == 0).all())


def _band_blocks(x: torch.Tensor, window: int, block: int) -> torch.Tensor:
    """``x [B, Hkv, T, d]`` as the keys each block of ``block`` queries sees: the W tokens before
    it and its own, ``[B, Hkv, blocks, d, W + block]`` (a view of x zero-padded; key n of block c is
    token c block - W + n)."""
    steps = x.shape[2]
    padded = torch.nn.functional.pad(x, (0, 0, window, -steps % block))
    return padded.unfold(2, window + block, block)


def band_window_part(q, k, v, window: int, sinks: int, scale: float, block: int):
    """The window part of a whole unpadded prompt from the empty state, ``(o [B, Hkv, G, T, d_v], u
    [B, Hkv, G, T])``: the softmax output and its denominator sum exp(s - m) (u >= 1). Every block of
    ``block`` queries at once over the W keys before it, its own and the sinks, with a mask that
    depends on positions only (no ring, no padding, no per-chunk loop). k, v fp32.

    One fused ``softmax`` gives p / u (p = exp(s - m)); its largest entry, exp(m - m) / u, gives u
    (every query sees itself, so u >= 1). The G query heads of a kv head and a block's queries are
    one ``[G block, .]`` matrix, so each product is one bmm over (B, H_kv, blocks) with no copies."""
    batch, num_kv_heads, group, steps, head_dim = q.shape
    sinks, blocks = min(sinks, steps), -(-steps // block)
    queries = torch.nn.functional.pad(scale * q, (0, 0, 0, blocks * block - steps))
    queries = queries.view(batch, num_kv_heads, group, blocks, block, head_dim).transpose(2, 3)
    queries = queries.reshape(batch, num_kv_heads, blocks, group * block, head_dim)
    first = torch.arange(blocks, device=q.device)[:, None, None] * block  # the first token of each block
    a = torch.arange(block, device=q.device)[:, None]  # the query's place in its block
    n = torch.arange(window + block, device=q.device)  # the key's place in the block's band
    allowed = (n > a) & (n <= a + window) & (first + n >= window)  # [blocks, block, W + block]
    keys, values = _band_blocks(k, window, block), _band_blocks(v, window, block).transpose(-1, -2)
    if sinks:  # a sink j is attended apart while out of the window (i - j >= W): first in every band
        sink = torch.arange(sinks, device=q.device)
        allowed = torch.cat([first + a - sink >= window, allowed], dim=-1)
        keys = torch.cat([k[:, :, None, :sinks].transpose(-1, -2).expand(-1, -1, blocks, -1, -1), keys], dim=-1)
        values = torch.cat([v[:, :, None, :sinks].expand(-1, -1, blocks, -1, -1), values], dim=-2)
    # 0 where allowed, else -inf, added: on a CPU 5x faster than masked_fill, and where is 8x faster than log
    masked = torch.where(allowed, 0.0, float("-inf"))
    scores = torch.matmul(queries, keys)  # [B, Hkv, blocks, G block, S + W + block]
    scores = scores.view(batch, num_kv_heads, blocks, group, block, -1).add_(masked[:, None])
    p = torch.softmax(scores, dim=-1).view(batch, num_kv_heads, blocks, group * block, -1)
    u = p.amax(-1).reciprocal()
    o = torch.matmul(p, values)  # w / u

    def by_token(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, blocks, G block, ...] -> [B, Hkv, G, T, ...]
        x = x.view(batch, num_kv_heads, blocks, group, block, *x.shape[4:]).transpose(2, 3)
        return x.reshape(batch, num_kv_heads, group, blocks * block, *x.shape[5:])[:, :, :, :steps]

    return by_token(o), by_token(u)


def prompt_window(q, k, v, window_state, scale: float, block: int = PROMPT_BLOCK):
    """The window part of a whole unpadded prompt from the empty state (``band_window_part``) and
    the state written from the prompt's tail (``kernels.ring.prompt_write``): ``(k, v fp32 as the
    ring holds them, o, u, window_state)``."""
    stored_k, stored_v = encode(k, window_state[0].dtype), encode(v, window_state[1].dtype)
    k, v = decode(stored_k), decode(stored_v)
    o, u = band_window_part(q, k, v, window_state[0].shape[2], window_state[2].shape[2], scale, block)
    return k, v, o, u, prompt_write(stored_k, stored_v, *window_state)


def sdpa_window_prompt(q, k, v, window: int, sinks: int, scale: float) -> torch.Tensor:
    """The window part of a whole unpadded prompt from the empty state through torch's fused
    ``scaled_dot_product_attention`` rather than a softmax of ours: ``[B, Hkv, G, T, d_v]``. Queries
    before W read every key up to theirs (one causal call); each later block of W / 8 queries
    (``SDPA_BLOCKS`` bound it) reads the sinks and the keys from W - 1 before its first query, with
    a mask: key j of query i where j <= i and i - j < W, sink j where i - j >= W (out of the window;
    within it, it is counted once as a window key). k, v fp32; q's G query heads of a kv head go as
    the kv head's group (``enable_gqa``)."""
    batch, num_kv_heads, group, steps, head_dim = q.shape
    queries = q.reshape(batch, num_kv_heads * group, steps, head_dim)
    attend = partial(torch.nn.functional.scaled_dot_product_attention, scale=scale, enable_gqa=True)
    head = min(window, steps)
    outs = [attend(queries[:, :, :head], k[:, :, :head], v[:, :, :head], is_causal=True)]
    sink = torch.arange(min(sinks, steps), device=q.device)
    block = min(max(window // 8, SDPA_BLOCKS[0]), SDPA_BLOCKS[1])
    for start in range(head, steps, block):
        end, first = min(start + block, steps), start - window + 1
        i = torch.arange(start, end, device=q.device)[:, None]
        j = torch.arange(first, end, device=q.device)
        allowed = torch.cat([i - sink >= window, (j <= i) & (i - j < window)], dim=1)
        keys = torch.cat([k[:, :, : len(sink)], k[:, :, first:end]], dim=2)
        values = torch.cat([v[:, :, : len(sink)], v[:, :, first:end]], dim=2)
        outs.append(attend(queries[:, :, start:end], keys, values, attn_mask=allowed))
    return torch.cat(outs, dim=2).view(batch, num_kv_heads, group, steps, -1)


def prompt_window_attn(q, k, v, keys, values, sink_keys, sink_values, length, scale: float):
    """A whole unpadded prompt from the empty state (``whole_prompt``): ``sdpa_window_prompt`` over the
    keys and values as the slots store them, and the state written from the prompt's tail; the window
    target's prefill path where it applies."""
    stored_k, stored_v = encode(k, keys.dtype), encode(v, values.dtype)
    out = sdpa_window_prompt(q, decode(stored_k), decode(stored_v), keys.shape[2], sink_keys.shape[2], scale)
    return out, *prompt_write(stored_k, stored_v, keys, values, sink_keys, sink_values, length)


def write_step(k, v, mask, keys, values, sink_keys, sink_values, length, overwrite: bool = False):
    """``window_write`` of one decode token in few ops, with what a read of the window needs (with
    ``overwrite``, written into ``keys`` and ``values`` themselves, ``Cell.overwrite_state``):
    ``(old_key, old_value (the ring slot's entry the token replaces, ring dtype), held keys and values
    (tuples of their parts: sinks, then ring; not joined, which would copy the whole window every
    token), empty [B, 1, 1, S + W] (held slots not attended), (keys, values, sink_keys, sink_values,
    length))``."""
    batch, num_kv_heads, window, head_dim = keys.shape
    sinks = sink_keys.shape[2]
    real, n = mask.reshape(batch, 1, 1, 1), length.reshape(batch, 1, 1, 1)
    slot = n % window
    key_index = slot.expand(-1, num_kv_heads, 1, head_dim)
    value_index = key_index if values.shape[3] == head_dim else slot.expand(-1, num_kv_heads, 1, values.shape[3])
    old_key, old_value = keys.gather(2, key_index), values.gather(2, value_index)
    k, v = encode(k, keys.dtype), encode(v, values.dtype)  # once, for the ring and the sinks
    # the slot's new entry (a padding token leaves it as it was), scattered into a copy of the ring
    # (a copy and one slot are cheaper than a where over the ring), or into the ring itself
    new_key, new_value = torch.where(real, k, old_key), torch.where(real, v, old_value)
    if overwrite:
        keys, values = keys.scatter_(2, key_index, new_key), values.scatter_(2, value_index, new_value)
    else:
        keys, values = keys.scatter(2, key_index, new_key), values.scatter(2, value_index, new_value)
    ring = torch.arange(window, device=keys.device)
    new_length = n + real
    held_keys, held_values, empty = (keys,), (values,), ring >= new_length
    if sinks:
        sink_slots = torch.arange(sinks, device=keys.device)
        into = real & (sink_slots[:, None] == n)
        sink_keys, sink_values = torch.where(into, k, sink_keys), torch.where(into, v, sink_values)
        held_keys, held_values = (sink_keys, keys), (sink_values, values)
        empty = torch.cat([sink_slots >= new_length - window, empty], dim=3)  # sinks still in the ring
    state = (keys, values, sink_keys, sink_values, new_length.view(batch))
    return old_key, old_value, held_keys, held_values, empty, state


def _held_scores(q, held_keys) -> torch.Tensor:
    """``[B Hkv, G, S + W]``: q (``[B, Hkv, G, 1, d]``) against each part of the held keys through
    ``bmm``, the parts' scores joined (a few numbers a head, where the keys are a window of them).
    int8 slots' scales multiply the scores, not every entry of the keys (``slots.levels_and_scales``)."""
    batch, num_kv_heads, group, _, head_dim = q.shape
    rows = q.reshape(batch * num_kv_heads, group, head_dim)
    scores = []
    for part in held_keys:
        levels, scales = levels_and_scales(part)
        part_scores = torch.bmm(rows, levels.reshape(batch * num_kv_heads, -1, head_dim).transpose(1, 2))
        scores.append(part_scores if scales is None else part_scores * scales.reshape(batch * num_kv_heads, 1, -1))
    return scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)


def _held_mix(p, held_values) -> torch.Tensor:
    """``p [B Hkv, G, S + W] @`` the held values, part by part: ``[B Hkv, G, d_v]`` (int8 slots' scales
    multiply p, not every entry of the values)."""
    rows, start, out = p.shape[0], 0, None
    for part in held_values:
        held = part.shape[2]
        levels, scales = levels_and_scales(part)
        weights = p.narrow(2, start, held)
        weights = weights if scales is None else weights * scales.reshape(rows, 1, held)
        mixed = torch.bmm(weights, levels.reshape(rows, held, -1))
        out, start = mixed if out is None else out + mixed, start + held
    return out


def read_held(q, held_keys, held_values, empty, scale: float):
    """One decode token's unnormalised softmax over the held keys (``write_step``'s parts), through
    ``bmm`` on ``[B Hkv, G, d]`` views: ``(w [B, Hkv, G, 1, d_v], u [B, Hkv, G, 1])``, relative to the
    scores' max m."""
    batch, num_kv_heads, group = q.shape[:3]
    scores = _held_scores(q, held_keys).view(batch, num_kv_heads, group, -1).masked_fill(empty, float("-inf"))
    m = scores.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)  # finite_or_zero in one op
    p = torch.exp((scores - m) * scale)  # the max of the scaled scores is scale m: scale > 0
    w = _held_mix(p.view(batch * num_kv_heads, group, -1), held_values)
    return w.view(batch, num_kv_heads, group, 1, -1), p.sum(-1, keepdim=True)


def window_step(q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float):
    """One decode token's window part in the fewest ops (a CPU step's time is its op count,
    docs/performance.md), for the hybrid: ``write_step`` and ``read_held``, with the token pushed out
    of the ring for the memory. Returns ``(w, u, old_key, old_value (fp32), leaves [B, 1, 1, 1] (a
    real token arrived and the one pushed out is not a sink), window_state)``."""
    old_key, old_value, held_keys, held_values, empty, state = write_step(
        k, v, mask, keys, values, sink_keys, sink_values, length
    )
    w, u = read_held(q, held_keys, held_values, empty, scale)
    batch = mask.shape[0]
    leaves = mask.reshape(batch, 1, 1, 1) & (length.reshape(batch, 1, 1, 1) >= keys.shape[2] + sink_keys.shape[2])
    return w, u, decode(old_key), decode(old_value), leaves, state


def steady_length(mask: torch.Tensor, length: torch.Tensor, window: int, sinks: int) -> int | None:
    """n when a decode token may take ``steady_window_step``, else None: eager on a CPU (where reading
    ``mask`` and ``length`` on the host costs no op; compiled or exported steps keep one graph), every
    row real and every row holding the same n >= W + S tokens, so the ring is full, the sinks are
    fixed, the token in slot n mod W leaves and is no sink, and every held slot is attended."""
    if not every_token_real(mask):
        return None
    counts = length.tolist()
    n = counts[0]
    return None if n < window + sinks or any(c != n for c in counts) else n


def steady_window_step(q, k, v, keys, values, sink_keys, sink_values, length, n: int, scale: float):
    """One decode token's window part in the steady state (``steady_length``), in the fewest ops: the
    token is written into slot n mod W with ``slice_scatter``, no mask is needed, and the softmax is
    normalised in one op, its largest probability giving the statistic the hybrid needs, 1 / u =
    1 / sum exp(s - m) (the max's own term is exp(0)). Returns ``(o [B, Hkv, G, 1, d_v], p_max [B, Hkv,
    G, 1, 1] (= 1 / u, shaped to scale o), old_key, old_value (fp32, [B, Hkv, 1, d]), window_state)``."""
    batch, num_kv_heads, group = q.shape[:3]
    slot = n % keys.shape[2]
    old_key, old_value = decode(keys.narrow(2, slot, 1)), decode(values.narrow(2, slot, 1))
    keys = keys.slice_scatter(encode(k, keys.dtype), 2, slot, slot + 1)
    values = values.slice_scatter(encode(v, values.dtype), 2, slot, slot + 1)
    held_keys, held_values = ((sink_keys, keys), (sink_values, values)) if sink_keys.shape[2] else ((keys,), (values,))
    p = torch.softmax(_held_scores(q, held_keys) * scale, dim=-1)
    o = _held_mix(p, held_values)
    p_max = p.amax(-1, keepdim=True)
    state = (keys, values, sink_keys, sink_values, length + 1)
    return (
        o.view(batch, num_kv_heads, group, 1, -1),
        p_max.view(batch, num_kv_heads, group, 1, 1),
        old_key,
        old_value,
        state,
    )


def window_output(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``readout(u, w)`` in fewer ops: u >= 1 wherever a key was read (the max's own term is 1),
    and u = 0 only with w = 0, so clamping u at 1 changes nothing."""
    return w / u.clamp_min(1.0)[..., None]


def step_window_attn(
    q,
    k,
    v,
    mask,
    keys,
    values,
    sink_keys,
    sink_values,
    length,
    scale: float,
    terms: ScoreTerms | None = None,
    overwrite: bool = False,
):
    """One decode token: ``write_step``, ``read_held``, normalised; the window target's decode path off
    kernels. With ``terms``, ``scored_read`` reads the held keys instead; ``overwrite``: ``write_step``'s."""
    *_, held_keys, held_values, empty, state = write_step(
        k, v, mask, keys, values, sink_keys, sink_values, length, overwrite
    )
    if terms is not None:
        return scored_read(q, held_keys, held_values, empty, state, scale, terms), *state
    return window_output(*read_held(q, held_keys, held_values, empty, scale)), *state


def scored_read(q, held_keys, held_values, empty, state, scale: float, terms: ScoreTerms) -> torch.Tensor:
    """One decode token's softmax over ``write_step``'s held keys (sinks, then ring) with ``terms``, the
    ALiBi distance from each slot's token to the token just read: ``[B, Hkv, G, 1, d_v]``."""
    keys, _, sink_keys, _, length = state
    index = held_index(length, keys.shape[2], sink_keys.shape[2])  # [B, S + W]
    distance = (index - (length[:, None] - 1))[:, None, None, None]
    held_keys, held_values = torch.cat(held_keys, dim=2), torch.cat(held_values, dim=2)
    scores = scale * torch.einsum("bhgtd,bhnd->bhgtn", q, decode(held_keys))
    scores = terms.scores(scores, distance).masked_fill(empty[:, :, :, None], float("-inf"))
    return terms.readout(scores, decode(held_values)[:, :, None])


def grouped_window_attn_step(q, k, v, mask, window_state, scale: float, backend: str, return_stats: bool = False):
    """``rnnify.kernels.window_attn_step`` (which writes the sinks and the ring and reads them in one
    kernel) on the cells' layout, one decode token with q ``[B, Hkv, G, 1, d]``: the op's ``(o [B, 1,
    H, d_v], window_state)``, with ``return_stats`` then ``(m, u)`` ``[B, 1, H]``."""
    batch, num_kv_heads, group, _, head_dim = q.shape  # T == 1; the op takes [B, 1, heads, d]
    keys, values, sink_keys, sink_values, length = window_state
    return kernels.window_attn_step(
        q.reshape(batch, 1, num_kv_heads * group, head_dim),
        k.transpose(1, 2),
        v.transpose(1, 2),
        keys,
        values,
        length,
        sink_keys,
        sink_values,
        mask,
        scale,
        return_stats=return_stats,
        backend=backend,
    )


def fused_window_attn_step(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float, backend: str = "auto"
):
    out, state = grouped_window_attn_step(q, k, v, mask, (keys, values, sink_keys, sink_values, length), scale, backend)
    return out.reshape(*q.shape[:4], -1), *state


# --------------------------------------------------------------------------- the cell


class WindowCell(Cell):
    """Softmax over the last W tokens and the first S (attention sinks), with constant memory.

    ``window=None`` takes the model's own sliding window (``spec.window``); with it and no sinks
    the cell is exact. ``block_size`` is the number of queries per block in a prefill. ``kv_dtype``
    ("float16", "bfloat16" or "int8"; None: the model dtype) is how the sinks and the ring store
    their keys and values (``rnnify.kernels.slots``): more tokens in the same bytes.
    """

    target = "window"
    state_names = ("keys", "values", "sink_keys", "sink_values", "length")
    own_forms_without_triton = frozenset({"decode"})

    score_terms = frozenset(SCORE_TERMS) - PER_QUERY_TERMS  # what queries bring reaches no window's ring

    def __init__(
        self,
        spec: CellSpec,
        window: int | None = None,
        sinks: int = 0,
        block_size: int = 64,
        kv_dtype: str | None = None,
    ):
        super().__init__(spec)
        if window is None and spec.window is None:
            raise ValueError(
                "this attention has no sliding window of its own: give window=N (--window N) "
                "(the number of recent tokens each query attends to)"
            )
        self.window = check_int("window", spec.window if window is None else window, 1)
        self.sinks = check_int("sinks", sinks, 0)
        self.block_size = check_int("block_size", block_size, 1)
        self.terms = score_terms(spec)
        self.kv_dtype = kv_dtype
        self.storage = kv_dtype_of(kv_dtype)

    @property
    def exact_span(self) -> int:
        return self.window + self.sinks

    def options(self) -> dict[str, Any]:
        options = {"window": self.window, "sinks": self.sinks, "block_size": self.block_size}
        return options | ({"kv_dtype": self.kv_dtype} if self.kv_dtype is not None else {})

    def describe(self) -> str:
        storage = f", stored as {self.kv_dtype}" if self.kv_dtype is not None else ""
        return f"{self.window} tokens" + (f" + {self.sinks} sinks" if self.sinks else "") + storage

    def fused_ops(self) -> dict[str, str]:
        # the op computes no score terms, and reads the ring in the model dtype
        return {"decode": "window_attn_step"} if self.terms is None and self.storage is None else {}

    def init_state(self, batch_size, device, dtype):
        spec, dtype = self.spec, self.storage or dtype

        def buffer(slots: int, dim: int) -> torch.Tensor:
            width = slot_width(dim, dtype)
            return torch.zeros(batch_size, spec.num_kv_heads, slots, width, device=device, dtype=dtype)

        return (
            buffer(self.window, spec.head_dim),
            buffer(self.window, spec.value_dim),
            buffer(self.sinks, spec.head_dim),
            buffer(self.sinks, spec.value_dim),
            torch.zeros(batch_size, device=device, dtype=torch.long),
        )

    def overwrites_state(self, x: torch.Tensor) -> bool:
        return self.backend(x, 1) is None  # the ring write of ``write_step``; the fused op copies

    def forward(self, q, k, v, mask, keys, values, sink_keys, sink_values, length):
        batch, _, steps, _ = q.shape
        grouped = q.float().reshape(batch, self.spec.num_kv_heads, self.spec.group_size, steps, -1)
        state = (keys, values, sink_keys, sink_values, length)
        mask = mask.to(torch.bool)
        backend = self.backend(q, steps)
        if self.terms is not None and steps == 1:
            out, *state = step_window_attn(
                grouped, k, v, mask, *state, self.spec.scale, self.terms, overwrite=self.overwrite_state
            )
        elif self.terms is not None:
            out, *state = chunk_window_attn(grouped, k, v, mask, *state, self.spec.scale, self.block_size, self.terms)
        elif steps == 1 and backend is not None:
            out, *state = fused_window_attn_step(grouped, k, v, mask, *state, self.spec.scale, backend)
        elif steps == 1:
            out, *state = step_window_attn(grouped, k, v, mask, *state, self.spec.scale, overwrite=self.overwrite_state)
        elif whole_prompt(mask, length):
            out, *state = prompt_window_attn(grouped, k, v, *state, self.spec.scale)
        else:
            out, *state = chunk_window_attn(grouped, k, v, mask, *state, self.spec.scale, self.block_size)
        return out.reshape(batch, self.spec.num_heads, steps, -1).to(q.dtype), *state
