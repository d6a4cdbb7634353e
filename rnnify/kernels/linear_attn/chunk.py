"""chunk_linear_attn: chunkwise-parallel (gated) linear attention for prefill, with autograd.

Chunks of BT tokens; inside a chunk, with cumulative log gates c_i = log a_1 + ... + log a_i
counted from the chunk's start (scalar g and/or per feature gk; math in ``naive.py``), and q, k
the featurised phi(q), phi(k) (a fused ``feature_map`` is applied to each loaded tile, with a
tl.dot against the weight for the projected maps; ``feature_maps.py``):

    o_i  = c (q_i * exp(c_i)) S  +  sum_{j <= i} A_ij v_j                (from the state / intra-chunk)
    A_ij = c sum_f q_if k_jf exp(c_if - c_jf)                            (exponents <= 0 only)
    S'   = exp(c_BT) * S + (k * exp(c_BT - c_j))^T v

(c: the output scale, ``feature_maps.output_scale``). One program per (value block, batch x kv
head) walks the chunks in order with S [BF, BV] in fp32 registers. A scalar gate's decay matrix is
exp(c_i - c_j) masked before exp; a per-channel gate builds the [BT, BT, BF] decays directly (no
exp(-c) factorisation, which overflows under strong decay), so BT is kept at 16. num_stages=1: at
BT = 64, sm_90 compiles need 82 KB (forward) and 98 KB (backward) of shared memory with one stage,
164 / 213 KB with two, over 227 KB with three. Wide feature maps shrink BT and BV (``block_sizes``).

Backward (``common.register_autograd``): on the Triton path one kernel (the ``rnnify::chunk_linear_attn_bwd``
op) recomputes the states in a forward sweep for dq, then walks the chunks back to front carrying
dS for dk, dv and d initial_state; the log-gate gradients follow from those in PyTorch. On the
reference path the PyTorch forward is recomputed under autograd and differentiated.
"""

from __future__ import annotations

import torch

from rnnify.kernels import utils
from rnnify.kernels.linear_attn import common, feature_maps
from rnnify.kernels.utils import tl, triton

