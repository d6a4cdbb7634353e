"""Sliding-window softmax plus linear attention for older tokens (LoLCATs, Zhang et al. 2024).

The math: docs/math.md §Hybrid window and linear.

Counting only a row's real tokens, query i sees through softmax the last W tokens and the first S
(the attention sinks of ``cells/window.py``, StreamingLLM; S = 4 by default), and every other
older token through linear attention with a feature map phi, in one normalised sum (the
``linear_window_attention`` of HazyResearch/lolcats, with a true sliding window):

    A(i) = { j <= i : i - j < W  or  j < S }                  the window part (softmax)
    M(i) = { j : S <= j <= i - W }                              the memory (linear), disjoint from A(i)
    s_ij = scale * q_i . k_j,      m_i = max_{j in A(i)} s_ij,      f_h = sigmoid(theta_h)

          f_h sum_{j in A(i)} exp(s_ij - m_i) v_j  +  sum_{j in M(i)} phi(q_i) . phi(k_j) v_j
    y_i = ---------------------------------------------------------------------------------
          f_h sum_{j in A(i)} exp(s_ij - m_i)      +  sum_{j in M(i)} phi(q_i) . phi(k_j)

so every token j <= i is counted exactly once, by the window part or by the memory. theta
(``window_logit``, one per query head, initialised to 0) is trainable, as are the weights of
trainable feature maps (hedgehog, t2r). With W >= the tokens read, y is plain softmax attention;
beyond that the model needs LoLCATs' attention transfer to be good.

A training-free linear memory is far from what a pretrained model's attention computes: on a
real 135M model at 2,048 tokens it made the hybrid 10x worse in KL than its window alone (4.06
against 0.404 nats/token, docs/fidelity-smollm2.md). So the cell's output
is the window's own output w_i / u_i plus a learned, zero-initialised share of the difference:

    out_i = w_i / u_i + g_h (y_i - w_i / u_i),        g_h = ``memory_gate`` (``memory_init``, default 0)

At g = 0 the converted model is exactly the ``window`` target with the same W and S, and
distillation grows g together with the feature map, adding long-range memory instead of first
repairing damage; at g = 1 it is LoLCATs' sum above. Both outputs come from the same (w, u) and
linear sums: no extra state, no extra pass.

Recurrent form, constant memory per kv head: the window target's state for the softmax part (a
ring buffer of the last W keys/values, token n in slot n mod W, the S sink keys/values, model
dtype, and ``length`` real tokens read per row; ``cells/window.py``) and the linear-attention
state of the tokens that have left the window (fp32, docs/math.md §Linear attention):

    when token i arrives, token i - W leaves the ring; unless it is a sink (i - W < S):
        kv += phi(k_{i-W})^T v_{i-W},      z += phi(k_{i-W})
    y_i = (f_h w_i + phi(q_i) kv) / (f_h u_i + phi(q_i) . z)

where (m_i, u_i, w_i) is the softmax recurrence of docs/math.md §Softmax attention as an RNN over
the ring (self included) and the sinks no longer in it (a sink still in the ring is counted once,
there). The window part is part of every step: decoding keeps the ring, it does not fall back to
linear attention alone.

Memory (``memory``): ``linear`` (the default, all of the above); ``gla``, the same with GLA's
decay (``cells/gated.py``, docs/math.md §Gated linear attention): when token i arrives and token
i - W leaves,

        kv <- diag(a_i) kv + phi(k_{i-W})^T v_{i-W},      z <- diag(a_i) z + phi(k_{i-W})
        log a_i = logsigmoid(x_i W_down W_up + b) / tau    (per feature and kv head, tau = 16)

from the arriving token's layer input, initialised as the ``gated`` target's (every a = 0.99), with
y_i read as above: the state is the linear memory's, the forms ``fused_hybrid_attn`` with ``log_a``
(the ops' per-feature gate, or ``cells.gated``'s gated forms off kernels); or a delta-rule memory,
``delta`` or ``gated-delta`` (``cells/delta.py``; the AHN design: what leaves the window is
written into a fixed-size recurrent memory). The delta state H = S^T ``[d_k, d_v]`` per kv head has
no normaliser, so it cannot join the normalised sum; the query's output blends the window's own
output with the memory's readout instead:

    when token i arrives and token j = i - W leaves the ring (not a sink):
        H <- alpha_i (I - beta_i k'_j k'_j^T) H + beta_i k'_j v_j^T
    out_i = w_i / u_i + s_i (H_i^T q'_i - w_i / u_i),      s_i = g_h 2 sigmoid(x_i W_s + b_s + c_h log(n_i / W))_h

with k' = normalise(k M + c) and q' = normalise(q M + c) through a map per kv head (``DeltaReader``;
M = I and c = 0 at start): RoPE'd keys far apart in position need not look alike, and keys that
share a common direction make each write erase the others, so the memory learns its own key
space. beta_i and alpha_i come from the layer input x_i of the arriving token
(``cells.delta.DeltaWriter``, initialised to beta = 0.5, alpha = 0.99): the token that pushes j out
decides how strongly j is written and how much the memory fades, so no layer input is kept in the
ring. s_i, the memory's share, is what softmax gives the tokens beyond the window, so it depends on
the query (here through x_i: W_s = 0, b_s = 0 at start) and on how many tokens n_i the memory holds:
n tokens of about the window's weight each have odds n / W against the window's W, hence the
log(n_i / W), weighted by c_h (1 at start; a factor of 1 at n = W); it is 0 while the memory is
still empty (nothing written yet: its readout 0 is no estimate). At g = 0 the model is again
exactly its window target; the state is the window's plus ``kv`` (H, fp32), no ``k_sum``; f_h
does not enter (w / u does not depend on it), so there is no ``window_logit`` and no feature map.
With ``share="mass"`` the share is the weight LoLCATs' sum gives the linear memory's tokens
instead, s_i = g_h M_i / (f_h u_i + M_i), M_i = phi(q_i) . z_i, z the sum of phi(k_j) over the
keys written (``mass_share``): the cell has phi and f_h, the state adds ``k_sum`` (z), the reader
no share projection; ``share="mass-input"`` scales those odds by exp(x_i W_s + b_s) (0 at start:
``"mass"`` again), a learned say of the query's token in how much it reads the memory. With
``anneal=tau`` each write's beta is beta tau_h / (tau_h + m), m the tokens written before, tau_h
learned from tau (``annealed``): a running mean of what leaves the window, not its last writes.
(Until this version the readout was added, out_i = w_i / u_i + g_h H^T q^_i, which could not give
the window's share to the memory: on SmolLM2 it ended worse than the window alone.) Forms:
``delta_memory_hybrid_attn`` (the window part as ``fused_hybrid_attn``'s, the memory through the
delta cells' chunk / step / fused forms on the leaving tokens); the tests hold it to the
``window`` target plus a delta-rule loop over the leaving tokens.

Forms (tests hold them to ``naive_recurrent_hybrid_attn``): ``naive_recurrent_*`` (a plain loop
over tokens, the window part key by key), ``parallel_*`` (masked quadratic over sinks + ring + new
tokens, plus the linear state), ``chunk_*`` (the parallel form over chunks: the prefill path),
``step_*`` (one token: the decode path off kernels, every memory, on ``window_step``: the ring
write, the softmax over sinks + ring and the leaving token in 33 aten ops where the general forms
dispatch 168; a CPU step's time is its op count, docs/performance.md); ``fused_*`` once ``use_kernels`` is set: the linear part
through ``rnnify.kernels``' linear-attention ops in both phases (raw q and the leaving keys, the
map applied by the op when it has it), the window part through ``window_attn_step`` (sinks
included) with its softmax statistics for a decode token, in PyTorch for a prompt. A whole
unpadded prompt read from the empty state (``whole_prompt``) needs no ring or padding bookkeeping:
its window part is computed for all query blocks at once (``band_window_part``), the leaving tokens
are the keys and values shifted by W, and the state is written from its tail; off kernels the
linear and gla memories read it without the shift (``prompt_hybrid_attn``). Shapes: q
``[B, Hkv, G, T, d]`` fp32, k/v ``[B, Hkv, T, d]``, mask ``[B, T]``, state ``keys/values
[B, Hkv, W, d]``, ``sink_keys/sink_values [B, Hkv, S, d]`` (S = 0: empty), ``length [B]``,
``kv [B, Hkv, F, d_v]``, ``k_sum [B, Hkv, F]`` (fp32); ``factor`` is f ``[Hkv, G]``; ``phi`` maps
``[B, Hkv, ..., d] -> [B, Hkv, ..., F]``. Every form returns ``(out fp32, *new_state)``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from rnnify import kernels
from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.exact import finite_or_zero, readout
from rnnify.cells.linear import KERNEL_MAX_FEATURES, build_feature_map, fused_feature_attn, read_step
from rnnify.choices import MEMORIES
from rnnify.errors import RnnifyError, check_int
from rnnify.kernels.ring import held_index, token_index, window_write
from rnnify.cells.delta import DeltaWriter, chunk_delta_attn, fused_delta_attn, l2_normalise, step_delta_attn
from rnnify.cells.gated import _gate_bias, gla_log_gates, gla_projections
from rnnify.cells.window import (
    PROMPT_BLOCK, prompt_window, steady_length, steady_window_step, whole_prompt, window_output, window_step,
)
from rnnify.kernels.linear_attn.naive import chunk_gated_attn

FeatureMap = Callable[[torch.Tensor], torch.Tensor]
DELTA_MEMORIES = ("delta", "gated-delta")
SHARES = ("count", "mass", "mass-input")  # how a delta memory's readout is weighed against the window's output
BY_MASS = ("mass", "mass-input")  # the shares read from phi(q) . z, with a feature map, f_h and z in the state
# the linear and gla memories' map when none is given: trainable, so distillation can fit the memory to
# softmax (an untrained map leaves it gated off, the window alone); elu, the default before, has no parameters
DEFAULT_FEATURE_MAP = "hedgehog"
# attention sinks when none are given: on a real model a window without them loses what its first
# tokens anchor (SmolLM2-135M at 2,048 tokens, window 64: KL 1.62 without, 0.40 with 4; StreamingLLM)
DEFAULT_SINKS = 4
# the mass share's logit is clamped to this: e^30 already scales its odds 1e13-fold, and past about 88
# exp(-logit) overflows (inf * 0 = NaN in the gradients)
MAX_SHARE_LOGIT = 30.0
GLA_RANK, GLA_TAU, GLA_DECAY = 16, 16.0, 0.99  # the gla memory's gate: the gated target's defaults (cells/gated.py)


def _combine(window_num, window_den, linear_num, linear_den, gate=None):
    """The hybrid output (f w + linear numerator) / (f u + linear denominator), blended with the
    window's own output w / u by the memory gate g ``[Hkv, G]``: ``window + g (hybrid - window)``.
    ``gate=None`` is g = 1, the plain LoLCATs sum."""
    hybrid = readout(window_den + linear_den, window_num + linear_num)
    if gate is None:
        return hybrid
    window = readout(window_den, window_num)
    gate = gate.reshape(*gate.shape, *(1,) * (window_den.dim() - 3), 1)  # over [B, Hkv, G, (T,)] d
    return window + gate * (hybrid - window)


def naive_recurrent_hybrid_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, kv, k_sum, phi: FeatureMap, factor, scale: float,
    gate=None,
):
    batch, _, _, steps, _ = q.shape
    window, sinks = keys.shape[2], sink_keys.shape[2]
    state = (keys, values, sink_keys, sink_values, length, kv, k_sum)
    keys, values, sink_keys, sink_values, length, kv, k_sum = (t.clone() for t in state)
    outs = []
    for t in range(steps):
        for b in range(batch):
            if not mask[b, t]:
                continue  # padding: the state stays as it was
            n = int(length[b])
            slot = n % window
            if n - window >= sinks:  # token n - W leaves the window for the linear state (a sink stays one)
                phi_k = phi(keys[b : b + 1, :, slot : slot + 1].float())[0, :, 0]  # [Hkv, F]
                kv[b] = kv[b] + phi_k[:, :, None] * values[b, :, slot, None, :].float()
                k_sum[b] = k_sum[b] + phi_k
            keys[b, :, slot], values[b, :, slot] = k[b, :, t], v[b, :, t]
            if n < sinks:
                sink_keys[b, :, n], sink_values[b, :, n] = k[b, :, t], v[b, :, t]
            length[b] += 1
        # window part: the (m, u, w) recurrence, one key at a time, over the sinks no longer in the
        # ring and the ring, with per row whether query t attends to each
        held = [(sink_keys[:, :, j], sink_values[:, :, j], j < length - window) for j in range(sinks)]
        held += [(keys[:, :, s], values[:, :, s], s < length) for s in range(window)]
        m = q.new_full(q.shape[:3], float("-inf"))  # [B, Hkv, G]
        u = q.new_zeros(q.shape[:3])
        w = q.new_zeros((*q.shape[:3], values.shape[-1]))
        for key, value, attended in held:
            s = scale * (q[:, :, :, t] * key[:, :, None].float()).sum(-1)
            s = torch.where(attended[:, None, None], s, float("-inf"))
            m_new = torch.maximum(m, s)
            m_safe = finite_or_zero(m_new)
            decay, p = torch.exp(m - m_safe), torch.exp(s - m_safe)
            u = u * decay + p
            w = w * decay[..., None] + p[..., None] * value[:, :, None].float()
            m = m_new
        # linear part: every other older token, from the state
        phi_q = phi(q[:, :, :, t : t + 1])[:, :, :, 0]  # [B, Hkv, G, F]
        linear_num = phi_q @ kv
        linear_den = (phi_q * k_sum[:, :, None]).sum(-1)
        outs.append(_combine(factor[..., None] * w, factor * u, linear_num, linear_den, gate))
    return torch.stack(outs, dim=3), keys, values, sink_keys, sink_values, length, kv, k_sum


def _held(k, v, mask, keys, values, sink_keys, sink_values, length):
    """Every key a new query might see, sinks, ring, then new tokens, with token indices (-1: none):
    ``(q_index [B, T], key_index [B, S + W + T], keys, values [B, Hkv, S + W + T, d] fp32)``."""
    q_index = token_index(length, mask)
    key_index = torch.cat([held_index(length, keys.shape[2], sink_keys.shape[2]), q_index], dim=1)
    all_keys = torch.cat([sink_keys, keys, k.to(keys.dtype)], dim=2).float()
    all_values = torch.cat([sink_values, values, v.to(values.dtype)], dim=2).float()
    return q_index, key_index, all_keys, all_values


def _window_part(q, q_index, key_index, all_keys, all_values, window: int, sinks: int, factor, scale: float):
    """f sum exp(s - m) v and f sum exp(s - m) over each query's window and sinks, m the max over them."""
    i, j = q_index[:, :, None], key_index[:, None, :]
    in_window = ((j >= 0) & (j <= i) & ((i - j < window) | (j < sinks)))[:, None, None]  # [B, 1, 1, T, N]
    scores = (scale * torch.einsum("bhgtd,bhnd->bhgtn", q, all_keys)).masked_fill(~in_window, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = factor[..., None, None] * torch.exp(scores - finite_or_zero(m))
    return p @ all_values[:, :, None], p.sum(-1)


def parallel_hybrid_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, kv, k_sum, phi: FeatureMap, factor, scale: float,
    gate=None,
):
    window, sinks = keys.shape[2], sink_keys.shape[2]
    q_index, key_index, all_keys, all_values = _held(k, v, mask, keys, values, sink_keys, sink_values, length)
    window_num, window_den = _window_part(q, q_index, key_index, all_keys, all_values, window, sinks, factor, scale)
    # linear part: older tokens of this call, and those already folded into kv/k_sum
    i, j = q_index[:, :, None], key_index[:, None, :]
    older = ((j >= sinks) & (i - j >= window))[:, None, None]  # left the window, not a sink, not yet in kv/k_sum
    phi_q, phi_k = phi(q), phi(all_keys)
    a = torch.where(older, torch.einsum("bhgtf,bhnf->bhgtn", phi_q, phi_k), 0.0)
    linear_num = a @ all_values[:, :, None] + phi_q @ kv[:, :, None]
    linear_den = a.sum(-1) + (phi_q * k_sum[:, :, None, None]).sum(-1)
    out = _combine(window_num, window_den, linear_num, linear_den, gate)
    # state: tokens other than sinks that leave the window in this call join kv/k_sum
    *window_state, new_length = window_write(k, v, mask, keys, values, sink_keys, sink_values, length)
    leaving = ((key_index >= sinks) & (key_index < new_length[:, None] - window))[:, None, :, None]
    phi_leaving = torch.where(leaving, phi_k, 0.0)
    kv = kv + phi_leaving.transpose(-1, -2) @ all_values
    k_sum = k_sum + phi_leaving.sum(2)
    return out, *window_state, new_length, kv, k_sum


