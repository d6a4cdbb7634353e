"""Sliding-window softmax attention with attention sinks (math.md §5; StreamingLLM, Xiao et al. 2023).

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
``naive_recurrent_*`` (a plain loop over tokens, the softmax key by key with the (m, u, w)
recurrence of math.md §1: the ground truth), ``parallel_*`` (one masked quadratic softmax over
sinks + ring + new tokens), ``chunk_*`` (the parallel form over blocks of queries: the prefill
path) and ``step_*`` (one token: write it, then ``softmax_attention_rnn`` of ``cells/exact.py``
over sinks + ring; the decode path; ``fused_*`` is the same through ``rnnify.kernels.window_attn_step``,
which writes with these helpers and reads in one kernel, once ``use_kernels`` is set; prefill
keeps the chunk form). Shapes: q ``[B, Hkv, G, T, d]`` (G query heads per kv
head, fp32), k/v ``[B, Hkv, T, d]``, mask ``[B, T]``; state ``keys/values [B, Hkv, W, d]`` and
``sink_keys/sink_values [B, Hkv, S, d]`` in the model dtype, ``length [B]`` int64. Every form
returns ``(out [B, Hkv, G, T, d_v] fp32, *new_state)``.
"""

from __future__ import annotations

from typing import Any

import torch

from rnnify import kernels
from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.exact import softmax_attention_rnn

# --------------------------------------------------------------------------- token bookkeeping


