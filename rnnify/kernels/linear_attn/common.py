"""What the linear-attention ops share: the public wrapper, the PyTorch reference, autograd.

Normaliser: z_t obeys S_t's recurrence with v_t replaced by 1, so ``normalize=True`` runs the
unnormalised op on v' = [v, 1] with state S' = [S, z] (``[B, H_kv, F, V + 1]``): the last output
column is phi(q_t) . z_t, the denominator. Kernels therefore only implement o = c phi(q) S.

Both ops have the schema ``(q, k, v, g, gk, h0, scale, feature_map, feature_weight, query_shift,
backend, mask) -> (o, ht)``, one autograd and one public signature (``define_op``).

Key mask (``mask [B, T]`` bool, True = a real token; None: all real): a padding token leaves the
state exactly as it was: its phi(k) is 0 (in S and in z: zeroing k alone is not enough, elu's
phi(0) = 1) and its log gates g / gk are taken as 0 (whatever the caller passes there; their
gradient is 0). A padding query reads the state like any other (finite; callers drop it). The
Triton forward kernels apply the mask to each loaded tile; the backward passes the masked phi(k)
and gates to the backward kernel and zeroes the padding gradients of k and the gates. Triton backward: the scan's gradients come from the op's
backward kernel, itself a custom op (``rnnify::*_bwd``, with a fake, so the backward traces under
torch.compile), which takes featurised inputs; with a fused feature map the features are recomputed in
PyTorch under autograd and the kernel's d phi(q), d phi(k) are pulled back through them into q, k
and the weight (the map itself is not fused in the backward). Reference backward: the whole
reference forward recomputed under autograd.
"""

from __future__ import annotations

import torch

from rnnify.kernels import utils
from rnnify.kernels.linear_attn.feature_maps import (
    check_feature_map,
    feature_dim,
    kernel_args,
    naive_feature_map,
    output_scale,
)
from rnnify.kernels.linear_attn.naive import check_inputs, chunk_gated_attn
from rnnify.kernels.utils import triton

State = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # S, or (S, z) with normalize


def features(q, k, feature_map, weight, scale, query_shift, mask=None):
    """phi(q), phi(k) in fp32; with a mask, phi(k) is 0 at padding tokens."""
    phi_k = naive_feature_map(k, feature_map, weight, scale)
    if mask is not None:
        phi_k = torch.where(mask[:, :, None, None], phi_k, 0.0)
    return naive_feature_map(q, feature_map, weight, scale, query_shift), phi_k


def masked_gates(g, gk, mask):
    """The log gates with 0 at padding tokens (a padding token decays nothing)."""
    if mask is None:
        return g, gk
    return (
        None if g is None else torch.where(mask[:, :, None], g, 0.0),
        None if gk is None else torch.where(mask[:, :, None, None], gk, 0.0),
    )


def reference(
    q, k, v, g, gk, h0, scale, feature_map="identity", weight=None, query_shift=False, mask=None, chunk_size=64
):
    """The unnormalised op in PyTorch: the feature map, then ``naive.chunk_gated_attn`` (its
    layout: phi_q [B, H_kv, G, T, F], phi_k [B, H_kv, T, F], log_a [B, H_kv, T, F|1], None without
    a gate)."""
    phi_q, phi_k = features(q, k, feature_map, weight, scale, query_shift, mask)
    g, gk = masked_gates(g, gk, mask)
    B, T, H, F = phi_q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    phi_q = (phi_q * output_scale(feature_map, scale)).reshape(B, T, Hkv, H // Hkv, F).permute(0, 2, 3, 1, 4)
    kv = q.new_zeros(B, Hkv, F, V, dtype=torch.float32) if h0 is None else h0.float()
    log_a = None if g is None else g.float().transpose(1, 2)[..., None]
    if gk is not None:
        gk = gk.float().transpose(1, 2)
        log_a = gk if log_a is None else log_a + gk
    o, ht, _ = chunk_gated_attn(
        phi_q, phi_k.transpose(1, 2), v.float().transpose(1, 2), log_a, kv, None, chunk_size=chunk_size
    )
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, H, V).to(v.dtype), ht


