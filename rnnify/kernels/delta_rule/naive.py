"""Ground truth: the (gated) delta rule as a plain loop over tokens, and its chunked PyTorch form
(docs/math.md §Delta rule).

Per kv head, with the state kept transposed, H = S^T ``[K, V]`` (the layout of the linear-attention
ops' k^T v), writing strength beta_t in (0, 1) and log decay g_t = log alpha_t <= 0 (absent: 0):

    H_t = alpha_t (I - beta_t k_t k_t^T) H_{t-1} + beta_t k_t v_t^T
        = alpha_t H_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - alpha_t H_{t-1}^T k_t)
    o_t = scale H_t^T q_t

Chunked (WY / UT form, Yang et al. 2024), chunks of C tokens starting from H, with c_i the
cumulative log decay from the chunk's start (c_i = g_1 + ... + g_i) and D_ij = exp(c_i - c_j),
j <= i, taken after masking (no positive exponent):

    A    = strictly_lower(diag(beta) K K^T * D)          M = (I + A)^-1
    W    = M diag(beta exp(c)) K,  U = M diag(beta) V    (the u_t above: U - W H)
    o    = scale (diag(exp(c)) Q H + (Q K^T * D * causal) (U - W H))
    H'   = exp(c_C) H + K^T diag(exp(c_C - c)) (U - W H)

Layout (fla's): q ``[B, T, H, K]``, k ``[B, T, H_kv, K]``, v ``[B, T, H_kv, V]``, beta and g
``[B, T, H_kv]``; query head i reads kv head i // (H / H_kv). State ``[B, H_kv, K, V]``, fp32
(float64 when the inputs are float64: the loop is the float64-checkable reference).
"""

from __future__ import annotations

import torch

from rnnify.kernels.utils import check_qkv


def check_inputs(q, k, v, beta, g) -> None:
    check_qkv(q, k, v)
    if beta is None:
        raise ValueError("beta (the writing strength, [B, T, H_kv]) is required")
    for name, x in (("beta", beta), ("g", g)):
        if x is not None and tuple(x.shape) != tuple(k.shape[:3]):
            raise ValueError(f"{name} must be [B, T, H_kv] = {tuple(k.shape[:3])}, got {tuple(x.shape)}")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def naive_recurrent_delta_rule(q, k, v, beta, g=None, scale=None, initial_state=None, output_final_state=False):
    """The loop above, one token at a time: the reference every other form is tested against."""
    check_inputs(q, k, v, beta, g)
    B, T, H, K = q.shape
    Hkv, V, dtype, ct = k.shape[2], v.shape[-1], v.dtype, _compute_dtype(q)
    scale = K ** -0.5 if scale is None else scale
    q = q.to(ct).reshape(B, T, Hkv, H // Hkv, K) * scale
    k, v, beta = k.to(ct), v.to(ct), beta.to(ct)
    S = q.new_zeros(B, Hkv, K, V) if initial_state is None else initial_state.to(ct)
    outs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t].to(ct).exp()[..., None, None]
        k_t = k[:, t]  # [B, Hkv, K]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t[..., None] * u[:, :, None, :]
        outs.append(torch.einsum("bhgk,bhkv->bhgv", q[:, t], S).reshape(B, H, V))
    return torch.stack(outs, dim=1).to(dtype), (S if output_final_state else None)


def chunk_delta_rule_reference(q, k, v, beta, g=None, scale=None, initial_state=None, chunk_size: int = 64):
    """The chunked form above in PyTorch (what the ops run off CUDA): ``(o, final_state)``, differentiable.

    M diag(beta) [V | exp(c) K] is one unit-lower-triangular solve per chunk."""
    check_inputs(q, k, v, beta, g)
    B, T, H, K = q.shape
    Hkv, V, dtype, ct = k.shape[2], v.shape[-1], v.dtype, _compute_dtype(q)
    G = H // Hkv
    scale = K ** -0.5 if scale is None else scale
    # [B, Hkv, (G,) T, .] layout, fp32 (or fp64)
    q = (q.to(ct) * scale).reshape(B, T, Hkv, G, K).permute(0, 2, 3, 1, 4)
    k, v = k.to(ct).transpose(1, 2), v.to(ct).transpose(1, 2)
    beta = beta.to(ct).transpose(1, 2)
    g = q.new_zeros(B, Hkv, T) if g is None else g.to(ct).transpose(1, 2)
    S = q.new_zeros(B, Hkv, K, V) if initial_state is None else initial_state.to(ct)
    outs = []
    for start in range(0, T, chunk_size):
        sl = slice(start, start + chunk_size)
        q_c, k_c, v_c, b_c, c = q[:, :, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl], g[:, :, sl].cumsum(-1)
        C = k_c.shape[2]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(causal, c[..., :, None] - c[..., None, :], float("-inf")).exp()  # D_ij, 0 above
        strict = causal & ~torch.eye(C, dtype=torch.bool, device=q.device)
        A = torch.where(strict, b_c[..., None] * (k_c @ k_c.transpose(-1, -2)) * decay, 0.0)
        eye = torch.eye(C, dtype=ct, device=q.device)
        rhs = b_c[..., None] * torch.cat([v_c, c.exp()[..., None] * k_c], dim=-1)
        UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        u = UW[..., :V] - UW[..., V:] @ S  # U - W H  [B, Hkv, C, V]
        scores = (q_c @ k_c[:, :, None].transpose(-1, -2)) * decay[:, :, None]  # [B, Hkv, G, C, C]
        outs.append((c.exp()[:, :, None, :, None] * q_c) @ S[:, :, None] + scores @ u[:, :, None])
        to_end = (c[..., -1:] - c).exp()  # exp(c_C - c_j)
        S = c[..., -1, None, None].exp() * S + k_c.transpose(-1, -2) @ (to_end[..., None] * u)
    o = torch.cat(outs, dim=3).permute(0, 3, 1, 2, 4).reshape(B, T, H, V)
    return o.to(dtype), S
