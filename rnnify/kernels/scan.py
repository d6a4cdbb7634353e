"""Associative scans: the first-order linear recurrence and Aaren's (m, u, w) softmax operator.

linear_recurrence: x ``[B, T, D]``,  x_t = a_t * x_{t-1} + b_t  (x_0 = initial_state, else 0), or with
``reverse=True``  x_t = a_t * x_{t+1} + b_t  (x_{T+1} = initial_state). Its operator on pairs
(a, b), applying the left one first, is (a1, b1) . (a2, b2) = (a1 a2, a2 b1 + b2). Differentiable:
its backward is the opposite-direction scan of the gradients, run by the op itself.

aaren_scan: scores s ``[B, T, H]``, values v ``[B, T, H, D]``; the running softmax of a fixed query
(rnnify/cells/aaren.py, docs/math.md §Scan operators) with state m, u ``[B, H]``, w ``[B, H, D]`` (start -inf, 0, 0):

    (mA, uA, wA) (+) (mB, uB, wB) = (m, uA e^{mA-m} + uB e^{mB-m}, wA e^{mA-m} + wB e^{mB-m}),  m = max(mA, mB)
    o_t = w_t / u_t  (0 while u_t = 0)

Triton: one program per (batch [x head], feature block) walks chunks of BT tokens, scans each with
tl.associative_scan and folds in the carry from the previous chunks. A reverse scan loads the
chunks back to front with reversed offsets and runs the forward scan: ``reverse=True`` of
tl.associative_scan has had bugs with non-commutative operators (triton#4362, #8412).

aaren_scan's Triton backward (``aaren_scan_bwd_kernel``, the ``rnnify::aaren_scan_bwd`` op) re-runs
the (m, u) scan into a scratch buffer, then two reverse linear recurrences give dv, ds and the
initial state's gradients; the running max's own gradient (through the final state) follows the
max's path with torch.maximum's tie rule, so it matches autograd of ``naive_aaren_scan``.
"""

from __future__ import annotations

import torch

from rnnify.kernels import tiles, utils
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