def forward(triton_fwd, q, k, v, g, gk, h0, scale, feature_map, feature_weight, query_shift, backend, mask):
    """The ops' body: ``triton_fwd(q, k, v, g, gk, h0, w, scale, feature_map, query_shift, mask)`` or the reference."""
    if utils.resolve_backend(backend, q):
        return triton_fwd(q, k, v, g, gk, h0, feature_weight, scale, feature_map, query_shift, mask)
    o, ht = reference(q, k, v, g, gk, h0, scale, feature_map, feature_weight, query_shift, mask)
    return o.contiguous(), ht.contiguous()


def fake(
    q, k, v, g, gk, h0, scale, feature_map="identity", feature_weight=None, query_shift=False, backend="auto", mask=None
):
    B, T, H, K = q.shape
    F = feature_dim(feature_map, K, feature_weight)
    return (
        q.new_empty(B, T, H, v.shape[-1], dtype=v.dtype),
        q.new_empty(B, k.shape[2], F, v.shape[-1], dtype=torch.float32),
    )


def gate_grads(q, k, dq, dk, ht, dht, g, gk):
    """d g, d gk from the gradients of (featurised) q and k. With c_t the cumulative log gate (per
    feature), q_t enters only through q_t exp(c_t), k_t through k_t exp(-c_t), and the final state
    through exp(c_T):

        dL/dc_t = sum_heads q_t * dq_t - k_t * dk_t   (+ sum_v ht * dht at t = T)
        dgk_t = sum_{s >= t} dL/dc_s,   dg_t = that summed over the features
    """
    if g is None and gk is None:
        return None, None
    B, T, H, F = q.shape
    Hkv = k.shape[2]
    dc = (q.float() * dq.float()).reshape(B, T, Hkv, H // Hkv, F).sum(3) - k.float() * dk.float()
    dc[:, -1] += (ht * dht.float()).sum(-1)
    dc = dc.flip(1).cumsum(1).flip(1)
    return (dc.sum(-1) if g is not None else None), (dc if gk is not None else None)


def fake_bwd(q, k, v, g, gk, h0, do, dht, scale):
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        torch.empty_like(h0) if h0 is not None else q.new_empty(0, dtype=torch.float32),
    )


def register_autograd(op, bwd_op) -> None:
    """``bwd_op(phi_q, phi_k, v, g, gk, h0, do, dht, c) -> (dphi_q, dphi_k, dv, dh0)``, a custom op
    (so the backward traces under torch.compile), differentiates o = c phi(q) S, ht = S_T on featurised
    inputs (dh0 is empty without h0); the gates' gradients follow from it (``gate_grads``)."""

    def setup_context(ctx, inputs, output):
        q, k, v, g, gk, h0, scale, feature_map, weight, query_shift, backend, mask = inputs
        ctx.save_for_backward(q, k, v, g, gk, h0, weight, mask, output[1])
        ctx.args = scale, feature_map, query_shift, backend

    def triton_bwd(q, k, v, g, gk, h0, ht, do, dht, scale, mask):
        # k: featurised and 0 at padding; the gates are masked here, their padding gradients zeroed
        mg, mgk = masked_gates(g, gk, mask)
        dq, dk, dv, dh0 = bwd_op(q, k, v, mg, mgk, h0, do, dht, scale)
        dg, dgk = masked_gates(*gate_grads(q, k, dq, dk, ht, dht, mg, mgk), mask)
        return dq.to(q.dtype), dk, dv, dg, dgk, (dh0 if h0 is not None else None)

    def backward(ctx, do, dht):
        q, k, v, g, gk, h0, w, mask, ht = ctx.saved_tensors
        scale, feature_map, query_shift, backend = ctx.args
        if not utils.resolve_backend(backend, q):
            inputs = [
                None if x is None else x.detach().requires_grad_(x.is_floating_point()) for x in (q, k, v, g, gk, h0, w)
            ]
            with torch.enable_grad():
                o, ht = reference(*inputs[:6], scale, feature_map, inputs[6], query_shift, mask)
                wrt = [x for x in inputs if x is not None]
                grads = iter(torch.autograd.grad((o, ht), wrt, (do, dht), allow_unused=True))
            dq, dk, dv, dg, dgk, dh0, dw = (None if x is None else next(grads) for x in inputs)
        elif feature_map == "identity":
            mk = k if mask is None else torch.where(mask[:, :, None, None], k, 0)
            dq, dk, dv, dg, dgk, dh0 = triton_bwd(q, mk, v, g, gk, h0, ht, do, dht, scale, mask)
            dk = (dk if mask is None else torch.where(mask[:, :, None, None], dk, 0.0)).to(k.dtype)
            dw = None
        else:
            leaves = [None if x is None else x.detach().requires_grad_() for x in (q, k, w)]
            with torch.enable_grad():
                phi_q, phi_k = features(*leaves[:2], feature_map, leaves[2], scale, query_shift, mask)
            dphi_q, dphi_k, dv, dg, dgk, dh0 = triton_bwd(
                phi_q.detach(), phi_k.detach(), v, g, gk, h0, ht, do, dht, output_scale(feature_map, scale), mask
            )
            wrt = [x for x in leaves if x is not None]
            grads = iter(torch.autograd.grad((phi_q, phi_k), wrt, (dphi_q, dphi_k)))
            dq, dk, dw = (None if x is None else next(grads) for x in leaves)
        return dq, dk, dv, dg, dgk, dh0, None, None, dw, None, None, None

    op.register_autograd(backward, setup_context=setup_context)


