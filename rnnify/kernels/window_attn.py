"""window_attn_step: one decode token of sliding-window attention with sinks (rnnify/cells/window.py).

The write (the new token into the ring slot n mod W and, while n < S, into sink slot n) is index
bookkeeping done in PyTorch with the helpers of ``kernels/ring.py``; the op is the read: softmax
attention of each query head over the held keys (sinks ++ ring, ``[B, H_kv, N, D]``) with a
validity mask ``[B, N]``,

    o = sum_n valid_n exp(s_n) v_n / sum_n valid_n exp(s_n),   s_n = scale * q . k_n      (0 if none valid)

The op also returns the softmax's statistics: m = max_n valid_n s_n (-inf if none valid) and
u = sum_n valid_n exp(s_n - m) (0 if none valid), so o u = sum_n exp(s_n - m) v_n is the
unnormalised sum and m + log u the log-sum-exp (``window_attn_step(..., return_stats=True)``;
rnnify.cells.hybrid adds its linear part to f o u and f u). All three are differentiable.

Triton: one program per (batch, query head) walks the keys in blocks of BN with the running
(m, u, w) softmax of docs/math.md §Softmax attention as an RNN, all in fp32. Backward (``rnnify::window_attn_step_bwd``): one
program per (batch, kv head) holds the group's query heads as rows, recomputes their (m, u), then
walks the keys once more for dq, d keys, d values (d of the sinks and ring reach them through the
PyTorch writes). Gradients reaching m and u are added by recomputing (m, u) from the scores in
PyTorch under autograd (a [B, H, N] matrix; amax's gradient as PyTorch defines it, ties split).
"""

from __future__ import annotations

import torch

from rnnify.kernels import tiles, utils
from rnnify.kernels.ring import held_index, window_write
from rnnify.kernels.utils import tl, triton


def naive_window_attn_read(q, keys, values, valid, scale, stats=False):
    """q ``[B, H, K]``, keys ``[B, H_kv, N, K]``, values ``[B, H_kv, N, V]``, valid ``[B, N]`` -> o ``[B, H, V]`` fp32;
    with ``stats``, ``(o, m [B, H], u [B, H])``."""
    B, H, _ = q.shape
    Hkv = keys.shape[1]
    q = q.float().reshape(B, Hkv, H // Hkv, -1)
    s = scale * torch.einsum("bhgk,bhnk->bhgn", q, keys.float())
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0))
    den = p.sum(-1, keepdim=True)
    o = torch.where(den > 0, (p @ values.float()) / den.clamp_min(1e-38), 0.0)
    if stats:
        return o.reshape(B, H, -1), m.reshape(B, H), den.reshape(B, H)
    return o.reshape(B, H, -1)


