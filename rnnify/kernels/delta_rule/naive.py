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
import torch.nn.functional as F

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
    scale = K**-0.5 if scale is None else scale
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

    Everything that does not read the state (D, M by one unit-lower-triangular solve, U, W, the
    intra-chunk scores) is computed for all chunks at once; only U - W H, the outputs and the
    state update walk the chunks in order. T is padded to whole chunks with beta = 0, g = 0 (no
    write, no decay), and the padding cut from the outputs."""
    check_inputs(q, k, v, beta, g)
    B, T, H, K = q.shape
    Hkv, V, dtype, ct = k.shape[2], v.shape[-1], v.dtype, _compute_dtype(q)
    G, C = H // Hkv, chunk_size
    N = -(-T // C)
    scale = K**-0.5 if scale is None else scale

    def chunks(x):  # [B, T, Hkv, ...] -> [B, Hkv, N, C, ...], zero-padded
        x = F.pad(x.to(ct), (0, 0) * (x.dim() - 2) + (0, N * C - T))
        return x.reshape(B, N, C, *x.shape[2:]).movedim(3, 1)

    q = chunks(q.reshape(B, T, Hkv, G, K) * scale)  # [B, Hkv, N, C, G, K]
    q = q.permute(0, 1, 2, 4, 3, 5)  # [B, Hkv, N, G, C, K]
    k, v, beta = chunks(k), chunks(v), chunks(beta)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal & ~torch.eye(C, dtype=torch.bool, device=q.device)
    if g is None:  # no decay: D is the causal mask, exp(c) = 1
        decay, q_start, to_end, total, k_start = causal.to(ct), q, k, None, k
    else:
        c = chunks(g).cumsum(-1)
        decay = torch.where(causal, c[..., :, None] - c[..., None, :], float("-inf")).exp()  # D_ij, 0 above
        q_start = c.exp()[:, :, :, None, :, None] * q  # exp(c_i) q_i: what reads the chunk's starting state
        to_end = (c[..., -1:] - c).exp()[..., None] * k  # exp(c_C - c_j) k_j
        total = c[..., -1].exp()  # [B, Hkv, N]
        k_start = c.exp()[..., None] * k
    A = torch.where(strict, beta[..., None] * (k @ k.transpose(-1, -2)) * decay, 0.0)
    eye = torch.eye(C, dtype=ct, device=q.device)
    rhs = beta[..., None] * torch.cat([v, k_start], dim=-1)
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :V], UW[..., V:]
    scores = (q @ k[:, :, :, None].transpose(-1, -2)) * (
        decay if g is None else decay[:, :, :, None]
    )  # [B, Hkv, N, G, C, C]
    S = q.new_zeros(B, Hkv, K, V) if initial_state is None else initial_state.to(ct)
    outs = []
    for n in range(N):
        u = U[:, :, n] - W[:, :, n] @ S  # U - W H  [B, Hkv, C, V]
        outs.append(q_start[:, :, n] @ S[:, :, None] + scores[:, :, n] @ u[:, :, None])
        S = S if total is None else total[:, :, n, None, None] * S
        S = S + to_end[:, :, n].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2)  # [B, Hkv, N, G, C, V]
    o = o.permute(0, 2, 4, 1, 3, 5).reshape(B, N * C, H, V)[:, :T]
    return o.to(dtype), S