def launch_forward(kernel, options, q, k, v, g, gk, h0, w, scale, feature_map, query_shift, mask):
    """(o, ht) from a forward kernel, one program per (value block, batch x kv head); ``options(F,
    V, gated)``: the kernel's own launch arguments for F features (``define_op``)."""
    q, k, v, g, gk, h0, w = utils.contiguous(q, k, v, g, gk, h0, w)
    km = None if mask is None else mask.to(torch.int8).contiguous()
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    F = feature_dim(feature_map, K, w)
    BF = utils.next_pow2(F)
    BV = value_block(BF, V)
    o = utils.empty((B, T, H, V), q.device, v.dtype)
    ht = utils.empty((B, Hkv, F, V), q.device, torch.float32)
    shapes = dict(T=T, **utils.head_dims(H, Hkv, K, V), F=F, BK=utils.next_pow2(K), BF=BF, BV=BV)
    flags = dict(USE_G=g is not None, USE_GK=gk is not None, USE_INITIAL_STATE=h0 is not None, USE_MASK=km is not None)
    feature_args = kernel_args(feature_map, scale, w, query_shift)
    kernel[(triton.cdiv(V, BV), B * Hkv)](
        q, k, v, g, gk, w, h0, km, o, ht, **shapes, **flags, **options(F, V, gk is not None), **feature_args
    )
    return o, ht


def launch_backward(kernel, options, q, k, v, g, gk, h0, do, dht, scale):
    """(dq fp32, dk fp32, dv, dh0) of (o = scale q S, ht) for featurised q, k from a backward kernel;
    dh0 is empty without h0. The kernel writes dq and dk per value block; they are summed here."""
    q, k, v, g, gk, h0, do, dht = utils.contiguous(q, k, v, g, gk, h0, do, dht)
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    BK = utils.next_pow2(K)
    BV = value_block(BK, V)
    NV = triton.cdiv(V, BV)
    dq = utils.empty((NV, B, T, H, K), q.device)
    dk = utils.empty((NV, B, T, Hkv, K), q.device)
    dv = utils.empty((B, T, Hkv, V), q.device, v.dtype)
    dh0 = utils.empty((B, Hkv, K, V), q.device) if h0 is not None else q.new_empty(0, dtype=torch.float32)
    shapes = dict(B=B, **utils.head_dims(H, Hkv, K, V), BK=BK, BV=BV)
    flags = dict(USE_G=g is not None, USE_GK=gk is not None, USE_INITIAL_STATE=h0 is not None)
    kernel[(NV, B * Hkv)](
        q, k, v, g, gk, h0, do, dht, dq, dk, dv, dh0, scale, T, **shapes, **flags, **options(K, V, gk is not None)
    )
    return dq.sum(0), dk.sum(0), dv, dh0


_OP_DOC = """ See ``naive.py`` for the math and shapes; ``initial_state`` /
final state: S ``[B, H_kv, F, V]``, or ``(S, z)`` with normalize. ``feature_map`` /
``feature_weight``: phi applied in the kernel (``feature_maps.py``; its backward goes through
PyTorch, see ``common``). ``mask`` ``[B, T]`` (True: a real token): padding keys add nothing to S
or z and padding gates are taken as 0 (see ``common``). ``backend``: see
``rnnify.kernels.utils.resolve_backend``."""


BWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? gk, Tensor? h0, Tensor do, Tensor dht, float scale)"
    " -> (Tensor, Tensor, Tensor, Tensor)"
)


def define_op(name: str, summary: str, kernels, options):
    """Register the custom ops ``rnnify::<name>`` (the forward: a Triton kernel or the reference,
    with its fake and autograd) and ``rnnify::<name>_bwd`` (the Triton backward); return the public
    function, documented by ``summary``. ``kernels()``: the (forward, backward) Triton kernels, asked
    for on the Triton path only (without triton they are not defined); ``options(F, V, gated)``:
    their own launch arguments (``launch_forward``)."""

    def triton_fwd(q, k, v, g, gk, h0, w, scale, feature_map, query_shift, mask):
        return launch_forward(kernels()[0], options, q, k, v, g, gk, h0, w, scale, feature_map, query_shift, mask)

    @torch.library.custom_op(f"rnnify::{name}", mutates_args=())
    def op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None,
        gk: torch.Tensor | None,
        h0: torch.Tensor | None,
        scale: float,
        feature_map: str = "identity",
        feature_weight: torch.Tensor | None = None,
        query_shift: bool = False,
        backend: str = "auto",
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(triton_fwd, q, k, v, g, gk, h0, scale, feature_map, feature_weight, query_shift, backend, mask)

    @torch.library.custom_op(f"rnnify::{name}_bwd", mutates_args=(), schema=BWD_SCHEMA)
    def bwd_op(q, k, v, g, gk, h0, do, dht, scale):
        return launch_backward(kernels()[1], options, q, k, v, g, gk, h0, do, dht, scale)

    op.register_fake(fake)
    bwd_op.register_fake(fake_bwd)
    register_autograd(op, bwd_op)

    def linear_attn(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor | None = None,
        gk: torch.Tensor | None = None,
        scale: float | None = None,
        initial_state: State | None = None,
        output_final_state: bool = False,
        normalize: bool = False,
        eps: float = 1e-6,
        *,
        feature_map: str | None = None,
        feature_weight: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, State | None]:
        feature_map = check_feature_map(feature_map, feature_weight, k)
        F = feature_dim(feature_map, k.shape[-1], feature_weight)
        check_inputs(q, k, v, g, gk, F)
        utils.check_kernels(backend, utils.BACKENDS)
        B, T, H, K = q.shape
        if mask is not None:
            if tuple(mask.shape) != (B, T):
                raise ValueError(f"mask must be [B, T] = {(B, T)}, got {tuple(mask.shape)}")
            mask = mask.to(torch.bool).contiguous()
        Hkv, V = k.shape[2], v.shape[-1]
        if normalize and initial_state is not None:
            utils.check_shape("initial_state[0]", initial_state[0], (B, Hkv, F, V))
            utils.check_shape("initial_state[1]", initial_state[1], (B, Hkv, F))
        elif initial_state is not None:
            utils.check_shape("initial_state", initial_state, (B, Hkv, F, V))
        scale = K**-0.5 if scale is None else float(scale)
        h0 = initial_state
        if normalize:
            v = torch.cat([v, v.new_ones(B, T, Hkv, 1)], dim=-1)
            if initial_state is not None:
                S, z = initial_state
                h0 = torch.cat([S.float(), z.float()[..., None]], dim=-1)
        elif h0 is not None:
            h0 = h0.float()
        q, k, v, w = utils.contiguous(q, k, v, feature_weight)
        g = None if g is None else g.float().contiguous()
        gk = None if gk is None else gk.float().contiguous()
        h0 = None if h0 is None else h0.contiguous()
        o, ht = getattr(torch.ops.rnnify, name)(q, k, v, g, gk, h0, scale, feature_map, w, normalize, backend, mask)
        if normalize:
            o = o[..., :V] / (o[..., V:] + eps)
            ht = (ht[..., :V], ht[..., V])
        return o, (ht if output_final_state else None)

    linear_attn.__name__ = linear_attn.__qualname__ = name
    linear_attn.__doc__ = summary + _OP_DOC
    return linear_attn


def value_block(BF: int, V: int) -> int:
    """Value columns per program: the fp32 state block [BF, BV] is kept at <= 8K elements."""
    return min(utils.next_pow2(V), 64, max(16, 8192 // BF))
