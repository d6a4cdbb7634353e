"""chunk_delta_rule: the chunkwise-parallel (gated) delta rule for prefill, with a Triton backward.

Math (WY / UT form) in ``naive.py``. Forward: one program per (value block, batch x kv head)
walks the chunks of BT tokens in order with H ``[BK, BV]`` in fp32 registers (the delta rule acts
on each value column alone, so value blocks are independent; every program rebuilds the chunk's
M = (I + A)^-1 by forward substitution, row i of M - I being -A_i - sum_{j<i} A_ij (M - I)_j).
``STORE_STATES`` also writes each chunk's starting state (what the backward reads).

Backward (``rnnify::delta_rule_bwd``): the forward kernel stores the chunk-start states, then one
program per batch x kv head (all of K and V: A's and M's gradients sum over the value columns)
walks the chunks back to front carrying dH, differentiating per chunk

    o = s (exp(c) Q) H + P N,  P = s Q K^T * D * causal,  N = M (diag(beta) V - diag(beta exp(c)) K H)
    H' = exp(c_C) H + K^T diag(exp(c_C - c)) N,           M = (I + A)^-1,  dA = -M^T dM M^T

and the log decays through the cumulative c: dg_t = sum_{i >= t in the chunk} dL/dc_i. Every
exponent is a masked difference c_i - c_j with j <= i (or c_C - c_j), never positive.
"""

from __future__ import annotations

import torch

from rnnify.kernels import tiles, utils
from rnnify.kernels.delta_rule import common
from rnnify.kernels.delta_rule.naive import chunk_delta_rule_reference
from rnnify.kernels.utils import tl, triton

