"""The hybrid's window part and the tokens that leave the window for its memory: what every
memory of the hybrid shares (``cells/linear_memory.py``, ``cells/delta_memory.py``).

The math: docs/math.md §Hybrid window and linear.

Query i reads the last W tokens and the first S (the sinks) by softmax, as the ``window`` target
does (``cells/window.py``), and its memory reads the rest: as real token i >= W + S arrives, token
i - W leaves the ring for the memory (sinks never leave). A memory writes the leaving tokens in
order, so they come lined up with the arriving ones, one per new token, zeros where none leaves.
The window part comes unnormalised, f sum exp(s - m) v and f sum exp(s - m) (f the window's
factor f_h, m the max over the query's window and sinks), so the linear memory's sums can join
it in one normalised sum and a memory with no normaliser can still read w / u.

``window_and_leaving`` reads a whole unpadded prompt from the empty state by the window target's
band form (``prompt_window_and_leaving``: the leaving tokens are the keys and values shifted by W),
anything else chunk by chunk (``chunked_window_and_leaving``: the masked quadratic ``window_part``
over sinks + ring + new tokens, or ``fused_window_step`` through ``rnnify.kernels.window_attn_step``
for a decode token on kernels). Shapes: q ``[B, Hkv, G, T, d]`` fp32, k/v ``[B, Hkv, T, d]``, mask
``[B, T]``, ``window_state`` the window target's ``(keys, values [B, Hkv, W, d], sink_keys,
sink_values [B, Hkv, S, d], length [B])``, factor f ``[Hkv, G]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rnnify.cells.online_softmax import finite_or_zero
from rnnify.cells.window import PROMPT_BLOCK, grouped_window_attn_step, prompt_window, whole_prompt
from rnnify.kernels.ring import held_index, token_index, window_write

FeatureMap = Callable[[torch.Tensor], torch.Tensor]


def visible_keys(k, v, mask, keys, values, sink_keys, sink_values, length):
    """Every key a new query might see, sinks, ring, then new tokens, with token indices (-1: none):
    ``(q_index [B, T], key_index [B, S + W + T], keys, values [B, Hkv, S + W + T, d] fp32)``."""
    q_index = token_index(length, mask)
    key_index = torch.cat([held_index(length, keys.shape[2], sink_keys.shape[2]), q_index], dim=1)
    all_keys = torch.cat([sink_keys, keys, k.to(keys.dtype)], dim=2).float()
    all_values = torch.cat([sink_values, values, v.to(values.dtype)], dim=2).float()
    return q_index, key_index, all_keys, all_values


def window_part(q, q_index, key_index, all_keys, all_values, window: int, sinks: int, factor, scale: float):
    """f sum exp(s - m) v and f sum exp(s - m) over each query's window and sinks, m the max over them."""
    i, j = q_index[:, :, None], key_index[:, None, :]
    in_window = ((j >= 0) & (j <= i) & ((i - j < window) | (j < sinks)))[:, None, None]  # [B, 1, 1, T, N]
    scores = (scale * torch.einsum("bhgtd,bhnd->bhgtn", q, all_keys)).masked_fill(~in_window, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = factor[..., None, None] * torch.exp(scores - finite_or_zero(m))
    return p @ all_values[:, :, None], p.sum(-1)


def leaving(q_index, key_index, all_keys, all_values, window: int, sinks: int):
    """The key and value that leave the window for the memory as each new token arrives
    (token i - W for real token i >= W + S: sinks never leave; zeros where none leaves)
    ``[B, Hkv, T, d]``, and whether one leaves ``[B, T]``."""
    leaves = q_index >= window + sinks
    source = (key_index[:, None, :] == (q_index - window)[:, :, None]).long().argmax(-1)  # [B, T]

    def take(x: torch.Tensor) -> torch.Tensor:
        taken = x.gather(2, source[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
        return torch.where(leaves[:, None, :, None], taken, 0.0)

    return take(all_keys), take(all_values), leaves


def query_and_leaving_features(phi: FeatureMap, q, old_key):
    """phi of the G queries ``[B, Hkv, G, 1, F]`` and of the key leaving the window ``[B, Hkv, 1, F]``, in one call."""
    features = phi(torch.cat([q, old_key[:, :, None]], dim=2))
    return features[:, :, : q.shape[2]], features[:, :, q.shape[2]]


def fused_window_step(q, k, v, mask, window_state, factor, scale: float, backend: str = "auto"):
    """The window part of one decode token through ``rnnify.kernels.window_attn_step``
    (``grouped_window_attn_step``): its normalised output o and softmax denominator u (over the
    sinks and the ring, self included, relative to the scores' max m) give f sum exp(s - m) v = f o u
    and f sum exp(s - m) = f u. Returns ``(window_num, window_den, (keys, values, sink_keys,
    sink_values, length))``."""
    o, state, (_, u) = grouped_window_attn_step(q, k, v, mask, window_state, scale, backend, return_stats=True)
    window_den = factor[..., None] * u.reshape(*q.shape[:4])
    return o.reshape(*q.shape[:4], -1) * window_den[..., None], window_den, state


def window_and_leaving(q, k, v, mask, window_state, factor, scale: float, chunk_size: int, backend: str | None):
    """The window part and the tokens leaving the window for the memory: ``(window_num, window_den,
    old_keys, old_values, leaves [B, T], window_state)``; ``prompt_window_and_leaving`` for a whole
    unpadded prompt, else ``chunked_window_and_leaving``."""
    if whole_prompt(mask, window_state[4]):
        return prompt_window_and_leaving(q, k, v, window_state, factor, scale)
    return chunked_window_and_leaving(q, k, v, mask, window_state, factor, scale, chunk_size, backend)


def factored_prompt_window(q, k, v, window_state, factor, scale: float, block: int = PROMPT_BLOCK):
    """``prompt_window`` with its window part as the terms of the normalised sum, f w and f u:
    ``(k, v, window_num, window_den, window_state)``."""
    k, v, o, u, window_state = prompt_window(q, k, v, window_state, scale, block)
    window_den = factor[..., None] * u
    return k, v, o * window_den[..., None], window_den, window_state


def prompt_window_and_leaving(q, k, v, window_state, factor, scale: float, block: int = PROMPT_BLOCK):
    """``chunked_window_and_leaving`` for a whole unpadded prompt from the empty state: ``factored_prompt_window``,
    and token i - W leaving as token i >= W + S arrives (the keys and values shifted by W)."""
    window, sinks, steps = window_state[0].shape[2], window_state[2].shape[2], k.shape[2]
    k, v, window_num, window_den, window_state = factored_prompt_window(q, k, v, window_state, factor, scale, block)
    leaves = (torch.arange(steps, device=q.device) >= window + sinks).expand(q.shape[0], -1)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, 0, window, 0))[:, :, :steps]
        return torch.where(leaves[:, None, :, None], x, 0.0)

    return window_num, window_den, shifted(k), shifted(v), leaves, window_state


def chunked_window_and_leaving(q, k, v, mask, window_state, factor, scale: float, chunk_size: int, backend: str | None):
    """The window part chunk by chunk (``fused_window_step`` for a decode token once ``backend`` is
    set, else ``window_part``) and the tokens leaving the window for the memory (``leaving``):
    ``(window_num, window_den, old_keys, old_values, leaves [B, T], window_state)``."""
    window, sinks = window_state[0].shape[2], window_state[2].shape[2]
    parts, left = [], []
    for start in range(0, q.shape[3], chunk_size):
        end = start + chunk_size
        chunk = (k[:, :, start:end], v[:, :, start:end], mask[:, start:end])
        held = visible_keys(*chunk, *window_state)
        left.append(leaving(*held, window, sinks))
        if q.shape[3] == 1 and backend is not None:
            *part, window_state = fused_window_step(q, *chunk, window_state, factor, scale, backend)
        else:
            part = window_part(q[:, :, :, start:end], *held, window, sinks, factor, scale)
            window_state = window_write(*chunk, *window_state)
        parts.append(part)
    window_num, window_den = (torch.cat([part[i] for part in parts], dim=3) for i in (0, 1))
    old_keys, old_values = (torch.cat([part[i] for part in left], dim=2) for i in (0, 1))
    leaves = torch.cat([part[2] for part in left], dim=1)
    return window_num, window_den, old_keys, old_values, leaves, window_state
