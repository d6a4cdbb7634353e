"""fused_recurrent_linear_attn: the token loop in one kernel (decode steps, short prompts), with autograd.

One program per (value block, batch x kv head): the state block S [F, BV] stays in registers in
fp32 for the whole sequence; at each token it is decayed, gets phi(k_t)^T v_t added, and is read
by the G query heads of the kv head. A fused feature map featurises each loaded q / k vector in
registers (``feature_maps.py``). Math in ``naive.py``.

Backward (``common.register_autograd``): on the Triton path one kernel replays the forward for
dq_t = c S_t do_t^T, then walks the tokens back to front carrying dS_t = sum_h c phi(q_t)^T do_t
+ a_{t+1} dS_{t+1}, which gives dk_t = dS_t v_t^T, dv_t = phi(k_t) dS_t and d initial_state; the
log gates' gradients follow in PyTorch (``common.gate_grads``).
"""

from __future__ import annotations

import torch

from rnnify.kernels import utils
from rnnify.kernels.linear_attn import common, feature_maps
from rnnify.kernels.utils import tl, triton

if triton is not None:
    from rnnify.kernels.linear_attn.feature_maps import feature_map_1d, load_feature_weight

    @triton.jit
    def fused_recurrent_linear_attn_fwd_kernel(
        q,
        k,
        v,
        g,
        gk,
        w,
        h0,
        km,
        o,
        ht,
        scale,
        fsqrt,
        fshift,
        T,
        H: tl.constexpr,
        HKV: tl.constexpr,
        G: tl.constexpr,
        K: tl.constexpr,
        F: tl.constexpr,
        V: tl.constexpr,
        BK: tl.constexpr,
        BF: tl.constexpr,
        BV: tl.constexpr,
        FEATURE: tl.constexpr,
        QUERY_SHIFT: tl.constexpr,
        USE_G: tl.constexpr,
        USE_GK: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
        USE_MASK: tl.constexpr,
    ):
        i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets
        i_b, i_h = i_bh // HKV, i_bh % HKV
        o_k = tl.arange(0, BK)
        o_f = tl.arange(0, BF)  # the state's rows: phi's features (o_k itself without a projection)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_f, m_v = o_k < K, o_f < F, o_v < V
        m_h = m_f[:, None] & m_v[None, :]
        b_w = None
        if FEATURE == "hedgehog" or FEATURE == "performer":
            b_w = load_feature_weight(w, i_h, o_k, o_f, K, F, FEATURE)
        b_h = tl.zeros([BF, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            p_h0 = h0 + i_bh * F * V + o_f[:, None] * V + o_v[None, :]
            b_h += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)
        for t in range(0, T):
            i_bt = i_b * T + t
            b_k = tl.load(k + (i_bt * HKV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_k = feature_map_1d(b_k, b_w, o_f, fsqrt, fshift, F, FEATURE, False)
            b_v = tl.load(v + (i_bt * HKV + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            if USE_MASK:  # a padding token: phi(k) = 0 and log a = 0, the state stays as it was
                b_real = tl.load(km + i_bt) != 0
                b_k = tl.where(b_real, b_k, 0.0)
            if USE_G:
                b_g = tl.load(g + i_bt * HKV + i_h).to(tl.float32)
                if USE_MASK:
                    b_g = tl.where(b_real, b_g, 0.0)
                b_h = b_h * tl.exp(b_g)
            if USE_GK:
                b_gk = tl.load(gk + (i_bt * HKV + i_h) * F + o_f, mask=m_f, other=0.0).to(tl.float32)
                if USE_MASK:
                    b_gk = tl.where(b_real, b_gk, 0.0)
                b_h = b_h * tl.exp(b_gk)[:, None]
            b_h += b_k[:, None] * b_v[None, :]
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tl.load(q + (i_bt * H + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_q = feature_map_1d(b_q, b_w, o_f, fsqrt, fshift, F, FEATURE, QUERY_SHIFT) * scale
                b_o = tl.sum(b_q[:, None] * b_h, axis=0)
                tl.store(o + (i_bt * H + i_hq) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        p_ht = ht + i_bh * F * V + o_f[:, None] * V + o_v[None, :]
        tl.store(p_ht, b_h, mask=m_h)

    @triton.jit
    def fused_recurrent_linear_attn_bwd_kernel(
        q,
        k,
        v,
        g,
        gk,
        h0,
        do,
        dht,
        dq,
        dk,
        dv,
        dh0,
        scale,
        T,
        B: tl.constexpr,
        H: tl.constexpr,
        HKV: tl.constexpr,
        G: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        USE_G: tl.constexpr,
        USE_GK: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
    ):
        # featurised q, k (K is the feature dim); dq and dk are partial sums over this value block:
        # [NV, B, T, H|HKV, K], summed by the caller
        i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets
        i_b, i_h = i_bh // HKV, i_bh % HKV
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        m_h = m_k[:, None] & m_v[None, :]
        p_dq0 = dq + i_v * B * T * H * K
        p_dk0 = dk + i_v * B * T * HKV * K
        # ---- sweep 1, tokens in order: dq_t = scale S_t do_t^T
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_h += tl.load(h0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_h, other=0.0).to(tl.float32)
        for t in range(0, T):
            i_bt = i_b * T + t
            b_k = tl.load(k + (i_bt * HKV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_bt * HKV + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            if USE_G:
                b_h = b_h * tl.exp(tl.load(g + i_bt * HKV + i_h).to(tl.float32))
            if USE_GK:
                b_gk = tl.load(gk + (i_bt * HKV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_h = b_h * tl.exp(b_gk)[:, None]
            b_h += b_k[:, None] * b_v[None, :]
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_do = tl.load(do + (i_bt * H + i_hq) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                b_dq = tl.sum(b_h * b_do[None, :], axis=1) * scale
                tl.store(p_dq0 + (i_bt * H + i_hq) * K + o_k, b_dq, mask=m_k)
        # ---- sweep 2, tokens back to front, dS = dL/dS_t
        b_dh = tl.load(dht + i_bh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_h, other=0.0).to(tl.float32)
        for r in range(0, T):
            i_bt = i_b * T + T - 1 - r
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tl.load(q + (i_bt * H + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
                b_do = tl.load(do + (i_bt * H + i_hq) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                b_dh += b_q[:, None] * b_do[None, :]
            b_k = tl.load(k + (i_bt * HKV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_bt * HKV + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            tl.store(p_dk0 + (i_bt * HKV + i_h) * K + o_k, tl.sum(b_dh * b_v[None, :], axis=1), mask=m_k)
            b_dv = tl.sum(b_dh * b_k[:, None], axis=0)
            tl.store(dv + (i_bt * HKV + i_h) * V + o_v, b_dv.to(dv.dtype.element_ty), mask=m_v)
            if USE_G:
                b_dh = b_dh * tl.exp(tl.load(g + i_bt * HKV + i_h).to(tl.float32))
            if USE_GK:
                b_gk = tl.load(gk + (i_bt * HKV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_dh = b_dh * tl.exp(b_gk)[:, None]
        if USE_INITIAL_STATE:
            tl.store(dh0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :], b_dh, mask=m_h)


def fused_recurrent_linear_attn_fwd_triton(
    q, k, v, g, gk, h0, w, scale, feature_map="identity", query_shift=False, mask=None
):
    q, k, v, g, gk, h0, w = (None if x is None else x.contiguous() for x in (q, k, v, g, gk, h0, w))
    km = None if mask is None else mask.to(torch.int8).contiguous()
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    F = feature_maps.feature_dim(feature_map, K, w)
    BF = utils.next_pow2(F)
    BV = common.value_block(BF, V)
    o = utils.empty((B, T, H, V), q.device, v.dtype)
    ht = utils.empty((B, Hkv, F, V), q.device, torch.float32)
    fused_recurrent_linear_attn_fwd_kernel[(triton.cdiv(V, BV), B * Hkv)](
        q,
        k,
        v,
        g,
        gk,
        w,
        h0,
        km,
        o,
        ht,
        T=T,
        H=H,
        HKV=Hkv,
        G=H // Hkv,
        K=K,
        F=F,
        V=V,
        BK=utils.next_pow2(K),
        BF=BF,
        BV=BV,
        USE_G=g is not None,
        USE_GK=gk is not None,
        USE_INITIAL_STATE=h0 is not None,
        USE_MASK=km is not None,
        **feature_maps.kernel_args(feature_map, scale, w, query_shift),
    )
    return o, ht


@torch.library.custom_op("rnnify::fused_recurrent_linear_attn_bwd", mutates_args=())
def _fused_recurrent_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    gk: torch.Tensor | None,
    h0: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton: (dq fp32, dk fp32, dv, dh0) of (o = scale q S, ht) for featurised q, k; dh0 is empty without h0."""
    q, k, v, g, gk, h0 = (None if x is None else x.contiguous() for x in (q, k, v, g, gk, h0))
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    BK = utils.next_pow2(K)
    BV = common.value_block(BK, V)
    NV = triton.cdiv(V, BV)
    dq = utils.empty((NV, B, T, H, K), q.device)
    dk = utils.empty((NV, B, T, Hkv, K), q.device)
    dv = utils.empty((B, T, Hkv, V), q.device, v.dtype)
    dh0 = utils.empty((B, Hkv, K, V), q.device) if h0 is not None else q.new_empty(0, dtype=torch.float32)
    fused_recurrent_linear_attn_bwd_kernel[(NV, B * Hkv)](
        q,
        k,
        v,
        g,
        gk,
        h0,
        do.contiguous(),
        dht.contiguous(),
        dq,
        dk,
        dv,
        dh0,
        scale,
        T,
        B=B,
        H=H,
        HKV=Hkv,
        G=H // Hkv,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        USE_G=g is not None,
        USE_GK=gk is not None,
        USE_INITIAL_STATE=h0 is not None,
    )
    return dq.sum(0), dk.sum(0), dv, dh0


_fused_recurrent_bwd_op.register_fake(common.fake_bwd)


fused_recurrent_linear_attn = common.define_op(
    "fused_recurrent_linear_attn",
    fused_recurrent_linear_attn_fwd_triton,
    _fused_recurrent_bwd_op,
    "(Gated) linear attention, token by token in one kernel, differentiable.",
)
