"""A model's own lightning attention layer (MiniMax), carried as state (docs/math.md §State space layers).

MiniMax-Text-01 mixes tokens in seven of every eight layers with lightning attention (Qin et al.
2024): linear attention without a normaliser or feature map whose state decays by a fixed rate per
head, λ_h = exp(-s_h) with the source's slope s_h (``slope_rate``). Per head, with q, k, v the
layer's activated projections,

    S_t = λ_h S_{t-1} + k_tᵀ v_t        [D, D]
    o_t = q_t S_t

which is §Gated linear attention's RetNet form with the identity map, no normaliser and the log
gate -s_h, so this cell computes it with ``cells.gated``'s forms. The source writes the prefill as
a loop over blocks of 256 tokens inside its layer's forward, which export unrolls for the example's
length; the stand-in hands ``rnnify::lightning_attention`` the layer's q, k, v and slopes. The
state that makes a step equal a prefill is S, ``[B, H, D, D]`` in fp32: ``out, S = cell(q, k, v
[B, T, H, D], slope [H, ...], mask [B, T], S)``, ``out`` ``[B, T, H, D]`` in q's dtype. This cell is not a ``--to``
target: ``rewrite_scans`` puts one wherever the model has such a layer, and it computes the
original unchanged (``exact``).

Padding never enters the state (§Padding): a padded token decays nothing and adds nothing.
``naive_recurrent_lightning_attention`` is the ground truth (a token at a time, fp64);
``chunk_gated_attn`` (quadratic within chunks of ``CHUNK`` tokens, S carried between chunks) is the
prefill and ``step_gated_attn`` the decode step; with ``use_kernels`` both run
``rnnify.kernels``' linear attention ops with the scalar gate.
"""

from __future__ import annotations

from typing import Any

import torch

from rnnify.cells.base import Cell, CellSpec, zero_fp32_state
from rnnify.cells.gated import step_gated_attn
from rnnify.cells.linear import IdentityFeatureMap, fused_feature_attn, masked
from rnnify.kernels.linear_attn.naive import chunk_gated_attn

# Tokens per chunk of the prefill: the within-chunk product holds chunk^2 decays per head.
CHUNK = 64


def _log_gates(slope, mask) -> torch.Tensor:
    """log λ = -s per head and token, ``[B, H, T, 1]`` fp32, 0 at padding."""
    batch, length = mask.shape
    log_a = -slope.reshape(1, -1, 1, 1).float().expand(batch, -1, length, 1)
    return masked(log_a, mask)


def naive_recurrent_lightning_attention(q, k, v, slope, mask, S) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time in fp64, from the equation above; returns (out fp64 ``[B, T, H, D]``, S)."""
    q, k, v, S, mask = (*(x.to(torch.float64) for x in (q, k, v, S)), mask.to(torch.bool))
    decay = torch.exp(-slope.to(torch.float64).reshape(1, -1, 1, 1))
    outs = []
    for t in range(q.shape[1]):
        real = mask[:, t, None, None, None]
        S = torch.where(real, decay * S + k[:, t, :, :, None] * v[:, t, :, None, :], S)
        outs.append((q[:, t, :, None] @ S)[:, :, 0])
    return torch.stack(outs, dim=1), S


class LightningAttentionCell(Cell):
    """Lightning attention over H heads of width D (``spec_for``). Nothing else is an option: the
    sizes are the spec's and the slopes the graph's."""

    target = "lightning_attention"
    own_layer = True
    state_names = ("S",)
    own_forms_without_triton = frozenset({"decode"})  # the step is one multiply-add, as GatedCell's

    @staticmethod
    def spec_for(heads: int, head_dim: int) -> CellSpec:
        return CellSpec(num_heads=heads, num_kv_heads=heads, head_dim=head_dim, value_dim=head_dim, scale=1.0)

    def options(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        return "the model's own lightning attention"

    def fused_ops(self) -> dict[str, str]:
        return {"prefill": "chunk_linear_attn", "decode": "fused_recurrent_linear_attn"}

    def init_state(self, batch_size, device, dtype):
        """S of every head, ``[B, H, D, D]``."""
        return zero_fp32_state(batch_size, self.spec.num_heads, self.spec.head_dim, self.spec.value_dim, device=device)

    def forward(self, q, k, v, slope, mask, S):
        mask = mask.to(torch.bool)
        log_a = _log_gates(slope, mask)
        queries = q.float().transpose(1, 2)[:, :, None]  # [B, H, 1, T, D]: one query head per head
        k, v = (masked(x.float().transpose(1, 2), mask) for x in (k, v))  # padding: k = 0, v = 0, λ = 1
        S = S.to(torch.float32)
        backend = self.backend(q, q.shape[1])
        if backend is not None:
            phi = IdentityFeatureMap(self.spec)
            out, S, _ = fused_feature_attn(queries, k, v, S, None, phi, mask, log_a=log_a, backend=backend)
        elif q.shape[1] == 1:
            out, S, _ = step_gated_attn(queries, k, v, log_a, S)
        else:
            out, S, _ = chunk_gated_attn(queries, k, v, log_a, S, chunk_size=CHUNK)
        return out[:, :, 0].transpose(1, 2).to(q.dtype), S
