"""Token-selection caches: exact softmax over the sinks, a recent window and K selected past tokens
(H2O, Zhang et al. 2023; SnapKV, Li et al. 2024; the sinks of StreamingLLM, Xiao et al. 2023).

The math: docs/math.md §Token-selection caches.

Counting only a row's real tokens (left padding is skipped), with chunk C, window W, S sinks and a
budget of K selected tokens, query i of the chunk that starts at c(i) = C floor(i / C) attends with
ordinary softmax to

    A(i) = { j < S } ∪ R(i) ∪ P_c(i),          R(i) = { j : c(i) - W < j <= i },

the sinks, the recent tokens (its last W and those that left the window since its chunk began, at
most W + C - 1: they stay readable until the boundary decides their fate, so P is fixed inside a
chunk and a chunk's queries can be read at once) and the set P_c chosen at the chunk's boundary.
Every query adds its attention,
summed over the G query heads of its kv head, to the score of each token it read:

    sigma_j += [i observes] sum_g softmax_{A(i)}(s_igj),        s_igj = scale * q_ig . k_j

where query i observes if i mod C >= C - ``observation`` (the last queries of each chunk; all of
them by default). At every boundary p (a multiple of C), the tokens leaving the recent set, L_p =
{ j >= S : p - C - W < j <= p - W }, compete with P_{p-C} for the K slots: each candidate's merit is
its score pooled over the held tokens within ``pool // 2`` positions, sinks aside (the mean over
``pool`` positions, counting those not held as 0, or the max; ``pool=1``: the score itself), and the K of
highest merit stay (ties: the newer token). Policy ``mass`` (H2O) keeps scores for as long as a
token is held, so they are the attention mass accumulated since it arrived; ``snapkv`` sets every
score to 0 after each boundary, so the next decision weighs the attention of the next chunk's
observation window only (SnapKV's rule, applied at every boundary instead of once at the end of a
prompt: where a prompt ends depends on how it was fed, a boundary on positions alone).

Why step == prefill and split == whole: boundaries, observers and the tokens that leave are
functions of positions alone, and every form reads a chunk's queries against the same held set
(P fixed inside a chunk, R(i) causal), adds the same attention to the same scores and decides at
the same boundaries, in position order. A prefill runs chunk by chunk of absolute positions (a
prompt that starts mid-chunk finishes that chunk first), so a decode step is a chunk read one
query at a time: the scores differ by float rounding only (sums in another order), and the
decisions with them unless two merits tie to rounding.

The state is fixed in size from the first token on, per kv head: a ring of the last W + C - 1
keys/values with their scores (token n in slot n mod (W + C - 1); the oldest C of them are the
next boundary's leaving tokens, read before they are overwritten), the S sink keys/values, the K
selected keys/values with their scores and positions (-1 and zeros where empty; kept in position
order, empty slots first, so the layout is a function of which tokens stay) and per row
``length``, the real tokens read. Padding is never written and never advances ``length``.

Forms (tests hold them to ``naive_recurrent_select_attn``):

- ``naive_recurrent_*``: a plain loop over tokens, rows and heads, decisions by Python's ``sorted``;
  the ground truth, in the dtype it is given (float64 in the tests).
- ``chunk_*``: the prefill path (``chunk_by_position``): the tokens laid out by absolute position,
  then per chunk one masked softmax of its queries over everything they may read (``attend_chunk``)
  and the boundary's decision (``select_at_boundary``), vectorised over rows and heads (gathers, no
  loop over rows).
- ``step_*``: one token (``step_by_position``): ``attend_chunk`` of one query, and the decision where
  it ends a chunk.

LoLA (``cells/lola.py``) keeps the same layout and differs in what it reads and how it decides, so
it shares the layout's pieces here: ``CacheLayout``, the naive loops' ``naive_arrivals`` and
``naive_read_set``, what a chunk reads and writes (``chunk_read_set``, ``with_tokens_written``), the
boundary's candidates and choice (``boundary_candidates``, ``best_candidates``), and the prefill and
step loops, which take the reading and the decision as functions.

Shapes: q ``[B, Hkv, G, T, d]`` (fp32), k/v ``[B, Hkv, T, d]``, mask ``[B, T]``; state ``keys/values
[B, Hkv, W + C - 1, d]``, ``scores [B, Hkv, W + C - 1]`` fp32, ``sink_keys/sink_values [B, Hkv, S,
d]``, ``selected_keys/selected_values [B, Hkv, K, d]``, ``selected_scores [B, Hkv, K]`` fp32,
``selected_positions [B, Hkv, K]`` and ``length [B]`` int64; keys and values in the model dtype,
or as ``kv_dtype`` stores them (``rnnify.kernels.slots``, as the window cell's: int8 slots are d + 1
wide). A token is encoded once as it arrives and every later copy (ring, sinks, selected) moves its
stored bytes, so every form reads the same numbers for it. Every form returns ``(out [B, Hkv, G, T,
d_v] fp32, *new_state)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from rnnify.cells.base import Cell, CellSpec, host_readable
from rnnify.cells.online_softmax import finite_or_zero
from rnnify.cells.window import naive_ring_write
from rnnify.errors import check_int
from rnnify.kernels.ring import ring_index, write_slots
from rnnify.kernels.slots import decode, encode, levels_and_scales, slot_width, vector_width
from rnnify.kernels.slots import kv_dtype as kv_dtype_of

POLICIES = ("mass", "snapkv")
POOLINGS = ("avg", "max")


@dataclass(frozen=True)
class CacheLayout:
    """What a cache of this layout holds (the module docstring's W, S, K and C): the select cell's
    and LoLA's (``cells/lola.py``), which differ in how they choose."""

    window: int
    sinks: int
    keep: int
    chunk: int

    @property
    def ring(self) -> int:
        """Recent slots: the window and the tokens that left it since the chunk began."""
        return self.window + self.chunk - 1

    @property
    def exact_span(self) -> int:
        """Tokens read whole before one is dropped: a query of the chunk that starts at c reads the
        sinks, the tokens after c - W and the K kept at c, so every earlier token while
        c < W + S + K; the first chunk that starts at or past W + S + K (a multiple of C) drops one."""
        return self.chunk * -(-(self.window + self.sinks + self.keep) // self.chunk)


@dataclass(frozen=True)
class Selection(CacheLayout):
    """The select cell's layout and how it chooses (the module docstring's rules)."""

    observation: int
    policy: str
    pool: int
    pooling: str


class SelectState(NamedTuple):
    """The select cell's state, in its ``state_names`` order (shapes: the module docstring)."""

    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    selected_keys: torch.Tensor
    selected_values: torch.Tensor
    selected_scores: torch.Tensor
    selected_positions: torch.Tensor
    length: torch.Tensor


def read_slots(slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The vectors ``slots`` store, in ``dtype``: int8 slots through ``slots.decode``, float ones as they are."""
    return (decode(slots) if slots.dtype == torch.int8 else slots).to(dtype)


def read_levels(slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``read_slots`` as a product wants it: ``(levels [..., N, d], scales [..., N] or None)`` in
    ``dtype``; int8 slots' scales multiply a product's results, not every entry (exact: powers of two)."""
    if slots.dtype != torch.int8:
        return slots.to(dtype), None
    levels, scales = levels_and_scales(slots)
    return levels.to(dtype), scales[..., 0].to(dtype)


def may_decide(deciding: torch.Tensor) -> bool:
    """False only where ``deciding [B]`` reads on the host for free (``host_readable``) and holds no
    row at a boundary: then a step skips the decision's ops. A compiled, exported or traced graph
    keeps them for every step, and on CUDA a host read would wait for the device."""
    return not host_readable(deciding) or bool(deciding.any())


def observes(positions: torch.Tensor, rule: Selection) -> torch.Tensor:
    """``[B, T]`` 1.0 where the query at ``positions`` (-1: padding) adds to the scores, else 0.0."""
    return ((positions >= 0) & (positions % rule.chunk >= rule.chunk - rule.observation)).float()


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the allowed keys; rows with none give all zeros."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.exp(scores - finite_or_zero(scores.amax(-1, keepdim=True)))
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def held_positions(length: torch.Tensor, selected_positions: torch.Tensor, rule: CacheLayout) -> torch.Tensor:
    """The token each held slot gives the next queries ``[B, Hkv, S + K + W + C - 1]`` (sinks,
    selected, ring), -1 where they read none: a sink still among the recent tokens is read there."""
    batch, num_kv_heads, _ = selected_positions.shape
    start = (length - length % rule.chunk)[:, None]  # the chunk the next token opens or continues
    sink = torch.arange(rule.sinks, device=length.device).expand(batch, -1)
    sink = torch.where(sink <= start - rule.window, sink, -1)
    ring = ring_index(length, rule.ring)
    ring = torch.where(ring > start - rule.window, ring, -1)
    sink, ring = (t[:, None].expand(-1, num_kv_heads, -1) for t in (sink, ring))
    return torch.cat([sink, selected_positions, ring], dim=2)


# --------------------------------------------------------------------------- the reference


def naive_arrivals(k, v, mask, state):
    """The naive loops' order: token by token, row by row, each real token written into ``state``
    (a ``SelectState`` or ``lola.LolaState``) by ``naive_ring_write``, in place; yields ``(t, b,
    n)``, n its position, for the caller to read it and decide before the next."""
    for t in range(mask.shape[1]):
        for b in range(mask.shape[0]):
            if mask[b, t]:  # padding leaves the state as it was
                ring_state = (state.keys, state.values, state.sink_keys, state.sink_values, state.length)
                yield t, b, naive_ring_write(b, k[b, :, t], v[b, :, t], *ring_state)


def naive_read_set(state, b: int, h: int, n: int, rule: CacheLayout) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
    """What query n of row b reads by softmax in kv head h, the token just written included:
    ``(key, value, where)`` of the sinks out of the recent set (where None), the selected
    (``("selected", slot)``) and the recent tokens (``("ring", slot)``)."""
    start = n - n % rule.chunk
    ring = {n - (n - s) % rule.ring: s for s in range(rule.ring)}  # token -> its ring slot
    read = [
        (state.sink_keys[b, h, j], state.sink_values[b, h, j], None)
        for j in range(rule.sinks)
        if j <= start - rule.window
    ]
    read += [
        (state.selected_keys[b, h, s], state.selected_values[b, h, s], ("selected", s))
        for s in range(rule.keep)
        if state.selected_positions[b, h, s] >= 0
    ]
    read += [
        (state.keys[b, h, s], state.values[b, h, s], ("ring", s))
        for j, s in ring.items()
        if j >= 0 and j > start - rule.window
    ]
    return read


def naive_recurrent_select_attn(q, k, v, mask, *state, scale: float, rule: Selection):
    state = SelectState(*(t.clone() for t in state))
    out = q.new_zeros(*q.shape[:4], vector_width(state.values))
    for t, b, n in naive_arrivals(k, v, mask, state):
        state.scores[b, :, n % rule.ring] = 0
        for h in range(q.shape[1]):
            read = naive_read_set(state, b, h, n, rule)
            logits = scale * torch.stack([q[b, h, :, t] @ read_slots(key, q.dtype) for key, _, _ in read], dim=-1)
            p = torch.softmax(logits, dim=-1)  # [G, N]
            out[b, h, :, t] = p @ torch.stack([read_slots(value, q.dtype) for _, value, _ in read])
            if n % rule.chunk >= rule.chunk - rule.observation:
                kept = {"selected": state.selected_scores, "ring": state.scores}  # the scores each slot keeps
                for (_, _, where), mass in zip(read, p.sum(0)):
                    if where is not None:
                        kept[where[0]][b, h, where[1]] += mass
        if (n + 1) % rule.chunk == 0 and rule.keep:
            for h in range(q.shape[1]):
                _naive_decide(b, h, n + 1, state, rule)
    return out, *state


def _naive_decide(b, h, p, state: SelectState, rule: Selection) -> None:
    """``select_at_boundary`` for row b, head h at boundary p, by ``sorted``; in place."""
    ring = {p - 1 - (p - 1 - s) % rule.ring: s for s in range(rule.ring)}  # the ring holds (p - W - C, p)
    # (position, score, key, value) of the held tokens but the sinks
    selected = [
        (
            int(state.selected_positions[b, h, s]),
            float(state.selected_scores[b, h, s]),
            state.selected_keys[b, h, s].clone(),
            state.selected_values[b, h, s].clone(),
        )
        for s in range(rule.keep)
        if state.selected_positions[b, h, s] >= 0
    ]
    recent = [
        (j, float(state.scores[b, h, s]), state.keys[b, h, s].clone(), state.values[b, h, s].clone())
        for j, s in ring.items()
        if j >= rule.sinks
    ]
    candidates = selected + [entry for entry in recent if entry[0] <= p - rule.window]

    def merit(candidate) -> float:
        near = [score for j, score, _, _ in selected + recent if abs(j - candidate[0]) <= rule.pool // 2]
        return sum(near) / rule.pool if rule.pooling == "avg" else max(near)

    kept = sorted(sorted(candidates, key=lambda c: (merit(c), c[0]), reverse=True)[: rule.keep], key=lambda c: c[0])
    empty = rule.keep - len(kept)
    for slot in range(rule.keep):
        position, score, key, value = kept[slot - empty] if slot >= empty else (-1, 0.0, 0, 0)
        state.selected_positions[b, h, slot], state.selected_scores[b, h, slot] = position, score
        state.selected_keys[b, h, slot], state.selected_values[b, h, slot] = key, value
    if rule.policy == "snapkv":
        state.scores[b, h], state.selected_scores[b, h] = 0, 0


# --------------------------------------------------------------------------- the vectorised forms


def chunk_read_set(q, k, v, positions, state, rule: CacheLayout):
    """What the new tokens at ``positions [B, T]`` (consecutive from each row's ``length`` inside one
    chunk; -1: none) read by softmax: sinks ∪ selected ∪ recent (``held_positions``) and each other
    causally. Returns ``(real [B, T], allowed [B, Hkv, T, S + K + W + C - 1 + T], keys, values [B,
    Hkv, S + K + W + C - 1 + T, width] as the slots store them)``; ``state`` a ``SelectState`` or
    ``lola.LolaState``."""
    real = positions >= 0
    held = held_positions(state.length, state.selected_positions, rule)  # [B, Hkv, N]
    causal = real[:, None, :] & (positions[:, None, :] <= positions[:, :, None])  # [B, T (query), T (key)]
    allowed = (
        torch.cat(
            [(held >= 0)[:, :, None].expand(-1, -1, q.shape[3], -1), causal[:, None].expand(-1, held.shape[1], -1, -1)],
            dim=3,
        )
        & real[:, None, :, None]
    )
    all_keys = torch.cat([state.sink_keys, state.selected_keys, state.keys, encode(k, state.keys.dtype)], dim=2)
    all_values = torch.cat(
        [state.sink_values, state.selected_values, state.values, encode(v, state.values.dtype)], dim=2
    )
    return real, allowed, all_keys, all_values


def token_slots(positions: torch.Tensor, real: torch.Tensor, rule: CacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the tokens at ``positions [B, T]`` (``real``: not -1) are written: token n into ring slot
    n mod (W + C - 1), and into sink slot n while n < S; -1 where not (``write_slots`` skips it)."""
    return torch.where(real, positions % rule.ring, -1), torch.where(real & (positions < rule.sinks), positions, -1)


def with_tokens_written(state, k, v, real, slot, sink_slot, **changes):
    """``state`` (a ``SelectState`` or ``lola.LolaState``) with the new tokens written at ``token_slots``'
    ``slot``, ``sink_slot`` and ``length`` advanced by the ``real`` ones, and the ``changes``."""
    return state._replace(
        keys=write_slots(state.keys, k, slot),
        values=write_slots(state.values, v, slot),
        sink_keys=write_slots(state.sink_keys, k, sink_slot),
        sink_values=write_slots(state.sink_values, v, sink_slot),
        length=state.length + real.sum(1),
        **changes,
    )


def attend_chunk(q, k, v, positions, state: SelectState, scale: float, rule: Selection):
    """The new tokens at ``positions [B, T]`` read ``chunk_read_set`` in one masked softmax; their
    attention is added to the scores of what they read (``observes``) and their keys, values and
    scores are written: ``(out, state)``. No decision: the caller makes the boundary's."""
    k, v = encode(k, state.keys.dtype), encode(v, state.values.dtype)  # once, for the read and the writes
    real, allowed, all_keys, all_values = chunk_read_set(q, k, v, positions, state, rule)
    (keys, key_scales), (values, value_scales) = read_levels(all_keys, q.dtype), read_levels(all_values, q.dtype)
    scores = scale * torch.einsum("bhgtd,bhnd->bhgtn", q, keys)
    p = masked_softmax(scores if key_scales is None else scores * key_scales[:, :, None, None], allowed[:, :, None])
    out = (p if value_scales is None else p * value_scales[:, :, None, None]) @ values[:, :, None]
    gained = torch.einsum("bhgtn,bt->bhn", p, observes(positions, rule).to(p.dtype))  # sigma_j += ...
    _, from_selected, from_ring, from_new = gained.split([rule.sinks, rule.keep, rule.ring, q.shape[3]], dim=2)
    slot, sink_slot = token_slots(positions, real, rule)
    scores = write_slots((state.scores + from_ring)[..., None], from_new[..., None], slot)[..., 0]
    selected_scores = state.selected_scores + from_selected
    return out, with_tokens_written(state, k, v, real, slot, sink_slot, scores=scores, selected_scores=selected_scores)


def pooled_merit(candidates, held, held_scores, rule: Selection) -> torch.Tensor:
    """Each candidate's merit ``[B, Hkv, K + C]``: the scores of the held tokens (no sinks) within
    ``pool // 2`` positions, averaged over ``pool`` positions (those not held count 0) or their max."""
    near = ((held[:, :, None] - candidates[..., None]).abs() <= rule.pool // 2) & (held >= 0)[:, :, None]
    if rule.pooling == "avg":
        return (held_scores[:, :, None] * near).sum(-1) / rule.pool
    return held_scores[:, :, None].masked_fill(~near, float("-inf")).amax(-1)


def boundary_candidates(length, selected_positions, rule: CacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates at boundary p = ``length``, the K selected then the C tokens leaving the recent
    set, (p - C - W, p - W] less the sinks: ``(their positions [B, Hkv, K + C] (-1: none), the
    leaving tokens' ring slots [B, Hkv, C])``."""
    num_kv_heads = selected_positions.shape[1]
    leaving = length[:, None] - rule.window - rule.chunk + 1 + torch.arange(rule.chunk, device=length.device)
    leaving = torch.where(leaving >= rule.sinks, leaving, -1)  # [B, C]
    slot = (leaving.clamp_min(0) % rule.ring)[:, None].expand(-1, num_kv_heads, -1)
    return torch.cat([selected_positions, leaving[:, None].expand(-1, num_kv_heads, -1)], dim=2), slot


def candidate_entries(selected: torch.Tensor, ring: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The candidates' entries ``[B, Hkv, K + C, d]``: the ``selected`` ones, then the leaving tokens'
    from the ``ring`` at ``slot``."""
    return torch.cat([selected, ring.gather(2, slot[..., None].expand(-1, -1, -1, ring.shape[3]))], dim=2)


def best_candidates(candidates: torch.Tensor, merit: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` candidates of highest ``merit`` (ties: the newer token; none where the position
    is -1), in position order, empty first: ``(their index among the candidates, their positions)``,
    each ``[B, Hkv, K]``."""
    merit = merit.masked_fill(candidates < 0, float("-inf"))
    # a stable sort by merit of the newest-first order
    newest_first = candidates.argsort(dim=2, descending=True, stable=True)
    by_merit = merit.gather(2, newest_first).argsort(dim=2, descending=True, stable=True)
    best = newest_first.gather(2, by_merit[..., :keep])
    best = best.gather(2, candidates.gather(2, best).argsort(dim=2, stable=True))  # in position order
    return best, candidates.gather(2, best)


def chosen_entries(entries, best, kept, deciding, old) -> torch.Tensor:
    """The selected entries after the decision: the ``best`` of the candidates' ``entries [B, Hkv, K +
    C, d]`` (zeros where none is ``kept``) in the rows ``deciding``, ``old`` in the others."""
    chosen = entries.gather(2, best[..., None].expand(-1, -1, -1, entries.shape[3]))
    return decided(deciding, torch.where(kept[..., None], chosen, 0).to(old.dtype), old)


def decided(deciding: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` in the rows ``deciding [B]``, at a boundary; the others keep ``old``."""
    return torch.where(deciding.view(-1, *[1] * (new.dim() - 1)), new, old)


def select_at_boundary(state: SelectState, deciding: torch.Tensor, rule: Selection) -> SelectState:
    """The decision at boundary p = ``length`` for the rows ``deciding [B]``: the K selected and the C
    tokens leaving the recent set compete (``boundary_candidates``); the K of highest merit stay, in
    position order (empty slots first, zeros); with ``snapkv`` every score restarts."""
    candidates, slot = boundary_candidates(state.length, state.selected_positions, rule)
    candidate_scores = torch.cat([state.selected_scores, state.scores.gather(2, slot)], dim=2)
    if rule.pool > 1:  # neighbours: the selected and every ring token but the sinks (the ring holds (p - W - C, p))
        ring = ring_index(state.length, rule.ring)[:, None].expand(-1, candidates.shape[1], -1)
        held = torch.cat([state.selected_positions, torch.where(ring >= rule.sinks, ring, -1)], dim=2)
        merit = pooled_merit(candidates, held, torch.cat([state.selected_scores, state.scores], dim=2), rule)
    else:
        merit = candidate_scores
    best, kept_positions = best_candidates(candidates, merit, rule.keep)
    kept = kept_positions >= 0
    scores, kept_scores = state.scores, torch.where(kept, candidate_scores.gather(2, best), 0.0)
    if rule.policy == "snapkv":  # the next decision weighs the next chunk's observation window alone
        scores, kept_scores = torch.zeros_like(scores), torch.zeros_like(kept_scores)

    candidate_keys = candidate_entries(state.selected_keys, state.keys, slot)
    candidate_values = candidate_entries(state.selected_values, state.values, slot)
    return state._replace(
        scores=decided(deciding, scores, state.scores),
        selected_keys=chosen_entries(candidate_keys, best, kept, deciding, state.selected_keys),
        selected_values=chosen_entries(candidate_values, best, kept, deciding, state.selected_values),
        selected_scores=decided(deciding, kept_scores, state.selected_scores),
        selected_positions=decided(deciding, kept_positions, state.selected_positions),
    )


def lay_out(q, k, v, mask, length, chunk: int):
    """The tokens of a prefill placed by each row's absolute position, in whole chunks (the first
    continues the chunk the state ended in): ``(q, k, v, positions [B, N C], place [B, T])``, where
    ``positions`` is -1 at places no token fills and ``place`` is each token's place (-1: padding)."""
    batch, num_kv_heads, group, steps, _ = q.shape
    offset = length % chunk
    place = torch.where(mask, offset[:, None] + mask.long().cumsum(1) - 1, -1)  # [B, T]: where each token goes
    width = (steps + 2 * chunk - 2) // chunk * chunk  # enough for any offset < C
    source = torch.full((batch, width + 1), -1, dtype=torch.long, device=q.device)
    source = source.scatter(1, torch.where(mask, place, width), torch.arange(steps, device=q.device).expand(batch, -1))
    source = source[:, :width]  # the token at each place, -1 for none
    positions = torch.where(source >= 0, (length - offset)[:, None] + torch.arange(width, device=q.device), -1)
    taken = source.clamp_min(0)
    laid_q = q.gather(3, taken[:, None, None, :, None].expand(-1, num_kv_heads, group, -1, q.shape[4]))
    laid_k, laid_v = (x.gather(2, taken[:, None, :, None].expand(-1, num_kv_heads, -1, x.shape[3])) for x in (k, v))
    return laid_q, laid_k, laid_v, positions, place


def put_back(outs: list[torch.Tensor], place: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The chunks' outputs ``[B, Hkv, G, C, d_v]`` each, in places, back in the prompt's order; padding 0."""
    out = torch.cat(outs, dim=3)
    index = place.clamp_min(0)[:, None, None, :, None].expand(-1, *out.shape[1:3], -1, out.shape[4])
    return torch.where(mask[:, None, None, :, None], out.gather(3, index), 0.0)


def chunk_by_position(attend, decide, q, k, v, mask, state, chunk: int):
    """A prefill of a cache of this layout: the tokens laid out by each row's absolute position (a
    run of whole chunks, the first continuing the chunk the state ended in), then per chunk
    ``attend(q, k, v, positions, state) -> (out, state)`` and, where ``decide`` is given,
    ``decide(state, deciding)`` for the rows that complete it. Padding queries give 0."""
    laid_q, laid_k, laid_v, positions, place = lay_out(q, k, v, mask, state.length, chunk)
    outs = []
    for start in range(0, positions.shape[1], chunk):
        span = slice(start, start + chunk)
        out, state = attend(laid_q[:, :, :, span], laid_k[:, :, span], laid_v[:, :, span], positions[:, span], state)
        outs.append(out)
        deciding = (positions[:, span] >= 0).any(1) & (state.length % chunk == 0)
        if decide is not None and may_decide(deciding):
            state = decide(state, deciding)
    return put_back(outs, place, mask), *state


def step_by_position(attend, decide, q, k, v, mask, state, chunk: int):
    """One decode token of a cache of this layout: ``attend`` of one query, then ``decide`` where it
    ends a chunk (as ``chunk_by_position``)."""
    out, state = attend(q, k, v, torch.where(mask, state.length[:, None], -1), state)
    deciding = mask[:, 0] & (state.length % chunk == 0)
    if decide is not None and may_decide(deciding):
        state = decide(state, deciding)
    return out, *state


def chunk_select_attn(q, k, v, mask, *state, scale: float, rule: Selection):
    """A prefill: ``chunk_by_position`` of ``attend_chunk`` and (with tokens to select) ``select_at_boundary``."""
    attend, decide = partial(attend_chunk, scale=scale, rule=rule), partial(select_at_boundary, rule=rule)
    return chunk_by_position(attend, decide if rule.keep else None, q, k, v, mask, SelectState(*state), rule.chunk)


def step_select_attn(q, k, v, mask, *state, scale: float, rule: Selection):
    """One decode token: ``step_by_position`` of ``attend_chunk`` and (with tokens to select) ``select_at_boundary``."""
    attend, decide = partial(attend_chunk, scale=scale, rule=rule), partial(select_at_boundary, rule=rule)
    return step_by_position(attend, decide if rule.keep else None, q, k, v, mask, SelectState(*state), rule.chunk)


# --------------------------------------------------------------------------- the cell


class SelectCell(Cell):
    """Softmax over sinks, a recent window and past tokens selected by attention (H2O, SnapKV), with constant memory.

    ``window=None`` takes the model's own sliding window (``spec.window``); ``sinks`` are kept for
    good (StreamingLLM's 4 by default); ``keep=None`` selects as many tokens as the window holds (H2O's
    even split of heavy hitters and recent tokens); ``policy``: ``mass`` (H2O: scores accumulate while
    a token is held) or ``snapkv`` (scores restart at every boundary); decisions every ``chunk``
    tokens, scored by the last ``observation`` queries of each chunk (None: all of them; SnapKV's
    observation window), the scores pooled over ``pool`` positions (``pooling`` avg or max; SnapKV's
    code pools 5 by avg; 1: none). ``kv_dtype`` ("float16", "bfloat16" or "int8"; None: the model
    dtype) is how the sinks, the ring and the selected tokens store their keys and values
    (``rnnify.kernels.slots``): more tokens in the same bytes. The module docstring has the rule.
    """

    target = "select"
    state_names = SelectState._fields

    def __init__(
        self,
        spec: CellSpec,
        window: int | None = None,
        sinks: int = 4,
        keep: int | None = None,
        policy: str = "mass",
        observation: int | None = None,
        chunk: int = 32,
        pool: int = 1,
        pooling: str = "avg",
        kv_dtype: str | None = None,
    ):
        super().__init__(spec)
        if window is None and spec.window is None:
            raise ValueError(
                "this attention has no sliding window of its own: give window=N (--window N) "
                "(the number of recent tokens each query attends to)"
            )
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
        window = check_int("window", spec.window if window is None else window, 1)
        chunk = check_int("chunk", chunk, 1)
        observation = check_int("observation", chunk if observation is None else observation, 1)
        if observation > chunk:
            raise ValueError(
                f"observation ({observation}) must be at most chunk ({chunk}): the queries that "
                "score a decision are the last of the chunk before it"
            )
        if check_int("pool", pool, 1) % 2 == 0:
            raise ValueError(f"pool must be odd (a window centred on each token), got {pool}")
        keep = check_int("keep", window if keep is None else keep, 0)
        self.rule = Selection(window, check_int("sinks", sinks, 0), keep, chunk, observation, policy, pool, pooling)
        self.kv_dtype = kv_dtype
        self.storage = kv_dtype_of(kv_dtype)

    @property
    def exact_span(self) -> int:
        return self.rule.exact_span

    def options(self) -> dict[str, Any]:
        return asdict(self.rule) | ({"kv_dtype": self.kv_dtype} if self.kv_dtype is not None else {})

    def describe(self) -> str:
        rule = self.rule
        by = "attention mass" if rule.policy == "mass" else "SnapKV's observation window"
        return (
            f"{rule.window} tokens"
            + (f" + {rule.sinks} sinks" if rule.sinks else "")
            + f" + {rule.keep} selected by {by} every {rule.chunk} tokens"
            + (f", stored as {self.kv_dtype}" if self.kv_dtype is not None else "")
        )

    def init_state(self, batch_size, device, dtype):
        spec, rule, stored = self.spec, self.rule, self.storage or dtype

        def zeros(slots: int, *dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(batch_size, spec.num_kv_heads, slots, *dim, device=device, dtype=dtype)

        def buffer(slots: int, dim: int) -> torch.Tensor:
            return zeros(slots, slot_width(dim, stored), dtype=stored)

        return (
            buffer(rule.ring, spec.head_dim),
            buffer(rule.ring, spec.value_dim),
            zeros(rule.ring),
            buffer(rule.sinks, spec.head_dim),
            buffer(rule.sinks, spec.value_dim),
            buffer(rule.keep, spec.head_dim),
            buffer(rule.keep, spec.value_dim),
            zeros(rule.keep),
            torch.full((batch_size, spec.num_kv_heads, rule.keep), -1, device=device, dtype=torch.long),
            torch.zeros(batch_size, device=device, dtype=torch.long),
        )

    def forward(self, q, k, v, mask, *state):
        batch, _, steps, _ = q.shape
        grouped = q.float().reshape(batch, self.spec.num_kv_heads, self.spec.group_size, steps, -1)
        form = step_select_attn if steps == 1 else chunk_select_attn
        out, *state = form(grouped, k, v, mask.to(torch.bool), *state, scale=self.spec.scale, rule=self.rule)
        return out.reshape(batch, self.spec.num_heads, steps, -1).to(q.dtype), *state
