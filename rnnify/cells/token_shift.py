"""A token shift: each token reads the vector of the token before it, carried as state
(docs/math.md §Token shift).

ZAYA's attention builds half of each value head from the previous token (its "delayed" value): a
layer computes f(x) for every token and hands token t the one of token t-1,

    y_t = x_{t-1}    (t > 1),        y_1 = first

where ``first`` is what the source computes for a sequence's first token (ZAYA: its projection of
zeros). Captured without a cache it is ``cat([first, x[:, :-1]], dim=1)``; kept as it is, every
step would read ``first``. The state that makes a step equal a prefill is the row's last real x,
``[B, C]``, and whether the row has read a token yet, ``[B, 1]`` (1 or 0): until it has, the next
token reads ``first``, which the graph computes on every call. This cell is not a ``--to``
target: ``rewrite_token_shifts`` puts one wherever the model has such a shift, and it computes the
original unchanged (``exact``): ``out, previous, seen = cell(x [B, T, C], first [B, 1, C], mask
[B, T], previous, seen)``.

Padding never enters the state (§Padding): a real token reads the last real token before it, and
padding leaves ``previous`` and ``seen`` as they were. ``naive_recurrent_token_shift`` is the
ground truth (a token at a time); ``token_shift`` is the cell's form (one gather).
"""

from __future__ import annotations

from typing import Any

import torch

from rnnify.cells.base import Cell, channel_spec, every_token_real


def naive_recurrent_token_shift(x, first, mask, previous, seen) -> tuple[torch.Tensor, ...]:
    """One token at a time; returns (out ``[B, T, C]``, previous, seen)."""
    outs = []
    for t in range(x.shape[1]):
        before = torch.where(seen > 0, previous, first[:, 0])
        real = mask[:, t, None]
        outs.append(torch.where(real, before, 0))
        previous = torch.where(real, x[:, t], previous)
        seen = torch.where(real, torch.ones_like(seen), seen)
    return torch.stack(outs, dim=1), previous, seen


def token_shift(x, first, mask, previous, seen) -> tuple[torch.Tensor, ...]:
    """Each token's input is gathered from ``[the token before the call, x_1..x_T]``; outputs at
    padding are whatever they read."""
    start = torch.where(seen[:, :, None] > 0, previous[:, None].to(x.dtype), first.to(x.dtype))  # [B, 1, C]
    window = torch.cat([start, x], dim=1)  # [B, 1+T, C]: entry t is token t (0: before the call)
    if every_token_real(mask):
        return window[:, :-1], window[:, -1], torch.ones_like(seen)
    index = torch.arange(1, x.shape[1] + 1, device=x.device) * mask  # each real token's entry; 0 at padding
    last = index.cummax(dim=1).values  # the last real token up to t (0: none in this call)
    before = torch.cat([torch.zeros_like(last[:, :1]), last[:, :-1]], dim=1)
    out = window.gather(1, before[..., None].expand(-1, -1, x.shape[2]))
    read = mask.any(1, keepdim=True)  # [B, 1]: a row with nothing real keeps its state
    last_real = window.gather(1, last[:, -1:, None].expand(-1, -1, x.shape[2]))[:, 0]
    previous = torch.where(read, last_real.to(previous.dtype), previous)
    return out, previous, torch.maximum(seen, read.to(seen.dtype))


class TokenShiftCell(Cell):
    """The shift of C channels by one token (``channel_spec``). Nothing else is an option."""

    target = "token_shift"
    own_layer = True
    state_names = ("previous", "seen")

    spec_for = staticmethod(channel_spec)

    def options(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        return "the previous token's vector"

    def init_state(self, batch_size, device, dtype):
        """The last real x ``[B, C]`` and whether there is one ``[B, 1]``."""
        channels = self.spec.num_heads
        return torch.zeros(batch_size, channels, device=device, dtype=dtype), torch.zeros(
            batch_size, 1, device=device, dtype=dtype
        )

    def forward(self, x, first, mask, previous, seen):
        out, new_previous, new_seen = token_shift(x, first, mask, previous, seen)
        return out, new_previous.to(previous.dtype), new_seen.to(seen.dtype)