def chunk_hybrid_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, kv, k_sum, phi, factor, scale: float, gate=None,
    chunk_size: int = 64,
):
    state, outs = (keys, values, sink_keys, sink_values, length, kv, k_sum), []
    for start in range(0, q.shape[3], chunk_size):
        end = start + chunk_size
        chunk = (q[:, :, :, start:end], k[:, :, start:end], v[:, :, start:end], mask[:, start:end])
        out, *state = parallel_hybrid_attn(*chunk, *state, phi, factor, scale, gate)
        outs.append(out)
    return torch.cat(outs, dim=3), *state


def _query_and_leaving_features(phi: FeatureMap, q, old_key):
    """phi of the G queries ``[B, Hkv, G, 1, F]`` and of the key leaving the window ``[B, Hkv, 1, F]``, in one call."""
    features = phi(torch.cat([q, old_key[:, :, None]], dim=2))
    return features[:, :, : q.shape[2]], features[:, :, q.shape[2]]


def _write_memory(kv, k_sum, phi_old, old_value, log_a=None):
    """The leaving token written into the linear memory, decayed first by a = exp(``log_a [B, Hkv, 1,
    F]``) for the gla memory: kv <- a kv + phi(k)^T v, z <- a z + phi(k)."""
    if log_a is not None:
        a = log_a.exp()
        kv, k_sum = kv * a.transpose(-1, -2), k_sum * a.squeeze(2)
    return torch.addcmul(kv, phi_old.transpose(-1, -2), old_value), k_sum + phi_old.squeeze(2)


