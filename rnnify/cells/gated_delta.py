"""A model's own Gated DeltaNet layer (the gated delta rule), carried as state (docs/math.md §State space layers).

Hybrids such as Qwen3-Next, Qwen3.5, OLMo-hybrid and Lara-mini mix tokens in some layers with the
gated delta rule (Yang, Kautz and Hatamizadeh 2024) instead of attention. Per value head h (of
H_v; each of the H_k query/key heads serves H_v / H_k consecutive value heads) and token t, with
the log decay g_t <= 0 and the writing strength beta_t that the layer computes, q and k
L2-normalised where the source asks (x / sqrt(|x|^2 + 1e-6)) and scale = d_k^-1/2:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,     u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)     [d_k, d_v]
    o_t = scale S_t^T q_t

(transformers' ``torch_chunk_gated_delta_rule``, the computation of fla's ``chunk_gated_delta_rule``).
The state that makes a step equal a prefill is S, ``[B, H_v, d_k, d_v]`` in fp32. This cell is
not a ``--to`` target: ``rewrite_scans`` puts one wherever the model has such a layer, whatever the
attention layers become, and it computes the original unchanged (``exact``). The layer's
projections, short convolution (a ``ShortConvCell``), decay and gate stay in the graph; the call is
``out, S = cell(q [B, T, H_k, d_k], k [B, T, H_k, d_k], v [B, T, H_v, d_v], g [B, T, H_v],
beta [B, T, H_v], mask [B, T], S)``, ``out`` ``[B, T, H_v, d_v]`` in q's dtype, as the source's
function returns it.

Padding never enters the state (§Padding): a padded token takes no step (g = 0 and beta = 0, so
S is kept and nothing is written). ``naive_recurrent_gated_delta`` is the ground truth (a token at
a time, fp64); ``chunk_gated_delta`` is the prefill (the WY / UT chunked form of
``rnnify.kernels.delta_rule``, docs/math.md §Delta rule); ``fused_recurrent_gated_delta`` is the
decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from rnnify.cells.base import Cell, CellSpec, zero_fp32_state
from rnnify.errors import check_int
from rnnify.kernels.delta_rule import chunk_delta_rule_reference

# the source's L2 normalisation, x / sqrt(|x|^2 + eps) (fla's l2norm)
L2NORM_EPS = 1e-6


def _by_head(q, k, v, g, beta, mask, l2norm: bool, dtype: torch.dtype):
    """q (L2-normalised if asked, and scaled) and k ``[b, t, H_v, d_k]``, v ``[b, t, H_v, d_v]``,
    g and beta ``[b, t, H_v]`` zero at padding, all in ``dtype``."""
    group = v.shape[2] // k.shape[2]
    q, k = (x.to(dtype).repeat_interleave(group, dim=2) for x in (q, k))
    if l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q, k))
    real = mask[..., None].to(dtype)
    return q * q.shape[-1] ** -0.5, k, v.to(dtype), g.to(dtype) * real, beta.to(dtype) * real


def naive_recurrent_gated_delta(q, k, v, g, beta, mask, state, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time in fp64, from the equations above; returns (out fp64 ``[b, t, H_v, d_v]``, state)."""
    q, k, v, g, beta = _by_head(q, k, v, g, beta, mask, l2norm, torch.float64)
    S, outs = state.to(torch.float64), []
    for t in range(q.shape[1]):
        S = torch.exp(g[:, t])[..., None, None] * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, dim=1), S


def chunk_gated_delta(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in fp32, a chunk of tokens at a time (``chunk_delta_rule_reference``: one
    triangular solve per chunk for the writes, the state carried from chunk to chunk); inputs as
    ``_by_head`` returns them, q already scaled."""
    return chunk_delta_rule_reference(q, k, v, beta, g, scale=1.0, initial_state=state)


def fused_recurrent_gated_delta(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (``t`` = 1) in fp32: the step of the equations above."""
    state = torch.exp(g[:, 0])[..., None, None] * state
    u = beta[:, 0, :, None] * (v[:, 0] - torch.einsum("bhk,bhkv->bhv", k[:, 0], state))
    state = state + k[:, 0, :, :, None] * u[:, :, None, :]
    return torch.einsum("bhk,bhkv->bhv", q[:, 0], state)[:, None], state


class GatedDeltaRuleCell(Cell):
    """The gated delta rule over H_v value heads of width d_v, read by H_k query/key heads of width d_k.

    Its spec describes the layer in attention's terms: each value head keeps its own [d_k, d_v]
    state, as a linear-attention head would, so ``num_heads`` = ``num_kv_heads`` = H_v,
    ``head_dim`` = d_k, ``value_dim`` = d_v and ``scale`` = d_k^-1/2 (the source's).
    """

    target = "gated_delta_rule"
    own_layer = True
    state_names = ("recurrent",)
    # (inputs by head in fp32, prefill, step); a subclass with another decay brings its own
    forms: ClassVar[tuple[Callable, Callable, Callable]] = (_by_head, chunk_gated_delta, fused_recurrent_gated_delta)

    def __init__(self, spec: CellSpec, key_heads: int, l2norm: bool):
        super().__init__(spec)
        self.key_heads = check_int("key_heads", key_heads)
        if spec.num_heads % self.key_heads:
            raise ValueError(f"num_heads ({spec.num_heads}) must be a multiple of key_heads ({self.key_heads})")
        if not isinstance(l2norm, bool):
            raise ValueError(f"l2norm must be true or false, got {l2norm!r}")
        self.l2norm = l2norm

    @staticmethod
    def spec_for(value_heads: int, key_dim: int, value_dim: int) -> CellSpec:
        """The spec of ``value_heads`` states of ``key_dim`` x ``value_dim``."""
        return CellSpec(
            num_heads=value_heads, num_kv_heads=value_heads, head_dim=key_dim, value_dim=value_dim, scale=key_dim**-0.5
        )

    def options(self) -> dict[str, Any]:
        return {"key_heads": self.key_heads, "l2norm": self.l2norm}

    def describe(self) -> str:
        return "the model's own Gated DeltaNet layer"

    def init_state(self, batch_size, device, dtype):
        """S of every value head, ``[B, H_v, d_k, d_v]``."""
        return zero_fp32_state(batch_size, self.spec.num_heads, self.spec.head_dim, self.spec.value_dim, device=device)

    def forward(self, q, k, v, g, beta, mask, recurrent):
        by_head, prefill, step = self.forms
        inputs = by_head(q, k, v, g, beta, mask, self.l2norm, torch.float32)
        out, recurrent = (step if q.shape[1] == 1 else prefill)(*inputs, recurrent.to(torch.float32))
        return out.to(q.dtype), recurrent
