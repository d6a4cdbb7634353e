"""Gated (decayed) linear attention: RetNet, GLA and GateLoop (docs/math.md §Gated linear attention).

Linear attention (``linear.py``) whose state forgets: a gate a_t in (0, 1] decays the state
before each new token is added, per kv head:

    S_t = diag(a_t) S_{t-1} + phi(k_t)^T v_t        [F, Dv]
    z_t = diag(a_t) z_{t-1} + phi(k_t)              [F]      (normalize=True, the default)
    o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)              (normalize=False: o_t = phi(q_t) S_t)

a_t is one scalar per kv head (RetNet, GateLoop) or a vector over the F features (GLA). The
trained gates read x_t, the attention layer's input [B, T, C]:

    retnet    a_t = gamma_h = 1 - 2^(-5-h), fixed for kv head h        (Sun et al. 2023)
    gla       log a_t = logsigmoid(x_t W_down W_up + b) / tau          (Yang et al. 2023)
              W_down [C, r], W_up [r, H_kv * F], tau = 16
    gateloop  log a_t = logsigmoid(x_t W + b) / tau, W [C, H_kv]       (Katsch 2023), tau = 1

Unrolled from a state S_0 (the same for z), with cumulative log gates G_i = sum_{t<=i} log a_t:

    o_i ~ phi(q_i) [ exp(G_i) S_0 + sum_{j<=i} exp(G_i - G_j) phi(k_j)^T v_j ]

(elementwise over the F features for GLA). Gates are kept in log space (log a <= 0). The decay
from token j to token i is exp(L_ij), L_ij = log a_{j+1} + ... + log a_i = G_i - G_j, summed
directly over the segment (a difference of two large cumulative sums loses a short segment's
digits) and set to -inf above the diagonal *before* exp: every exponent is <= 0, so nothing
overflows at any length. GateLoop's factorisation
((Q * A)(K / A)^T * M) V is the same sum, but dividing by a cumulative product A_j that underflows
to 0 gives inf (fla#215); it is never computed that way here.

Forms, all computing the same thing (tests hold them to ``naive_recurrent_gated_attn``):
``naive_recurrent_*`` (a plain loop, the ground truth), ``parallel_*`` (masked quadratic),
``chunk_*`` (fla's naive_chunk: quadratic with relative decays inside chunks of C tokens, the
state carried between chunks with the chunk's total decay exp(G_C); the prefill path), the three
in ``rnnify/kernels/linear_attn/naive.py`` as the ops' references, and ``step_*`` here (one token;
the decode path); the fused form is ``cells.linear.fused_feature_attn`` with
the gates (the ops' g for a scalar gate, gk for GLA's vector gate; the raw q, k, the map and the
mask go to the ops, which apply them). Shapes: phi_q
``[B, Hkv, G, T, F]`` (G query heads per kv head), phi_k ``[B, Hkv, T, F]``, v ``[B, Hkv, T, Dv]``,
log_a ``[B, Hkv, T, 1]`` (scalar gate) or ``[B, Hkv, T, F]`` (vector gate), state ``kv [B, Hkv, F, Dv]`` and ``k_sum [B, Hkv, F]`` (None
without the normaliser) in fp32.

Padding tokens have phi(k) = 0 *and* log a = 0, so they leave the state exactly as it was.

Initialisation of the trainable gates (gla, gateloop): the last projection (W_up, W) is zero and
the bias is logit(decay_init^tau), so every gate starts at a = decay_init whatever the input.
The default 0.99 (log a = -0.01, a memory half-life of ~69 tokens, about RetNet's gamma for h = 2)
trades the two uses: closer to 1 is closer to plain linear attention when used training-free,
but the gate then sits deep in the sigmoid's tail and trains slowly (d log a / d bias =
(1 - a^tau) / tau: ~9e-3 at 0.99, ~1e-3 at 0.999); set decay_init to choose. W_down is random
(nn.Linear's default), so W_up gets a gradient from the first step and W_down from the second on.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rnnify.cells.base import CellSpec
from rnnify.cells.linear import FeatureMapCell, fused_feature_attn, masked, read_step
from rnnify.errors import check_int
from rnnify.kernels.linear_attn.naive import Forms, chunk_gated_attn, normalise

GATES = ("retnet", "gla", "gateloop")
GATE_OPTIONS = {"retnet": (), "gla": ("gate_rank", "tau", "decay_init"), "gateloop": ("tau", "decay_init")}


def step_gated_attn(phi_q, phi_k, v, log_a, kv, k_sum=None, eps: float = 1e-6) -> Forms:
    a = log_a[:, :, 0].exp()  # T == 1; [B, Hkv, F|1]
    kv = torch.addcmul(a[..., None] * kv, phi_k[:, :, 0, :, None], v[:, :, 0, None, :])  # + phi(k)^T v
    if k_sum is not None:
        k_sum = a * k_sum + phi_k[:, :, 0]
    num, den = read_step(phi_q, kv, k_sum)
    return (num if den is None else normalise(num, den, eps)), kv, k_sum


def retnet_log_gammas(num_kv_heads: int) -> torch.Tensor:
    """log(1 - 2^(-5-h)) for h = 0 .. H_kv-1, in float64 (1 - 2^-30 is not an fp32 number; its log is)."""
    return torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(num_kv_heads, dtype=torch.float64)))


def gate_bias(decay_init: float, tau: float) -> float:
    """b with logsigmoid(b) / tau = log(decay_init): logit(decay_init ** tau)."""
    p = math.exp(tau * math.log(decay_init))
    return math.log(p) - math.log1p(-p)


def gla_projections(hidden_size: int, rank: int, outputs: int, bias: float) -> tuple[nn.Linear, nn.Linear]:
    """GLA's low-rank gate projections W_down ``[C, r]`` (random) and W_up ``[r, outputs]`` (zero,
    bias ``bias``: every gate starts at the same a whatever the input)."""
    down, up = nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, outputs)
    nn.init.zeros_(up.weight)
    nn.init.constant_(up.bias, bias)
    return down, up


def gla_log_gates(
    x: torch.Tensor, down: nn.Linear, up: nn.Linear, tau: float, num_kv_heads: int, mask: torch.Tensor
) -> torch.Tensor:
    """GLA's log a_t = logsigmoid(x_t W_down W_up + b) / tau, ``[B, H_kv, T, F]``, 0 at padding."""
    batch, length = mask.shape
    logits = F.linear(F.linear(x.float(), down.weight.float()), up.weight.float(), up.bias.float())
    return masked(F.logsigmoid(logits.reshape(batch, length, num_kv_heads, -1).transpose(1, 2)) / tau, mask)


