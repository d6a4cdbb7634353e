"""Associative scans: the first-order linear recurrence and Aaren's (m, u, w) softmax operator.

linear_recurrence: x ``[B, T, D]``,  x_t = a_t * x_{t-1} + b_t  (x_0 = initial_state, else 0), or with
``reverse=True``  x_t = a_t * x_{t+1} + b_t  (x_{T+1} = initial_state). Its operator on pairs
(a, b), applying the left one first, is (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2). Differentiable:
its backward is the opposite-direction scan of the gradients, run by the op itself.

aaren_scan: scores s ``[B, T, H]``, values v ``[B, T, H, D]``; the running softmax of a fixed query
(rnnify/cells/aaren.py, math.md §1) with state m, u ``[B, H]``, w ``[B, H, D]`` (start -inf, 0, 0):

    (mA, uA, wA) (+) (mB, uB, wB) = (m, uA e^{mA-m} + uB e^{mB-m}, wA e^{mA-m} + wB e^{mB-m}),  m = max(mA, mB)
    o_t = w_t / u_t  (0 while u_t = 0)

Triton: one program per (batch [x head], feature block) walks chunks of BT tokens, scans each with
tl.associative_scan and folds in the carry from the previous chunks. aaren_scan's backward
recomputes the reference loop under autograd (no Triton backward yet). A reverse scan loads the
chunks back to front with reversed offsets and runs the forward scan: ``reverse=True`` of
tl.associative_scan has had bugs with non-commutative operators (triton#4362, #8412).
"""

from __future__ import annotations

import torch

from rnnify.kernels import utils
from rnnify.kernels.utils import tl, triton


# --------------------------------------------------------------------------- references

def naive_linear_recurrence(a, b, initial_state=None, reverse=False, output_final_state=False):
    x = torch.zeros_like(b[:, 0], dtype=torch.float32) if initial_state is None else initial_state.float()
    outs = []
    steps = range(b.shape[1] - 1, -1, -1) if reverse else range(b.shape[1])
    for t in steps:
        x = a[:, t].float() * x + b[:, t].float()
        outs.append(x)
    if reverse:
        outs = outs[::-1]
    xs = torch.stack(outs, dim=1).to(b.dtype)
    return xs, (x if output_final_state else None)


def naive_aaren_scan(s, v, initial_state=None, output_final_state=False):
    B, T, H, D = v.shape
    if initial_state is None:
        m = torch.full((B, H), float("-inf"), device=v.device)
        u, w = torch.zeros(B, H, device=v.device), torch.zeros(B, H, D, device=v.device)
    else:
        m, u, w = (x.float() for x in initial_state)
    outs = []
    for t in range(T):
        s_t = s[:, t].float()
        m_new = torch.maximum(m, s_t)
        ref = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        u = u * (m - ref).exp() + (s_t - ref).exp()
        w = w * (m - ref).exp()[..., None] + v[:, t].float() * (s_t - ref).exp()[..., None]
        m = m_new
        outs.append(torch.where(u[..., None] > 0, w / u.clamp_min(1e-38)[..., None], 0.0))
    o = torch.stack(outs, dim=1).to(v.dtype)
    return o, ((m, u, w) if output_final_state else None)


# --------------------------------------------------------------------------- triton