def step_hybrid_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, kv, k_sum, phi: FeatureMap, factor, scale: float,
    gate=None, log_a=None,
):
    """The decode path off kernels: ``window_step``, then the token leaving the window joins the
    linear memory (decayed by a = exp(``log_a [B, Hkv, 1, F]``), the gla memory, where it leaves),
    which the query reads; one normalised sum as in ``_combine``. In the steady state
    (``steady_length``: the common decode token) ``steady_step_hybrid_attn`` instead."""
    n = steady_length(mask, length, keys.shape[2], sink_keys.shape[2])
    if n is not None:
        return steady_step_hybrid_attn(q, k, v, keys, values, sink_keys, sink_values, length, kv, k_sum, phi,
                                       factor, scale, n, gate, log_a)
    w, u, old_key, old_value, leaves, window_state = window_step(
        q, k, v, mask, keys, values, sink_keys, sink_values, length, scale)
    phi_q, phi_old = _query_and_leaving_features(phi, q, old_key)
    # nothing written where none leaves: phi_old = 0, no decay
    kv, k_sum = _write_memory(kv, k_sum, phi_old * leaves, old_value,
                              None if log_a is None else torch.where(leaves, log_a, 0.0))
    linear_num, linear_den = read_step(phi_q, kv, k_sum)  # shaped as w and u
    factor = factor[..., None]  # [Hkv, G, 1]
    hybrid = readout(factor * u + linear_den, factor[..., None] * w + linear_num)
    out = hybrid if gate is None else torch.lerp(window_output(w, u), hybrid, gate[..., None, None])
    return out, *window_state, kv, k_sum