if triton is not None:

    @triton.jit
    def held_block(valid, i_b, i_h, i_n, N, HKV: tl.constexpr, BN: tl.constexpr):
        """Block ``i_n`` of the BN keys kv head ``i_h`` of batch row ``i_b`` holds: their rows of
        keys / values ``[*, K|V]``, which of them are held (below N), which are valid."""
        o_j = i_n * BN + tl.arange(0, BN)
        m_j = o_j < N
        b_ok = tl.load(valid + i_b * N + o_j, mask=m_j, other=0) != 0
        return (i_b * HKV + i_h) * N + o_j, m_j, b_ok

    @triton.jit
    def window_attn_step_kernel(
        q, keys, values, valid, o, mo, uo, scale, N,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ):  # fmt: skip
        i_bh = tl.program_id(0).to(tl.int64)  # int64 offsets
        i_b, i_hq = i_bh // H, i_bh % H
        i_h = i_hq // G
        o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
        b_q = tiles.load_row(q, i_bh, o_k, K) * scale
        b_m = tl.full([1], float("-inf"), dtype=tl.float32)
        b_u = tl.zeros([1], dtype=tl.float32)
        b_w = tl.zeros([BV], dtype=tl.float32)
        for i_n in range(0, tl.cdiv(N, BN)):
            i_j, m_j, b_ok = held_block(valid, i_b, i_h, i_n, N, HKV, BN)
            b_k = tiles.load_rows(keys, i_j, o_k, m_j, K)
            b_v = tiles.load_rows(values, i_j, o_v, m_j, V)
            b_s = tl.where(b_ok, tl.sum(b_q[None, :] * b_k, axis=1), float("-inf"))  # [BN]
            b_mn = tl.maximum(b_m, tl.max(b_s, axis=0))
            b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)
            b_decay = tl.exp(b_m - b_ref)
            b_p = tl.exp(b_s - b_ref)  # [BN]
            b_u = b_u * b_decay + tl.sum(b_p, axis=0)
            b_w = b_w * b_decay + tl.sum(b_p[:, None] * b_v, axis=0)
            b_m = b_mn
        tiles.store_row(o, tl.where(b_u > 0, b_w / tl.maximum(b_u, 1e-38), 0.0), i_bh, o_v, V)
        tl.store(mo + i_bh + tl.arange(0, 1), b_m)
        tl.store(uo + i_bh + tl.arange(0, 1), b_u)

    @triton.jit
    def window_attn_step_bwd_kernel(
        q, keys, values, valid, o, do, dq, dkeys, dvalues, scale, N,
        H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ):  # fmt: skip
        # one program per (batch, kv head) holds its G query heads as rows, so it owns its keys'
        # gradients: p_gn = softmax weights, dv_n = sum_g p_gn do_g, ds_gn = p_gn (do_g . v_n - do_g . o_g),
        # dk_n = scale sum_g ds_gn q_g, dq_g = scale sum_n ds_gn k_n
        i_bh = tl.program_id(0).to(tl.int64)  # int64 offsets
        i_b, i_h = i_bh // HKV, i_bh % HKV
        o_g = tl.arange(0, BG)
        o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
        m_g = o_g < G
        i_q = i_b * H + i_h * G + o_g  # [BG] query heads
        b_q = tiles.load_rows(q, i_q, o_k, m_g, K)
        b_do = tiles.load_rows(do, i_q, o_v, m_g, V)
        b_delta = tl.sum(b_do * tiles.load_rows(o, i_q, o_v, m_g, V), axis=1)  # [BG]
        b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
        b_u = tl.zeros([BG], dtype=tl.float32)
        # ---- sweep 1: each head's running max and normaliser
        for i_n in range(0, tl.cdiv(N, BN)):
            i_j, m_j, b_ok = held_block(valid, i_b, i_h, i_n, N, HKV, BN)
            b_k = tiles.load_rows(keys, i_j, o_k, m_j, K)
            b_s = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2) * scale  # [BG, BN]
            b_s = tl.where(b_ok[None, :], b_s, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
            b_ref = tl.where(b_mn == float("-inf"), 0.0, b_mn)
            b_u = b_u * tl.exp(b_m - b_ref) + tl.sum(tl.exp(b_s - b_ref[:, None]), axis=1)
            b_m = b_mn
        b_ref = tl.where(b_m == float("-inf"), 0.0, b_m)
        b_r = tl.where(b_u > 0, 1.0 / tl.maximum(b_u, 1e-38), 0.0)
        # ---- sweep 2: the gradients, block by block of keys
        b_dq = tl.zeros([BG, BK], dtype=tl.float32)
        for i_n in range(0, tl.cdiv(N, BN)):
            i_j, m_j, b_ok = held_block(valid, i_b, i_h, i_n, N, HKV, BN)
            b_k = tiles.load_rows(keys, i_j, o_k, m_j, K)
            b_v = tiles.load_rows(values, i_j, o_v, m_j, V)
            b_s = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2) * scale
            b_p = tl.where(b_ok[None, :], tl.exp(b_s - b_ref[:, None]), 0.0) * b_r[:, None]  # [BG, BN]
            b_dp = tl.sum(b_do[:, None, :] * b_v[None, :, :], axis=2)
            b_ds = b_p * (b_dp - b_delta[:, None]) * scale
            b_dq += tl.sum(b_ds[:, :, None] * b_k[None, :, :], axis=1)
            tiles.store_rows(dkeys, tl.sum(b_ds[:, :, None] * b_q[:, None, :], axis=0), i_j, o_k, m_j, K)  # [BN, BK]
            tiles.store_rows(dvalues, tl.sum(b_p[:, :, None] * b_do[:, None, :], axis=0), i_j, o_v, m_j, V)  # [BN, BV]
        tiles.store_rows(dq, b_dq, i_q, o_k, m_g, K)


