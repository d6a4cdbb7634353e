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
- ``chunk_*``: the prefill path: the tokens laid out by absolute position, then per chunk one masked
  softmax of its queries over everything they may read (``attend_chunk``) and the boundary's
  decision (``select_at_boundary``), vectorised over rows and heads (gathers, no loop over rows).
- ``step_*``: one token: ``attend_chunk`` of one query, and the decision where it ends a chunk.

Shapes: q ``[B, Hkv, G, T, d]`` (fp32), k/v ``[B, Hkv, T, d]``, mask ``[B, T]``; state ``keys/values
[B, Hkv, W + C - 1, d]``, ``scores [B, Hkv, W + C - 1]`` fp32, ``sink_keys/sink_values [B, Hkv, S,
d]``, ``selected_keys/selected_values [B, Hkv, K, d]``, ``selected_scores [B, Hkv, K]`` fp32,
``selected_positions [B, Hkv, K]`` and ``length [B]`` int64; keys and values in the model dtype.
Every form returns ``(out [B, Hkv, G, T, d_v] fp32, *new_state)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.online_softmax import finite_or_zero
from rnnify.errors import check_int
from rnnify.kernels.ring import ring_index, write_slots

POLICIES = ("mass", "snapkv")
POOLINGS = ("avg", "max")


@dataclass(frozen=True)
class Selection:
    """What the cache holds and how it chooses (the module docstring's W, S, K, C and rules)."""

    window: int
    sinks: int
    keep: int
    chunk: int
    observation: int
    policy: str
    pool: int
    pooling: str

    @property
    def ring(self) -> int:
        """Recent slots: the window and the tokens that left it since the chunk began."""
        return self.window + self.chunk - 1


def may_decide(deciding: torch.Tensor) -> bool:
    """False only where ``deciding [B]`` reads on the host for free (eager on a CPU) and holds no
    row at a boundary: then a step skips the decision's ops. A compiled, exported or traced graph
    keeps them for every step, and on CUDA a host read would wait for the device."""
    if (
        deciding.device.type != "cpu"
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or isinstance(deciding, FakeTensor)
    ):
        return True
    return bool(deciding.any())


def observes(positions: torch.Tensor, rule: Selection) -> torch.Tensor:
    """``[B, T]`` 1.0 where the query at ``positions`` (-1: padding) adds to the scores, else 0.0."""
    return ((positions >= 0) & (positions % rule.chunk >= rule.chunk - rule.observation)).float()


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the allowed keys; rows with none give all zeros."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.exp(scores - finite_or_zero(scores.amax(-1, keepdim=True)))
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def held_positions(length: torch.Tensor, selected_positions: torch.Tensor, rule: Selection) -> torch.Tensor:
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


# --------------------------------------------------------------------------- the forms


def naive_recurrent_select_attn(q, k, v, mask, *state, scale: float, rule: Selection):
    batch, num_kv_heads, group, steps, _ = q.shape
    window, sinks, keep, chunk, ring_size = rule.window, rule.sinks, rule.keep, rule.chunk, rule.ring
    (
        keys,
        values,
        scores,
        sink_keys,
        sink_values,
        selected_keys,
        selected_values,
        selected_scores,
        selected_positions,
        length,
    ) = (t.clone() for t in state)
    out = q.new_zeros(batch, num_kv_heads, group, steps, values.shape[-1])
    for t in range(steps):
        for b in range(batch):
            if not mask[b, t]:
                continue  # padding: the state stays as it was
            n = int(length[b])
            slot = n % ring_size
            keys[b, :, slot], values[b, :, slot], scores[b, :, slot] = k[b, :, t], v[b, :, t], 0
            if n < sinks:
                sink_keys[b, :, n], sink_values[b, :, n] = k[b, :, t], v[b, :, t]
            length[b] += 1
            start = n - n % chunk
            ring = {n - (n - s) % ring_size: s for s in range(ring_size)}  # token -> its ring slot
            for h in range(num_kv_heads):
                # (key, value, (scores, slot) that keeps its score or None) of each token query n reads
                read = [(sink_keys[b, h, j], sink_values[b, h, j], None) for j in range(sinks) if j <= start - window]
                read += [
                    (selected_keys[b, h, s], selected_values[b, h, s], (selected_scores, s))
                    for s in range(keep)
                    if selected_positions[b, h, s] >= 0
                ]
                read += [
                    (keys[b, h, s], values[b, h, s], (scores, s))
                    for j, s in ring.items()
                    if j >= 0 and j > start - window
                ]
                logits = scale * torch.stack([q[b, h, :, t] @ key.to(q.dtype) for key, _, _ in read], dim=-1)
                p = torch.softmax(logits, dim=-1)  # [G, N]
                out[b, h, :, t] = p @ torch.stack([value.to(q.dtype) for _, value, _ in read])
                if n % chunk >= chunk - rule.observation:
                    for (_, _, kept), mass in zip(read, p.sum(0)):
                        if kept is not None:
                            kept[0][b, h, kept[1]] += mass
            if (n + 1) % chunk == 0 and keep:
                for h in range(num_kv_heads):
                    _naive_decide(
                        b,
                        h,
                        n + 1,
                        keys,
                        values,
                        scores,
                        selected_keys,
                        selected_values,
                        selected_scores,
                        selected_positions,
                        rule,
                    )
    return (
        out,
        keys,
        values,
        scores,
        sink_keys,
        sink_values,
        selected_keys,
        selected_values,
        selected_scores,
        selected_positions,
        length,
    )