if triton is not None:

    @triton.jit
    def unit_lower_inverse(b_A, BT: tl.constexpr):
        """(I + A)^-1 for a strictly lower-triangular A ``[BT, BT]``, by forward substitution."""
        o_i = tl.arange(0, BT)
        b_N = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(1, BT):
            b_a = tl.sum(tl.where(o_i[:, None] == i, b_A, 0.0), axis=0)  # row i of A
            b_n = -b_a - tl.sum(b_a[:, None] * b_N, axis=0)
            b_N = tl.where(o_i[:, None] == i, b_n[None, :], b_N)
        return b_N + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)

    @triton.jit
    def load_chunk(
        k,
        beta,
        g,
        i_bt,
        m_t,
        i_h,
        HKV: tl.constexpr,
        K: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        USE_G: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """A chunk's keys, betas (0 past the end), cumulative log decays c, their total, D and M (its
        tokens: rows ``i_bt`` of the batch x time axis, ``m_t`` those in the sequence)."""
        o_i = tl.arange(0, BT)
        b_k = tiles.load_rows(k, i_bt * HKV + i_h, tl.arange(0, BK), m_t, K)
        b_beta = tl.load(beta + i_bt * HKV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_c = tl.zeros([BT], dtype=tl.float32)
        if USE_G:  # past the end: g = 0, so c stays at the chunk's total
            b_c = tl.cumsum(tl.load(g + i_bt * HKV + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
        b_cn = tl.sum(tl.where(o_i == BT - 1, b_c, 0.0), axis=0)
        m_c = o_i[:, None] >= o_i[None, :]
        b_D = tl.exp(tl.where(m_c, b_c[:, None] - b_c[None, :], float("-inf")))
        b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=PRECISION)
        b_A = tl.where(o_i[:, None] > o_i[None, :], b_beta[:, None] * b_kk * b_D, 0.0)
        b_M = unit_lower_inverse(b_A, BT)
        return b_k, b_beta, b_c, b_cn, b_D, b_kk, b_M

    @triton.jit
    def chunk_delta_rule_fwd_kernel(
        q, k, v, beta, g, h0, o, ht, hs, scale, T,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_OUTPUT: tl.constexpr, STORE_STATES: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        i_v, i_bh, i_b, i_h, o_v = tiles.value_block_program(HKV, BV)
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        m_c = o_i[:, None] >= o_i[None, :]
        NT = tl.cdiv(T, BT)
        b_h = tiles.initial_state(h0, i_bh, o_k, o_v, K, V, USE_INITIAL_STATE)
        for i_t in range(0, NT):
            if STORE_STATES:
                tiles.store_rows(hs, b_h, (i_bh * NT + i_t) * K + o_k, o_v, o_k < K, V)
            i_bt, m_t = tiles.chunk_tokens(i_b, i_t, T, BT)
            b_k, b_beta, b_c, b_cn, b_D, b_kk, b_M = load_chunk(
                k, beta, g, i_bt, m_t, i_h, HKV, K, BT, BK, USE_G, PRECISION
            )
            b_v = tiles.load_rows(v, i_bt * HKV + i_h, o_v, m_t, V)
            b_w = tl.dot(b_M, b_k * (b_beta * tl.exp(b_c))[:, None], input_precision=PRECISION)
            b_u = tl.dot(b_M, b_v * b_beta[:, None], input_precision=PRECISION)
            b_n = b_u - tl.dot(b_w, b_h, input_precision=PRECISION)  # the tokens' writes u_t  [BT, BV]
            if STORE_OUTPUT:
                for i_g in tl.static_range(G):
                    i_hq = i_h * G + i_g
                    b_q = tiles.load_rows(q, i_bt * H + i_hq, o_k, m_t, K) * scale
                    b_o = tl.dot(b_q * tl.exp(b_c)[:, None], b_h, input_precision=PRECISION)
                    b_s = tl.where(m_c, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * b_D, 0.0)
                    b_o += tl.dot(b_s, b_n, input_precision=PRECISION)
                    tiles.store_rows(o, b_o, i_bt * H + i_hq, o_v, m_t, V)
            b_ke = b_k * tl.exp(b_cn - b_c)[:, None]
            b_h = b_h * tl.exp(b_cn) + tl.dot(tl.trans(b_ke), b_n, input_precision=PRECISION)
        tiles.store_state(ht, b_h, i_bh, o_k, o_v, K, V)

    @triton.jit
    def chunk_delta_rule_bwd_kernel(
        q, k, v, beta, g, hs, do, dht, dq, dk, dv, dbeta, dg, dh0, scale, T,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
        USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        i_bh = tl.program_id(0).to(tl.int64)
        i_b, i_h = i_bh // HKV, i_bh % HKV
        o_i = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = tl.arange(0, BV)
        m_c = o_i[:, None] >= o_i[None, :]
        m_s = o_i[:, None] > o_i[None, :]
        NT = tl.cdiv(T, BT)
        b_dh = tiles.load_state(dht, i_bh, o_k, o_v, K, V)
        for r in range(0, NT):
            i_t = NT - 1 - r
            i_bt, m_t = tiles.chunk_tokens(i_b, i_t, T, BT)
            b_k, b_beta, b_c, b_cn, b_D, b_kk, b_M = load_chunk(
                k, beta, g, i_bt, m_t, i_h, HKV, K, BT, BK, USE_G, PRECISION
            )
            b_v = tiles.load_rows(v, i_bt * HKV + i_h, o_v, m_t, V)
            b_h = tiles.load_rows(hs, (i_bh * NT + i_t) * K + o_k, o_v, o_k < K, V)
            b_ec = tl.exp(b_c)
            b_y = b_k * (b_beta * b_ec)[:, None]  # diag(beta exp(c)) K
            b_x = b_v * b_beta[:, None]  # diag(beta) V
            b_w = tl.dot(b_M, b_y, input_precision=PRECISION)
            b_n = tl.dot(b_M, b_x, input_precision=PRECISION) - tl.dot(b_w, b_h, input_precision=PRECISION)
            b_e = tl.exp(b_cn - b_c)
            # through H' = exp(c_C) H + K^T diag(e) N
            b_kdh = tl.dot(b_k, b_dh, input_precision=PRECISION)  # [BT, BV]
            b_dn = b_kdh * b_e[:, None]
            b_dk = tl.dot(b_n, tl.trans(b_dh), input_precision=PRECISION) * b_e[:, None]
            b_dc = tl.zeros([BT], dtype=tl.float32)
            b_dcn = 0.0
            if USE_G:
                b_r = tl.sum(b_kdh * b_n, axis=1) * b_e
                b_dcn = tl.sum(tl.sum(b_dh * b_h, axis=1), axis=0) * tl.exp(b_cn) + tl.sum(b_r, axis=0)
                b_dc -= b_r
            b_dh_prev = b_dh * tl.exp(b_cn)
            # through the outputs of each query head of the group
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tiles.load_rows(q, i_bt * H + i_hq, o_k, m_t, K) * scale
                b_do = tiles.load_rows(do, i_bt * H + i_hq, o_v, m_t, V)
                b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
                b_s = tl.where(m_c, b_qk * b_D, 0.0)
                b_dn += tl.dot(tl.trans(b_s), b_do, input_precision=PRECISION)
                b_dp = tl.where(m_c, tl.dot(b_do, tl.trans(b_n), input_precision=PRECISION), 0.0) * b_D
                b_dqi = tl.dot(b_do, tl.trans(b_h), input_precision=PRECISION) * b_ec[:, None]
                b_dq = (b_dqi + tl.dot(b_dp, b_k, input_precision=PRECISION)) * scale
                tiles.store_rows(dq, b_dq, i_bt * H + i_hq, o_k, m_t, K)
                b_dk += tl.dot(tl.trans(b_dp), b_q, input_precision=PRECISION)
                b_dh_prev += tl.dot(tl.trans(b_q * b_ec[:, None]), b_do, input_precision=PRECISION)
                if USE_G:
                    b_R = b_dp * b_qk
                    b_dc += tl.sum(b_dqi * b_q, axis=1) + tl.sum(b_R, axis=1) - tl.sum(b_R, axis=0)
            # through N = M X - M Y H
            b_dh_prev -= tl.dot(tl.trans(b_w), b_dn, input_precision=PRECISION)
            b_dw = -tl.dot(b_dn, tl.trans(b_h), input_precision=PRECISION)  # [BT, BK]
            b_Mt = tl.trans(b_M)
            b_dx = tl.dot(b_Mt, b_dn, input_precision=PRECISION)
            b_dy = tl.dot(b_Mt, b_dw, input_precision=PRECISION)
            b_dM = tl.dot(b_dn, tl.trans(b_x), input_precision=PRECISION) + tl.dot(
                b_dw, tl.trans(b_y), input_precision=PRECISION
            )
            b_dA = -tl.dot(tl.dot(b_Mt, b_dM, input_precision=PRECISION), b_Mt, input_precision=PRECISION)
            b_dAD = tl.where(m_s, b_dA, 0.0) * b_D  # A = strictly_lower(diag(beta) K K^T * D)
            b_dv = b_dx * b_beta[:, None]
            b_dbeta = tl.sum(b_dx * b_v, axis=1) + tl.sum(b_dy * b_k, axis=1) * b_ec + tl.sum(b_dAD * b_kk, axis=1)
            b_dkk = b_dAD * b_beta[:, None]
            b_dk += b_dy * (b_beta * b_ec)[:, None]
            b_dk += tl.dot(b_dkk, b_k, input_precision=PRECISION) + tl.dot(
                tl.trans(b_dkk), b_k, input_precision=PRECISION
            )
            tiles.store_rows(dk, b_dk, i_bt * HKV + i_h, o_k, m_t, K)
            tiles.store_rows(dv, b_dv, i_bt * HKV + i_h, o_v, m_t, V)
            tl.store(dbeta + i_bt * HKV + i_h, b_dbeta, mask=m_t)
            if USE_G:
                b_RA = b_dkk * b_kk
                b_dc += tl.sum(b_dy * b_y, axis=1) + tl.sum(b_RA, axis=1) - tl.sum(b_RA, axis=0)
                b_dc += tl.where(o_i == BT - 1, b_dcn, 0.0)
                b_dg = tl.sum(b_dc, axis=0) - tl.cumsum(b_dc, axis=0) + b_dc  # sum over i >= t
                tl.store(dg + i_bt * HKV + i_h, b_dg, mask=m_t)
            b_dh = b_dh_prev
        if USE_INITIAL_STATE:
            tiles.store_state(dh0, b_dh, i_bh, o_k, o_v, K, V)


def block_sizes(K: int, V: int) -> tuple[int, int, int]:
    """(BT, BK, BV) of the forward: chunks of 32 tokens (M's forward substitution is BT steps),
    value blocks of at most 64 columns."""
    return 32, utils.next_pow2(K), min(utils.next_pow2(V), 64)


def _states_fwd(q, k, v, beta, g, h0, scale, store_output: bool, store_states: bool):
    q, k, v, beta, g, h0 = utils.contiguous(q, k, v, beta, g, h0)
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    BT, BK, BV = block_sizes(K, V)
    o = utils.empty((B, T, H, V), q.device, v.dtype) if store_output else None
    ht = utils.empty((B, Hkv, K, V), q.device)
    hs = utils.empty((B, Hkv, triton.cdiv(T, BT), K, V), q.device) if store_states else None
    shapes = dict(**utils.head_dims(H, Hkv, K, V), BT=BT, BK=BK, BV=BV)
    flags = dict(
        USE_G=g is not None, USE_INITIAL_STATE=h0 is not None, STORE_OUTPUT=store_output, STORE_STATES=store_states
    )
    chunk_delta_rule_fwd_kernel[(triton.cdiv(V, BV), B * Hkv)](
        q, k, v, beta, g, h0, o, ht, hs, scale, T, **shapes, **flags, **utils.dot_options()
    )
    return o, ht, hs


def chunk_delta_rule_fwd_triton(q, k, v, beta, g, h0, scale):
    o, ht, _ = _states_fwd(q, k, v, beta, g, h0, scale, store_output=True, store_states=False)
    return o, ht


@torch.library.custom_op("rnnify::delta_rule_bwd", mutates_args=(), schema=common.BWD_SCHEMA)
def _bwd_op(q, k, v, beta, g, h0, do, dht, scale):
    """Triton: (dq, dk, dv, dbeta, dg, dh0), fp32, of (o, ht) = the delta rule; dg / dh0 are empty
    without g / h0."""
    _, _, hs = _states_fwd(q, k, v, beta, g, h0, scale, store_output=False, store_states=True)
    q, k, v, beta, g, do, dht = utils.contiguous(q, k, v, beta, g, do, dht)
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    dq, dk = utils.empty((B, T, H, K), q.device), utils.empty((B, T, Hkv, K), q.device)
    dv, dbeta = utils.empty((B, T, Hkv, V), q.device), utils.empty((B, T, Hkv), q.device)
    dg = utils.empty((B, T, Hkv), q.device) if g is not None else q.new_empty(0, dtype=torch.float32)
    dh0 = utils.empty((B, Hkv, K, V), q.device) if h0 is not None else q.new_empty(0, dtype=torch.float32)
    shapes = dict(
        **utils.head_dims(H, Hkv, K, V), BT=block_sizes(K, V)[0], BK=utils.next_pow2(K), BV=utils.next_pow2(V)
    )
    flags = dict(USE_G=g is not None, USE_INITIAL_STATE=h0 is not None)
    chunk_delta_rule_bwd_kernel[(B * Hkv,)](
        q, k, v, beta, g, hs, do, dht, dq, dk, dv, dbeta, dg, dh0, scale, T, **shapes, **flags, **utils.dot_options()
    )
    return dq, dk, dv, dbeta, dg, dh0


_bwd_op.register_fake(common.fake_bwd)


_reference = chunk_delta_rule_reference


chunk_delta_rule = common.define_op(
    "chunk_delta_rule",
    "The (gated) delta rule over a prompt, chunkwise-parallel, differentiable.",
    chunk_delta_rule_fwd_triton,
    lambda *args: _reference(*args),  # looked up per call: the tests replace it to catch a fallback
)