if triton is not None:
    from rnnify.kernels.linear_attn.feature_maps import feature_map_2d, load_feature_weight

    @triton.jit
    def chunk_linear_attn_fwd_kernel(
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
        BT: tl.constexpr,
        BK: tl.constexpr,
        BF: tl.constexpr,
        BV: tl.constexpr,
        FEATURE: tl.constexpr,
        QUERY_SHIFT: tl.constexpr,
        USE_G: tl.constexpr,
        USE_GK: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
        USE_MASK: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets
        i_b, i_h = i_bh // HKV, i_bh % HKV
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_f = tl.arange(0, BF)  # the state's rows: phi's features (o_k itself without a projection)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_f, m_v = o_k < K, o_f < F, o_v < V
        m_h = m_f[:, None] & m_v[None, :]
        m_c = o_i[:, None] >= o_i[None, :]  # causal, inside the chunk
        b_w = None
        if FEATURE == "hedgehog" or FEATURE == "performer":
            b_w = load_feature_weight(w, i_h, o_k, o_f, K, F, FEATURE)
        b_h = tl.zeros([BF, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            p_h0 = h0 + i_bh * F * V + o_f[:, None] * V + o_v[None, :]
            b_h += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)
        for i_t in range(0, tl.cdiv(T, BT)):
            o_t = i_t * BT + o_i
            m_t = o_t < T
            i_bt = i_b * T + o_t  # [BT]
            m_r = m_t  # real tokens: in the sequence and, with a key mask, not padding
            if USE_MASK:
                m_r = m_t & (tl.load(km + i_bt, mask=m_t, other=0) != 0)
            p_k = k + (i_bt[:, None] * HKV + i_h) * K + o_k[None, :]
            p_v = v + (i_bt[:, None] * HKV + i_h) * V + o_v[None, :]
            b_k = tl.load(p_k, mask=m_r[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            b_k = feature_map_2d(b_k, b_w, o_f, fsqrt, fshift, F, FEATURE, False, PRECISION)
            b_k = tl.where(m_r[:, None], b_k, 0.0)  # past the end and padding: phi(0) need not be 0
            b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            if USE_G:  # past the end and padding get log a = 0: they decay nothing
                b_g = tl.cumsum(tl.load(g + i_bt * HKV + i_h, mask=m_r, other=0.0).to(tl.float32), axis=0)
                b_gn = tl.sum(tl.where(o_i == BT - 1, b_g, 0.0), axis=0)  # the whole chunk's decay
                b_dg = tl.exp(tl.where(m_c, b_g[:, None] - b_g[None, :], float("-inf")))
            if USE_GK:
                p_gk = gk + (i_bt[:, None] * HKV + i_h) * F + o_f[None, :]
                b_gk = tl.cumsum(tl.load(p_gk, mask=m_r[:, None] & m_f[None, :], other=0.0).to(tl.float32), axis=0)
                b_gkn = tl.sum(tl.where(o_i[:, None] == BT - 1, b_gk, 0.0), axis=0)  # [BF]
                b_dgk = tl.exp(tl.where(m_c[:, :, None], b_gk[:, None, :] - b_gk[None, :, :], float("-inf")))
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                p_q = q + (i_bt[:, None] * H + i_hq) * K + o_k[None, :]
                b_q = tl.load(p_q, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
                b_q = feature_map_2d(b_q, b_w, o_f, fsqrt, fshift, F, FEATURE, QUERY_SHIFT, PRECISION) * scale
                b_qg = b_q
                if USE_G:
                    b_qg = b_qg * tl.exp(b_g)[:, None]
                if USE_GK:
                    b_qg = b_qg * tl.exp(b_gk)
                b_o = tl.dot(b_qg, b_h, input_precision=PRECISION)
                if USE_GK:
                    b_A = tl.sum(b_q[:, None, :] * b_k[None, :, :] * b_dgk, axis=2)
                else:
                    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
                if USE_G:
                    b_A = b_A * b_dg
                b_A = tl.where(m_c, b_A, 0.0)
                b_o += tl.dot(b_A, b_v, input_precision=PRECISION)
                p_o = o + (i_bt[:, None] * H + i_hq) * V + o_v[None, :]
                tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
            b_kd = b_k
            if USE_G:
                b_kd = b_kd * tl.exp(b_gn - b_g)[:, None]
                b_h = b_h * tl.exp(b_gn)
            if USE_GK:
                b_kd = b_kd * tl.exp(b_gkn[None, :] - b_gk)
                b_h = b_h * tl.exp(b_gkn)[:, None]
            b_h += tl.dot(tl.trans(b_kd), b_v, input_precision=PRECISION)
        p_ht = ht + i_bh * F * V + o_f[:, None] * V + o_v[None, :]
        tl.store(p_ht, b_h, mask=m_h)

    @triton.jit
    def chunk_linear_attn_bwd_kernel(
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
        BT: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        USE_G: tl.constexpr,
        USE_GK: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # dq and dk are partial sums over this value block: [NV, B, T, H|HKV, K], summed by the caller
        i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets
        i_b, i_h = i_bh // HKV, i_bh % HKV
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        m_h = m_k[:, None] & m_v[None, :]
        m_c = o_i[:, None] >= o_i[None, :]
        NT = tl.cdiv(T, BT)
        p_dq0 = dq + i_v * B * T * H * K
        p_dk0 = dk + i_v * B * T * HKV * K
        # ---- sweep 1, chunks in order: dq_i = scale (do_i S^T * exp(c_i) + sum_j dA_ij k_j exp(c_i - c_j))
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            p_h0 = h0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
            b_h += tl.load(p_h0, mask=m_h, other=0.0).to(tl.float32)
        for i_t in range(0, NT):
            o_t = i_t * BT + o_i
            m_t = o_t < T
            i_bt = i_b * T + o_t
            m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
            b_k = tl.load(k + (i_bt[:, None] * HKV + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_bt[:, None] * HKV + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            if USE_G:
                b_g = tl.cumsum(tl.load(g + i_bt * HKV + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
                b_gn = tl.sum(tl.where(o_i == BT - 1, b_g, 0.0), axis=0)
                b_dg = tl.exp(tl.where(m_c, b_g[:, None] - b_g[None, :], float("-inf")))
            if USE_GK:
                p_gk = gk + (i_bt[:, None] * HKV + i_h) * K + o_k[None, :]
                b_gk = tl.cumsum(tl.load(p_gk, mask=m_tk, other=0.0).to(tl.float32), axis=0)
                b_gkn = tl.sum(tl.where(o_i[:, None] == BT - 1, b_gk, 0.0), axis=0)
                b_dgk = tl.exp(tl.where(m_c[:, :, None], b_gk[:, None, :] - b_gk[None, :, :], float("-inf")))
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_do = tl.load(do + (i_bt[:, None] * H + i_hq) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
                b_dq = tl.dot(b_do, tl.trans(b_h), input_precision=PRECISION)
                if USE_G:
                    b_dq = b_dq * tl.exp(b_g)[:, None]
                if USE_GK:
                    b_dq = b_dq * tl.exp(b_gk)
                b_dA = tl.where(m_c, tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION), 0.0)
                if USE_G:
                    b_dA = b_dA * b_dg
                if USE_GK:
                    b_dq += tl.sum(b_dA[:, :, None] * b_k[None, :, :] * b_dgk, axis=1)
                else:
                    b_dq += tl.dot(b_dA, b_k, input_precision=PRECISION)
                p_dq = p_dq0 + (i_bt[:, None] * H + i_hq) * K + o_k[None, :]
                tl.store(p_dq, b_dq * scale, mask=m_tk)
            b_kd = b_k
            if USE_G:
                b_kd = b_kd * tl.exp(b_gn - b_g)[:, None]
                b_h = b_h * tl.exp(b_gn)
            if USE_GK:
                b_kd = b_kd * tl.exp(b_gkn[None, :] - b_gk)
                b_h = b_h * tl.exp(b_gkn)[:, None]
            b_h += tl.dot(tl.trans(b_kd), b_v, input_precision=PRECISION)
        # ---- sweep 2, chunks back to front, dS = dL/d(state after the chunk)
        p_dht = dht + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
        b_dh = tl.load(p_dht, mask=m_h, other=0.0).to(tl.float32)
        for i_r in range(0, NT):
            i_t = NT - 1 - i_r
            o_t = i_t * BT + o_i
            m_t = o_t < T
            i_bt = i_b * T + o_t
            m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
            b_k = tl.load(k + (i_bt[:, None] * HKV + i_h) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_bt[:, None] * HKV + i_h) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
            b_kd = b_k
            if USE_G:
                b_g = tl.cumsum(tl.load(g + i_bt * HKV + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
                b_gn = tl.sum(tl.where(o_i == BT - 1, b_g, 0.0), axis=0)
                b_dg = tl.exp(tl.where(m_c, b_g[:, None] - b_g[None, :], float("-inf")))
                b_kd = b_kd * tl.exp(b_gn - b_g)[:, None]
            if USE_GK:
                p_gk = gk + (i_bt[:, None] * HKV + i_h) * K + o_k[None, :]
                b_gk = tl.cumsum(tl.load(p_gk, mask=m_tk, other=0.0).to(tl.float32), axis=0)
                b_gkn = tl.sum(tl.where(o_i[:, None] == BT - 1, b_gk, 0.0), axis=0)
                b_dgk = tl.exp(tl.where(m_c[:, :, None], b_gk[:, None, :] - b_gk[None, :, :], float("-inf")))
                b_kd = b_kd * tl.exp(b_gkn[None, :] - b_gk)
            # through the state: S' = exp(c_n) S + kd^T v
            b_dv = tl.dot(b_kd, b_dh, input_precision=PRECISION)
            b_dk = tl.dot(b_v, tl.trans(b_dh), input_precision=PRECISION)
            if USE_G:
                b_dk = b_dk * tl.exp(b_gn - b_g)[:, None]
                b_dh = b_dh * tl.exp(b_gn)
            if USE_GK:
                b_dk = b_dk * tl.exp(b_gkn[None, :] - b_gk)
                b_dh = b_dh * tl.exp(b_gkn)[:, None]
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = (
                    tl.load(q + (i_bt[:, None] * H + i_hq) * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
                    * scale
                )
                b_do = tl.load(do + (i_bt[:, None] * H + i_hq) * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
                if USE_GK:
                    b_A = tl.sum(b_q[:, None, :] * b_k[None, :, :] * b_dgk, axis=2)
                else:
                    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
                b_dA = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
                if USE_G:
                    b_A = b_A * b_dg
                    b_dA = b_dA * b_dg
                b_A = tl.where(m_c, b_A, 0.0)
                b_dA = tl.where(m_c, b_dA, 0.0)
                b_dv += tl.dot(tl.trans(b_A), b_do, input_precision=PRECISION)
                if USE_GK:
                    b_dk += tl.sum(b_dA[:, :, None] * b_q[:, None, :] * b_dgk, axis=0)
                else:
                    b_dk += tl.dot(tl.trans(b_dA), b_q, input_precision=PRECISION)
                b_qg = b_q
                if USE_G:
                    b_qg = b_qg * tl.exp(b_g)[:, None]
                if USE_GK:
                    b_qg = b_qg * tl.exp(b_gk)
                b_dh += tl.dot(tl.trans(b_qg), b_do, input_precision=PRECISION)
            p_dk = p_dk0 + (i_bt[:, None] * HKV + i_h) * K + o_k[None, :]
            tl.store(p_dk, b_dk, mask=m_tk)
            p_dv = dv + (i_bt[:, None] * HKV + i_h) * V + o_v[None, :]
            tl.store(p_dv, b_dv.to(dv.dtype.element_ty), mask=m_tv)
        if USE_INITIAL_STATE:
            p_dh0 = dh0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :]
            tl.store(p_dh0, b_dh, mask=m_h)


def block_sizes(F: int, V: int, gk: bool) -> tuple[int, int, int]:
    """(BT, BF, BV). The [BT, BF] tiles set the shared memory: BT * BF <= 8K keeps sm_90 compiles
    within 227 KB (performer's F = 266 at BT = 64 needs 315 KB forward, 405 KB backward). A
    per-channel gate builds [BT, BT, BF] decays, hence BT = 16 with gk."""
    BF = utils.next_pow2(F)
    return (16 if gk else min(64, max(16, 8192 // BF))), BF, common.value_block(BF, V)


def chunk_linear_attn_fwd_triton(q, k, v, g, gk, h0, w, scale, feature_map="identity", query_shift=False, mask=None):
    q, k, v, g, gk, h0, w = (None if x is None else x.contiguous() for x in (q, k, v, g, gk, h0, w))
    km = None if mask is None else mask.to(torch.int8).contiguous()
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    F = feature_maps.feature_dim(feature_map, K, w)
    BT, BF, BV = block_sizes(F, V, gk is not None)
    o = utils.empty((B, T, H, V), q.device, v.dtype)
    ht = utils.empty((B, Hkv, F, V), q.device, torch.float32)
    chunk_linear_attn_fwd_kernel[(triton.cdiv(V, BV), B * Hkv)](
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
        BT=BT,
        BK=utils.next_pow2(K),
        BF=BF,
        BV=BV,
        USE_G=g is not None,
        USE_GK=gk is not None,
        USE_INITIAL_STATE=h0 is not None,
        USE_MASK=km is not None,
        PRECISION=utils.DOT_PRECISION,
        num_warps=4,
        num_stages=1,
        **feature_maps.kernel_args(feature_map, scale, w, query_shift),
    )
    return o, ht


@torch.library.custom_op("rnnify::chunk_linear_attn_bwd", mutates_args=())
def _chunk_bwd_op(
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
    BT, BK, BV = block_sizes(K, V, gk is not None)
    NV = triton.cdiv(V, BV)
    dq = utils.empty((NV, B, T, H, K), q.device)
    dk = utils.empty((NV, B, T, Hkv, K), q.device)
    dv = utils.empty((B, T, Hkv, V), q.device, v.dtype)
    dh0 = utils.empty((B, Hkv, K, V), q.device) if h0 is not None else q.new_empty(0, dtype=torch.float32)
    chunk_linear_attn_bwd_kernel[(NV, B * Hkv)](
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
        BT=BT,
        BK=BK,
        BV=BV,
        USE_G=g is not None,
        USE_GK=gk is not None,
        USE_INITIAL_STATE=h0 is not None,
        PRECISION=utils.DOT_PRECISION,
        num_warps=4,
        num_stages=1,
    )
    return dq.sum(0), dk.sum(0), dv, dh0


_chunk_bwd_op.register_fake(common.fake_bwd)


chunk_linear_attn = common.define_op(
    "chunk_linear_attn",
    chunk_linear_attn_fwd_triton,
    _chunk_bwd_op,
    "(Gated) linear attention over a prompt, chunkwise-parallel, differentiable.",
)
