"""The hybrid's linear and gla memories: the tokens that have left the window, read by linear
attention in one normalised sum with the window part (LoLCATs' ``linear_window_attention`` with a
true sliding window).

The math: docs/math.md §Hybrid window and linear (the sum, the memory gate and the gla decay).

As token i - W leaves the ring (not a sink, ``cells/hybrid_window.py``) it is written into the
state of linear attention, kv += phi(k)^T v and z += phi(k) (fp32; the gla memory first decays both
by the arriving token's per-feature gate a_i), and query i reads

    y_i = (f_h w_i + phi(q_i) kv) / (f_h u_i + phi(q_i) . z),      out_i = w_i / u_i + g_h (y_i - w_i / u_i)

with (w_i, u_i) the window part. Both outputs come from the same sums, so the memory gate g adds
no state and no pass; at g = 0 the output is the window's own.

Forms (tests hold them to ``naive_recurrent_hybrid_attn``): ``naive_recurrent_*`` (a plain loop over
tokens, the window part key by key as the window target's loop reads it, ``naive_window_read``),
``parallel_*`` (masked quadratic over sinks + ring + new tokens, plus the linear state), ``chunk_*``
(the parallel form over chunks, ``by_chunks``: the prefill path with kernels "none"), ``step_*``
(one token off kernels, on ``cells.window.window_step``; ``steady_step_*`` once every row holds
W + S tokens, in fewer ops: a CPU step's time is its op count, docs/performance.md),
``fused_hybrid_attn`` (the window part by ``window_and_leaving``, the linear part through
``rnnify.kernels``' linear-attention ops, which apply the map when they have it, or off kernels
through ``chunk_gated_attn`` on featurised inputs) and ``prompt_hybrid_attn`` (a whole unpadded
prompt off kernels: the memory read without shifting the keys). Shapes: those of
``cells/hybrid_window.py``, plus ``kv [B, Hkv, F, d_v]`` and ``k_sum [B, Hkv, F]`` (fp32); ``phi``
maps ``[B, Hkv, ..., d] -> [B, Hkv, ..., F]``; ``gate`` g ``[Hkv, G]`` (None: 1, LoLCATs' plain
sum). Every form takes ``(q, k, v, mask, *state)`` (the steady step: no mask), the state ``(keys,
values, sink_keys, sink_values, length, kv, k_sum)`` flat, then its options by keyword, and returns
``(out fp32, *new_state)``.
"""

from __future__ import annotations

from functools import partial

import torch

from rnnify.cells.hybrid_window import (
    FeatureMap,
    query_and_leaving_features,
    visible_keys,
    window_and_leaving,
    window_part,
)
from rnnify.cells.linear import fused_feature_attn, read_step
from rnnify.cells.online_softmax import readout
from rnnify.cells.window import (
    by_chunks,
    naive_ring_write,
    naive_window_read,
    prompt_window,
    steady_length,
    steady_window_step,
    whole_prompt,
    window_output,
    window_step,
)
from rnnify.kernels.linear_attn.naive import chunk_gated_attn
from rnnify.kernels.ring import window_write


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


def naive_recurrent_hybrid_attn(q, k, v, mask, *state, phi: FeatureMap, factor, scale: float, gate=None):
    keys, values, sink_keys, sink_values, length, kv, k_sum = (t.clone() for t in state)
    window, sinks = keys.shape[2], sink_keys.shape[2]
    outs = []
    for t in range(q.shape[3]):
        for b in range(q.shape[0]):
            if not mask[b, t]:
                continue  # padding: the state stays as it was
            n = int(length[b])
            slot = n % window
            if n - window >= sinks:  # token n - W leaves the window for the linear state (a sink stays one)
                phi_k = phi(keys[b : b + 1, :, slot : slot + 1].float())[0, :, 0]  # [Hkv, F]
                kv[b] = kv[b] + phi_k[:, :, None] * values[b, :, slot, None, :].float()
                k_sum[b] = k_sum[b] + phi_k
            naive_ring_write(b, k[b, :, t], v[b, :, t], keys, values, sink_keys, sink_values, length)
        # window part: the sinks no longer in the ring and the ring, key by key
        _, u, w = naive_window_read(q[:, :, :, t], keys, values, sink_keys, sink_values, length, scale)
        # linear part: every other older token, from the state
        phi_q = phi(q[:, :, :, t : t + 1])[:, :, :, 0]  # [B, Hkv, G, F]
        linear_num = phi_q @ kv
        linear_den = (phi_q * k_sum[:, :, None]).sum(-1)
        outs.append(_combine(factor[..., None] * w, factor * u, linear_num, linear_den, gate))
    return torch.stack(outs, dim=3), keys, values, sink_keys, sink_values, length, kv, k_sum