def steady_step_hybrid_attn(
    q, k, v, keys, values, sink_keys, sink_values, length, kv, k_sum, phi: FeatureMap, factor, scale: float, n: int,
    gate=None, log_a=None,
):
    """``step_hybrid_attn`` for a decode token in the steady state (``steady_length``: every row real,
    holding n >= W + S tokens), in about half its ops: ``steady_window_step`` gives the window's
    normalised output o = w / u and p_max = 1 / u, a token leaves every row, and the sum is read
    divided through by u: (f o + p_max phi(q) kv) / (f + p_max phi(q) . z)."""
    o, p_max, old_key, old_value, window_state = steady_window_step(
        q, k, v, keys, values, sink_keys, sink_values, length, n, scale)
    phi_q, phi_old = _query_and_leaving_features(phi, q, old_key)
    kv, k_sum = _write_memory(kv, k_sum, phi_old, old_value, log_a)
    linear_num, linear_den = read_step(phi_q, kv, k_sum)
    factor = factor.view(*factor.shape, 1, 1)  # [Hkv, G, 1, 1], as p_max
    num = torch.addcmul(factor * o, p_max, linear_num)
    den = torch.addcmul(factor, p_max, linear_den.unsqueeze(-1))  # >= f > 0 where phi(q) . phi(k) >= 0
    hybrid = num / den if getattr(phi, "non_negative_products", False) else readout(den.squeeze(-1), num)
    out = hybrid if gate is None else torch.lerp(o, hybrid, gate.view(*gate.shape, 1, 1))
    return out, *window_state, kv, k_sum


def step_delta_memory_hybrid_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, kv, beta, log_a, share, key_map, key_bias,
    scale: float, mass=None, log_tau=None,
):
    """The decode path of the delta memories off kernels: ``window_step``, then the token leaving
    the window is written by the delta rule (beta = 0 and no decay where none leaves: the stale key
    it would write is then ignored) and the query reads the memory, as in ``delta_memory_hybrid_attn``."""
    w, u, old_key, old_value, leaves, window_state = window_step(
        q, k, v, mask, keys, values, sink_keys, sink_values, length, scale)
    leaves = leaves.view(-1, 1, 1)  # [B, 1, T]
    beta = torch.where(leaves, beta, 0.0)
    counted = mass is None or log_tau is not None  # the share by count, or annealed writes
    written = tokens_written(length, leaves, keys.shape[2] + sink_keys.shape[2]) if counted else None
    if log_tau is not None:
        beta = annealed(beta, log_tau, written[:, None] - leaves.long())
    log_a = None if log_a is None else torch.where(leaves, log_a, 0.0)
    memory, kv = step_delta_attn(memory_keys(q, key_map, key_bias), memory_keys(old_key, key_map, key_bias),
                                 old_value, beta, log_a, kv)
    if mass is None:
        share, z = memory_share(*share, written, keys.shape[2]), ()
    else:
        phi, factor, k_sum, logit = mass
        phi_q, phi_old = _query_and_leaving_features(phi, q, old_key)
        share, k_sum = mass_share(share, factor, phi_q, torch.where(leaves[..., None], phi_old, 0.0), k_sum, u, logit)
        z = (k_sum,)
    return torch.lerp(window_output(w, u), memory, share[..., None]), *window_state, kv, *z


def leaving(q_index, key_index, all_keys, all_values, window: int, sinks: int):
    """The key and value that leave the window for the linear state as each new token arrives
    (token i - W for real token i >= W + S: sinks never leave; zeros where none leaves)
    ``[B, Hkv, T, d]``, and whether one leaves ``[B, T]``."""
    leaves = q_index >= window + sinks
    source = (key_index[:, None, :] == (q_index - window)[:, :, None]).long().argmax(-1)  # [B, T]

    def take(x: torch.Tensor) -> torch.Tensor:
        taken = x.gather(2, source[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
        return torch.where(leaves[:, None, :, None], taken, 0.0)

    return take(all_keys), take(all_values), leaves


def fused_window_step(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, factor, scale: float, backend: str = "auto"
):
    """The window part of one decode token through ``rnnify.kernels.window_attn_step`` (which also
    writes the sinks and the ring): its normalised output o and softmax denominator u (over the
    sinks and the ring, self included, relative to the scores' max m) give f sum exp(s - m) v = f o u
    and f sum exp(s - m) = f u. Returns ``(window_num, window_den, (keys, values, sink_keys,
    sink_values, length))``."""
    batch, num_kv_heads, group, _, head_dim = q.shape
    o, state, (_, u) = kernels.window_attn_step(
        q.reshape(batch, 1, num_kv_heads * group, head_dim), k.transpose(1, 2), v.transpose(1, 2), keys, values,
        length, sink_keys, sink_values, mask=mask, scale=scale, return_stats=True, backend=backend,
    )
    window_den = factor[..., None] * u.reshape(batch, num_kv_heads, group, 1)
    window_num = o.reshape(batch, num_kv_heads, group, 1, -1) * window_den[..., None]
    return window_num, window_den, state


def window_and_leaving(q, k, v, mask, window_state, factor, scale: float, chunk_size: int, backend: str | None):
    """The window part and the tokens leaving the window for the memory: ``(window_num, window_den,
    old_keys, old_values, leaves [B, T], window_state)``; ``prompt_window_and_leaving`` for a whole
    unpadded prompt, else ``chunked_window_and_leaving``."""
    if whole_prompt(mask, window_state[4]):
        return prompt_window_and_leaving(q, k, v, window_state, factor, scale)
    return chunked_window_and_leaving(q, k, v, mask, window_state, factor, scale, chunk_size, backend)


def factored_prompt_window(q, k, v, window_state, factor, scale: float, block: int = PROMPT_BLOCK):
    """``prompt_window`` with its window part as the terms of the normalised sum, f w and f u:
    ``(k, v, window_num, window_den, window_state)``."""
    k, v, o, u, window_state = prompt_window(q, k, v, window_state, scale, block)
    window_den = factor[..., None] * u
    return k, v, o * window_den[..., None], window_den, window_state


def prompt_window_and_leaving(q, k, v, window_state, factor, scale: float, block: int = PROMPT_BLOCK):
    """``chunked_window_and_leaving`` for a whole unpadded prompt from the empty state: ``factored_prompt_window``,
    and token i - W leaving as token i >= W + S arrives (the keys and values shifted by W)."""
    window, sinks, steps = window_state[0].shape[2], window_state[2].shape[2], k.shape[2]
    k, v, window_num, window_den, window_state = factored_prompt_window(q, k, v, window_state, factor, scale, block)
    leaves = (torch.arange(steps, device=q.device) >= window + sinks).expand(q.shape[0], -1)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, 0, window, 0))[:, :, :steps]
        return torch.where(leaves[:, None, :, None], x, 0.0)

    return window_num, window_den, shifted(k), shifted(v), leaves, window_state


