"""Triton scan kernels as torch custom ops (namespace ``rnnify``), each beside its PyTorch reference.

    linear_attn/   naive_recurrent_linear_attn (ground truth), fused_recurrent_linear_attn (decode,
                   short prompts) and chunk_linear_attn (prefill), both differentiable and able to
                   apply the feature map in the kernel (``feature_map=``: elu, relu, hedgehog, performer)
                   and a key mask for left padding (``mask=`` [B, T]: padding adds nothing, decays nothing)
    delta_rule/    naive_recurrent_delta_rule (ground truth, float64-checkable) and its chunked PyTorch
                   form, chunk_delta_rule (prefill) and fused_recurrent_delta_rule (decode): the
                   delta rule and its gated form (DeltaNet, Gated DeltaNet), differentiable, with
                   a key mask (padding: beta = 0, no decay)
    scan.py        linear_recurrence (x_t = a_t x_{t-1} + b_t, forward and reverse),
                   aaren_scan (Aaren's (m, u, w) operator)
    window_attn.py window_attn_step (one decode token of sliding-window attention with sinks;
                   ``return_stats=True`` adds the softmax's max and denominator)
    ring.py        the ring-buffer bookkeeping window_attn_step and the window cells share
    tiles.py       the Triton building blocks the kernels share (row loads and stores, a state's
                   start, a gated decay), inlined where called

The bottom layer: references live here beside their ops (``linear_attn/naive.py`` holds the token
loop and the chunked feature-space forms the gated cells also run), and nothing here imports
``rnnify.cells``.

Every op has a Triton backward (its own custom op, so backward graphs trace) and a fake impl.
Calling convention (fla's): q, k, v ``[B, T, H, D]`` (k, v may have fewer heads: GQA, query head
h reads kv head h // (H / H_kv)), ``scale=None`` (D^-0.5), ``initial_state=None``,
``output_final_state=False``; every op returns ``(o, final_state)``. Recurrent state is fp32.
``backend=`` ("auto", "triton", "reference"; ``utils.resolve_backend``) picks the path: "auto" is
Triton on CUDA (or forced for tests under TRITON_INTERPRET=1), the PyTorch reference elsewhere.
"""

from rnnify.kernels.delta_rule import (
    chunk_delta_rule,
    fused_recurrent_delta_rule,
    naive_recurrent_delta_rule,
)
from rnnify.kernels.linear_attn import (
    chunk_linear_attn,
    fused_recurrent_linear_attn,
    naive_recurrent_linear_attn,
)
from rnnify.kernels.scan import aaren_scan, linear_recurrence, naive_aaren_scan, naive_linear_recurrence
from rnnify.kernels.window_attn import naive_window_attn_read, window_attn_step

__all__ = [
    "aaren_scan",
    "chunk_delta_rule",
    "chunk_linear_attn",
    "fused_recurrent_delta_rule",
    "fused_recurrent_linear_attn",
    "linear_recurrence",
    "naive_aaren_scan",
    "naive_linear_recurrence",
    "naive_recurrent_delta_rule",
    "naive_recurrent_linear_attn",
    "naive_window_attn_read",
    "window_attn_step",
]