@torch.library.custom_op("rnnify::window_attn_step", mutates_args=())
def _window_attn_step_op(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o ``[B, H, V]``, m ``[B, H]``, u ``[B, H]``), fp32."""
    if not utils.resolve_backend(backend, q):
        o, m, u = naive_window_attn_read(q, keys, values, valid, scale, stats=True)
        return o.contiguous(), m.contiguous(), u.contiguous()
    q, keys, values, valid = utils.contiguous(q, keys, values, valid.to(torch.int8))
    B, H, K = q.shape
    Hkv, N, V = keys.shape[1], keys.shape[2], values.shape[-1]
    o = utils.empty((B, H, V), q.device)
    m, u = utils.empty((B, H), q.device), utils.empty((B, H), q.device)
    shapes = dict(**utils.head_dims(H, Hkv, K, V), BN=32, BK=utils.next_pow2(K), BV=utils.next_pow2(V))
    window_attn_step_kernel[(B * H,)](q, keys, values, valid, o, m, u, scale, N, **shapes)
    return o, m, u


@_window_attn_step_op.register_fake
def _(q, keys, values, valid, scale, backend="auto"):
    B, H = q.shape[:2]
    return (
        q.new_empty(B, H, values.shape[-1], dtype=torch.float32),
        q.new_empty(B, H, dtype=torch.float32),
        q.new_empty(B, H, dtype=torch.float32),
    )


@torch.library.custom_op("rnnify::window_attn_step_bwd", mutates_args=())
def _window_attn_step_bwd_op(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton: (dq, dkeys, dvalues) of the read."""
    q, keys, values, valid, do = utils.contiguous(q, keys, values, valid.to(torch.int8), do)
    B, H, K = q.shape
    Hkv, N, V = keys.shape[1], keys.shape[2], values.shape[-1]
    dq = utils.empty((B, H, K), q.device, q.dtype)
    dkeys = utils.empty((B, Hkv, N, K), q.device, keys.dtype)
    dvalues = utils.empty((B, Hkv, N, V), q.device, values.dtype)
    shapes = dict(**utils.head_dims(H, Hkv, K, V), BG=utils.next_pow2(H // Hkv, 1), BN=16)
    window_attn_step_bwd_kernel[(B * Hkv,)](
        q,
        keys,
        values,
        valid,
        o,
        do,
        dq,
        dkeys,
        dvalues,
        scale,
        N,
        **shapes,
        BK=utils.next_pow2(K),
        BV=utils.next_pow2(V),
    )
    return dq, dkeys, dvalues


@_window_attn_step_bwd_op.register_fake
def _(q, keys, values, valid, o, do, scale):
    return torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values)


def _window_setup(ctx, inputs, output):
    q, keys, values, valid, scale, backend = inputs
    ctx.save_for_backward(q, keys, values, valid, output[0])
    ctx.scale, ctx.backend = scale, backend


def _stats_grads(q, keys, valid, scale, dm, du):
    """(dq, dkeys) of <dm, m> + <du, u>, m and u recomputed from the scores under autograd."""
    inputs = [x.detach().requires_grad_() for x in (q, keys)]
    with torch.enable_grad():
        B, H, _ = q.shape
        s = scale * torch.einsum(
            "bhgk,bhnk->bhgn", inputs[0].float().reshape(B, keys.shape[1], H // keys.shape[1], -1), inputs[1].float()
        )
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        m = s.amax(-1)
        u = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0)[..., None]).sum(-1)
        dq, dkeys = torch.autograd.grad((m.reshape(B, H), u.reshape(B, H)), inputs, (dm, du))
    return dq, dkeys


