"""What the public linear-attention wrappers share: the normaliser as one more value column.

z_t obeys S_t's recurrence with v_t replaced by 1, so ``normalize=True`` runs the unnormalised op on
v' = [v, 1] with state S' = [S, z] (``[B, H_kv, K, V + 1]``): the last output column is scale q_t . z_t,
the denominator. Kernels therefore only implement o = scale q S.
"""

from __future__ import annotations

import torch

from rnnify.kernels.linear_attn.naive import check_inputs


def run(op, q, k, v, g, gk, scale, initial_state, output_final_state, normalize, eps):
    check_inputs(q, k, v, g, gk)
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    h0 = initial_state
    if normalize:
        v = torch.cat([v, v.new_ones(B, T, Hkv, 1)], dim=-1)
        if initial_state is not None:
            S, z = initial_state
            h0 = torch.cat([S.float(), z.float()[..., None]], dim=-1)
    elif h0 is not None:
        h0 = h0.float()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if g is None else g.float().contiguous()
    gk = None if gk is None else gk.float().contiguous()
    h0 = None if h0 is None else h0.contiguous()
    o, ht = op(q, k, v, g, gk, h0, scale)
    if normalize:
        o = o[..., :V] / (o[..., V:] + eps)
        ht = (ht[..., :V], ht[..., V])
    return o, (ht if output_final_state else None)


def reference(q, k, v, g, gk, h0, scale, chunk_size=64):
    """The unnormalised op in PyTorch, through rnnify.cells.gated's chunk form (its layout:
    phi_q [B, H_kv, G, T, K], phi_k [B, H_kv, T, K], log_a [B, H_kv, T, K|1])."""
    from rnnify.cells.gated import chunk_gated_attn

    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    phi_q = (q.float() * scale).reshape(B, T, Hkv, H // Hkv, K).permute(0, 2, 3, 1, 4)
    phi_k = k.float().transpose(1, 2)
    vv = v.float().transpose(1, 2)
    log_a = q.new_zeros(B, Hkv, T, 1, dtype=torch.float32)
    if g is not None:
        log_a = log_a + g.float().transpose(1, 2)[..., None]
    if gk is not None:
        log_a = log_a + gk.float().transpose(1, 2)
    kv = q.new_zeros(B, Hkv, K, V, dtype=torch.float32) if h0 is None else h0.float()
    o, ht, _ = chunk_gated_attn(phi_q, phi_k, vv, log_a, kv, None, chunk_size=chunk_size)
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, H, V).to(v.dtype), ht


def fake(q, k, v, g, gk, h0, scale):
    B, T, H, _ = q.shape
    return q.new_empty(B, T, H, v.shape[-1], dtype=v.dtype), q.new_empty(
        B, k.shape[2], k.shape[3], v.shape[-1], dtype=torch.float32)