def doubling_linear_recurrence(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix pairs of x_t = a_t x_{t-1} + b_t over dim 1, by doubling (Hillis and Steele 1986):
    after the steps of 1, 2, 4, ... tokens each pair covers every token up to its own, so
    x_t = A_t x_0 + B_t for the returned (A, B). log2(T) vectorised steps over the whole of a and b,
    which callers keep to a chunk of tokens."""
    span = 1
    while span < a.shape[1]:
        b = torch.cat([b[:, :span], a[:, span:] * b[:, :-span] + b[:, span:]], dim=1)
        a = torch.cat([a[:, :span], a[:, span:] * a[:, :-span]], dim=1)
        span *= 2
    return a, b


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
        a, b, h0, x, ht, T,
        D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
        REVERSE: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
    ):  # fmt: skip
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
        s, v, m0, u0, w0, o, mt, ut, wt, T,
        H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
    ):  # fmt: skip
        # m and u are per head; they are carried broadcast over the BD value channels
        i_d, i_bh, i_b, i_h, o_d = tiles.value_block_program(H, BD)
        o_i = tl.arange(0, BT)
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

    @triton.jit
    def _softmax_combine(m1, u1, m2, u2):
        m = tl.maximum(m1, m2)
        ref = tl.where(m == float("-inf"), 0.0, m)
        return m, u1 * tl.exp(m1 - ref) + u2 * tl.exp(m2 - ref)

    @triton.jit
    def _finite(m):
        return tl.where(m == float("-inf"), 0.0, m)

    @triton.jit
    def aaren_scan_bwd_kernel(
        s, v, m0, u0, w0, do, o, dmt, dwt, dut, ms, us, ds, dv, dm0, du0, dw0, T,
        B: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
        USE_INITIAL_STATE: tl.constexpr,
    ):  # fmt: skip
        # ms, us: this program's scratch for m_t, u_t; ds, dm0, du0: partial sums over feature blocks
        # [ND, ...], summed by the caller; the per-head terms (-du, the max's path) go to block 0
        i_d, i_bh, i_b, i_h, o_d = tiles.value_block_program(H, BD)
        o_i = tl.arange(0, BT)
        m_d = o_d < D
        o_1 = tl.zeros([1], dtype=tl.int64)
        head0 = (i_d == 0).to(tl.float32)
        p_ms, p_us = ms + i_d * B * T * H, us + i_d * B * T * H
        p_ds = ds + i_d * B * T * H
        # ---- sweep 1, chunks in order: m_t, u_t into the scratch
        b_m0 = tl.full([1], float("-inf"), dtype=tl.float32)
        b_u0 = tl.zeros([1], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_m0 = tl.load(m0 + i_bh + o_1).to(tl.float32)
            b_u0 = tl.load(u0 + i_bh + o_1).to(tl.float32)
        b_m, b_u = b_m0, b_u0
        for i_t in range(0, tl.cdiv(T, BT)):
            o_t = i_t * BT + o_i
            m_t = o_t < T
            b_s = tl.load(s + (i_b * T + o_t) * H + i_h, mask=m_t, other=float("-inf")).to(tl.float32)
            b_M, b_U = tl.associative_scan((b_s, tl.where(m_t, 1.0, 0.0)), 0, _softmax_combine)
            b_M, b_U = _softmax_combine(b_m, b_u, b_M, b_U)
            tl.store(p_ms + (i_b * T + o_t) * H + i_h, b_M, mask=m_t)
            tl.store(p_us + (i_b * T + o_t) * H + i_h, b_U, mask=m_t)
            b_m = tl.max(tl.where(o_i == BT - 1, b_M, float("-inf")), axis=0, keep_dims=True)
            b_u = tl.sum(tl.where(o_i == BT - 1, b_U, 0.0), axis=0, keep_dims=True)
        tl.debug_barrier()  # the scratch is read back by other threads of this program
        # ---- sweep 2, chunks back to front (tokens loaded in reverse, scanned forward). With
        # e_t = exp(s_t - m_t):  A_t = do_t / u_t + exp(m_t - m_{t+1}) A_{t+1}  (A_{T+1} = dw), and Bt
        # the same of (do_t . o_t) / u_t  (B_{T+1} = -du):  dv_t = e_t A_t,  ds_t = e_t (v_t . A_t - B_t);
        # the max's path: g_t = dL/dm_t, g_T = dm - du u_T - dw . w_T, g_{t-1} = (1 - c_t) g_t,
        # ds_t += c_t g_t, c_t = [s_t > m_{t-1}] (1/2 on ties: torch.maximum's gradient)
        b_A = tl.load(dwt + i_bh * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_B = -tl.load(dut + i_bh + o_1).to(tl.float32) * head0
        b_g = tl.load(dmt + i_bh + o_1).to(tl.float32) * head0
        for i_r in range(0, tl.cdiv(T, BT)):
            o_t = T - 1 - (i_r * BT + o_i)
            m_t = o_t >= 0
            m_td = m_t[:, None] & m_d[None, :]
            p_t = (i_b * T + o_t) * H + i_h
            b_s = tl.load(s + p_t, mask=m_t, other=float("-inf")).to(tl.float32)
            b_mt = tl.load(p_ms + p_t, mask=m_t, other=0.0)
            b_ut = tl.load(p_us + p_t, mask=m_t, other=0.0)
            p_next = (i_b * T + tl.minimum(o_t + 1, T - 1)) * H + i_h  # m_{t+1}; after the last token, m_T
            b_a = tl.where(m_t, tl.exp(b_mt - _finite(tl.load(p_ms + p_next, mask=m_t, other=0.0))), 1.0)
            p_vt = p_t[:, None] * D + o_d[None, :]
            b_v = tl.load(v + p_vt, mask=m_td, other=0.0).to(tl.float32)
            b_do = tl.load(do + p_vt, mask=m_td, other=0.0).to(tl.float32)
            b_o = tl.load(o + p_vt, mask=m_td, other=0.0).to(tl.float32)
            b_r = tl.where(b_ut > 0, 1.0 / tl.maximum(b_ut, 1e-38), 0.0)  # o_t = 0 while u_t = 0
            b_xa = b_do * b_r[:, None]
            b_xb = tl.sum(b_do * b_o, axis=1) * b_r
            b_Pa, b_Xa = tl.associative_scan(
                (b_a[:, None] + tl.zeros([BT, BD], dtype=tl.float32), b_xa), 0, _linear_combine
            )
            b_Pb, b_Xb = tl.associative_scan((b_a, b_xb), 0, _linear_combine)
            b_At = b_Pa * b_A[None, :] + b_Xa
            b_Bt = b_Pb * b_B + b_Xb
            b_e = tl.exp(b_s - _finite(b_mt))
            tl.store(dv + p_vt, (b_e[:, None] * b_At).to(dv.dtype.element_ty), mask=m_td)
            b_ds = b_e * (tl.sum(b_v * b_At, axis=1) - b_Bt)
            # the max's path
            p_prev = (i_b * T + tl.maximum(o_t - 1, 0)) * H + i_h
            b_mp = tl.where(o_t > 0, tl.load(p_ms + p_prev, mask=m_t, other=0.0), b_m0)  # m_{t-1}
            b_c = tl.where(b_s > b_mp, 1.0, tl.where(b_s == b_mp, 0.5, 0.0))
            b_sn = tl.load(s + p_t + H, mask=m_t & (o_t + 1 < T), other=0.0).to(tl.float32)  # s_{t+1}
            b_cn = tl.where(b_sn > b_mt, 1.0, tl.where(b_sn == b_mt, 0.5, 0.0))
            b_f = tl.where(m_t & (o_t + 1 < T), 1.0 - b_cn, 1.0)
            b_gt = b_g * tl.cumprod(b_f, axis=0)  # g_t = g_{t_hi + 1} prod_{t < t' <= t_hi + 1} (1 - c_t')
            b_ds += b_c * b_gt
            tl.store(p_ds + p_t, b_ds, mask=m_t)
            last = o_i == BT - 1
            b_A = tl.sum(tl.where(last[:, None], b_At, 0.0), axis=0)
            b_B = tl.sum(tl.where(last, b_Bt, 0.0), axis=0, keep_dims=True)
            b_g = tl.sum(tl.where(last, b_gt, 0.0), axis=0, keep_dims=True)
        if USE_INITIAL_STATE:  # the initial state is one more leaf, (m0, u0, w0), before token 0
            b_s0 = tl.load(s + i_b * T * H + i_h + o_1).to(tl.float32)
            b_a = tl.exp(b_m0 - _finite(tl.load(p_ms + i_b * T * H + i_h + o_1)))
            b_A = b_a * b_A
            b_B = b_a * b_B
            b_g = b_g * (1.0 - tl.where(b_s0 > b_m0, 1.0, tl.where(b_s0 == b_m0, 0.5, 0.0)))
            b_w0 = tl.load(w0 + i_bh * D + o_d, mask=m_d, other=0.0).to(tl.float32)
            tl.store(dw0 + i_bh * D + o_d, b_A, mask=m_d)
            b_dm0 = tl.sum(b_w0 * b_A, axis=0) - b_u0 * b_B + b_g
            tl.store(dm0 + i_d * B * H + i_bh + o_1, b_dm0)
            tl.store(du0 + i_d * B * H + i_bh + o_1, -b_B)


# --------------------------------------------------------------------------- ops


@torch.library.custom_op("rnnify::linear_recurrence", mutates_args=())
def _linear_recurrence_op(
    a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor | None, reverse: bool, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    if not utils.resolve_backend(backend, b):
        x, ht = naive_linear_recurrence(a, b, h0, reverse, True)
        return x.contiguous(), ht.contiguous()
    a, b, h0 = utils.contiguous(a, b, h0)
    B, T, D = b.shape
    x = utils.empty((B, T, D), b.device, b.dtype)
    ht = utils.empty((B, D), b.device, torch.float32)
    BD = min(utils.next_pow2(D), 64)
    linear_recurrence_fwd_kernel[(triton.cdiv(D, BD), B)](
        a, b, h0, x, ht, T, D=D, BT=64, BD=BD, REVERSE=reverse, USE_INITIAL_STATE=h0 is not None
    )
    return x, ht


@_linear_recurrence_op.register_fake
def _(a, b, h0, reverse, backend="auto"):
    return torch.empty_like(b), b.new_empty(b.shape[0], b.shape[2], dtype=torch.float32)


def _linear_recurrence_setup(ctx, inputs, output):
    a, b, h0, reverse, backend = inputs
    ctx.save_for_backward(a, h0, output[0])
    ctx.reverse, ctx.backend = reverse, backend


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
    g, _ = torch.ops.rnnify.linear_recurrence(
        a_adj.contiguous(), dx.contiguous(), dht.float().contiguous(), not ctx.reverse, ctx.backend
    )
    first = -1 if ctx.reverse else 0  # the step that reads the initial state
    dh0 = None if h0 is None else (a[:, first].float() * g[:, first].float())
    return (g * x_prev).to(a.dtype), g, dh0, None, None


_linear_recurrence_op.register_autograd(_linear_recurrence_backward, setup_context=_linear_recurrence_setup)


def linear_recurrence(
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    reverse: bool = False,
    output_final_state: bool = False,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x_t = a_t x_{t-1} + b_t over dim 1 of ``[B, T, D]`` (``reverse``: x_t = a_t x_{t+1} + b_t);
    returns ``(x, final_state)``, the final state ``[B, D]`` fp32 (x_T, or x_1 when reversed).
    ``backend``: see ``rnnify.kernels.utils.resolve_backend``."""
    if a.shape != b.shape or b.dim() != 3:
        raise ValueError(f"a and b must both be [B, T, D], got {tuple(a.shape)} and {tuple(b.shape)}")
    utils.check_kernels(backend, utils.BACKENDS)
    utils.check_shape("initial_state", initial_state, (b.shape[0], b.shape[2]))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    x, ht = torch.ops.rnnify.linear_recurrence(a.contiguous(), b.contiguous(), h0, bool(reverse), backend)
    return x, (ht if output_final_state else None)


@torch.library.custom_op("rnnify::aaren_scan", mutates_args=())
def _aaren_scan_op(
    s: torch.Tensor,
    v: torch.Tensor,
    m0: torch.Tensor | None,
    u0: torch.Tensor | None,
    w0: torch.Tensor | None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    h0 = None if m0 is None else (m0, u0, w0)
    if not utils.resolve_backend(backend, v):
        o, (m, u, w) = naive_aaren_scan(s, v, h0, True)
        return o.contiguous(), m.contiguous(), u.contiguous(), w.contiguous()
    s, v, m0, u0, w0 = utils.contiguous(s, v, m0, u0, w0)
    B, T, H, D = v.shape
    o = utils.empty((B, T, H, D), v.device, v.dtype)
    mt, ut = utils.empty((B, H), v.device), utils.empty((B, H), v.device)
    wt = utils.empty((B, H, D), v.device)
    BD = min(utils.next_pow2(D), 64)
    aaren_scan_fwd_kernel[(triton.cdiv(D, BD), B * H)](
        s, v, m0, u0, w0, o, mt, ut, wt, T, H=H, D=D, BT=32, BD=BD, USE_INITIAL_STATE=m0 is not None
    )
    return o, mt, ut, wt


@_aaren_scan_op.register_fake
def _(s, v, m0, u0, w0, backend="auto"):
    B, T, H, D = v.shape
    f = torch.float32
    return torch.empty_like(v), v.new_empty(B, H, dtype=f), v.new_empty(B, H, dtype=f), v.new_empty(B, H, D, dtype=f)


_AAREN_BWD_SCHEMA = (
    "(Tensor s, Tensor v, Tensor? m0, Tensor? u0, Tensor? w0, Tensor o, Tensor do, Tensor dmt, Tensor du, Tensor dw)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@torch.library.custom_op("rnnify::aaren_scan_bwd", mutates_args=(), schema=_AAREN_BWD_SCHEMA)
def _aaren_scan_bwd_op(s, v, m0, u0, w0, o, do, dmt, du, dw):
    """Triton: (ds, dv, dm0, du0, dw0), the last three empty without an initial state; ``dmt``: the
    final max's own gradient (``_aaren_backward``)."""
    s, v, m0, u0, w0, o, do, dmt, dw, du = utils.contiguous(s, v, m0, u0, w0, o, do, dmt, dw.float(), du.float())
    B, T, H, D = v.shape
    BD = min(utils.next_pow2(D), 64)
    ND = triton.cdiv(D, BD)
    ms, us, ds = (utils.empty((ND, B, T, H), v.device) for _ in range(3))
    dv = utils.empty((B, T, H, D), v.device, v.dtype)
    if m0 is None:
        dm0, du0, dw0 = (v.new_empty(0, dtype=torch.float32) for _ in range(3))
    else:
        dm0, du0 = utils.empty((ND, B, H), v.device), utils.empty((ND, B, H), v.device)
        dw0 = utils.empty((B, H, D), v.device)
    constants = dict(B=B, H=H, D=D, BT=32, BD=BD, USE_INITIAL_STATE=m0 is not None)
    aaren_scan_bwd_kernel[(ND, B * H)](
        s, v, m0, u0, w0, do, o, dmt, dw, du, ms, us, ds, dv, dm0, du0, dw0, T, **constants
    )
    return ds.sum(0), dv, (dm0 if m0 is None else dm0.sum(0)), (du0 if m0 is None else du0.sum(0)), dw0


@_aaren_scan_bwd_op.register_fake
def _(s, v, m0, u0, w0, o, do, dmt, du, dw):
    if m0 is None:
        return torch.empty_like(s), torch.empty_like(v), *(s.new_empty(0) for _ in range(3))
    return torch.empty_like(s), torch.empty_like(v), torch.empty_like(m0), torch.empty_like(u0), torch.empty_like(w0)


def _aaren_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], *output)
    ctx.backend = inputs[5]


def _aaren_backward(ctx, do, dm, du, dw):
    """Triton: ``aaren_scan_bwd_kernel``. Reference: the loop recomputed under autograd and differentiated."""
    *saved, o, mt, ut, wt = ctx.saved_tensors
    if utils.resolve_backend(ctx.backend, saved[1]):
        # m_T's own gradient: u_T and w_T are relative to it
        dmt = dm.float() - du.float() * ut - (dw.float() * wt).sum(-1)
        ds, dv, dm0, du0, dw0 = torch.ops.rnnify.aaren_scan_bwd(*saved, o, do, dmt, du, dw)
        return (ds, dv, *((None,) * 3 if saved[2] is None else (dm0, du0, dw0)), None)
    inputs = [None if x is None else x.detach().requires_grad_() for x in saved]
    s, v, m0, u0, w0 = inputs
    with torch.enable_grad():
        o, state = naive_aaren_scan(s, v, None if m0 is None else (m0, u0, w0), True)
        wrt = [x for x in inputs if x is not None]
        grads = torch.autograd.grad((o, *state), wrt, (do, dm, du, dw), allow_unused=True)
    it = iter(grads)
    return (*[None if x is None else next(it) for x in inputs], None)


_aaren_scan_op.register_autograd(_aaren_backward, setup_context=_aaren_setup)


AarenState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # m [B, H], u [B, H], w [B, H, D]


def aaren_scan(
    s: torch.Tensor,
    v: torch.Tensor,
    initial_state: AarenState | None = None,
    output_final_state: bool = False,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, AarenState | None]:
    """Aaren's prefix softmax: s ``[B, T, H]``, v ``[B, T, H, D]`` -> ``(o [B, T, H, D], (m, u, w))``.
    ``backend``: see ``rnnify.kernels.utils.resolve_backend``."""
    if s.shape != v.shape[:3]:
        raise ValueError(f"s must be [B, T, H] = {tuple(v.shape[:3])}, got {tuple(s.shape)}")
    utils.check_kernels(backend, utils.BACKENDS)
    m0 = u0 = w0 = None
    if initial_state is not None:
        B, _, H, D = v.shape
        for name, x, shape in zip(("m", "u", "w"), initial_state, ((B, H), (B, H), (B, H, D))):
            utils.check_shape(f"initial_state's {name}", x, shape)
        m0, u0, w0 = (x.float().contiguous() for x in initial_state)
    o, m, u, w = torch.ops.rnnify.aaren_scan(s.float().contiguous(), v.contiguous(), m0, u0, w0, backend)
    return o, ((m, u, w) if output_final_state else None)