def _window_backward(ctx, do, dm, du):
    """Triton: ``rnnify::window_attn_step_bwd`` for o, plus ``_stats_grads`` for m, u.
    Reference: the read recomputed under autograd."""
    q, keys, values, valid, o = ctx.saved_tensors
    if utils.resolve_backend(ctx.backend, q):
        dq, dkeys, dvalues = torch.ops.rnnify.window_attn_step_bwd(q, keys, values, valid, o, do, ctx.scale)
        if dm is not None or du is not None:
            dm = torch.zeros_like(o[..., 0]) if dm is None else dm
            du = torch.zeros_like(o[..., 0]) if du is None else du
            dq_s, dkeys_s = _stats_grads(q, keys, valid, ctx.scale, dm, du)
            dq, dkeys = dq + dq_s.to(dq.dtype), dkeys + dkeys_s.to(dkeys.dtype)
    else:
        inputs = [x.detach().requires_grad_() for x in (q, keys, values)]
        with torch.enable_grad():
            outs = naive_window_attn_read(*inputs, valid, ctx.scale, stats=True)
            used = [(x, d) for x, d in zip(outs, (do, dm, du)) if d is not None]
            dq, dkeys, dvalues = torch.autograd.grad(
                [x for x, _ in used], inputs, [d for _, d in used], allow_unused=True
            )
        dq, dkeys, dvalues = (
            torch.zeros_like(x) if d is None else d for x, d in zip((q, keys, values), (dq, dkeys, dvalues))
        )
    return dq, dkeys, dvalues, None, None, None


_window_attn_step_op.register_autograd(_window_backward, setup_context=_window_setup)


def _check_window_state(q, k, v, keys, values, length, sink_keys, sink_values, mask) -> None:
    """The token and the state against q's ``[B, 1, H, K]``: the kernel indexes them by its shapes."""
    B, _, H, K = q.shape
    if keys.dim() != 4 or H % max(keys.shape[1], 1):
        raise ValueError(f"keys must be [B, H_kv, W, K] with H_kv dividing {H} query heads, got {list(keys.shape)}")
    Hkv, window, sinks, V = keys.shape[1], keys.shape[2], sink_keys.shape[2], values.shape[-1]
    for name, x, shape in (
        ("k", k, (B, 1, Hkv, K)),
        ("v", v, (B, 1, Hkv, V)),
        ("keys", keys, (B, Hkv, window, K)),
        ("values", values, (B, Hkv, window, V)),
        ("sink_keys", sink_keys, (B, Hkv, sinks, K)),
        ("sink_values", sink_values, (B, Hkv, sinks, V)),
        ("length", length, (B,)),
        ("mask", mask, (B, 1)),
    ):
        utils.check_shape(name, x, shape)


def window_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    length: torch.Tensor,
    sink_keys: torch.Tensor | None = None,
    sink_values: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    return_stats: bool = False,
    backend: str = "auto",
):
    """One decode token: q ``[B, 1, H, K]``, k/v ``[B, 1, H_kv, K|V]``; state as rnnify.cells.window
    holds it: ring ``keys/values [B, H_kv, W, K|V]``, sinks ``[B, H_kv, S, K|V]`` (or None), ``length [B]``
    real tokens read; ``mask [B, 1]`` (False: padding, the state stays). Returns ``(o [B, 1, H, V] fp32,
    (keys, values, sink_keys, sink_values, length))``, and with ``return_stats`` a third item ``(m, u)``,
    each ``[B, 1, H]`` fp32: the scores' max over the attended keys (-inf if none) and the softmax
    denominator sum exp(s - m) (0 if none), so ``o * u`` is the unnormalised sum and ``m + log(u)``
    the log-sum-exp; differentiable. ``backend``: see ``rnnify.kernels.utils.resolve_backend``."""
    B, T, H, K = q.shape
    if T != 1:
        raise ValueError(f"window_attn_step reads one token, got T = {T}")
    utils.check_kernels(backend, utils.BACKENDS)
    scale = K**-0.5 if scale is None else float(scale)
    mask = torch.ones(B, 1, dtype=torch.bool, device=q.device) if mask is None else mask
    if sink_keys is None:
        sink_keys, sink_values = keys[:, :, :0], values[:, :, :0]
    _check_window_state(q, k, v, keys, values, length, sink_keys, sink_values, mask)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, 1, D]
    window, sinks = keys.shape[2], sink_keys.shape[2]
    keys, values, sink_keys, sink_values, length = window_write(
        k, v, mask, keys, values, sink_keys, sink_values, length
    )
    valid = held_index(length, window, sinks) >= 0
    o, m, u = torch.ops.rnnify.window_attn_step(
        q[:, 0].contiguous(),
        torch.cat([sink_keys, keys], 2).contiguous(),
        torch.cat([sink_values, values], 2).contiguous(),
        valid,
        scale,
        backend,
    )
    state = (keys, values, sink_keys, sink_values, length)
    return (o[:, None], state, (m[:, None], u[:, None])) if return_stats else (o[:, None], state)
