"""A model's own Kimi Delta Attention layer (KDA), carried as state (docs/math.md §State space layers).

Kimi-Linear and Bailing-hybrid mix tokens in some layers with Kimi Delta Attention (Kimi Team
2025): the gated delta rule with a decay per key channel (a diagonal gate) instead of one scalar
per head. Per head h (of H; queries, keys and values have the same heads) and token t, with the
log decays g_t ``[d_k]`` <= 0 and the writing strength beta_t that the layer computes, q and k
L2-normalised where the source asks (x / sqrt(|x|^2 + 1e-6)) and scale = d_k^-1/2:

    S_t = diag(exp(g_t)) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t)   [d_k, d_v]
    o_t = scale S_t^T q_t

(transformers' ``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention``, the
computations of fla's ``chunk_kda`` and ``fused_recurrent_kda``). The state that makes a step equal
a prefill is S, ``[B, H, d_k, d_v]`` in fp32. This cell is not a ``--to`` target:
``rewrite_scans`` puts one wherever the model has such a layer, whatever the attention layers
become, and it computes the original unchanged (``exact``). The layer's projections, short
convolution (a ``ShortConvCell``), forget gate and output gate stay in the graph; the call is
``out, S = cell(q [B, T, H, d_k], k [B, T, H, d_k], v [B, T, H, d_v], g [B, T, H, d_k],
beta [B, T, H], mask [B, T], S)``, ``out`` ``[B, T, H, d_v]`` in q's dtype, as the source's
function returns it.

Chunked (the WY / UT form of docs/math.md §Delta rule with a vector decay), chunks of C tokens
from the state H, with c_i ``[d_k]`` the cumulative log decay from the chunk's start and
D_ijk = exp(c_ik - c_jk) for j <= i (masked before the exponential: no positive exponent):

    A_ij = beta_i sum_k k_ik D_ijk k_jk  (j < i)      M = (I + A)^-1
    W = M diag(beta) (K * exp(c)),  U = M diag(beta) V            (u = U - W H)
    o = scale ((Q * exp(c)) H + P u),   P_ij = sum_k q_ik D_ijk k_jk  (j <= i)
    H' = diag(exp(c_C)) H + (K * exp(c_C - c))^T u

Unlike a scalar decay, D does not factor into a matrix product of the chunk's keys and queries
without exponents of either sign, so A and P are built from D itself, ``[C, C, d_k]`` per chunk
and head: one chunk at a time, which bounds the memory to one chunk's D.

Padding never enters the state (§Padding): a padded token takes no step (g = 0 and beta = 0, so
S is kept and nothing is written). ``naive_recurrent_kda`` is the ground truth (a token at a time,
fp64); ``chunk_kda`` is the prefill; ``fused_recurrent_kda`` is the decode step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rnnify.cells.base import CellSpec
from rnnify.cells.gated_delta import GatedDeltaRuleCell

# the source's L2 normalisation, x / sqrt(|x|^2 + eps) (fla's l2norm)
L2NORM_EPS = 1e-6
# Tokens per chunk of the prefill: a chunk's decays D hold chunk^2 * d_k entries per head.
CHUNK = 64


def _by_head(q, k, v, g, beta, mask, l2norm: bool, dtype: torch.dtype):
    """q (L2-normalised if asked, and scaled) and k ``[b, t, H, d_k]``, v ``[b, t, H, d_v]``, g
    ``[b, t, H, d_k]`` and beta ``[b, t, H]`` zero at padding, all in ``dtype``."""
    q, k = q.to(dtype), k.to(dtype)
    if l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q, k))
    real = mask[..., None].to(dtype)
    return q * q.shape[-1] ** -0.5, k, v.to(dtype), g.to(dtype) * real[..., None], beta.to(dtype) * real


def naive_recurrent_kda(q, k, v, g, beta, mask, state, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time in fp64, from the equations above; returns (out fp64 ``[b, t, H, d_v]``, state)."""
    q, k, v, g, beta = _by_head(q, k, v, g, beta, mask, l2norm, torch.float64)
    S, outs = state.to(torch.float64), []
    for t in range(q.shape[1]):
        S = torch.exp(g[:, t])[..., None] * S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, dim=1), S


def chunk_kda(q, k, v, g, beta, state, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form above in fp32, ``chunk`` tokens at a time; inputs as ``_by_head`` returns
    them (q already scaled), state ``[b, H, d_k, d_v]``. The tokens are padded to whole chunks with
    g = 0 and beta = 0 (no decay, no write), and the padding cut from the outputs."""
    b, t, heads, key_dim = k.shape
    pad = -t % chunk
    n = (t + pad) // chunk

    def chunks(x):  # [b, t, H, ...] -> [b, H, n, C, ...], zero-padded
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(b, n, chunk, *x.shape[2:]).movedim(3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    c = g.cumsum(dim=3)  # [b, H, n, C, d_k]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    outs = []
    for i in range(n):
        c_i, k_i, beta_i = c[:, :, i], k[:, :, i], beta[:, :, i, :, None]
        gaps = c_i[:, :, :, None] - c_i[:, :, None]  # [b, H, C, C, d_k]: c_i - c_j
        decay = torch.exp(gaps.masked_fill(~causal[..., None], -torch.inf))
        keys = decay * k_i[:, :, None]  # D_ij * k_j
        A = torch.einsum("bhik,bhijk->bhij", beta_i * k_i, keys).masked_fill(~strict, 0.0)
        scores = torch.einsum("bhik,bhijk->bhij", q[:, :, i], keys)  # P, zero above the diagonal
        rhs = beta_i * torch.cat([v[:, :, i], k_i * torch.exp(c_i)], dim=-1)
        UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        U, W = UW[..., : v.shape[-1]], UW[..., v.shape[-1] :]
        u = U - W @ state
        outs.append((q[:, :, i] * torch.exp(c_i)) @ state + scores @ u)
        last = c_i[:, :, -1:]  # [b, H, 1, d_k]
        state = torch.exp(last).transpose(-1, -2) * state + (k_i * torch.exp(last - c_i)).transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2)  # [b, H, n, C, d_v]
    return out.movedim(1, 3).reshape(b, n * chunk, heads, -1)[:, :t], state


def fused_recurrent_kda(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (``t`` = 1) in fp32: the step of the equations above."""
    state = torch.exp(g[:, 0])[..., None] * state
    u = beta[:, 0, :, None] * (v[:, 0] - torch.einsum("bhk,bhkv->bhv", k[:, 0], state))
    state = state + k[:, 0, :, :, None] * u[:, :, None, :]
    return torch.einsum("bhk,bhkv->bhv", q[:, 0], state)[:, None], state


class KimiDeltaAttentionCell(GatedDeltaRuleCell):
    """Kimi Delta Attention over H heads, keys of width d_k (each channel with its own decay) and
    values of width d_v: the gated delta rule's cell with a decay per key channel, and as many key
    heads as value heads (its spec as ``GatedDeltaRuleCell``'s).
    """

    target = "kda"
    forms = (_by_head, chunk_kda, fused_recurrent_kda)

    def __init__(self, spec: CellSpec, l2norm: bool):
        super().__init__(spec, spec.num_heads, l2norm)

    def options(self) -> dict[str, Any]:
        return {"l2norm": self.l2norm}

    def describe(self) -> str:
        return "the model's own Kimi Delta Attention layer"
