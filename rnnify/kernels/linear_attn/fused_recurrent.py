"""fused_recurrent_linear_attn: the token loop in one kernel (decode steps, short prompts). Forward only.

One program per (value block, batch x kv head): the state block S [K, BV] stays in registers in
fp32 for the whole sequence; at each token it is decayed, gets k_t^T v_t added, and is read by
the G query heads of the kv head. Math in ``naive.py``.
"""

from __future__ import annotations

import torch

from rnnify.kernels import utils
from rnnify.kernels.linear_attn import common
from rnnify.kernels.utils import tl, triton

if triton is not None:

    @triton.jit
    def fused_recurrent_linear_attn_fwd_kernel(
        q, k, v, g, gk, h0, o, ht, scale, T,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr,
        USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    ):
        i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets
        i_b, i_h = i_bh // HKV, i_bh % HKV
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        m_h = m_k[:, None] & m_v[None, :]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            p_h0 = h0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
            b_h += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)
        for t in range(0, T):
            i_bt = i_b * T + t
            b_k = tl.load(k + (i_bt * HKV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_bt * HKV + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            if USE_G:
                b_g = tl.load(g + i_bt * HKV + i_h).to(tl.float32)
                b_h = b_h * tl.exp(b_g)
            if USE_GK:
                b_gk = tl.load(gk + (i_bt * HKV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_h = b_h * tl.exp(b_gk)[:, None]
            b_h += b_k[:, None] * b_v[None, :]
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tl.load(q + (i_bt * H + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
                b_o = tl.sum(b_q[:, None] * b_h, axis=0)
                tl.store(o + (i_bt * H + i_hq) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        p_ht = ht + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_ht, b_h, mask=m_h)


def fused_recurrent_linear_attn_triton(q, k, v, g, gk, h0, scale):
    q, k, v, g, gk, h0 = (None if x is None else x.contiguous() for x in (q, k, v, g, gk, h0))
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    o = utils.empty((B, T, H, V), q.device, v.dtype)
    ht = utils.empty((B, Hkv, K, V), q.device, torch.float32)
    BK = utils.next_pow2(K)
    BV = min(utils.next_pow2(V), 64)
    grid = (triton.cdiv(V, BV), B * Hkv)
    fused_recurrent_linear_attn_fwd_kernel[grid](
        q, k, v, g, gk, h0, o, ht, scale, T,
        H=H, HKV=Hkv, G=H // Hkv, K=K, V=V, BK=BK, BV=BV,
        USE_G=g is not None, USE_GK=gk is not None, USE_INITIAL_STATE=h0 is not None,
    )
    return o, ht


@torch.library.custom_op("rnnify::fused_recurrent_linear_attn", mutates_args=())
def _fused_recurrent_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                        gk: torch.Tensor | None, h0: torch.Tensor | None,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if utils.use_triton(q):
        return fused_recurrent_linear_attn_triton(q, k, v, g, gk, h0, scale)
    o, ht = common.reference(q, k, v, g, gk, h0, scale)
    return o.contiguous(), ht.contiguous()


_fused_recurrent_op.register_fake(common.fake)


def fused_recurrent_linear_attn(q, k, v, g=None, gk=None, scale=None, initial_state=None,
                                output_final_state=False, normalize=False, eps=1e-6):
    """(Gated) linear attention, token by token in one kernel. See ``naive.py`` for the math and
    shapes; ``initial_state`` / final state: S ``[B, H_kv, K, V]``, or ``(S, z)`` with normalize."""
    return common.run(torch.ops.rnnify.fused_recurrent_linear_attn, q, k, v, g, gk, scale,
                      initial_state, output_final_state, normalize, eps)