class GatedCell(FeatureMapCell):
    """Decayed linear attention with a fixed (retnet) or trained, input-dependent (gla, gateloop) gate."""

    target = "gated"
    own_forms_without_triton = frozenset({"decode"})
    state_names = ("kv", "k_sum")  # ("kv",) with normalize=False
    needs_input = True  # gla and gateloop read the layer input x; a retnet cell sets this False

    def __init__(
        self,
        spec: CellSpec,
        gate: str = "retnet",
        feature_map: str = "elu",
        feature_options: dict[str, Any] | None = None,
        normalize: bool = True,
        chunk_size: int = 64,
        eps: float = 1e-6,
        gate_rank: int | None = None,
        tau: float | None = None,
        decay_init: float | None = None,
    ):
        if gate not in GATES:
            raise ValueError(f"unknown gate {gate!r}; choose from {list(GATES)}")
        super().__init__(spec, feature_map, feature_options, normalize, chunk_size, eps)
        for name, value in {"gate_rank": gate_rank, "tau": tau, "decay_init": decay_init}.items():
            if value is not None and name not in GATE_OPTIONS[gate]:
                users = " and ".join(repr(g) for g, names in GATE_OPTIONS.items() if name in names)
                raise ValueError(f"option {name!r} does not apply to gate {gate!r}, only to {users}")
        self.gate = gate
        self.needs_input = gate != "retnet"
        num_kv_heads, features = spec.num_kv_heads, self.phi.feature_dim

        if gate == "retnet":
            self.register_buffer("log_gamma", retnet_log_gammas(num_kv_heads).float(), persistent=False)
            return
        if spec.hidden_size is None:
            raise ValueError(f"gate {gate!r} reads the layer input, but its width (spec.hidden_size) is unknown")
        self.tau = float(16.0 if tau is None and gate == "gla" else 1.0 if tau is None else tau)
        self.decay_init = float(0.99 if decay_init is None else decay_init)
        if not self.tau > 0:
            raise ValueError(f"tau must be > 0, got {tau!r}")
        if not 0 < self.decay_init < 1:
            raise ValueError(f"decay_init must be strictly between 0 and 1, got {decay_init!r}")
        bias = gate_bias(self.decay_init, self.tau)
        if gate == "gla":
            self.gate_rank = 16 if gate_rank is None else gate_rank
            check_int("gate_rank", self.gate_rank)
            self.gate_down, self.gate_up = gla_projections(
                spec.hidden_size, self.gate_rank, num_kv_heads * features, bias
            )
        else:
            self.gate_proj = nn.Linear(spec.hidden_size, num_kv_heads)
            nn.init.zeros_(self.gate_proj.weight)
            nn.init.constant_(self.gate_proj.bias, bias)

    def options(self) -> dict[str, Any]:
        options = {
            "gate": self.gate,
            "feature_map": self.feature_map,
            "feature_options": self.phi.options(),
            "normalize": self.normalize,
            "chunk_size": self.chunk_size,
            "eps": self.eps,
        }
        if self.gate == "gla":
            options["gate_rank"] = self.gate_rank
        if self.gate != "retnet":
            options.update(tau=self.tau, decay_init=self.decay_init)
        return options

    def log_gates(self, x: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """log a_t, ``[B, H_kv, T, 1]`` (retnet, gateloop) or ``[B, H_kv, T, F]`` (gla), 0 at padding."""
        batch, length = mask.shape
        num_kv_heads = self.spec.num_kv_heads
        if self.gate == "retnet":
            log_a = self.log_gamma.float()[None, :, None, None].expand(batch, num_kv_heads, length, 1)
        else:
            if x is None:
                raise ValueError(f"gate {self.gate!r} needs the layer input: call the cell with x=[B, T, hidden]")
            if self.gate == "gla":
                return gla_log_gates(x, self.gate_down, self.gate_up, self.tau, num_kv_heads, mask)
            logits = F.linear(x.float(), self.gate_proj.weight.float(), self.gate_proj.bias.float())
            log_a = F.logsigmoid(logits.reshape(batch, length, num_kv_heads, 1).transpose(1, 2)) / self.tau
        return masked(log_a, mask)

    def forward(self, q, k, v, mask, *state, x=None):
        kv, k_sum = state if self.normalize else (state[0], None)
        mask = mask.to(torch.bool)
        log_a = self.log_gates(x, mask)
        v = masked(v.float(), mask)  # padding: phi(k) = 0, a = 1, v = 0
        backend = self.backend(q, q.shape[2])
        if backend is not None:  # the ops featurise (and mask) q, k themselves
            out, kv, k_sum = fused_feature_attn(
                self.grouped(q), k, v, kv, k_sum, self.phi, mask, self.eps, log_a, backend
            )
        elif q.shape[2] == 1:
            out, kv, k_sum = step_gated_attn(*self.features(q, k, mask), v, log_a, kv, k_sum, self.eps)
        else:
            out, kv, k_sum = chunk_gated_attn(
                *self.features(q, k, mask), v, log_a, kv, k_sum, self.eps, self.chunk_size
            )
        out = out.reshape(q.shape[0], self.spec.num_heads, q.shape[2], -1).to(q.dtype)
        return (out, kv, k_sum) if self.normalize else (out, kv)
