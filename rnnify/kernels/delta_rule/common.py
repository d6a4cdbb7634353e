"""What the delta-rule ops share: the public wrapper, the fake impls and the autograd.

Schema of both forward ops: ``(q, k, v, beta, g, h0, scale, backend) -> (o, ht)``; the backward is
one Triton op for both (``chunk.py``'s ``rnnify::delta_rule_bwd``: the fused recurrent op
computes the same function, so the chunked backward is its gradient too).

Key mask (``mask [B, T]`` bool, True = a real token): applied here, before the op, as beta = 0
and g = 0 at padding tokens: u_t = beta_t (...) = 0 and alpha_t = 1, so a padding token leaves the
state exactly as it was (k_t then does not matter), and the gradients of its beta and g are 0.
A padding query reads the state like any other (finite; callers drop it).
"""

from __future__ import annotations

import torch

from rnnify.kernels import utils
from rnnify.kernels.delta_rule.naive import check_inputs


def forward(triton_fwd, reference, q, k, v, beta, g, h0, scale, backend):
    """The ops' body: ``triton_fwd(q, k, v, beta, g, h0, scale)`` or ``reference(q, k, v, beta, g, scale, h0)``."""
    if utils.resolve_backend(backend, q):
        return triton_fwd(q, k, v, beta, g, h0, scale)
    o, ht = reference(q, k, v, beta, g, scale, h0)
    return o.contiguous(), ht.contiguous()


def fake(q, k, v, beta, g, h0, scale, backend="auto"):
    B, T, H, K = q.shape
    return (
        q.new_empty(B, T, H, v.shape[-1], dtype=v.dtype),
        q.new_empty(B, k.shape[2], K, v.shape[-1], dtype=torch.float32),
    )


def fake_bwd(q, k, v, beta, g, h0, do, dht, scale):
    f32 = lambda x: torch.empty_like(x, dtype=torch.float32)  # noqa: E731
    return (
        f32(q),
        f32(k),
        f32(v),
        f32(beta),
        f32(g) if g is not None else q.new_empty(0, dtype=torch.float32),
        f32(h0) if h0 is not None else q.new_empty(0, dtype=torch.float32),
    )


def register_autograd(op, reference) -> None:
    """Triton path: ``rnnify::delta_rule_bwd`` (``chunk.py``; a custom op, so the backward traces);
    reference path: ``reference`` (the op's own PyTorch forward, ``(q, k, v, beta, g, scale, h0) ->
    (o, ht)``) recomputed under autograd."""

    def setup_context(ctx, inputs, output):
        q, k, v, beta, g, h0, scale, backend = inputs
        ctx.save_for_backward(q, k, v, beta, g, h0)
        ctx.args = scale, backend

    def backward(ctx, do, dht):
        q, k, v, beta, g, h0 = ctx.saved_tensors
        scale, backend = ctx.args
        if utils.resolve_backend(backend, q):
            grads = torch.ops.rnnify.delta_rule_bwd(q, k, v, beta, g, h0, do, dht, scale)
            dq, dk, dv, dbeta, dg, dh0 = (
                x.to(y.dtype) if y is not None else None for x, y in zip(grads, (q, k, v, beta, g, h0))
            )
        else:
            inputs = [None if x is None else x.detach().requires_grad_() for x in (q, k, v, beta, g, h0)]
            with torch.enable_grad():
                o, ht = reference(*inputs[:5], scale, inputs[5])
                wrt = [x for x in inputs if x is not None]
                grads = iter(torch.autograd.grad((o, ht), wrt, (do, dht), allow_unused=True))
            dq, dk, dv, dbeta, dg, dh0 = (None if x is None else next(grads) for x in inputs)
        return dq, dk, dv, dbeta, dg, dh0, None, None

    op.register_autograd(backward, setup_context=setup_context)


BWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? g, Tensor? h0, Tensor do, Tensor dht, float scale)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)

_OP_DOC = """ Math and shapes in ``naive.py``: beta ``[B, T, H_kv]`` in (0, 1),
g ``[B, T, H_kv]`` log decays (None: no decay), state ``[B, H_kv, K, V]``. The caller
L2-normalises q and k. ``mask`` ``[B, T]`` (True: a real token): padding leaves the state as it was
(see ``common``). ``backend``: see ``rnnify.kernels.utils.resolve_backend``."""


def define_op(name: str, summary: str, triton_fwd, reference):
    """Register the custom op ``rnnify::<name>`` (``forward`` over ``triton_fwd`` and ``reference``,
    the fake, the autograd) and return its public function, documented by ``summary``."""

    @torch.library.custom_op(f"rnnify::{name}", mutates_args=())
    def op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        beta: torch.Tensor,
        g: torch.Tensor | None,
        h0: torch.Tensor | None,
        scale: float,
        backend: str = "auto",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(triton_fwd, reference, q, k, v, beta, g, h0, scale, backend)

    op.register_fake(fake)
    register_autograd(op, reference)

    def delta_rule(
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
        check_inputs(q, k, v, beta, g)
        utils.check_kernels(backend, utils.BACKENDS)
        B, T, H, K = q.shape
        beta = beta.float()
        g = None if g is None else g.float()
        if mask is not None:
            if tuple(mask.shape) != (B, T):
                raise ValueError(f"mask must be [B, T] = {(B, T)}, got {tuple(mask.shape)}")
            real = mask.to(torch.bool)[:, :, None]
            beta = torch.where(real, beta, 0.0)
            g = None if g is None else torch.where(real, g, 0.0)
        utils.check_shape("initial_state", initial_state, (B, k.shape[2], K, v.shape[-1]))
        scale = K**-0.5 if scale is None else float(scale)
        h0 = None if initial_state is None else initial_state.float()
        o, ht = getattr(torch.ops.rnnify, name)(*utils.contiguous(q, k, v, beta, g, h0), scale, backend)
        return o, (ht if output_final_state else None)

    delta_rule.__name__ = delta_rule.__qualname__ = name
    delta_rule.__doc__ = summary + _OP_DOC
    return delta_rule