def chunked_window_and_leaving(q, k, v, mask, window_state, factor, scale: float, chunk_size: int,
                               backend: str | None):
    """The window part chunk by chunk (``fused_window_step`` for a decode token once ``backend`` is
    set, else ``_window_part``) and the tokens leaving the window for the memory (``leaving``):
    ``(window_num, window_den, old_keys, old_values, leaves [B, T], window_state)``."""
    window, sinks = window_state[0].shape[2], window_state[2].shape[2]
    parts, left = [], []
    for start in range(0, q.shape[3], chunk_size):
        end = start + chunk_size
        chunk = (k[:, :, start:end], v[:, :, start:end], mask[:, start:end])
        held = _held(*chunk, *window_state)
        left.append(leaving(*held, window, sinks))
        if q.shape[3] == 1 and backend is not None:
            *part, window_state = fused_window_step(q, *chunk, *window_state, factor, scale, backend)
        else:
            part = _window_part(q[:, :, :, start:end], *held, window, sinks, factor, scale)
            window_state = window_write(*chunk, *window_state)
        parts.append(part)
    window_num, window_den = (torch.cat([part[i] for part in parts], dim=3) for i in (0, 1))
    old_keys, old_values = (torch.cat([part[i] for part in left], dim=2) for i in (0, 1))
    leaves = torch.cat([part[2] for part in left], dim=1)
    return window_num, window_den, old_keys, old_values, leaves, window_state


def fused_hybrid_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, kv, k_sum, phi, factor, scale: float, gate=None,
    chunk_size: int = 64, backend: str | None = "auto", log_a=None,
):
    """Both phases through ``rnnify.kernels`` (``backend`` None: PyTorch, the GLA memory's path off
    kernels). The linear part is linear attention whose keys are the tokens leaving the window (not
    sinks), at most one per new token (query i reads every S <= j <= i - W), so
    ``cells.linear.fused_feature_attn`` runs it (the op applies phi, masking the tokens where none
    leaves) unnormalised, with the denominator as one more value column of ones and z as one more
    state column; ``log_a`` ``[B, Hkv, T, F]`` (the GLA memory; None: linear) decays both, where a
    token leaves. The window part: ``window_and_leaving``. A whole prompt off kernels:
    ``prompt_hybrid_attn``."""
    window_state = (keys, values, sink_keys, sink_values, length)
    if backend is None and whole_prompt(mask, length):
        return prompt_hybrid_attn(q, k, v, window_state, kv, k_sum, phi, factor, scale, gate, chunk_size, log_a)
    window_num, window_den, old_keys, old_values, leaves, window_state = window_and_leaving(
        q, k, v, mask, window_state, factor, scale, chunk_size, backend)
    old_values = torch.cat([old_values, torch.ones_like(old_values[..., :1])], dim=-1)
    state = torch.cat([kv, k_sum[..., None]], dim=-1)
    if log_a is not None:
        log_a = torch.where(leaves[:, None, :, None], log_a, 0.0)
    if backend is not None:
        linear, state, _ = fused_feature_attn(q, old_keys, old_values, state, None, phi, leaves, log_a=log_a,
                                              backend=backend)
    else:  # the gated forms of cells.gated on featurised inputs, phi(k) = 0 where none leaves
        phi_k = torch.where(leaves[:, None, :, None], phi(old_keys), 0.0)
        args = (phi(q), phi_k, old_values, log_a, state)
        linear, state, _ = chunk_gated_attn(*args, chunk_size=chunk_size)
    out = _combine(window_num, window_den, linear[..., :-1], linear[..., -1], gate)
    return out, *window_state, state[..., :-1], state[..., -1]


def prompt_hybrid_attn(q, k, v, window_state, kv, k_sum, phi, factor, scale: float, gate, chunk_size: int, log_a):
    """``fused_hybrid_attn`` off kernels for a whole unpadded prompt from the empty state (so an
    empty memory too): the window part and the ring by ``prompt_window``. Token j (S <= j < T - W)
    leaves as token j + W arrives, so the queries from W + S on read the keys from S on, one step
    behind in the same order: the memory is causal linear attention of q[W + S:] over k[S:T - W],
    with no shifted copies or masks. The queries before W + S read nothing, so their output is the
    window's own o, and only the tail is combined (``_combine``'s sum, blended as o + g (hybrid - o)).
    k, v are read as the ring holds them."""
    window, sinks, steps = window_state[0].shape[2], window_state[2].shape[2], k.shape[2]
    k, v, o, u, window_state = prompt_window(q, k, v, window_state, scale)
    start, end = window + sinks, steps - window  # the first query that reads the memory, the last key + 1
    if end <= sinks:  # nothing leaves the window: the memory stays empty and the output is the window's o;
        if torch.is_grad_enabled():  # under autograd as the sum gives it, so f and g stay in the graph (grad 0)
            window_den = factor[..., None] * u
            o = _combine(window_den[..., None] * o, window_den, 0.0, 0.0, gate)
        return o, *window_state, kv, k_sum
    values = torch.cat([v[:, :, sinks:end], torch.ones_like(v[:, :, sinks:end, :1])], dim=-1)
    gates = None if log_a is None else log_a[:, :, start:]  # those of the arriving tokens
    state = torch.cat([kv, k_sum[..., None]], dim=-1)
    linear, state, _ = chunk_gated_attn(phi(q[:, :, :, start:]), phi(k[:, :, sinks:end]), values, gates, state,
                                        chunk_size=chunk_size)
    window_out, window_den = o[:, :, :, start:], factor[..., None] * u[:, :, :, start:]  # o and f u of the tail
    hybrid = readout(window_den + linear[..., -1], window_den[..., None] * window_out + linear[..., :-1])
    tail = hybrid if gate is None else torch.lerp(window_out, hybrid, gate[..., None, None])
    out = torch.cat([o[:, :, :, :start], tail], dim=3)
    return out, *window_state, state[..., :-1], state[..., -1]


