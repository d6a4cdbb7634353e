"""Ground truth: (gated) linear attention as a plain loop over tokens, fp32 (math.md §2).

Per kv head h, with a_t = exp(g_t) (scalar, RetNet / GateLoop) and exp(gk_t) (per key channel, GLA),
both in log space and both optional (absent = 1):

    S_t = exp(g_t) * diag(exp(gk_t)) S_{t-1} + k_t^T v_t        [K, V]
    z_t = exp(g_t) * exp(gk_t) * z_{t-1} + k_t                  [K]   (normalize=True only)
    o_t = scale q_t S_t                                          (normalize=False)
    o_t = scale q_t S_t / (scale q_t . z_t + eps)                (normalize=True)

Layout: q ``[B, T, H, K]``, k ``[B, T, H_kv, K]``, v ``[B, T, H_kv, V]``, g ``[B, T, H_kv]``,
gk ``[B, T, H_kv, K]``; query head i reads kv head i // (H / H_kv). State S ``[B, H_kv, K, V]``
(and z ``[B, H_kv, K]``) fp32; with normalize the state is the pair ``(S, z)``.
"""

from __future__ import annotations

import torch

from rnnify.kernels.utils import check_qkv


def check_inputs(q, k, v, g, gk, F=None):
    """Shapes; ``F``: the feature dim (gk's last dim), K unless a feature map changes it."""
    check_qkv(q, k, v)
    K = q.shape[3]
    if g is not None and tuple(g.shape) != tuple(k.shape[:3]):
        raise ValueError(f"g must be [B, T, H_kv] = {tuple(k.shape[:3])}, got {tuple(g.shape)}")
    gk_shape = (*k.shape[:3], K if F is None else F)
    if gk is not None and tuple(gk.shape) != gk_shape:
        raise ValueError(f"gk must be [B, T, H_kv, F] = {gk_shape}, got {tuple(gk.shape)}")


def naive_recurrent_linear_attn(q, k, v, g=None, gk=None, scale=None, initial_state=None,
                                output_final_state=False, normalize=False, eps=1e-6):
    check_inputs(q, k, v, g, gk)
    B, T, H, K = q.shape
    Hkv, V, dtype = k.shape[2], v.shape[-1], v.dtype
    scale = K ** -0.5 if scale is None else scale
    q = q.float().reshape(B, T, Hkv, H // Hkv, K) * scale
    k, v = k.float(), v.float()
    if initial_state is None:
        S, z = q.new_zeros(B, Hkv, K, V), q.new_zeros(B, Hkv, K)
    elif normalize:
        S, z = (s.float() for s in initial_state)
    else:
        S, z = initial_state.float(), None
    outs = []
    for t in range(T):
        decay = torch.ones(B, Hkv, K, device=q.device)
        if g is not None:
            decay = decay * g[:, t].float().exp()[..., None]
        if gk is not None:
            decay = decay * gk[:, t].float().exp()
        S = decay[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o = torch.einsum("bhgk,bhkv->bhgv", q[:, t], S)
        if normalize:
            z = decay * z + k[:, t]
            o = o / (torch.einsum("bhgk,bhk->bhg", q[:, t], z)[..., None] + eps)
        outs.append(o.reshape(B, H, V))
    o = torch.stack(outs, dim=1).to(dtype)
    final = ((S, z) if normalize else S) if output_final_state else None
    return o, final
