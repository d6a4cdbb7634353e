"""fused_recurrent_delta_rule: the (gated) delta rule token by token in one kernel (the decode step).

One program per (value block, batch x kv head) keeps H ``[BK, BV]`` in fp32 registers and, per
token (math in ``naive.py``):

    H <- exp(g_t) H;   u = beta_t (v_t - H^T k_t);   H <- H + k_t u^T;   o_t = scale H^T q_t

for each query head of the kv head's group. It computes the same function as ``chunk_delta_rule``,
so its backward is that op's (``rnnify::delta_rule_bwd``).
"""

from __future__ import annotations

import functools

from rnnify.kernels import tiles, utils
from rnnify.kernels.delta_rule import common
from rnnify.kernels.delta_rule.naive import naive_recurrent_delta_rule
from rnnify.kernels.utils import tl, triton

if triton is not None:

    @triton.jit
    def fused_recurrent_delta_rule_fwd_kernel(
        q, k, v, beta, g, h0, o, ht, scale, T,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr,
        USE_G: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    ):  # fmt: skip
        i_v, i_bh, i_b, i_h, o_v = tiles.value_block_program(HKV, BV)
        o_k = tl.arange(0, BK)
        b_h = tiles.initial_state(h0, i_bh, o_k, o_v, K, V, USE_INITIAL_STATE)
        for t in range(0, T):
            i_bt = i_b * T + t
            b_k = tiles.load_row(k, i_bt * HKV + i_h, o_k, K)
            b_v = tiles.load_row(v, i_bt * HKV + i_h, o_v, V)
            b_beta = tl.load(beta + i_bt * HKV + i_h).to(tl.float32)
            b_h = tiles.decay(b_h, g, None, i_bt * HKV + i_h, o_k, True, K, USE_G, False, False)
            b_u = b_beta * (b_v - tl.sum(b_k[:, None] * b_h, axis=0))
            b_h += b_k[:, None] * b_u[None, :]
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tiles.load_row(q, i_bt * H + i_hq, o_k, K) * scale
                tiles.store_row(o, tl.sum(b_q[:, None] * b_h, axis=0), i_bt * H + i_hq, o_v, V)
        tiles.store_state(ht, b_h, i_bh, o_k, o_v, K, V)


def fused_recurrent_delta_rule_fwd_triton(q, k, v, beta, g, h0, scale):
    q, k, v, beta, g, h0 = utils.contiguous(q, k, v, beta, g, h0)
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    BV = min(utils.next_pow2(V), 64)
    o = utils.empty((B, T, H, V), q.device, v.dtype)
    ht = utils.empty((B, Hkv, K, V), q.device)
    flags = dict(USE_G=g is not None, USE_INITIAL_STATE=h0 is not None)
    fused_recurrent_delta_rule_fwd_kernel[(triton.cdiv(V, BV), B * Hkv)](
        q, k, v, beta, g, h0, o, ht, scale, T, **utils.head_dims(H, Hkv, K, V), BK=utils.next_pow2(K), BV=BV, **flags
    )
    return o, ht


_reference = functools.partial(naive_recurrent_delta_rule, output_final_state=True)


fused_recurrent_delta_rule = common.define_op(
    "fused_recurrent_delta_rule",
    "The (gated) delta rule token by token in one kernel (decode, short prompts), differentiable.",
    fused_recurrent_delta_rule_fwd_triton,
    lambda *args: _reference(*args),  # looked up per call: the tests replace it to catch a fallback
)
