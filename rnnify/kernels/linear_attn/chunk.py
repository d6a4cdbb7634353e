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

from rnnify.kernels import tiles, utils
from rnnify.kernels.linear_attn import common
from rnnify.kernels.utils import tl, triton

if triton is not None:
    from rnnify.kernels.linear_attn.feature_maps import feature_map_2d, load_feature_weight

    @triton.jit
    def chunk_gates(g, gk, i_r, o_f, m_r, F: tl.constexpr, BT: tl.constexpr, USE_G: tl.constexpr, USE_GK: tl.constexpr):
        """A chunk's log gates (rows ``i_r`` [BT] of g ``[*]``, gk ``[*, F]``; 0 outside ``m_r``: no
        decay) as the cumulative c_i from the chunk's start, its total c_BT and the decays
        exp(c_i - c_j) for j <= i (0 above): ``(c, c_BT, exp)`` of g, then of gk (0 where unused)."""
        o_i = tl.arange(0, BT)
        m_c = o_i[:, None] >= o_i[None, :]
        b_g, b_gn, b_dg, b_gk, b_gkn, b_dgk = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0  # what an unused gate returns
        if USE_G:
            b_g = tl.cumsum(tl.load(g + i_r, mask=m_r, other=0.0).to(tl.float32), axis=0)
            b_gn = tl.sum(tl.where(o_i == BT - 1, b_g, 0.0), axis=0)
            b_dg = tl.exp(tl.where(m_c, b_g[:, None] - b_g[None, :], float("-inf")))
        if USE_GK:
            b_gk = tl.cumsum(tiles.load_rows(gk, i_r, o_f, m_r, F), axis=0)
            b_gkn = tl.sum(tl.where(o_i[:, None] == BT - 1, b_gk, 0.0), axis=0)  # [BF]
            b_dgk = tl.exp(tl.where(m_c[:, :, None], b_gk[:, None, :] - b_gk[None, :, :], float("-inf")))
        return b_g, b_gn, b_dg, b_gk, b_gkn, b_dgk

    @triton.jit
    def from_chunk_start(b_x, b_g, b_gk, USE_G: tl.constexpr, USE_GK: tl.constexpr):
        """x_i exp(c_i): a query (or its gradient) against the state at the chunk's start."""
        if USE_G:
            b_x = b_x * tl.exp(b_g)[:, None]
        if USE_GK:
            b_x = b_x * tl.exp(b_gk)
        return b_x

    @triton.jit
    def to_chunk_end(b_x, b_g, b_gn, b_gk, b_gkn, USE_G: tl.constexpr, USE_GK: tl.constexpr):
        """x_j exp(c_BT - c_j): a key (or its gradient) carried to the chunk's end."""
        if USE_G:
            b_x = b_x * tl.exp(b_gn - b_g)[:, None]
        if USE_GK:
            b_x = b_x * tl.exp(b_gkn[None, :] - b_gk)
        return b_x

    @triton.jit
    def over_chunk(b_h, b_x, b_g, b_gn, b_gk, b_gkn, USE_G: tl.constexpr, USE_GK: tl.constexpr):
        """(exp(c_BT) S, x_j exp(c_BT - c_j)): the state and the keys (or their gradients) carried to
        the chunk's end."""
        if USE_G:
            b_x = b_x * tl.exp(b_gn - b_g)[:, None]
            b_h = b_h * tl.exp(b_gn)
        if USE_GK:
            b_x = b_x * tl.exp(b_gkn[None, :] - b_gk)
            b_h = b_h * tl.exp(b_gkn)[:, None]
        return b_h, b_x

    @triton.jit
    def scores(b_q, b_k, b_dgk, USE_GK: tl.constexpr, PRECISION: tl.constexpr):
        """sum_f q_if k_jf exp(c_if - c_jf), or q_i . k_j without a per-feature gate (the scalar gate's
        exp(c_i - c_j) and the causal mask are the caller's)."""
        if USE_GK:
            b_A = tl.sum(b_q[:, None, :] * b_k[None, :, :] * b_dgk, axis=2)
        else:
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
        return b_A

    @triton.jit
    def chunk_linear_attn_fwd_kernel(
        q, k, v, g, gk, w, h0, km, o, ht, scale, fsqrt, fshift, T,  # km: the key mask (int8)
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, F: tl.constexpr, V: tl.constexpr,
        BT: tl.constexpr, BK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
        USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, USE_MASK: tl.constexpr,
        FEATURE: tl.constexpr, QUERY_SHIFT: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        i_v, i_bh, i_b, i_h, o_v = tiles.value_block_program(HKV, BV)
        o_k, o_f = tl.arange(0, BK), tl.arange(0, BF)  # o_f: the state's rows, phi's features (o_k unprojected)
        m_c = tl.arange(0, BT)[:, None] >= tl.arange(0, BT)[None, :]  # causal, inside the chunk
        b_w = load_feature_weight(w, i_h, o_k, o_f, K, F, FEATURE)
        b_h = tiles.initial_state(h0, i_bh, o_f, o_v, F, V, USE_INITIAL_STATE)
        for i_t in range(0, tl.cdiv(T, BT)):
            i_bt, m_t = tiles.chunk_tokens(i_b, i_t, T, BT)
            m_r = m_t  # real tokens: in the sequence and, with a key mask, not padding
            if USE_MASK:
                m_r = m_t & (tl.load(km + i_bt, mask=m_t, other=0) != 0)
            b_k = tiles.load_rows(k, i_bt * HKV + i_h, o_k, m_r, K)
            b_k = feature_map_2d(b_k, b_w, o_f, fsqrt, fshift, F, FEATURE, False, PRECISION)
            b_k = tl.where(m_r[:, None], b_k, 0.0)  # past the end and padding: phi(0) need not be 0
            b_v = tiles.load_rows(v, i_bt * HKV + i_h, o_v, m_t, V)
            # past the end and padding get log a = 0: they decay nothing
            b_g, b_gn, b_dg, b_gk, b_gkn, b_dgk = chunk_gates(g, gk, i_bt * HKV + i_h, o_f, m_r, F, BT, USE_G, USE_GK)
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tiles.load_rows(q, i_bt * H + i_hq, o_k, m_t, K)
                b_q = feature_map_2d(b_q, b_w, o_f, fsqrt, fshift, F, FEATURE, QUERY_SHIFT, PRECISION) * scale
                b_o = tl.dot(from_chunk_start(b_q, b_g, b_gk, USE_G, USE_GK), b_h, input_precision=PRECISION)
                b_A = scores(b_q, b_k, b_dgk, USE_GK, PRECISION)
                if USE_G:
                    b_A = b_A * b_dg
                b_A = tl.where(m_c, b_A, 0.0)
                b_o += tl.dot(b_A, b_v, input_precision=PRECISION)
                tiles.store_rows(o, b_o, i_bt * H + i_hq, o_v, m_t, V)
            b_h, b_kd = over_chunk(b_h, b_k, b_g, b_gn, b_gk, b_gkn, USE_G, USE_GK)
            b_h += tl.dot(tl.trans(b_kd), b_v, input_precision=PRECISION)
        tiles.store_state(ht, b_h, i_bh, o_f, o_v, F, V)

    @triton.jit
    def chunk_linear_attn_bwd_kernel(
        q, k, v, g, gk, h0, do, dht, dq, dk, dv, dh0, scale, T,  # q, k featurised: K is the feature dim
        B: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        i_v, i_bh, i_b, i_h, o_v = tiles.value_block_program(HKV, BV)
        o_k = tl.arange(0, BK)
        m_c = tl.arange(0, BT)[:, None] >= tl.arange(0, BT)[None, :]
        NT = tl.cdiv(T, BT)
        p_dq = dq + i_v * B * T * H * K
        p_dk = dk + i_v * B * T * HKV * K
        # ---- sweep 1, chunks in order: dq_i = scale (do_i S^T * exp(c_i) + sum_j dA_ij k_j exp(c_i - c_j))
        b_h = tiles.initial_state(h0, i_bh, o_k, o_v, K, V, USE_INITIAL_STATE)
        for i_t in range(0, NT):
            i_bt, m_t = tiles.chunk_tokens(i_b, i_t, T, BT)
            b_k = tiles.load_rows(k, i_bt * HKV + i_h, o_k, m_t, K)
            b_v = tiles.load_rows(v, i_bt * HKV + i_h, o_v, m_t, V)
            b_g, b_gn, b_dg, b_gk, b_gkn, b_dgk = chunk_gates(g, gk, i_bt * HKV + i_h, o_k, m_t, K, BT, USE_G, USE_GK)
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_do = tiles.load_rows(do, i_bt * H + i_hq, o_v, m_t, V)
                b_dq = tl.dot(b_do, tl.trans(b_h), input_precision=PRECISION)
                b_dq = from_chunk_start(b_dq, b_g, b_gk, USE_G, USE_GK)
                b_dA = tl.where(m_c, tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION), 0.0)
                if USE_G:
                    b_dA = b_dA * b_dg
                if USE_GK:
                    b_dq += tl.sum(b_dA[:, :, None] * b_k[None, :, :] * b_dgk, axis=1)
                else:
                    b_dq += tl.dot(b_dA, b_k, input_precision=PRECISION)
                tiles.store_rows(p_dq, b_dq * scale, i_bt * H + i_hq, o_k, m_t, K)
            b_h, b_kd = over_chunk(b_h, b_k, b_g, b_gn, b_gk, b_gkn, USE_G, USE_GK)
            b_h += tl.dot(tl.trans(b_kd), b_v, input_precision=PRECISION)
        # ---- sweep 2, chunks back to front, dS = dL/d(state after the chunk)
        b_dh = tiles.load_state(dht, i_bh, o_k, o_v, K, V)
        for i_r in range(0, NT):
            i_t = NT - 1 - i_r
            i_bt, m_t = tiles.chunk_tokens(i_b, i_t, T, BT)
            b_k = tiles.load_rows(k, i_bt * HKV + i_h, o_k, m_t, K)
            b_v = tiles.load_rows(v, i_bt * HKV + i_h, o_v, m_t, V)
            b_g, b_gn, b_dg, b_gk, b_gkn, b_dgk = chunk_gates(g, gk, i_bt * HKV + i_h, o_k, m_t, K, BT, USE_G, USE_GK)
            # through the state: S' = exp(c_n) S + kd^T v
            b_kd = to_chunk_end(b_k, b_g, b_gn, b_gk, b_gkn, USE_G, USE_GK)
            b_dv = tl.dot(b_kd, b_dh, input_precision=PRECISION)
            b_dk = tl.dot(b_v, tl.trans(b_dh), input_precision=PRECISION)
            b_dh, b_dk = over_chunk(b_dh, b_dk, b_g, b_gn, b_gk, b_gkn, USE_G, USE_GK)
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tiles.load_rows(q, i_bt * H + i_hq, o_k, m_t, K) * scale
                b_do = tiles.load_rows(do, i_bt * H + i_hq, o_v, m_t, V)
                b_A = scores(b_q, b_k, b_dgk, USE_GK, PRECISION)
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
                b_qg = from_chunk_start(b_q, b_g, b_gk, USE_G, USE_GK)
                b_dh += tl.dot(tl.trans(b_qg), b_do, input_precision=PRECISION)
            tiles.store_rows(p_dk, b_dk, i_bt * HKV + i_h, o_k, m_t, K)
            tiles.store_rows(dv, b_dv, i_bt * HKV + i_h, o_v, m_t, V)
        if USE_INITIAL_STATE:
            tiles.store_state(dh0, b_dh, i_bh, o_k, o_v, K, V)


def block_sizes(F: int, V: int, gk: bool) -> tuple[int, int, int]:
    """(BT, BF, BV). The [BT, BF] tiles set the shared memory: BT * BF <= 8K keeps sm_90 compiles
    within 227 KB (performer's F = 266 at BT = 64 needs 315 KB forward, 405 KB backward). A
    per-channel gate builds [BT, BT, BF] decays, hence BT = 16 with gk."""
    BF = utils.next_pow2(F)
    return (16 if gk else min(64, max(16, 8192 // BF))), BF, common.value_block(BF, V)


def launch_options(F: int, V: int, gated: bool) -> dict:
    """The chunk size and ``utils.dot_options`` of both kernels, for F features (gk: ``gated``)."""
    return dict(BT=block_sizes(F, V, gated)[0], **utils.dot_options())


chunk_linear_attn = common.define_op(
    "chunk_linear_attn",
    "(Gated) linear attention over a prompt, chunkwise-parallel, differentiable.",
    lambda: (chunk_linear_attn_fwd_kernel, chunk_linear_attn_bwd_kernel),
    launch_options,
)