if triton is not None:

    @triton.jit
    def _linear_combine(a1, b1, a2, b2):
        return a1 * a2, a2 * b1 + b2

    @triton.jit
    def linear_recurrence_fwd_kernel(
        a, b, h0, x, ht, T, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
        REVERSE: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    ):
        i_d, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # int64 offsets
        o_i = tl.arange(0, BT)
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        b_x = tl.zeros([BD], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_x += tl.load(h0 + i_b * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        for i_t in range(0, tl.cdiv(T, BT)):
            if REVERSE:
                o_t = T - 1 - (i_t * BT + o_i)
                m_t = o_t >= 0
            else:
                o_t = i_t * BT + o_i
                m_t = o_t < T
            m_td = m_t[:, None] & m_d[None, :]
            p = (i_b * T + o_t[:, None]) * D + o_d[None, :]
            b_a = tl.load(a + p, mask=m_td, other=1.0).to(tl.float32)  # padding: identity (1, 0)
            b_b = tl.load(b + p, mask=m_td, other=0.0).to(tl.float32)
            b_A, b_B = tl.associative_scan((b_a, b_b), 0, _linear_combine)
            b_xs = b_A * b_x[None, :] + b_B
            tl.store(x + p, b_xs.to(x.dtype.element_ty), mask=m_td)
            b_x = tl.sum(tl.where(o_i[:, None] == BT - 1, b_xs, 0.0), axis=0)
        tl.store(ht + i_b * D + o_d, b_x, mask=m_d)

    @triton.jit
    def _aaren_combine(m1, u1, w1, m2, u2, w2):
        m = tl.maximum(m1, m2)
        ref = tl.where(m == float("-inf"), 0.0, m)
        e1 = tl.exp(m1 - ref)
        e2 = tl.exp(m2 - ref)
        return m, u1 * e1 + u2 * e2, w1 * e1 + w2 * e2

    @triton.jit
    def aaren_scan_fwd_kernel(
        s, v, m0, u0, w0, o, mt, ut, wt, T, H: tl.constexpr, D: tl.constexpr,
        BT: tl.constexpr, BD: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    ):
        # m and u are per head; they are carried broadcast over the BD value channels
        i_d, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        i_b, i_h = i_bh // H, i_bh % H
        o_i = tl.arange(0, BT)
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        b_m = tl.full([BD], float("-inf"), dtype=tl.float32)
        b_u = tl.zeros([BD], dtype=tl.float32)
        b_w = tl.zeros([BD], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_m = tl.zeros([BD], dtype=tl.float32) + tl.load(m0 + i_bh).to(tl.float32)
            b_u += tl.load(u0 + i_bh).to(tl.float32)
            b_w += tl.load(w0 + i_bh * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        for i_t in range(0, tl.cdiv(T, BT)):
            o_t = i_t * BT + o_i
            m_t = o_t < T
            m_td = m_t[:, None] & m_d[None, :]
            b_s = tl.load(s + (i_b * T + o_t) * H + i_h, mask=m_t, other=float("-inf")).to(tl.float32)
            p_v = ((i_b * T + o_t[:, None]) * H + i_h) * D + o_d[None, :]
            b_v = tl.load(v + p_v, mask=m_td, other=0.0).to(tl.float32)
            b_ms = b_s[:, None] + tl.zeros([BT, BD], dtype=tl.float32)
            b_us = tl.where(m_t[:, None], 1.0, 0.0) + tl.zeros([BT, BD], dtype=tl.float32)  # leaf: (s, 1, v)
            b_M, b_U, b_W = tl.associative_scan((b_ms, b_us, b_v), 0, _aaren_combine)
            b_M, b_U, b_W = _aaren_combine(b_m[None, :], b_u[None, :], b_w[None, :], b_M, b_U, b_W)
            b_o = tl.where(b_U > 0, b_W / tl.maximum(b_U, 1e-38), 0.0)
            tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_td)
            last = o_i[:, None] == BT - 1
            b_m = tl.max(tl.where(last, b_M, float("-inf")), axis=0)
            b_u = tl.sum(tl.where(last, b_U, 0.0), axis=0)
            b_w = tl.sum(tl.where(last, b_W, 0.0), axis=0)
        tl.store(mt + i_bh + o_d * 0, b_m, mask=o_d == 0)
        tl.store(ut + i_bh + o_d * 0, b_u, mask=o_d == 0)
        tl.store(wt + i_bh * D + o_d, b_w, mask=m_d)


# --------------------------------------------------------------------------- ops

@torch.library.custom_op("rnnify::linear_recurrence", mutates_args=())
def _linear_recurrence_op(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None,
                          reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not utils.use_triton(b):
        x, ht = naive_linear_recurrence(a, b, h0, reverse, True)
        return x.contiguous(), ht.contiguous()
    a, b, h0 = (None if x is None else x.contiguous() for x in (a, b, h0))
    B, T, D = b.shape
    x = utils.empty((B, T, D), b.device, b.dtype)
    ht = utils.empty((B, D), b.device, torch.float32)
    BD = min(utils.next_pow2(D), 64)
    linear_recurrence_fwd_kernel[(triton.cdiv(D, BD), B)](
        a, b, h0, x, ht, T, D=D, BT=64, BD=BD, REVERSE=reverse, USE_INITIAL_STATE=h0 is not None)
    return x, ht


@_linear_recurrence_op.register_fake
def _(a, b, h0, reverse):
    return torch.empty_like(b), b.new_empty(b.shape[0], b.shape[2], dtype=torch.float32)


def _linear_recurrence_setup(ctx, inputs, output):
    a, b, h0, reverse = inputs
    ctx.save_for_backward(a, h0, output[0])
    ctx.reverse = reverse


def _linear_recurrence_backward(ctx, dx, dht):
    """The adjoint is the same recurrence run the other way, so the op computes its own gradient:
    forward scan: g_t = dx_t + a_{t+1} g_{t+1} (g_{T+1} = dht), db_t = g_t, da_t = g_t x_{t-1},
    d initial_state = a_1 g_1; a reverse scan mirrors it."""
    a, h0, x = ctx.saved_tensors
    ones = torch.ones_like(a[:, :1])
    x0 = torch.zeros_like(x[:, :1]) if h0 is None else h0[:, None].to(x.dtype)
    if ctx.reverse:
        a_adj, x_prev = torch.cat([ones, a[:, :-1]], 1), torch.cat([x[:, 1:], x0], 1)
    else:
        a_adj, x_prev = torch.cat([a[:, 1:], ones], 1), torch.cat([x0, x[:, :-1]], 1)
    g, _ = torch.ops.rnnify.linear_recurrence(a_adj.contiguous(), dx.contiguous(), dht.float().contiguous(),
                                              not ctx.reverse)
    first = -1 if ctx.reverse else 0  # the step that reads the initial state
    dh0 = None if h0 is None else (a[:, first].float() * g[:, first].float())
    return (g * x_prev).to(a.dtype), g, dh0, None


_linear_recurrence_op.register_autograd(_linear_recurrence_backward, setup_context=_linear_recurrence_setup)


def linear_recurrence(a, b, initial_state=None, reverse=False, output_final_state=False):
    """x_t = a_t x_{t-1} + b_t over dim 1 of ``[B, T, D]`` (``reverse``: x_t = a_t x_{t+1} + b_t);
    returns ``(x, final_state)``, the final state ``[B, D]`` fp32 (x_T, or x_1 when reversed)."""
    if a.shape != b.shape or b.dim() != 3:
        raise ValueError(f"a and b must both be [B, T, D], got {tuple(a.shape)} and {tuple(b.shape)}")
    h0 = None if initial_state is None else initial_state.float().contiguous()
    x, ht = torch.ops.rnnify.linear_recurrence(a.contiguous(), b.contiguous(), h0, bool(reverse))
    return x, (ht if output_final_state else None)


@torch.library.custom_op("rnnify::aaren_scan", mutates_args=())
def _aaren_scan_op(s: torch.Tensor, v: torch.Tensor, m0: torch.Tensor | None, u0: torch.Tensor | None,
                   w0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h0 = None if m0 is None else (m0, u0, w0)
    if not utils.use_triton(v):
        o, (m, u, w) = naive_aaren_scan(s, v, h0, True)
        return o.contiguous(), m.contiguous(), u.contiguous(), w.contiguous()
    s, v, m0, u0, w0 = (None if x is None else x.contiguous() for x in (s, v, m0, u0, w0))
    B, T, H, D = v.shape
    o = utils.empty((B, T, H, D), v.device, v.dtype)
    mt, ut = utils.empty((B, H), v.device), utils.empty((B, H), v.device)
    wt = utils.empty((B, H, D), v.device)
    BD = min(utils.next_pow2(D), 64)
    aaren_scan_fwd_kernel[(triton.cdiv(D, BD), B * H)](
        s, v, m0, u0, w0, o, mt, ut, wt, T, H=H, D=D, BT=32, BD=BD, USE_INITIAL_STATE=m0 is not None)
    return o, mt, ut, wt


@_aaren_scan_op.register_fake
def _(s, v, m0, u0, w0):
    B, T, H, D = v.shape
    f = torch.float32
    return torch.empty_like(v), v.new_empty(B, H, dtype=f), v.new_empty(B, H, dtype=f), v.new_empty(B, H, D, dtype=f)


def _aaren_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _aaren_backward(ctx, do, dm, du, dw):
    """No Triton backward yet: the reference loop is recomputed under autograd and differentiated."""
    inputs = [None if x is None else x.detach().requires_grad_() for x in ctx.saved_tensors]
    s, v, m0, u0, w0 = inputs
    with torch.enable_grad():
        o, state = naive_aaren_scan(s, v, None if m0 is None else (m0, u0, w0), True)
        wrt = [x for x in inputs if x is not None]
        grads = torch.autograd.grad((o, *state), wrt, (do, dm, du, dw), allow_unused=True)
    it = iter(grads)
    return tuple(None if x is None else next(it) for x in inputs)


_aaren_scan_op.register_autograd(_aaren_backward, setup_context=_aaren_setup)


def aaren_scan(s, v, initial_state=None, output_final_state=False):
    """Aaren's prefix softmax: s ``[B, T, H]``, v ``[B, T, H, D]`` -> ``(o [B, T, H, D], (m, u, w))``."""
    if s.shape != v.shape[:3]:
        raise ValueError(f"s must be [B, T, H] = {tuple(v.shape[:3])}, got {tuple(s.shape)}")
    m0 = u0 = w0 = None
    if initial_state is not None:
        m0, u0, w0 = (x.float().contiguous() for x in initial_state)
    o, m, u, w = torch.ops.rnnify.aaren_scan(s.float().contiguous(), v.contiguous(), m0, u0, w0)
    return o, ((m, u, w) if output_final_state else None)
