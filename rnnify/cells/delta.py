"""Delta-rule cells: DeltaNet and Gated DeltaNet (docs/math.md §Delta rule).

Linear attention adds every k_t^T v_t to its state; the delta rule first erases what the state
holds at k_t, so a key written twice keeps its latest value instead of the sum. Per kv head
(the queries of a GQA group share the state), with k and q L2-normalised:

    DeltaNet        S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T               [d_v, d_k]
    Gated DeltaNet  S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
                    o_t = S_t q_t

(Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length";
Yang et al. 2024, "Gated Delta Networks"). The state is stored transposed, kv = S^T
``[B, H_kv, d_k, d_v]``, the layout of the linear cells' phi(k)^T v. beta_t in (0, 1) is the
writing strength and alpha_t in (0, 1) the decay, both scalars per kv head and token from small
trainable projections of the layer input x:

    beta_t = sigmoid(x_t W_beta + b_beta)            W_beta [C, H_kv]
    log alpha_t = logsigmoid(x_t W_alpha + b_alpha)  W_alpha [C, H_kv]   (gated-delta only)

Initialisation (from the attention it replaces: q, k, v are the model's own, after RoPE): W = 0
and b such that every token starts at beta = ``beta_init`` (default 0.5) and alpha =
``decay_init`` (default 0.99). With unit keys S_t k_t moves the fraction beta of the way towards
v_t, so beta = 1 overwrites a key's memory entirely and small beta averages it over ~1/beta writes;
0.5 keeps each write modest while a repeated key still converges to its value. Eigenvalues of
(I - beta k k^T) lie in [1 - beta, 1] and alpha <= 1, so |S| never grows beyond the values written
and the training-free output (|q| = 1, no softmax normaliser needed) stays on the scale of v.
Keys of padding tokens get beta = 0 and log alpha = 0: they leave the state exactly as it was.

Forms (tests hold them to ``naive_recurrent_delta_attn`` and to the float64 loop of
``rnnify.kernels.delta_rule``): ``naive_recurrent_*`` (a plain loop), ``chunk_*`` (the WY / UT
chunked form of ``rnnify.kernels.delta_rule.naive``: T = (I + strictly_lower(diag(beta) K K^T))^-1
diag(beta), W = T K, U = T V per chunk of C tokens, the gates as cumulative log decays; the
prefill path), ``step_*`` (one token; the decode path) and ``fused_*`` (the ``rnnify.kernels`` ops,
``chunk_delta_rule`` for T > 1 and ``fused_recurrent_delta_rule`` for T == 1, once
``use_kernels`` is set). Shapes: q ``[B, Hkv, G, T, d_k]`` (L2-normalised), k ``[B, Hkv, T, d_k]``
(L2-normalised), v ``[B, Hkv, T, d_v]``, beta and log_a ``[B, Hkv, T]`` (log_a None: DeltaNet),
state ``kv [B, Hkv, d_k, d_v]`` fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rnnify import kernels
from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.gated import gate_bias
from rnnify.kernels.delta_rule import chunk_delta_rule_reference

Forms = tuple[torch.Tensor, torch.Tensor]


def naive_recurrent_delta_attn(q, k, v, beta, log_a, kv) -> Forms:
    outs = []
    for t in range(k.shape[2]):
        if log_a is not None:
            kv = log_a[:, :, t, None, None].exp() * kv
        k_t = k[:, :, t]  # [B, Hkv, d_k]
        write = beta[:, :, t, None] * (v[:, :, t] - (k_t[..., None] * kv).sum(2))  # beta (v - S k)
        kv = kv + k_t[..., None] * write[:, :, None, :]
        outs.append(q[:, :, :, t] @ kv)
    return torch.stack(outs, dim=3), kv


def _to_ops(q, k, v, beta, log_a):
    """The cell layout as the ops' ``[B, T, H, .]``."""
    batch, num_kv_heads, group, length, dim = q.shape
    q = q.permute(0, 3, 1, 2, 4).reshape(batch, length, num_kv_heads * group, dim)
    return (
        q,
        k.transpose(1, 2),
        v.transpose(1, 2),
        beta.transpose(1, 2),
        None if log_a is None else log_a.transpose(1, 2),
    )


def _from_ops(out, q_shape):
    batch, num_kv_heads, group, length, _ = q_shape
    return out.reshape(batch, length, num_kv_heads, group, -1).permute(0, 2, 3, 1, 4)


def chunk_delta_attn(q, k, v, beta, log_a, kv, chunk_size: int = 64) -> Forms:
    out, kv = chunk_delta_rule_reference(
        *_to_ops(q, k, v, beta, log_a), scale=1.0, initial_state=kv, chunk_size=chunk_size
    )
    return _from_ops(out, q.shape), kv


def step_delta_attn(q, k, v, beta, log_a, kv) -> Forms:
    if log_a is not None:  # T == 1
        kv = log_a[:, :, 0, None, None].exp() * kv
    k_t = k[:, :, 0]
    write = beta[:, :, 0, None] * (v[:, :, 0] - (k_t[..., None] * kv).sum(2))
    kv = kv + k_t[..., None] * write[:, :, None, :]
    return q @ kv[:, :, None], kv


