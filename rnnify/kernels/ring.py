"""Ring-buffer bookkeeping of sliding-window attention with sinks (docs/math.md §Sliding window and sinks).

Per row, ``length`` counts the real tokens read so far (left padding never advances it): real token
n lives in ring slot n mod W while it is among the last W, and in sink slot n if n < S. Writes are
functional (new buffers), so the same helpers serve ``rnnify.cells.window``'s forms and the
``window_attn_step`` op.
"""

from __future__ import annotations

import torch

from rnnify.kernels.slots import encode


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
    """``buffer [B, Hkv, N, d]`` with token t of ``new [B, Hkv, T, d]`` in slot ``target[b, t]``, stored
    as the buffer stores it (``slots.encode``).

    ``target`` is -1 for tokens written nowhere; at most one token targets a slot. Functional.
    """
    if buffer.shape[2] == 0:
        return buffer
    if new.shape[2] == 1:  # a decode step: one copy of the buffer with one slot replaced, not a gather of all
        slot = target[:, 0]
        index = slot.clamp_min(0)[:, None, None, None].expand(-1, buffer.shape[1], 1, buffer.shape[3])
        kept = torch.where((slot >= 0)[:, None, None, None], encode(new, buffer.dtype), buffer.gather(2, index))
        return buffer.scatter(2, index, kept)
    hit = target[:, :, None] == torch.arange(buffer.shape[2], device=target.device)  # [B, T, N]
    source = hit.long().argmax(1)  # [B, N]: which new token lands in each slot
    taken = new.gather(2, source[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3]))
    return torch.where(hit.any(1)[:, None, :, None], encode(taken, buffer.dtype), buffer)


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


def prompt_write(k, v, keys, values, sink_keys, sink_values, length):
    """``window_write`` for a whole unpadded prompt from the empty state (``length`` all 0), without
    slot bookkeeping: its last W tokens go to the ring (token n in slot n mod W: the tail rolled),
    its first S to the sinks; slots no token reaches keep what they held. Returns ``(keys, values,
    sink_keys, sink_values, length)``."""
    steps, window, sinks = k.shape[2], keys.shape[2], sink_keys.shape[2]

    def ring(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        new = encode(new, old.dtype)
        if steps >= window:
            return new[:, :, steps - window :].roll(steps % window, dims=2)
        return torch.cat([new, old[:, :, steps:]], dim=2)

    def sink(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return torch.cat([encode(new[:, :, :sinks], old.dtype), old[:, :, steps:]], dim=2)

    return ring(k, keys), ring(v, values), sink(k, sink_keys), sink(v, sink_values), length + steps