def _naive_decide(
    b, h, p, keys, values, scores, selected_keys, selected_values, selected_scores, selected_positions, rule: Selection
) -> None:
    """``select_at_boundary`` for row b, head h at boundary p, by ``sorted``; in place."""
    ring = {p - 1 - (p - 1 - s) % rule.ring: s for s in range(rule.ring)}  # the ring holds (p - W - C, p)
    # (position, score, key, value) of the held tokens but the sinks
    selected = [
        (
            int(selected_positions[b, h, s]),
            float(selected_scores[b, h, s]),
            selected_keys[b, h, s].clone(),
            selected_values[b, h, s].clone(),
        )
        for s in range(rule.keep)
        if selected_positions[b, h, s] >= 0
    ]
    recent = [
        (j, float(scores[b, h, s]), keys[b, h, s].clone(), values[b, h, s].clone())
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
        selected_positions[b, h, slot], selected_scores[b, h, slot] = position, score
        selected_keys[b, h, slot], selected_values[b, h, slot] = key, value
    if rule.policy == "snapkv":
        scores[b, h], selected_scores[b, h] = 0, 0


def attend_chunk(q, k, v, positions, state, scale: float, rule: Selection):
    """The new tokens at ``positions [B, T]`` (consecutive from each row's ``length`` inside one chunk;
    -1: none) read sinks ∪ selected ∪ recent and each other causally, in one masked softmax; their
    attention is added to the scores of what they read (``observes``) and their keys, values and
    scores are written: ``(out, state)``. No decision: the caller makes the boundary's."""
    (
        keys,
        values,
        scores,
        sink_keys,
        sink_values,
        selected_keys,
        selected_values,
        selected_scores,
        selected_positions,
        length,
    ) = state
    real = positions >= 0
    held = held_positions(length, selected_positions, rule)  # [B, Hkv, N]
    causal = real[:, None, :] & (positions[:, None, :] <= positions[:, :, None])  # [B, T (query), T (key)]
    allowed = (
        torch.cat(
            [(held >= 0)[:, :, None].expand(-1, -1, q.shape[3], -1), causal[:, None].expand(-1, held.shape[1], -1, -1)],
            dim=3,
        )
        & real[:, None, :, None]
    )
    all_keys = torch.cat([sink_keys, selected_keys, keys, k.to(keys.dtype)], dim=2).to(q.dtype)
    all_values = torch.cat([sink_values, selected_values, values, v.to(values.dtype)], dim=2).to(q.dtype)
    p = masked_softmax(scale * torch.einsum("bhgtd,bhnd->bhgtn", q, all_keys), allowed[:, :, None])
    out = p @ all_values[:, :, None]
    gained = torch.einsum("bhgtn,bt->bhn", p, observes(positions, rule).to(p.dtype))  # sigma_j += ...
    _, from_selected, from_ring, from_new = gained.split([rule.sinks, rule.keep, rule.ring, q.shape[3]], dim=2)

    slot = torch.where(real, positions % rule.ring, -1)  # token n goes to ring slot n mod (W + C - 1)
    sink_slot = torch.where(real & (positions < rule.sinks), positions, -1)
    scores = write_slots((scores + from_ring)[..., None], from_new[..., None], slot)[..., 0]
    state = (
        write_slots(keys, k, slot),
        write_slots(values, v, slot),
        scores,
        write_slots(sink_keys, k, sink_slot),
        write_slots(sink_values, v, sink_slot),
        selected_keys,
        selected_values,
        selected_scores + from_selected,
        selected_positions,
        length + real.sum(1),
    )
    return out, state


def pooled_merit(candidates, held, held_scores, rule: Selection) -> torch.Tensor:
    """Each candidate's merit ``[B, Hkv, K + C]``: the scores of the held tokens (no sinks) within
    ``pool // 2`` positions, averaged over ``pool`` positions (those not held count 0) or their max."""
    near = ((held[:, :, None] - candidates[..., None]).abs() <= rule.pool // 2) & (held >= 0)[:, :, None]
    if rule.pooling == "avg":
        return (held_scores[:, :, None] * near).sum(-1) / rule.pool
    return held_scores[:, :, None].masked_fill(~near, float("-inf")).amax(-1)


def select_at_boundary(state, deciding: torch.Tensor, rule: Selection):
    """The decision at boundary p = ``length`` for the rows ``deciding [B]``: the K selected and the C
    tokens leaving the recent set, (p - C - W, p - W] less the sinks, compete; the K of highest
    merit stay, in position order (empty slots first, zeros); with ``snapkv`` every score restarts."""
    (
        keys,
        values,
        scores,
        sink_keys,
        sink_values,
        selected_keys,
        selected_values,
        selected_scores,
        selected_positions,
        length,
    ) = state
    batch, num_kv_heads = keys.shape[:2]
    leaving = length[:, None] - rule.window - rule.chunk + 1 + torch.arange(rule.chunk, device=length.device)
    leaving = torch.where(leaving >= rule.sinks, leaving, -1)  # [B, C]
    slot = (leaving.clamp_min(0) % rule.ring)[:, None].expand(-1, num_kv_heads, -1)
    candidates = torch.cat([selected_positions, leaving[:, None].expand(-1, num_kv_heads, -1)], dim=2)
    candidate_scores = torch.cat([selected_scores, scores.gather(2, slot)], dim=2)
    if rule.pool > 1:  # neighbours: the selected and every ring token but the sinks (the ring holds (p - W - C, p))
        ring = ring_index(length, rule.ring)[:, None].expand(-1, num_kv_heads, -1)
        held = torch.cat([selected_positions, torch.where(ring >= rule.sinks, ring, -1)], dim=2)
        merit = pooled_merit(candidates, held, torch.cat([selected_scores, scores], dim=2), rule)
    else:
        merit = candidate_scores
    merit = merit.masked_fill(candidates < 0, float("-inf"))
    # the K of highest merit, ties to the newer token: a stable sort by merit of the newest-first order
    newest_first = candidates.argsort(dim=2, descending=True, stable=True)
    by_merit = merit.gather(2, newest_first).argsort(dim=2, descending=True, stable=True)
    best = newest_first.gather(2, by_merit[..., : rule.keep])
    best = best.gather(2, candidates.gather(2, best).argsort(dim=2, stable=True))  # in position order
    kept_positions = candidates.gather(2, best)
    kept = kept_positions >= 0
    kept_scores = torch.where(kept, candidate_scores.gather(2, best), 0.0)
    if rule.policy == "snapkv":  # the next decision weighs the next chunk's observation window alone
        scores, kept_scores = torch.zeros_like(scores), torch.zeros_like(kept_scores)

    def keep(selected: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        leaving_entries = ring.gather(2, slot[..., None].expand(-1, -1, -1, ring.shape[3]))
        chosen = torch.cat([selected, leaving_entries], dim=2)
        chosen = chosen.gather(2, best[..., None].expand(-1, -1, -1, ring.shape[3]))
        return torch.where(kept[..., None], chosen, 0).to(selected.dtype)

    def decided(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:  # rows not at a boundary keep theirs
        return torch.where(deciding.view(batch, *[1] * (new.dim() - 1)), new, old)

    return (
        keys,
        values,
        decided(scores, state[2]),
        sink_keys,
        sink_values,
        decided(keep(selected_keys, keys), selected_keys),
        decided(keep(selected_values, values), selected_values),
        decided(kept_scores, selected_scores),
        decided(kept_positions, selected_positions),
        length,
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


def chunk_select_attn(q, k, v, mask, *state, scale: float, rule: Selection):
    """A prefill: the tokens laid out by each row's absolute position (a run of whole chunks, the
    first continuing the chunk the state ended in), then per chunk ``attend_chunk`` and the
    boundary's decision for the rows that complete it. Padding queries give 0."""
    chunk = rule.chunk
    laid_q, laid_k, laid_v, positions, place = lay_out(q, k, v, mask, state[-1], chunk)
    outs = []
    for start in range(0, positions.shape[1], chunk):
        span = slice(start, start + chunk)
        out, state = attend_chunk(
            laid_q[:, :, :, span], laid_k[:, :, span], laid_v[:, :, span], positions[:, span], state, scale, rule
        )
        outs.append(out)
        deciding = (positions[:, span] >= 0).any(1) & (state[-1] % chunk == 0)
        if rule.keep and may_decide(deciding):
            state = select_at_boundary(state, deciding, rule)
    return put_back(outs, place, mask), *state


def step_select_attn(q, k, v, mask, *state, scale: float, rule: Selection):
    """One decode token: ``attend_chunk`` of one query, then the decision where it ends a chunk."""
    out, state = attend_chunk(q, k, v, torch.where(mask, state[-1][:, None], -1), state, scale, rule)
    deciding = mask[:, 0] & (state[-1] % rule.chunk == 0)
    if rule.keep and may_decide(deciding):
        state = select_at_boundary(state, deciding, rule)
    return out, *state


# --------------------------------------------------------------------------- the cell


class SelectCell(Cell):
    """Softmax over sinks, a recent window and past tokens selected by attention (H2O, SnapKV), with constant memory.

    ``window=None`` takes the model's own sliding window (``spec.window``); ``sinks`` are kept for
    good (StreamingLLM's 4 by default); ``keep=None`` selects as many tokens as the window holds (H2O's
    even split of heavy hitters and recent tokens); ``policy``: ``mass`` (H2O: scores accumulate while
    a token is held) or ``snapkv`` (scores restart at every boundary); decisions every ``chunk``
    tokens, scored by the last ``observation`` queries of each chunk (None: all of them; SnapKV's
    observation window), the scores pooled over ``pool`` positions (``pooling`` avg or max; SnapKV's
    code pools 5 by avg; 1: none). The module docstring has the rule.
    """

    target = "select"
    state_names = (
        "keys",
        "values",
        "scores",
        "sink_keys",
        "sink_values",
        "selected_keys",
        "selected_values",
        "selected_scores",
        "selected_positions",
        "length",
    )

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
    ):
        super().__init__(spec)
        if window is None and spec.window is None:
            raise ValueError(
                "this attention has no sliding window of its own: give window=N "
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

    def options(self) -> dict[str, Any]:
        return asdict(self.rule)

    def describe(self) -> str:
        rule = self.rule
        by = "attention mass" if rule.policy == "mass" else "SnapKV's observation window"
        return (
            f"{rule.window} tokens"
            + (f" + {rule.sinks} sinks" if rule.sinks else "")
            + f" + {rule.keep} selected by {by} every {rule.chunk} tokens"
        )

    def init_state(self, batch_size, device, dtype):
        spec, rule = self.spec, self.rule

        def zeros(slots: int, *dim: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(batch_size, spec.num_kv_heads, slots, *dim, device=device, dtype=dtype)

        return (
            zeros(rule.ring, spec.head_dim),
            zeros(rule.ring, spec.value_dim),
            zeros(rule.ring, dtype=torch.float32),
            zeros(rule.sinks, spec.head_dim),
            zeros(rule.sinks, spec.value_dim),
            zeros(rule.keep, spec.head_dim),
            zeros(rule.keep, spec.value_dim),
            zeros(rule.keep, dtype=torch.float32),
            torch.full((batch_size, spec.num_kv_heads, rule.keep), -1, device=device, dtype=torch.long),
            torch.zeros(batch_size, device=device, dtype=torch.long),
        )

    def forward(self, q, k, v, mask, *state):
        batch, _, steps, _ = q.shape
        grouped = q.float().reshape(batch, self.spec.num_kv_heads, self.spec.group_size, steps, -1)
        form = step_select_attn if steps == 1 else chunk_select_attn
        out, *state = form(grouped, k, v, mask.to(torch.bool), *state, scale=self.spec.scale, rule=self.rule)
        return out.reshape(batch, self.spec.num_heads, steps, -1).to(q.dtype), *state