def delta_memory_hybrid_attn(
    q, k, v, mask, keys, values, sink_keys, sink_values, length, kv, beta, log_a, share, key_map, key_bias,
    scale: float, chunk_size: int = 64, kernels: str | None = None, mass=None, log_tau=None,
):
    """The hybrid with a delta-rule memory (see above), every phase: the window part by
    ``window_and_leaving``, the memory on the tokens leaving the window, at most one per new token
    (beta = 0 and no decay where none leaves), through ``cells.delta``'s forms (``fused_delta_attn``
    with ``kernels``). beta / log_a ``[B, Hkv, T]`` are those of the arriving tokens (0 at padding),
    share what ``memory_share`` reads besides the count (``DeltaReader.share``: gate, logit, count weight),
    key_map / key_bias ``[Hkv, d, d]`` / ``[Hkv, d]`` the reader's key map. ``mass``: ``(phi, factor,
    k_sum, logit)`` for the shares by mass (``mass_share``; ``share`` is then the gate alone), which add
    ``k_sum`` to the returned state. ``log_tau`` ``[Hkv]``: beta annealed by the count (``annealed``)."""
    unit = torch.ones(q.shape[1], q.shape[2], device=q.device)  # f = 1: w / u does not depend on it
    window_num, window_den, old_keys, old_values, leaves, window_state = window_and_leaving(
        q, k, v, mask, (keys, values, sink_keys, sink_values, length), unit, scale, chunk_size, kernels)
    leaves = leaves[:, None]  # [B, 1, T]
    beta = torch.where(leaves, beta, 0.0)
    counted = mass is None or log_tau is not None  # the share by count, or annealed writes
    written = tokens_written(length, leaves, keys.shape[2] + sink_keys.shape[2]) if counted else None
    if log_tau is not None:
        beta = annealed(beta, log_tau, written[:, None] - leaves.long())
    log_a = None if log_a is None else torch.where(leaves, log_a, 0.0)
    args = (memory_keys(q, key_map, key_bias), memory_keys(old_keys, key_map, key_bias), old_values, beta, log_a, kv)
    if kernels is not None:
        memory, kv = fused_delta_attn(*args, backend=kernels)
    else:
        memory, kv = chunk_delta_attn(*args, chunk_size=chunk_size)
    if mass is None:
        share, z = memory_share(*share, written, keys.shape[2]), ()
    else:
        phi, factor, k_sum, logit = mass
        phi_written = torch.where(leaves[..., None], phi(old_keys), 0.0)
        share, k_sum = mass_share(share, factor, phi(q), phi_written, k_sum, window_den, logit)
        z = (k_sum,)
    return torch.lerp(readout(window_den, window_num), memory, share[..., None]), *window_state, kv, *z


def annealed(beta, log_tau, before) -> torch.Tensor:
    """beta_i tau_h / (tau_h + m_i): the writing strength falls as 1 / m with the m tokens written
    before, so the memory keeps a running mean along each key direction rather than its last few
    writes. beta ``[B, Hkv, T]``, log_tau ``[Hkv]``, before m ``[B, 1, T]``. As sigmoid(log tau -
    log m), finite for any finite log tau (m = 0: 1)."""
    return beta * torch.sigmoid(log_tau.float()[:, None] - before.float().log())