def fused_delta_attn(q, k, v, beta, log_a, kv, backend: str = "auto") -> Forms:
    """The forms above through ``rnnify.kernels``' delta-rule ops (layout change only)."""
    op = kernels.fused_recurrent_delta_rule if q.shape[3] == 1 else kernels.chunk_delta_rule
    out, kv = op(*_to_ops(q, k, v, beta, log_a), scale=1.0, initial_state=kv, output_final_state=True, backend=backend)
    return _from_ops(out, q.shape), kv


def _logit(p: float) -> float:
    return math.log(p) - math.log1p(-p)


def check_probability(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{name} must be a number strictly between 0 and 1, got {value!r}")
    return float(value)


class DeltaWriter(nn.Module):
    """The data-dependent parts of a delta-rule memory: beta (and, gated, log alpha) per kv head
    and token from the layer input, and the L2 normalisation of q and k. Shared by the delta cells
    and the hybrid's delta memory."""

    def __init__(self, spec: CellSpec, gated: bool, beta_init: float, decay_init: float | None):
        super().__init__()
        if spec.hidden_size is None:
            raise ValueError("the delta rule reads the layer input, but its width (spec.hidden_size) is unknown")
        self.gated = gated
        self.beta_init = check_probability("beta_init", beta_init)
        self.beta_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads)
        nn.init.zeros_(self.beta_proj.weight)
        nn.init.constant_(self.beta_proj.bias, _logit(self.beta_init))
        self.decay_init = None
        if gated:
            self.decay_init = check_probability("decay_init", 0.99 if decay_init is None else decay_init)
            self.gate_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads)
            nn.init.zeros_(self.gate_proj.weight)
            nn.init.constant_(self.gate_proj.bias, gate_bias(self.decay_init, 1.0))

    def forward(self, x: torch.Tensor | None, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """beta ``[B, H_kv, T]`` and log alpha (None ungated), 0 at padding (mask False)."""
        if x is None:
            raise ValueError("the delta rule needs the layer input: call the cell with x=[B, T, hidden]")
        x = x.float()
        real = mask.to(torch.bool)[:, None, :]
        proj = self.beta_proj
        beta = torch.sigmoid(F.linear(x, proj.weight.float(), proj.bias.float())).transpose(1, 2)
        beta = torch.where(real, beta, 0.0)
        if not self.gated:
            return beta, None
        proj = self.gate_proj
        log_a = F.logsigmoid(F.linear(x, proj.weight.float(), proj.bias.float())).transpose(1, 2)
        return beta, torch.where(real, log_a, 0.0)


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1, eps=1e-6)


class DeltaCell(Cell):
    """DeltaNet: linear attention whose writes first erase the key's old value (delta rule)."""

    target = "delta"
    own_forms_without_triton = frozenset({"decode"})
    state_names = ("kv",)
    needs_input = True
    gated = False

    def __init__(self, spec: CellSpec, beta_init: float = 0.5, chunk_size: int = 64):
        super().__init__(spec)
        self._setup(spec, beta_init, chunk_size, None)

    def _setup(self, spec: CellSpec, beta_init: float, chunk_size: int, decay_init: float | None) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.writer = DeltaWriter(spec, self.gated, beta_init, decay_init)

    def options(self) -> dict[str, Any]:
        options = {"beta_init": self.writer.beta_init, "chunk_size": self.chunk_size}
        if self.gated:
            options["decay_init"] = self.writer.decay_init
        return options

    def init_state(self, batch_size, device, dtype):
        spec = self.spec
        return (
            torch.zeros(
                batch_size, spec.num_kv_heads, spec.head_dim, spec.value_dim, device=device, dtype=torch.float32
            ),
        )

    def fused_ops(self) -> dict[str, str]:
        return {"prefill": "chunk_delta_rule", "decode": "fused_recurrent_delta_rule"}

    def forward(self, q, k, v, mask, kv, x=None):
        beta, log_a = self.writer(x, mask)
        batch, _, length, _ = q.shape
        grouped = l2_normalise(q.reshape(batch, self.spec.num_kv_heads, self.spec.group_size, length, -1))
        args = (grouped, l2_normalise(k), v.float(), beta, log_a, kv)
        backend = self.backend(q, length)
        if backend is not None:
            out, kv = fused_delta_attn(*args, backend=backend)
        elif length == 1:
            out, kv = step_delta_attn(*args)
        else:
            out, kv = chunk_delta_attn(*args, chunk_size=self.chunk_size)
        return out.reshape(batch, self.spec.num_heads, length, -1).to(q.dtype), kv


class GatedDeltaCell(DeltaCell):
    """Gated DeltaNet: the delta rule with a data-dependent decay alpha_t of the whole state."""

    target = "gated-delta"
    gated = True

    def __init__(self, spec: CellSpec, beta_init: float = 0.5, chunk_size: int = 64, decay_init: float = 0.99):
        Cell.__init__(self, spec)
        self._setup(spec, beta_init, chunk_size, decay_init)
