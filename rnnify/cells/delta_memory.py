"""The hybrid's delta-rule memories (``delta``, ``gated-delta``): the tokens that leave the window
are written into a fixed-size recurrent memory (the design of Artificial Hippocampus Networks),
whose readout the output blends with the window's own by a learned share.

The math: docs/math.md §Hybrid window and linear ("Other memories") and §Delta rule; the options
and what they are for: docs/targets.md, ``hybrid``.

When token i arrives and token j = i - W leaves the ring (not a sink, ``cells/hybrid_window.py``):

    H <- alpha_i (I - beta_i k'_j k'_j^T) H + beta_i k'_j v_j^T,      out_i = w_i / u_i + s_i (H^T q'_i - w_i / u_i)

H = S^T ``[d_k, d_v]`` per kv head (fp32) has no normaliser, so it cannot join the linear memory's
normalised sum: the output moves from the window's output towards the readout by the memory's
share s_i, as softmax splits a query's weight between the window and the older tokens.
``share="count"`` (``memory_share``) reads that split from how many tokens n_i the memory holds
(n tokens of about the window's weight each have odds n / W against the window's W) and from the
query's layer input; ``"mass"`` (``mass_share``) gives the readout the weight LoLCATs' sum would
give the linear memory's tokens, from the sum z of phi(k) of the keys written, which joins the
state; ``"mass-input"`` scales those odds by a learned factor of the layer input. The share is 0
while nothing is written (an empty memory reads 0, no estimate), and the memory gate g_h, 0 at
start, scales it: the converted model starts as its window target.

Keys and queries reach the memory through a map per kv head, then L2-normalised (``DeltaReader``,
the identity at start): RoPE'd keys far apart in position need not look alike, and keys sharing a
common direction make each write erase the others, so the memory learns a key space of its own.
beta_i and alpha_i come from the layer input of the arriving token (``cells.delta.DeltaWriter``):
the token that pushes j out decides how strongly j is written and how much the memory fades, so no
layer input is kept in the ring. With ``anneal`` each write's beta falls with the tokens written
before it (``annealed``), so the memory keeps a running mean of what left the window rather than
its last few writes.

Forms: ``delta_memory_hybrid_attn`` (every phase: the window part by ``window_and_leaving``, the
memory through ``cells.delta``'s chunk or fused forms on the leaving tokens) and
``step_delta_memory_hybrid_attn`` (a decode token off kernels, on ``cells.window.window_step``);
the tests hold them to the ``window`` target plus a delta-rule loop over the leaving tokens.
Shapes: those of ``cells/hybrid_window.py``, plus ``kv`` H ``[B, Hkv, d, d_v]`` (fp32) and, for
the shares by mass, ``k_sum`` z ``[B, Hkv, F]``. Both forms take ``(q, k, v, mask, *state)``, the state
``(keys, values, sink_keys, sink_values, length, kv)`` flat (z is passed in ``mass``), then the
memory's arguments by keyword, and return ``(out fp32, *new_state)``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from rnnify.cells.base import CellSpec
from rnnify.cells.delta import (
    chunk_delta_attn,
    fused_delta_attn,
    l2_normalise,
    step_delta_attn,
)
from rnnify.cells.hybrid_window import query_and_leaving_features, window_and_leaving
from rnnify.cells.online_softmax import readout
from rnnify.cells.window import window_output, window_step

DELTA_MEMORIES = ("delta", "gated-delta")
SHARES = ("count", "mass", "mass-input")  # how a delta memory's readout is weighed against the window's output
BY_MASS = ("mass", "mass-input")  # the shares read from phi(q) . z, with a feature map, f_h and z in the state
# the mass share's logit is clamped to this: e^30 already scales its odds 1e13-fold, and past about 88
# exp(-logit) overflows (inf * 0 = NaN in the gradients)
MAX_SHARE_LOGIT = 30.0


def delta_memory_hybrid_attn(
    q, k, v, mask, *state, beta, log_a, share, key_map, key_bias, scale, chunk_size, kernels, mass=None, log_tau=None
):
    """The hybrid with a delta-rule memory (module docstring), every phase: the window part by
    ``window_and_leaving``, the memory on the tokens leaving the window, at most one per new token
    (beta = 0 and no decay where none leaves), through ``cells.delta``'s forms (``fused_delta_attn``
    with ``kernels``). beta / log_a ``[B, Hkv, T]`` are those of the arriving tokens (0 at padding),
    share what ``memory_share`` reads besides the count (``DeltaReader.share``: gate, logit, count weight),
    key_map / key_bias ``[Hkv, d, d]`` / ``[Hkv, d]`` the reader's key map. ``mass``: ``(phi, factor,
    k_sum, logit)`` for the shares by mass (``mass_share``; ``share`` is then the gate alone), which add
    ``k_sum`` to the returned state. ``log_tau`` ``[Hkv]``: beta annealed by the count (``annealed``)."""
    keys, _, sink_keys, _, length, kv = state
    unit = torch.ones(q.shape[1], q.shape[2], device=q.device)  # f = 1: w / u does not depend on it
    window_num, window_den, old_keys, old_values, leaves, window_state = window_and_leaving(
        q, k, v, mask, state[:-1], unit, scale, chunk_size, kernels
    )
    leaves = leaves[:, None]  # [B, 1, T]
    held = keys.shape[2] + sink_keys.shape[2]
    beta, log_a, written = _leaving_writes(beta, log_a, leaves, length, held, mass is None, log_tau)
    args = (memory_keys(q, key_map, key_bias), memory_keys(old_keys, key_map, key_bias), old_values, beta, log_a, kv)
    if kernels is not None:
        memory, kv = fused_delta_attn(*args, backend=kernels)
    else:
        memory, kv = chunk_delta_attn(*args, chunk_size=chunk_size)
    share, z = _share(share, mass, written, keys.shape[2], leaves, window_den, lambda phi: (phi(q), phi(old_keys)))
    return torch.lerp(readout(window_den, window_num), memory, share[..., None]), *window_state, kv, *z


def step_delta_memory_hybrid_attn(
    q, k, v, mask, *state, beta, log_a, share, key_map, key_bias, scale: float, mass=None, log_tau=None
):
    """The decode path of the delta memories off kernels: ``window_step``, then the token leaving
    the window is written by the delta rule (beta = 0 and no decay where none leaves: the stale key
    it would write is then ignored) and the query reads the memory, as in ``delta_memory_hybrid_attn``."""
    keys, _, sink_keys, _, length, kv = state
    w, u, old_key, old_value, leaves, window_state = window_step(q, k, v, mask, *state[:-1], scale)
    leaves = leaves.view(-1, 1, 1)  # [B, 1, T]
    held = keys.shape[2] + sink_keys.shape[2]
    beta, log_a, written = _leaving_writes(beta, log_a, leaves, length, held, mass is None, log_tau)
    memory, kv = step_delta_attn(
        memory_keys(q, key_map, key_bias), memory_keys(old_key, key_map, key_bias), old_value, beta, log_a, kv
    )
    share, z = _share(
        share, mass, written, keys.shape[2], leaves, u, lambda phi: query_and_leaving_features(phi, q, old_key)
    )
    return torch.lerp(window_output(w, u), memory, share[..., None]), *window_state, kv, *z


def _leaving_writes(beta, log_a, leaves, length, held: int, by_count: bool, log_tau):
    """How the tokens leaving the window are written, in both forms: beta and log_a ``[B, Hkv, T]``
    where a token leaves (``leaves [B, 1, T]``; beta = 0 and no decay elsewhere), beta ``annealed``
    by the count with ``log_tau``, and n ``tokens_written`` (``held`` = W + S) where the share by
    count or the annealing reads it, else None. Returns ``(beta, log_a, written)``."""
    beta = torch.where(leaves, beta, 0.0)
    written = tokens_written(length, leaves, held) if by_count or log_tau is not None else None
    if log_tau is not None:
        beta = annealed(beta, log_tau, written[:, None] - leaves.long())
    log_a = None if log_a is None else torch.where(leaves, log_a, 0.0)
    return beta, log_a, written


def _share(share, mass, written, window: int, leaves, window_den, features):
    """The memory's share s ``[B, Hkv, G, T]`` of the output and the state it adds, in both forms: by
    count (``memory_share`` of ``share``; none), or by ``mass`` (``mass_share``; z), reading
    ``features(phi) -> (phi of the queries, phi of the leaving keys)`` only then."""
    if mass is None:
        return memory_share(*share, written, window), ()
    phi, factor, k_sum, logit = mass
    phi_q, phi_leaving = features(phi)
    phi_written = torch.where(leaves[..., None], phi_leaving, 0.0)
    share, k_sum = mass_share(share, factor, phi_q, phi_written, k_sum, window_den, logit)
    return share, (k_sum,)


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