def mass_share(gate, factor, phi_q, phi_written, k_sum, window_den, logit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta memory's share by mass, as the linear memory's LoLCATs sum weighs its tokens:
    s_i = g M_i / (f u_i + M_i), M_i = phi(q_i) . z_i, z_i = z + the features of the keys written up
    to token i; 0 while M_i = 0 (nothing written). gate, factor ``[Hkv, G]``; phi_q ``[B, Hkv, G, T,
    F]``, phi_written ``[B, Hkv, T, F]`` (0 where no key is written), k_sum z ``[B, Hkv, F]``,
    window_den u ``[B, Hkv, G, T]``. ``logit`` ``[B, Hkv, G, T]`` (``share="mass-input"``): the odds M / f u
    times exp(logit), s = g M / (f u exp(-logit) + M), the logit within +-``MAX_SHARE_LOGIT``. Returns
    ``(s [B, Hkv, G, T], the last z)``."""
    z = k_sum[:, :, None] + phi_written.cumsum(2)  # [B, Hkv, T, F]
    memory_mass = (phi_q * z[:, :, None]).sum(-1)
    window_weight = factor[..., None] * window_den
    if logit is not None:
        window_weight = window_weight * torch.exp(-logit.clamp(-MAX_SHARE_LOGIT, MAX_SHARE_LOGIT))
    # M = 0 (nothing written): s = 0 / 1, so no 0 / 0 reaches the output or the gradients
    return gate[..., None] * memory_mass / torch.where(memory_mass > 0, window_weight + memory_mass, 1.0), z[:, :, -1]


def memory_keys(x: torch.Tensor, key_map: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
    """Queries ``[B, Hkv, G, T, d]`` or keys ``[B, Hkv, T, d]`` as the delta memory reads and
    writes them: through the kv head's map x W + b, then L2-normalised, fp32."""
    group = [1] * (x.dim() - 4)  # queries have a group axis
    key_map = key_map.float().view(key_map.shape[0], *group, *key_map.shape[1:])
    key_bias = key_bias.float().view(key_bias.shape[0], *group, 1, key_bias.shape[1])
    return l2_normalise(x.float() @ key_map + key_bias)


def tokens_written(length, leaves, held: int) -> torch.Tensor:
    """n ``[B, T]``, the tokens written to the memory by the time each token of the call reads it:
    the real tokens read before the call (``length [B]``) past the ``held`` = W + S the window
    keeps, then one per leaving token (``leaves``, T last)."""
    return (length - held).clamp_min(0)[:, None] + leaves.reshape(length.shape[0], -1).cumsum(-1)


def memory_share(gate, logit, count_weight, written, window: int) -> torch.Tensor:
    """s = g 2 sigmoid(logit + c log(n / W)) ``[B, Hkv, G, T]``, n ``written`` (``tokens_written``),
    and s = 0 while n = 0: an empty delta memory reads 0, no estimate. gate and count_weight
    ``[Hkv, G]``, logit ``[B, Hkv, G, T]`` (``DeltaReader.share``)."""
    written = written.float()[:, None, None]
    share = torch.sigmoid(torch.addcmul(logit, count_weight[..., None], torch.log(written.clamp_min(1) / window)))
    return torch.where(written > 0, share * (2 * gate[..., None]), 0.0)


class DeltaReader(nn.Module):
    """How the hybrid reads its delta memory: a map of queries and written keys (one per kv head,
    the identity at start) and the memory's share of the output, from the layer input and how many
    tokens the memory holds (``share="count"``) or by mass (``mass_share``: ``"mass"``, from phi(q) . z
    alone, or ``"mass-input"``, corrected by the layer input)."""

    def __init__(self, spec: CellSpec, share: str = "count"):
        super().__init__()
        if share not in SHARES:
            raise ValueError(f"share must be one of {list(SHARES)}, got {share!r}")
        self.num_kv_heads, self.group_size = spec.num_kv_heads, spec.group_size
        self.key_map = nn.Parameter(torch.eye(spec.head_dim).repeat(spec.num_kv_heads, 1, 1))
        self.key_bias = nn.Parameter(torch.zeros(spec.num_kv_heads, spec.head_dim))
        if share == "mass":  # the share is read by mass alone, not from the layer input
            return
        if spec.hidden_size is None:
            raise ValueError("the delta memory reads the layer input, but its width (spec.hidden_size) is unknown")
        self.share_proj = nn.Linear(spec.hidden_size, spec.num_heads)
        nn.init.zeros_(self.share_proj.weight)
        nn.init.zeros_(self.share_proj.bias)
        if share == "count":
            self.count_weight = nn.Parameter(torch.ones(spec.num_heads))  # c_h: 1, the count's odds as softmax's

    def logit(self, x: torch.Tensor) -> torch.Tensor:
        """The share's logit x W + b ``[B, Hkv, G, T]`` from each token's layer input ``x [B, T, hidden]``
        (0 at start)."""
        proj = self.share_proj
        logit = F.linear(x.float(), proj.weight.float(), proj.bias.float())  # [B, T, H]
        return logit.transpose(1, 2).reshape(x.shape[0], self.num_kv_heads, self.group_size, x.shape[1])

    def share(self, x: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What ``memory_share`` needs besides the count: the memory gate ``[Hkv, G]`` (0 at start),
        the ``logit`` and the count's weight c ``[Hkv, G]`` (1 at start)."""
        return gate, self.logit(x), self.count_weight.float().reshape(self.num_kv_heads, self.group_size)


class HybridCell(Cell):
    """Softmax over the last W tokens and the first S (sinks) plus linear attention over the other
    older ones (LoLCATs), trainable.

    ``sinks`` (default ``DEFAULT_SINKS``, 4) are the attention sinks of the window part; ``feature_map`` is any name in
    ``rnnify.cells.linear.FEATURE_MAPS`` (default ``DEFAULT_FEATURE_MAP``, hedgehog), built with
    ``feature_options``; ``chunk_size`` is the prefill chunk; ``memory_init`` the initial memory
    gate (0: the converted model starts as its window target alone). Trainable: ``window_logit``
    (f_h = sigmoid of it, per query head), ``memory_gate`` (g_h, per query head) and the feature
    map's parameters. ``memory``: ``linear`` (the default), or ``delta`` / ``gated-delta``: a
    delta-rule memory (see the module docstring), trainable through ``memory_gate``, its beta (and
    alpha) projections and its reader (key map, share projection, count weight), with no f_h or
    feature map; ``gla``: the linear memory decayed by GLA's gate of the arriving token (trainable too).
    ``share`` (delta memories): ``count`` (the default) or ``mass``, the readout weighed as the linear
    memory's tokens would be, through the feature map and f_h, or ``mass-input``, those odds scaled
    by a learned factor of the layer input (module docstring). ``anneal`` (delta
    memories; 0, the default: off): beta falls as 1 / n with the tokens the memory holds, from tau_h
    = ``anneal``, learned (``log_tau``; module docstring).

    The state is the window target's (keys, values, sink_keys, sink_values, length) then the linear
    memory (kv, k_sum); with no sinks the empty sink buffers are left out, so a hybrid without
    sinks keeps the five state tensors of hybrids saved before sinks existed.
    """

    target = "hybrid"
    own_forms_without_triton = frozenset({"prefill", "decode"})
    manifest_defaults = {"sinks": 0}  # hybrids saved before sinks existed had none
    gates = ("memory_gate", "window_logit")
    state_names = ("keys", "values", "length", "kv", "k_sum")  # with sinks: + sink_keys, sink_values after values

    def __init__(
        self,
        spec: CellSpec,
        window: int = 64,
        feature_map: str | None = None,
        feature_options: dict[str, Any] | None = None,
        chunk_size: int = 64,
        memory_init: float = 0.0,
        sinks: int = DEFAULT_SINKS,
        memory: str = "linear",
        share: str = "count",
        anneal: float = 0.0,
    ):
        super().__init__(spec)
        if memory not in MEMORIES:
            raise ValueError(f"unknown memory {memory!r}; choose from {list(MEMORIES)}")
        if share not in SHARES or (share != "count" and memory not in DELTA_MEMORIES):
            raise ValueError(f"share must be one of {list(SHARES)}, and the shares by mass apply to the delta "
                             f"memories only; got {share!r} with memory {memory!r}")
        # a delta memory read by count has no feature map: "elu" is what its manifests recorded while that was the default
        if memory in DELTA_MEMORIES and share == "count" and (feature_map not in (None, "elu") or feature_options):
            raise ValueError(f"memory {memory!r} has no feature map unless its share is by mass (share='mass' or "
                             "'mass-input'): feature_map and feature_options apply to the linear and gla memories "
                             "and to the shares by mass")
        if isinstance(anneal, bool) or not isinstance(anneal, (int, float)) or not 0 <= anneal < math.inf or (
                anneal and memory not in DELTA_MEMORIES):
            raise ValueError(f"anneal must be a finite number >= 0 (0: off), for the delta memories only; got "
                             f"{anneal!r} with memory {memory!r}")
        if feature_options is not None and not isinstance(feature_options, dict):
            raise ValueError(f"feature_options must be a dict of feature-map options, got {feature_options!r}")
        if isinstance(memory_init, bool) or not isinstance(memory_init, (int, float)) or not 0 <= memory_init <= 1:
            raise ValueError(f"memory_init must be a number in [0, 1] (0: start as the window alone), got {memory_init!r}")
        self.window = check_int("window", window, 1)
        self.sinks = check_int("sinks", sinks, 0)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        self.memory_init, self.memory, self.share, self.anneal = float(memory_init), memory, share, float(anneal)
        weighed = memory not in DELTA_MEMORIES or share in BY_MASS  # has a feature map and f_h
        if feature_map is None:  # the delta memories read by count record the old default, which they never use
            feature_map = DEFAULT_FEATURE_MAP if weighed else "elu"
        self.feature_map, self.feature_options = feature_map, dict(feature_options or {})
        self.memory_gate = nn.Parameter(torch.full((spec.num_heads,), self.memory_init))
        memory_state = ("kv", "k_sum")
        if weighed:
            self.phi = build_feature_map(feature_map, spec, **self.feature_options)
            if share in BY_MASS and not getattr(self.phi, "non_negative_products", False):
                raise ValueError(f"share={share!r} weighs the memory by phi(q) . phi(k), which feature map {feature_map!r} "
                                 "can make negative: choose a non-negative map (hedgehog, elu, relu, ...)")
            self.window_logit = nn.Parameter(torch.zeros(spec.num_heads))
        if memory == "gla":  # per-feature decays from the layer input
            if spec.hidden_size is None:
                raise ValueError("the gla memory reads the layer input, but its width (spec.hidden_size) is unknown")
            self.gate_down, self.gate_up = gla_projections(spec.hidden_size, GLA_RANK,
                                                           spec.num_kv_heads * self.phi.feature_dim,
                                                           _gate_bias(GLA_DECAY, GLA_TAU))
            self.needs_input = True
        elif memory in DELTA_MEMORIES:  # beta (and alpha) from the layer input
            self.writer = DeltaWriter(spec, memory == "gated-delta", 0.5, None)
            self.reader = DeltaReader(spec, share)
            if self.anneal:  # tau_h of ``annealed``, learned from here
                self.log_tau = nn.Parameter(torch.full((spec.num_kv_heads,), math.log(self.anneal)))
            self.needs_input = True
            memory_state = ("kv", "k_sum") if share in BY_MASS else ("kv",)
        window_state = ("keys", "values", "sink_keys", "sink_values") if self.sinks else ("keys", "values")
        self.state_names = (*window_state, "length", *memory_state)

    def options(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "sinks": self.sinks,
            "feature_map": self.feature_map,
            "feature_options": dict(self.feature_options),
            "chunk_size": self.chunk_size,
            "memory_init": self.memory_init,
            "memory": self.memory,
            **({"share": self.share} if self.memory in DELTA_MEMORIES else {}),
            **({"anneal": self.anneal} if self.anneal else {}),
        }

    def fused_ops(self) -> dict[str, str]:
        if self.memory in DELTA_MEMORIES:
            return {"prefill": "chunk_delta_rule", "decode": "window_attn_step + fused_recurrent_delta_rule"}
        if self.phi.feature_dim > KERNEL_MAX_FEATURES:
            return {}
        # prefill: the linear part (the window part stays PyTorch); decode: both parts
        return {"prefill": "chunk_linear_attn", "decode": "window_attn_step + fused_recurrent_linear_attn"}

    def init_state(self, batch_size, device, dtype):
        spec = self.spec

        def buffer(slots: int, dim: int) -> torch.Tensor:
            return torch.zeros(batch_size, spec.num_kv_heads, slots, dim, device=device, dtype=dtype)

        sinks = (buffer(self.sinks, spec.head_dim), buffer(self.sinks, spec.value_dim)) if self.sinks else ()
        if self.memory in DELTA_MEMORIES:
            mass = (torch.zeros(batch_size, spec.num_kv_heads, self.phi.feature_dim, device=device, dtype=torch.float32),
                    ) if self.share in BY_MASS else ()
            return (
                buffer(self.window, spec.head_dim),
                buffer(self.window, spec.value_dim),
                *sinks,
                torch.zeros(batch_size, device=device, dtype=torch.long),
                torch.zeros(batch_size, spec.num_kv_heads, spec.head_dim, spec.value_dim, device=device,
                            dtype=torch.float32),
                *mass,
            )
        features = self.phi.feature_dim
        return (
            buffer(self.window, spec.head_dim),
            buffer(self.window, spec.value_dim),
            *sinks,
            torch.zeros(batch_size, device=device, dtype=torch.long),
            torch.zeros(batch_size, spec.num_kv_heads, features, spec.value_dim, device=device, dtype=torch.float32),
            torch.zeros(batch_size, spec.num_kv_heads, features, device=device, dtype=torch.float32),
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # hybrids saved before the memory gate existed computed the plain LoLCATs sum: gate 1
        state_dict.setdefault(prefix + "memory_gate", torch.ones_like(self.memory_gate))
        by_count = self.memory in DELTA_MEMORIES and self.share == "count"
        if by_count and prefix + "reader.share_proj.weight" not in state_dict:
            raise RnnifyError(
                "this hybrid's delta memory was saved by an earlier rnnify, which added its readout to the window's "
                "output; the memory is now read through a learned key map and blended in: convert the model again")
        if by_count:  # saved before the share counted the memory's tokens: c = 0 is that share
            state_dict.setdefault(prefix + "reader.count_weight", torch.zeros_like(self.reader.count_weight))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def mixing_factor(self) -> torch.Tensor:
        """f_h = sigmoid(theta_h), grouped per kv head ``[Hkv, G]``, fp32."""
        return torch.sigmoid(self.window_logit.float()).reshape(self.spec.num_kv_heads, self.spec.group_size)

    def forward(self, q, k, v, mask, *state, x=None):
        batch, _, steps, _ = q.shape
        grouped = q.float().reshape(batch, self.spec.num_kv_heads, self.spec.group_size, steps, -1)
        if not self.sinks:  # the forms take sink buffers: empty ones
            keys, values, *rest = state
            state = (keys, values, keys[:, :, :0], values[:, :, :0], *rest)
        gate = self.memory_gate.float().reshape(self.spec.num_kv_heads, self.spec.group_size)
        mask = mask.to(torch.bool)
        backend = self.backend(q, steps)
        if self.memory in DELTA_MEMORIES:
            out, *state = self._delta_memory(grouped, k, v, mask, state, gate, x, backend)
        else:
            out, *state = self._linear_memory(grouped, k, v, mask, state, gate, x, backend)
        if not self.sinks:
            del state[2:4]
        return out.reshape(batch, self.spec.num_heads, steps, -1).to(q.dtype), *state

    def _delta_memory(self, q, k, v, mask, state, gate, x, backend: str | None):
        """A delta or gated-delta memory: the lean step for a decode token off kernels, else the general forms."""
        beta, log_a = self.writer(x, mask)
        mass = None
        if self.share in BY_MASS:  # the last state tensor is z; the share is read from it, the gate (and the input)
            *state, k_sum = state
            logit = self.reader.logit(x) if self.share == "mass-input" else None
            mass, share = (self.phi, self.mixing_factor(), k_sum, logit), gate
        else:
            share = self.reader.share(x, gate)
        reading = (share, self.reader.key_map, self.reader.key_bias, self.spec.scale)
        log_tau = self.log_tau if self.anneal else None
        if q.shape[3] == 1 and backend is None:
            return step_delta_memory_hybrid_attn(q, k, v, mask, *state, beta, log_a, *reading, mass, log_tau)
        return delta_memory_hybrid_attn(q, k, v, mask, *state, beta, log_a, *reading, self.chunk_size, backend, mass,
                                        log_tau)

    def _linear_memory(self, q, k, v, mask, state, gate, x, backend: str | None):
        """A linear or gla memory: the lean step for a decode token off kernels; a prompt through
        ``fused_hybrid_attn`` (in PyTorch off Triton: the whole-prompt window part, the linear part
        chunked on featurised inputs), or the general ``chunk_hybrid_attn`` with kernels "none" (and
        for a cell with no fused form: a feature map wider than the ops take)."""
        args, log_a = (self.phi, self.mixing_factor(), self.spec.scale, gate), None
        if self.memory == "gla":
            if x is None:
                raise ValueError("the gla memory needs the layer input: call the cell with x=[B, T, hidden]")
            log_a = gla_log_gates(x, self.gate_down, self.gate_up, GLA_TAU, self.spec.num_kv_heads, mask)
        if q.shape[3] == 1 and backend is None:
            return step_hybrid_attn(q, k, v, mask, *state, *args, log_a)
        if self.kernels is None and log_a is None:  # kernels "none" (or no fused form): the general chunked form
            return chunk_hybrid_attn(q, k, v, mask, *state, *args, self.chunk_size)
        return fused_hybrid_attn(q, k, v, mask, *state, *args, self.chunk_size, backend, log_a)
