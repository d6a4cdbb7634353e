"""The linear-attention ops' references: a plain loop over tokens (the ground truth) and the chunked form.

``naive_recurrent_linear_attn`` (the ops' layout, fp32; docs/math.md §Linear attention and
§Gated linear attention):

Per kv head h, with a_t = exp(g_t) (scalar, RetNet / GateLoop) and exp(gk_t) (per key channel, GLA),
both in log space and both optional (absent = 1):

    S_t = exp(g_t) * diag(exp(gk_t)) S_{t-1} + k_t^T v_t        [K, V]
    z_t = exp(g_t) * exp(gk_t) * z_{t-1} + k_t                  [K]   (normalize=True only)
    o_t = scale q_t S_t                                          (normalize=False)
    o_t = scale q_t S_t / (scale q_t . z_t + eps)                (normalize=True)

Layout: q ``[B, T, H, K]``, k ``[B, T, H_kv, K]``, v ``[B, T, H_kv, V]``, g ``[B, T, H_kv]``,
gk ``[B, T, H_kv, K]``; query head i reads kv head i // (H / H_kv). State S ``[B, H_kv, K, V]``
(and z ``[B, H_kv, K]``) fp32; with normalize the state is the pair ``(S, z)``.

The feature-space forms below compute the same per kv head on featurised inputs in the cells'
layout, ungated (``naive_recurrent_feature_attn``, ``parallel_feature_attn``,
``chunk_feature_attn``: ``cells.linear``'s forms) and gated (``naive_recurrent_gated_attn``,
``parallel_gated_attn``, ``chunk_gated_attn``):
phi_q ``[B, H_kv, G, T, F]`` (G query heads per kv head), phi_k ``[B, H_kv, T, F]``,
v ``[B, H_kv, T, V]``, log gates log_a ``[B, H_kv, T, 1]`` (scalar) or ``[B, H_kv, T, F]``
(per feature), state kv ``[B, H_kv, F, V]`` and k_sum ``[B, H_kv, F]`` (None: unnormalised).
``chunk_gated_attn`` (ungated with no log gates: ``chunk_feature_attn``) is the ops' PyTorch path
(``common.reference``) and the cells' prefill.
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


def naive_recurrent_linear_attn(
    q, k, v, g=None, gk=None, scale=None, initial_state=None, output_final_state=False, normalize=False, eps=1e-6
):
    check_inputs(q, k, v, g, gk)
    B, T, H, K = q.shape
    Hkv, V, dtype = k.shape[2], v.shape[-1], v.dtype
    scale = K**-0.5 if scale is None else scale
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


# --------------------------------------------------------------------------- feature-space forms

Forms = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def normalise(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """o = num / (den + eps): the normalised output from phi(q) S and phi(q) . z."""
    return num / (den[..., None] + eps)


def naive_recurrent_feature_attn(phi_q, phi_k, v, kv, k_sum, eps: float = 1e-6) -> Forms:
    outs = []
    for t in range(phi_k.shape[2]):
        kv = kv + phi_k[:, :, t, :, None] * v[:, :, t, None, :]
        q_t = phi_q[:, :, :, t]  # [B, Hkv, G, F]
        if k_sum is None:
            outs.append(q_t @ kv)
            continue
        k_sum = k_sum + phi_k[:, :, t]
        outs.append(normalise(q_t @ kv, (q_t * k_sum[:, :, None]).sum(-1), eps))
    return torch.stack(outs, dim=3), kv, k_sum


def parallel_feature_attn(phi_q, phi_k, v, kv, k_sum, eps: float = 1e-6) -> Forms:
    # the G query heads of a kv head as one [G T, F] matrix: each product is one bmm over (B, H_kv),
    # with no broadcast copies of k, v or kv and no reordered copy of the scores (einsum made both)
    batch, num_kv_heads, group, length, features = phi_q.shape
    queries = phi_q.reshape(batch, num_kv_heads, group * length, features)
    scores = torch.matmul(queries, phi_k.transpose(-1, -2)).view(batch, num_kv_heads, group, length, length)
    scores.mul_(torch.ones(length, length, device=v.device).tril())  # causal; on a CPU 5x faster than masked_fill
    num = torch.matmul(scores.view(batch, num_kv_heads, group * length, length), v) + torch.matmul(queries, kv)
    num = num.view(batch, num_kv_heads, group, length, -1)
    kv = kv + phi_k.transpose(-1, -2) @ v
    if k_sum is None:
        return num, kv, None
    den = scores.sum(-1) + (phi_q * k_sum[:, :, None, None]).sum(-1)
    return normalise(num, den, eps), kv, k_sum + phi_k.sum(2)


def chunk_feature_attn(phi_q, phi_k, v, kv, k_sum, eps: float = 1e-6, chunk_size: int = 64) -> Forms:
    return chunk_gated_attn(phi_q, phi_k, v, None, kv, k_sum, eps, chunk_size)


def naive_recurrent_gated_attn(phi_q, phi_k, v, log_a, kv, k_sum=None, eps: float = 1e-6) -> Forms:
    outs = []
    for t in range(phi_k.shape[2]):
        a = log_a[:, :, t].exp()  # [B, Hkv, F] or [B, Hkv, 1]
        kv = a[..., None] * kv + phi_k[:, :, t, :, None] * v[:, :, t, None, :]
        q_t = phi_q[:, :, :, t]  # [B, Hkv, G, F]
        if k_sum is None:
            outs.append(q_t @ kv)
            continue
        k_sum = a * k_sum + phi_k[:, :, t]
        outs.append(normalise(q_t @ kv, (q_t * k_sum[:, :, None]).sum(-1), eps))
    return torch.stack(outs, dim=3), kv, k_sum


def relative_decays(log_a: torch.Tensor) -> torch.Tensor:
    """D[.., f, i, j] = exp(log a_{j+1} + ... + log a_i) = exp(G_i - G_j), the decay from token j to
    token i, for j <= i, and 0 above the diagonal: ``[B, Hkv, F|1, T, T]``.

    Each segment is summed directly (Mamba2's ``segsum``), not taken as G_i - G_j: that difference
    of two large cumulative sums loses the digits of a short segment once |G| is large. Entries
    above the diagonal are set to -inf before exp, so no exponent is ever positive.
    """
    length = log_a.shape[2]
    ones = torch.ones(length, length, dtype=torch.bool, device=log_a.device)
    terms = log_a.transpose(-1, -2)[..., None, :].expand(-1, -1, -1, length, -1)  # [.., f, j, k] = log a_k
    sums = terms.masked_fill(~ones.triu(1), 0.0).cumsum(-1)  # [.., f, j, i] = sum over j < k <= i
    return sums.masked_fill(~ones.triu(), float("-inf")).exp().transpose(-1, -2)


def parallel_gated_attn(phi_q, phi_k, v, log_a, kv, k_sum=None, eps: float = 1e-6) -> Forms:
    decay = relative_decays(log_a)  # [B, Hkv, F|1, i, j]
    if log_a.shape[-1] == 1:  # scalar gate: decay the plain scores (decay's size-1 axis spans the G query heads)
        scores = (phi_q @ phi_k[:, :, None].transpose(-1, -2)) * decay
    else:  # vector gate: the decay sits inside the feature sum
        scores = torch.einsum("bhgif,bhfij->bhgij", phi_q, decay * phi_k.transpose(-1, -2)[:, :, :, None])
    G = log_a.cumsum(2)  # [B, Hkv, T, F|1]: G_i = log a_1 + ... + log a_i
    q_from_start = phi_q * G[:, :, None].exp()  # phi(q_i) exp(G_i): what reaches token i from the initial state
    num = scores @ v[:, :, None] + q_from_start @ kv[:, :, None]
    total = G[:, :, -1:]  # [B, Hkv, 1, F|1]: the decay over the whole block
    k_to_end = phi_k * decay[:, :, :, -1].transpose(-1, -2)  # phi(k_j) exp(G_T - G_j)
    new_kv = total.transpose(-1, -2).exp() * kv + k_to_end.transpose(-1, -2) @ v
    if k_sum is None:
        return num, new_kv, None
    den = scores.sum(-1) + (q_from_start * k_sum[:, :, None, None]).sum(-1)
    return normalise(num, den, eps), new_kv, total[:, :, 0].exp() * k_sum + k_to_end.sum(2)


def chunk_gated_attn(phi_q, phi_k, v, log_a, kv, k_sum=None, eps: float = 1e-6, chunk_size: int = 64) -> Forms:
    """The parallel form chunk by chunk, carrying the state; ``log_a`` None: no gate, so the ungated
    ``parallel_feature_attn`` (fewer ops than zero log gates)."""
    outs = []
    for start in range(0, phi_k.shape[2], chunk_size):
        part = slice(start, start + chunk_size)
        chunk = (phi_q[:, :, :, part], phi_k[:, :, part], v[:, :, part])
        if log_a is None:
            out, kv, k_sum = parallel_feature_attn(*chunk, kv, k_sum, eps)
        else:
            out, kv, k_sum = parallel_gated_attn(*chunk, log_a[:, :, part], kv, k_sum, eps)
        outs.append(out)
    return torch.cat(outs, dim=3), kv, k_sum