def parallel_hybrid_attn(q, k, v, mask, *state, phi: FeatureMap, factor, scale: float, gate=None):
    *window_state, kv, k_sum = state
    window, sinks = window_state[0].shape[2], window_state[2].shape[2]
    q_index, key_index, all_keys, all_values = visible_keys(k, v, mask, *window_state)
    window_num, window_den = window_part(q, q_index, key_index, all_keys, all_values, window, sinks, factor, scale)
    # linear part: older tokens of this call, and those already folded into kv/k_sum
    i, j = q_index[:, :, None], key_index[:, None, :]
    older = ((j >= sinks) & (i - j >= window))[:, None, None]  # left the window, not a sink, not yet in kv/k_sum
    phi_q, phi_k = phi(q), phi(all_keys)
    a = torch.where(older, torch.einsum("bhgtf,bhnf->bhgtn", phi_q, phi_k), 0.0)
    linear_num = a @ all_values[:, :, None] + phi_q @ kv[:, :, None]
    linear_den = a.sum(-1) + (phi_q * k_sum[:, :, None, None]).sum(-1)
    out = _combine(window_num, window_den, linear_num, linear_den, gate)
    # state: tokens other than sinks that leave the window in this call join kv/k_sum
    *window_state, new_length = window_write(k, v, mask, *window_state)
    leaving = ((key_index >= sinks) & (key_index < new_length[:, None] - window))[:, None, :, None]
    phi_leaving = torch.where(leaving, phi_k, 0.0)
    kv = kv + phi_leaving.transpose(-1, -2) @ all_values
    k_sum = k_sum + phi_leaving.sum(2)
    return out, *window_state, new_length, kv, k_sum


def chunk_hybrid_attn(q, k, v, mask, *state, phi: FeatureMap, factor, scale: float, chunk_size: int, gate=None):
    parallel_form = partial(parallel_hybrid_attn, phi=phi, factor=factor, scale=scale, gate=gate)
    return by_chunks(parallel_form, q, k, v, mask, state, chunk_size)


def _write_memory(kv, k_sum, phi_old, old_value, log_a=None):
    """The leaving token written into the linear memory, decayed first by a = exp(``log_a [B, Hkv, 1,
    F]``) for the gla memory: kv <- a kv + phi(k)^T v, z <- a z + phi(k)."""
    if log_a is not None:
        a = log_a.exp()
        kv, k_sum = kv * a.transpose(-1, -2), k_sum * a.squeeze(2)
    return torch.addcmul(kv, phi_old.transpose(-1, -2), old_value), k_sum + phi_old.squeeze(2)


def step_hybrid_attn(q, k, v, mask, *state, phi: FeatureMap, factor, scale: float, gate=None, log_a=None):
    """The decode path off kernels: ``window_step``, then the token leaving the window joins the
    linear memory (decayed by a = exp(``log_a [B, Hkv, 1, F]``), the gla memory, where it leaves),
    which the query reads; one normalised sum as in ``_combine``. In the steady state
    (``steady_length``: the common decode token) ``steady_step_hybrid_attn`` instead."""
    *window_state, kv, k_sum = state
    keys, _, sink_keys, _, length = window_state
    n = steady_length(mask, length, keys.shape[2], sink_keys.shape[2])
    if n is not None:
        return steady_step_hybrid_attn(
            q, k, v, *state, phi=phi, factor=factor, scale=scale, n=n, gate=gate, log_a=log_a
        )
    w, u, old_key, old_value, leaves, window_state = window_step(q, k, v, mask, *window_state, scale)
    phi_q, phi_old = query_and_leaving_features(phi, q, old_key)
    # nothing written where none leaves: phi_old = 0, no decay
    kv, k_sum = _write_memory(
        kv, k_sum, phi_old * leaves, old_value, None if log_a is None else torch.where(leaves, log_a, 0.0)
    )
    linear_num, linear_den = read_step(phi_q, kv, k_sum)  # shaped as w and u
    factor = factor[..., None]  # [Hkv, G, 1]
    hybrid = readout(factor * u + linear_den, factor[..., None] * w + linear_num)
    out = hybrid if gate is None else torch.lerp(window_output(w, u), hybrid, gate[..., None, None])
    return out, *window_state, kv, k_sum


