"""A model's own RG-LRU layer (Griffin's real-gated linear recurrent unit), carried as state
(docs/math.md §State space layers).

RecurrentGemma mixes tokens in two of every three layers with Griffin's recurrent block (De et al.
2024): a short convolution (``ShortConvCell``), then the RG-LRU. Per channel, with gates computed
from the token alone,

    a_t = exp(-c softplus(Λ) r_t)        (a_t = 0 at a row's first token: the source resets there)
    h_t = a_t h_{t-1} + u_t,             u_t = sqrt(1 - a_t²) (i_t x_t)   (u_t = i_t x_t at the reset)

The graph keeps the gates, the decay and the normalised input as the source computes them; only the
recurrence h_t = a_t h_{t-1} + u_t (§Scan operators' first-order linear recurrence, elementwise) is
this cell's. Its state is h, ``[B, D]`` in fp32, as the source accumulates it: ``out, h = cell(u
[B, T, D], a [B, T, D], mask [B, T], h)``, ``out`` the states h_t in u's dtype. This cell is not a
``--to`` target: ``rewrite_scans`` puts one wherever the model has such a layer, and it computes the
original unchanged (``exact``).

Padding never enters the state (§Padding): a padded token takes no step (a = 1, u = 0).
``naive_recurrent_rg_lru`` is the ground truth (a token at a time, fp64); ``chunk_rg_lru`` is the
prefill, doubling within chunks of ``CHUNK`` tokens with h carried from chunk to chunk;
``fused_recurrent_rg_lru`` is the decode step. With ``use_kernels`` the prefill runs
``rnnify.kernels.linear_recurrence`` (Triton on CUDA; off Triton the doubling form, faster than the
op's token loop).
"""

from __future__ import annotations

from typing import Any

import torch

from rnnify import kernels
from rnnify.cells.base import Cell, channel_spec, zero_fp32_state
from rnnify.kernels.scan import doubling_linear_recurrence

# Tokens per chunk of the prefill: the doubling scan holds a chunk's [L, D] states and decays.
CHUNK = 64


def _steps(u, a, mask, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """u and a in ``dtype``, a padded token's step the identity (a = 1, u = 0)."""
    real = mask[..., None]
    return torch.where(real, u.to(dtype), 0.0), torch.where(real, a.to(dtype), 1.0)


def naive_recurrent_rg_lru(u, a, mask, h) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time in fp64, from the equation above; returns (out fp64 ``[b, t, D]``, h)."""
    u, a = _steps(u, a, mask, torch.float64)
    h, outs = h.to(torch.float64), []
    for t in range(u.shape[1]):
        h = a[:, t] * h + u[:, t]
        outs.append(h)
    return torch.stack(outs, dim=1), h


def chunk_rg_lru(u, a, h, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, fp32, ``chunk`` tokens at a time: within a chunk the pairs (a_t, u_t) are combined
    by doubling (``doubling_linear_recurrence``), so h_t = a_t h_in + u_t with h_in the state entering
    the chunk. u, a ``[b, t, D]`` (padding already the identity), h ``[b, D]``."""
    outs = []
    for start in range(0, u.shape[1], chunk):
        decay, added = doubling_linear_recurrence(a[:, start : start + chunk], u[:, start : start + chunk])
        states = decay * h[:, None] + added
        outs.append(states)
        h = states[:, -1]
    return torch.cat(outs, dim=1), h


def fused_recurrent_rg_lru(u, a, h) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (``t`` = 1) in fp32: the step of the equation above."""
    h = a[:, 0] * h + u[:, 0]
    return h[:, None], h


class RGLRUCell(Cell):
    """The RG-LRU's recurrence over D channels (``channel_spec``). Nothing else is an option: the sizes
    are the spec's, and the gates are the graph's."""

    target = "rg_lru"
    own_layer = True
    state_names = ("h",)
    own_forms_without_triton = frozenset({"prefill"})

    spec_for = staticmethod(channel_spec)

    def options(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        return "the model's own RG-LRU recurrence"

    def fused_ops(self) -> dict[str, str]:
        return {"prefill": "linear_recurrence"}

    def init_state(self, batch_size, device, dtype):
        """h of every channel, ``[B, D]``."""
        return zero_fp32_state(batch_size, self.spec.num_heads, device=device)

    def forward(self, u, a, mask, h):
        steps, decays = _steps(u, a, mask, torch.float32)
        backend = self.backend(u, u.shape[1])
        if u.shape[1] == 1:
            out, h = fused_recurrent_rg_lru(steps, decays, h.to(torch.float32))
        elif backend is not None:
            out, h = kernels.linear_recurrence(decays, steps, h, output_final_state=True, backend=backend)
        else:
            out, h = chunk_rg_lru(steps, decays, h.to(torch.float32))
        return out.to(u.dtype), h
