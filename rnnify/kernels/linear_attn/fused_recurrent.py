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

from rnnify.kernels import tiles
from rnnify.kernels.linear_attn import common
from rnnify.kernels.utils import tl, triton

if triton is not None:
    from rnnify.kernels.linear_attn.feature_maps import feature_map_1d, load_feature_weight

    @triton.jit
    def fused_recurrent_linear_attn_fwd_kernel(
        q, k, v, g, gk, w, h0, km, o, ht, scale, fsqrt, fshift, T,  # km: the key mask (int8)
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, F: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr,
        USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, USE_MASK: tl.constexpr,
        FEATURE: tl.constexpr, QUERY_SHIFT: tl.constexpr,
    ):  # fmt: skip
        i_v, i_bh, i_b, i_h, o_v = tiles.value_block_program(HKV, BV)
        o_k, o_f = tl.arange(0, BK), tl.arange(0, BF)  # o_f: the state's rows, phi's features (o_k unprojected)
        b_w = load_feature_weight(w, i_h, o_k, o_f, K, F, FEATURE)
        b_h = tiles.initial_state(h0, i_bh, o_f, o_v, F, V, USE_INITIAL_STATE)
        for t in range(0, T):
            i_bt = i_b * T + t
            b_k = feature_map_1d(
                tiles.load_row(k, i_bt * HKV + i_h, o_k, K), b_w, o_f, fsqrt, fshift, F, FEATURE, False
            )
            b_v = tiles.load_row(v, i_bt * HKV + i_h, o_v, V)
            b_real = True  # a padding token: phi(k) = 0 and log a = 0, the state stays as it was
            if USE_MASK:
                b_real = tl.load(km + i_bt) != 0
                b_k = tl.where(b_real, b_k, 0.0)
            b_h = tiles.decay(b_h, g, gk, i_bt * HKV + i_h, o_f, b_real, F, USE_G, USE_GK, USE_MASK)
            b_h += b_k[:, None] * b_v[None, :]
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tiles.load_row(q, i_bt * H + i_hq, o_k, K)
                b_q = feature_map_1d(b_q, b_w, o_f, fsqrt, fshift, F, FEATURE, QUERY_SHIFT) * scale
                tiles.store_row(o, tl.sum(b_q[:, None] * b_h, axis=0), i_bt * H + i_hq, o_v, V)
        tiles.store_state(ht, b_h, i_bh, o_f, o_v, F, V)

    @triton.jit
    def fused_recurrent_linear_attn_bwd_kernel(
        q, k, v, g, gk, h0, do, dht, dq, dk, dv, dh0, scale, T,  # q, k featurised: K is the feature dim
        B: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr,
        USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    ):  # fmt: skip
        i_v, i_bh, i_b, i_h, o_v = tiles.value_block_program(HKV, BV)
        o_k = tl.arange(0, BK)
        p_dq = dq + i_v * B * T * H * K
        p_dk = dk + i_v * B * T * HKV * K
        # ---- sweep 1, tokens in order: dq_t = scale S_t do_t^T
        b_h = tiles.initial_state(h0, i_bh, o_k, o_v, K, V, USE_INITIAL_STATE)
        for t in range(0, T):
            i_bt = i_b * T + t
            b_k = tiles.load_row(k, i_bt * HKV + i_h, o_k, K)
            b_v = tiles.load_row(v, i_bt * HKV + i_h, o_v, V)
            b_h = tiles.decay(b_h, g, gk, i_bt * HKV + i_h, o_k, True, K, USE_G, USE_GK, False)
            b_h += b_k[:, None] * b_v[None, :]
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_do = tiles.load_row(do, i_bt * H + i_hq, o_v, V)
                tiles.store_row(p_dq, tl.sum(b_h * b_do[None, :], axis=1) * scale, i_bt * H + i_hq, o_k, K)
        # ---- sweep 2, tokens back to front, dS = dL/dS_t
        b_dh = tiles.load_state(dht, i_bh, o_k, o_v, K, V)
        for r in range(0, T):
            i_bt = i_b * T + T - 1 - r
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tiles.load_row(q, i_bt * H + i_hq, o_k, K) * scale
                b_dh += b_q[:, None] * tiles.load_row(do, i_bt * H + i_hq, o_v, V)[None, :]
            b_k = tiles.load_row(k, i_bt * HKV + i_h, o_k, K)
            b_v = tiles.load_row(v, i_bt * HKV + i_h, o_v, V)
            tiles.store_row(p_dk, tl.sum(b_dh * b_v[None, :], axis=1), i_bt * HKV + i_h, o_k, K)
            tiles.store_row(dv, tl.sum(b_dh * b_k[:, None], axis=0), i_bt * HKV + i_h, o_v, V)
            b_dh = tiles.decay(b_dh, g, gk, i_bt * HKV + i_h, o_k, True, K, USE_G, USE_GK, False)
        if USE_INITIAL_STATE:
            tiles.store_state(dh0, b_dh, i_bh, o_k, o_v, K, V)


fused_recurrent_linear_attn = common.define_op(
    "fused_recurrent_linear_attn",
    "(Gated) linear attention, token by token in one kernel, differentiable.",
    lambda: (fused_recurrent_linear_attn_fwd_kernel, fused_recurrent_linear_attn_bwd_kernel),
    lambda F, V, gated: {},  # the default warps and stages; no chunks
)
