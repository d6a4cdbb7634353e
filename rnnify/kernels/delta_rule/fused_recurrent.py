"""fused_recurrent_delta_rule: the (gated) delta rule token by token in one kernel (the decode step).

One program per (value block, batch x kv head) keeps H ``[BK, BV]`` in fp32 registers and, per
token (math in ``naive.py``):

    H <- exp(g_t) H;   u = beta_t (v_t - H^T k_t);   H <- H + k_t u^T;   o_t = scale H^T q_t

for each query head of the kv head's group. It computes the same function as ``chunk_delta_rule``,
so its backward is that op's (``rnnify::delta_rule_bwd``).
"""

from __future__ import annotations

import torch

from rnnify.kernels import utils
from rnnify.kernels.delta_rule import common
from rnnify.kernels.delta_rule.chunk import _bwd_op
from rnnify.kernels.delta_rule.naive import naive_recurrent_delta_rule
from rnnify.kernels.utils import tl, triton

if triton is not None:

    @triton.jit
    def fused_recurrent_delta_rule_fwd_kernel(
        q,
        k,
        v,
        beta,
        g,
        h0,
        o,
        ht,
        scale,
        T,
        H: tl.constexpr,
        HKV: tl.constexpr,
        G: tl.constexpr,
        K: tl.constexpr,
        V: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        USE_G: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
    ):
        i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets
        i_b, i_h = i_bh // HKV, i_bh % HKV
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k, m_v = o_k < K, o_v < V
        m_h = m_k[:, None] & m_v[None, :]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_h += tl.load(h0 + i_bh * K * V + o_k[:, None] * V + o_v[None, :], mask=m_h, other=0.0).to(tl.float32)
        for t in range(0, T):
            i_bt = i_b * T + t
            b_k = tl.load(k + (i_bt * HKV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_v = tl.load(v + (i_bt * HKV + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + i_bt * HKV + i_h).to(tl.float32)
            if USE_G:
                b_h = b_h * tl.exp(tl.load(g + i_bt * HKV + i_h).to(tl.float32))
            b_u = b_beta * (b_v - tl.sum(b_k[:, None] * b_h, axis=0))
            b_h += b_k[:, None] * b_u[None, :]
            for i_g in tl.static_range(G):
                i_hq = i_h * G + i_g
                b_q = tl.load(q + (i_bt * H + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
                b_o = tl.sum(b_q[:, None] * b_h, axis=0)
                tl.store(o + (i_bt * H + i_hq) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        tl.store(ht + i_bh * K * V + o_k[:, None] * V + o_v[None, :], b_h, mask=m_h)


def fused_recurrent_delta_rule_fwd_triton(q, k, v, beta, g, h0, scale):
    q, k, v, beta, g, h0 = (None if x is None else x.contiguous() for x in (q, k, v, beta, g, h0))
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    BV = min(utils.next_pow2(V), 64)
    o = utils.empty((B, T, H, V), q.device, v.dtype)
    ht = utils.empty((B, Hkv, K, V), q.device)
    fused_recurrent_delta_rule_fwd_kernel[(triton.cdiv(V, BV), B * Hkv)](
        q,
        k,
        v,
        beta,
        g,
        h0,
        o,
        ht,
        scale,
        T,
        H=H,
        HKV=Hkv,
        G=H // Hkv,
        K=K,
        V=V,
        BK=utils.next_pow2(K),
        BV=BV,
        USE_G=g is not None,
        USE_INITIAL_STATE=h0 is not None,
    )
    return o, ht


def _reference(q, k, v, beta, g, scale, h0):
    o, ht = naive_recurrent_delta_rule(q, k, v, beta, g, scale, h0, output_final_state=True)
    return o.contiguous(), ht.contiguous()


@torch.library.custom_op("rnnify::fused_recurrent_delta_rule", mutates_args=())
def _fused_recurrent_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    h0: torch.Tensor | None,
    scale: float,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    return common.forward(fused_recurrent_delta_rule_fwd_triton, _reference, q, k, v, beta, g, h0, scale, backend)


_fused_recurrent_op.register_fake(common.fake)
common.register_autograd(_fused_recurrent_op, _bwd_op, _reference)


def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The (gated) delta rule token by token in one kernel (decode, short prompts), differentiable.
    Arguments as ``chunk_delta_rule``."""
    return common.run(
        torch.ops.rnnify.fused_recurrent_delta_rule,
        q,
        k,
        v,
        beta,
        g,
        scale,
        initial_state,
        output_final_state,
        mask,
        backend,
    )