def token_index(length: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Index among its row's real tokens of each new token ``[B, T]``; -1 for padding."""
    index = length[:, None] + mask.long().cumsum(1) - 1
    return torch.where(mask, index, -1)


def ring_index(length: torch.Tensor, window: int) -> torch.Tensor:
    """The token each ring slot holds after ``length`` real tokens ``[B, W]``; -1 if none yet."""
    slot = torch.arange(window, device=length.device)
    index = length[:, None] - window + (slot - length[:, None]) % window
    return torch.where(index >= 0, index, -1)


def write_slots(buffer: torch.Tensor, new: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``buffer [B, Hkv, N, d]`` with token t of ``new [B, Hkv, T, d]`` in slot ``target[b, t]``.

    ``target`` is -1 for tokens written nowhere; at most one token targets a slot. Functional.
    """
    if buffer.shape[2] == 0:
        return buffer
    hit = target[:, :, None] == torch.arange(buffer.shape[2], device=target.device)  # [B, T, N]
    source = hit.long().argmax(1)  # [B, N]: which new token lands in each slot
    taken = new.gather(2, source[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3]))
    return torch.where(hit.any(1)[:, None, :, None], taken.to(buffer.dtype), buffer)


def ring_write(k, v, mask, keys, values, length):
    """Read the new tokens into the ring: real token n goes to slot n mod W if among the last W.

    Returns ``(keys, values, new_length)``.
    """
    window = keys.shape[2]
    index = token_index(length, mask)
    new_length = length + mask.long().sum(1)
    target = torch.where((index >= 0) & (index >= new_length[:, None] - window), index % window, -1)
    return write_slots(keys, k, target), write_slots(values, v, target), new_length


def sink_write(k, v, mask, sink_keys, sink_values, length):
    """Real token n < S goes to sink slot n."""
    index = token_index(length, mask)
    target = torch.where((index >= 0) & (index < sink_keys.shape[2]), index, -1)
    return write_slots(sink_keys, k, target), write_slots(sink_values, v, target)


def sinks_outside_window(length: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Sink slots to attend to ``[B, S]``: written, and not in the ring any more (else counted there)."""
    slot = torch.arange(sinks, device=length.device)
    return slot[None, :] < (length[:, None] - window)


def window_write(k, v, mask, keys, values, sink_keys, sink_values, length):
    """Read the new tokens into the sinks and the ring: ``(keys, values, sink_keys, sink_values, length)``."""
    sink_keys, sink_values = sink_write(k, v, mask, sink_keys, sink_values, length)
    keys, values, length = ring_write(k, v, mask, keys, values, length)
    return keys, values, sink_keys, sink_values, length


def held_index(length: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """The token of each held slot, sinks then ring ``[B, S + W]``, after ``length`` real tokens;
    -1 where a query attends to none (not written yet, or a sink still in the ring)."""
    sink = torch.arange(sinks, device=length.device).expand(length.shape[0], -1)
    sink = torch.where(sinks_outside_window(length, window, sinks), sink, -1)
    return torch.cat([sink, ring_index(length, window)], dim=1)


def masked_softmax_attention(scores: torch.Tensor, allowed: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(scores) @ values over the allowed keys; rows with no allowed key give 0."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isfinite(m), m, 0.0))
    den = p.sum(-1, keepdim=True)
    return torch.where(den > 0, (p @ values) / den.clamp_min(torch.finfo(den.dtype).tiny), 0.0)


# --------------------------------------------------------------------------- the forms

def naive_recurrent_window_attn(q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float):
    batch, _, _, steps, _ = q.shape
    window, sinks = keys.shape[2], sink_keys.shape[2]
    keys, values, sink_keys, sink_values, length = (t.clone() for t in (keys, values, sink_keys, sink_values, length))
    outs = []
    for t in range(steps):
        for b in range(batch):
            if not mask[b, t]:
                continue  # padding: the state stays as it was
            n = int(length[b])
            keys[b, :, n % window], values[b, :, n % window] = k[b, :, t], v[b, :, t]
            if n < sinks:
                sink_keys[b, :, n], sink_values[b, :, n] = k[b, :, t], v[b, :, t]
            length[b] += 1
        # the held keys with, per row, whether query t attends to them
        held = [(sink_keys[:, :, j], sink_values[:, :, j], j < length - window) for j in range(sinks)]
        held += [(keys[:, :, s], values[:, :, s], s < length) for s in range(window)]
        m = q.new_full(q.shape[:3], float("-inf"))  # [B, Hkv, G]
        u = q.new_zeros(q.shape[:3])
        w = q.new_zeros((*q.shape[:3], values.shape[-1]))
        for key, value, attended in held:
            s = scale * (q[:, :, :, t] * key[:, :, None].float()).sum(-1)
            s = torch.where(attended[:, None, None], s, float("-inf"))
            m_new = torch.maximum(m, s)
            m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
            decay, p = torch.exp(m - m_safe), torch.exp(s - m_safe)
            u = u * decay + p
            w = w * decay[..., None] + p[..., None] * value[:, :, None].float()
            m = m_new
        outs.append(torch.where(u[..., None] > 0, w / u.clamp_min(torch.finfo(u.dtype).tiny)[..., None], 0.0))
    return torch.stack(outs, dim=3), keys, values, sink_keys, sink_values, length


def parallel_window_attn(q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float):
    window, sinks = keys.shape[2], sink_keys.shape[2]
    q_index = token_index(length, mask)
    # every key a new query might see: the sinks, the ring, the new tokens; each with its token index
    key_index = torch.cat([held_index(length, window, sinks), q_index], dim=1)  # [B, N]
    all_keys = torch.cat([sink_keys, keys, k.to(keys.dtype)], dim=2).float()
    all_values = torch.cat([sink_values, values, v.to(values.dtype)], dim=2).float()
    i, j = q_index[:, :, None], key_index[:, None, :]
    allowed = (j >= 0) & (j <= i) & ((i - j < window) | (j < sinks))  # [B, T, N]
    scores = scale * torch.einsum("bhgtd,bhnd->bhgtn", q, all_keys)
    out = masked_softmax_attention(scores, allowed[:, None, None], all_values[:, :, None])
    return out, *window_write(k, v, mask, keys, values, sink_keys, sink_values, length)


def chunk_window_attn(q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float, block_size: int = 64):
    state, outs = (keys, values, sink_keys, sink_values, length), []
    for start in range(0, q.shape[3], block_size):
        end = start + block_size
        chunk = (q[:, :, :, start:end], k[:, :, start:end], v[:, :, start:end], mask[:, start:end])
        out, *state = parallel_window_attn(*chunk, *state, scale)
        outs.append(out)
    return torch.cat(outs, dim=3), *state


def step_window_attn(q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float, block_size: int = 512):
    window, sinks = keys.shape[2], sink_keys.shape[2]
    keys, values, sink_keys, sink_values, length = window_write(k, v, mask, keys, values, sink_keys, sink_values, length)
    # the ring now holds the last W tokens, self included: attend to all of them and the sinks
    valid = held_index(length, window, sinks) >= 0
    batch, num_kv_heads, group, _, head_dim = q.shape
    out = softmax_attention_rnn(
        q.reshape(batch, num_kv_heads * group, 1, head_dim),
        torch.cat([sink_keys, keys], dim=2),
        torch.cat([sink_values, values], dim=2),
        valid,
        scale,
        block_size=block_size,
    )
    return out.reshape(batch, num_kv_heads, group, 1, -1).float(), keys, values, sink_keys, sink_values, length


def fused_window_attn_step(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, scale: float, backend: str = "auto"
):
    batch, num_kv_heads, group, _, head_dim = q.shape  # T == 1; the op takes [B, 1, heads, d]
    out, state = kernels.window_attn_step(
        q.reshape(batch, 1, num_kv_heads * group, head_dim), k.transpose(1, 2), v.transpose(1, 2),
        keys, values, length, sink_keys, sink_values, mask, scale, backend=backend,
    )
    return out.reshape(batch, num_kv_heads, group, 1, -1), *state


# --------------------------------------------------------------------------- the cell


def check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class WindowCell(Cell):
    """Softmax over the last W tokens and the first S (attention sinks), with constant memory.

    ``window=None`` takes the model's own sliding window (``spec.window``); with it and no sinks
    the cell is exact. ``block_size`` is the number of queries per block in a prefill.
    """

    target = "window"
    state_names = ("keys", "values", "sink_keys", "sink_values", "length")

    def __init__(self, spec: CellSpec, window: int | None = None, sinks: int = 0, block_size: int = 64):
        super().__init__(spec)
        if window is None and spec.window is None:
            raise ValueError(
                "this attention has no sliding window of its own: give window=N "
                "(the number of recent tokens each query attends to)"
            )
        self.window = check_int("window", spec.window if window is None else window, 1)
        self.sinks = check_int("sinks", sinks, 0)
        self.block_size = check_int("block_size", block_size, 1)

    def options(self) -> dict[str, Any]:
        return {"window": self.window, "sinks": self.sinks, "block_size": self.block_size}

    def fused_ops(self) -> dict[str, str]:
        return {"decode": "window_attn_step"}

    def init_state(self, batch_size, device, dtype):
        spec = self.spec

        def buffer(slots: int, dim: int) -> torch.Tensor:
            return torch.zeros(batch_size, spec.num_kv_heads, slots, dim, device=device, dtype=dtype)

        return (
            buffer(self.window, spec.head_dim),
            buffer(self.window, spec.value_dim),
            buffer(self.sinks, spec.head_dim),
            buffer(self.sinks, spec.value_dim),
            torch.zeros(batch_size, device=device, dtype=torch.long),
        )

    def forward(self, q, k, v, mask, keys, values, sink_keys, sink_values, length):
        batch, _, steps, _ = q.shape
        grouped = q.float().reshape(batch, self.spec.num_kv_heads, self.spec.group_size, steps, -1)
        state = (keys, values, sink_keys, sink_values, length)
        mask = mask.to(torch.bool)
        if steps == 1 and self.kernels is not None:
            out, *state = fused_window_attn_step(grouped, k, v, mask, *state, self.spec.scale, self.kernels)
        elif steps == 1:
            out, *state = step_window_attn(grouped, k, v, mask, *state, self.spec.scale)
        else:
            out, *state = chunk_window_attn(grouped, k, v, mask, *state, self.spec.scale, self.block_size)
        return out.reshape(batch, self.spec.num_heads, steps, -1).to(q.dtype), *state