def steady_step_hybrid_attn(q, k, v, *state, phi: FeatureMap, factor, scale: float, n: int, gate=None, log_a=None):
    """``step_hybrid_attn`` for a decode token in the steady state (``steady_length``: every row real,
    holding n >= W + S tokens), in about half its ops: ``steady_window_step`` gives the window's
    normalised output o = w / u and p_max = 1 / u, a token leaves every row, and the sum is read
    divided through by u: (f o + p_max phi(q) kv) / (f + p_max phi(q) . z)."""
    *window_state, kv, k_sum = state
    o, p_max, old_key, old_value, window_state = steady_window_step(q, k, v, *window_state, n, scale)
    phi_q, phi_old = query_and_leaving_features(phi, q, old_key)
    kv, k_sum = _write_memory(kv, k_sum, phi_old, old_value, log_a)
    linear_num, linear_den = read_step(phi_q, kv, k_sum)
    factor = factor.view(*factor.shape, 1, 1)  # [Hkv, G, 1, 1], as p_max
    num = torch.addcmul(factor * o, p_max, linear_num)
    den = torch.addcmul(factor, p_max, linear_den.unsqueeze(-1))  # >= f > 0 where phi(q) . phi(k) >= 0
    hybrid = num / den if getattr(phi, "non_negative_products", False) else readout(den.squeeze(-1), num)
    out = hybrid if gate is None else torch.lerp(o, hybrid, gate.view(*gate.shape, 1, 1))
    return out, *window_state, kv, k_sum


def fused_hybrid_attn(q, k, v, mask, *state, phi, factor, scale: float, chunk_size, backend, gate=None, log_a=None):
    """Both phases through ``rnnify.kernels`` (``backend`` None: PyTorch, the GLA memory's path off
    kernels). The linear part is linear attention whose keys are the tokens leaving the window (not
    sinks), at most one per new token (query i reads every S <= j <= i - W), so
    ``cells.linear.fused_feature_attn`` runs it (the op applies phi, masking the tokens where none
    leaves) unnormalised, with the denominator as one more value column of ones and z as one more
    state column; ``log_a`` ``[B, Hkv, T, F]`` (the GLA memory; None: linear) decays both, where a
    token leaves. The window part: ``window_and_leaving``. A whole prompt off kernels:
    ``prompt_hybrid_attn``."""
    *window_state, kv, k_sum = state
    if backend is None and whole_prompt(mask, window_state[4]):
        return prompt_hybrid_attn(q, k, v, window_state, kv, k_sum, phi, factor, scale, gate, chunk_size, log_a)
    window_num, window_den, old_keys, old_values, leaves, window_state = window_and_leaving(
        q, k, v, mask, window_state, factor, scale, chunk_size, backend
    )
    old_values = torch.cat([old_values, torch.ones_like(old_values[..., :1])], dim=-1)
    memory = torch.cat([kv, k_sum[..., None]], dim=-1)
    if log_a is not None:
        log_a = torch.where(leaves[:, None, :, None], log_a, 0.0)
    if backend is not None:
        linear, memory, _ = fused_feature_attn(
            q, old_keys, old_values, memory, None, phi, leaves, log_a=log_a, backend=backend
        )
    else:  # the gated forms of cells.gated on featurised inputs, phi(k) = 0 where none leaves
        phi_k = torch.where(leaves[:, None, :, None], phi(old_keys), 0.0)
        args = (phi(q), phi_k, old_values, log_a, memory)
        linear, memory, _ = chunk_gated_attn(*args, chunk_size=chunk_size)
    out = _combine(window_num, window_den, linear[..., :-1], linear[..., -1], gate)
    return out, *window_state, memory[..., :-1], memory[..., -1]


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
    linear, state, _ = chunk_gated_attn(
        phi(q[:, :, :, start:]), phi(k[:, :, sinks:end]), values, gates, state, chunk_size=chunk_size
    )
    window_out, window_den = o[:, :, :, start:], factor[..., None] * u[:, :, :, start:]  # o and f u of the tail
    hybrid = readout(window_den + linear[..., -1], window_den[..., None] * window_out + linear[..., :-1])
    tail = hybrid if gate is None else torch.lerp(window_out, hybrid, gate[..., None, None])
    out = torch.cat([o[:, :, :, :start], tail], dim=3)
    return out, *window_state, state[..., :-1], state[..., -1]
