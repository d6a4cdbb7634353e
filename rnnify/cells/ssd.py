"""A model's own Mamba-2 layer (state space duality, SSD), carried as state (docs/math.md §State space layers).

Hybrids such as Granite 4, Bamba, Falcon-H1, Nemotron-H and Zamba2 mix tokens in some layers with
Mamba-2's selective scan instead of attention. Per head h (of H, width P) and token t, with a
scalar decay per head and token:

    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_min, dt_max)      a_t = exp(dt_t * A),  A = -exp(A_log)
    S_t  = a_t S_{t-1} + dt_t x_t B_t^T                           [P, N]
    y_t  = S_t C_t + D x_t

with B and C shared by the heads of a group (G groups of width N). The state that makes a step
equal a prefill is S, ``[B, H, P, N]`` in fp32. This cell is not a ``--to`` target:
``rewrite_scans`` puts one wherever the model has such a layer, whatever the attention layers
become, and it computes the original unchanged (``exact``). The graph keeps the layer's weights
(the source's, under their own names) and hands them to the call:
``out, S = cell(x [B, T, H*P], B [B, T, G*N], C [B, T, G*N], dt_raw [B, T, H], A_log [H], D [H],
dt_bias [H], mask [B, T], S)``; ``out`` is fp32 ``[B, T, H*P]``, as the source's scan returns it.

Padding never enters the state (§Padding): a padded token takes no step (dt = 0, so a = 1 and it
adds nothing). ``naive_recurrent_ssd`` is the ground truth (a token at a time, fp64);
``chunk_ssd`` is the prefill (the scan within chunks as a masked matrix product, the state carried
from chunk to chunk); ``fused_recurrent_ssd`` is the decode step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from rnnify.cells.base import Cell, CellSpec, zero_fp32_state
from rnnify.errors import check_int

# Tokens per chunk of the prefill: the within-chunk product holds chunk^2 decays per head.
CHUNK = 64


def _by_head(x, B, C, heads: int, groups: int, dtype: torch.dtype):
    """x ``[b, t, H, P]``; B and C ``[b, t, H, N]`` (each group's shared by its heads), in ``dtype``."""
    b, t, _ = x.shape
    x = x.to(dtype).view(b, t, heads, -1)
    B, C = (z.to(dtype).view(b, t, groups, -1).repeat_interleave(heads // groups, dim=2) for z in (B, C))
    return x, B, C


def _steps(dt, dt_bias, A_log, mask, dt_min: float, dt_max: float | None, dtype: torch.dtype):
    """(dt ``[b, t, H]``, zero at padding; log decay per unit dt ``A`` ``[H]``), in ``dtype``."""
    dt = F.softplus(dt.to(dtype) + dt_bias.to(dtype)).clamp(min=dt_min, max=dt_max)
    return dt * mask[..., None].to(dtype), -torch.exp(A_log.to(dtype))


def naive_recurrent_ssd(
    x,
    B,
    C,
    dt,
    A_log,
    D,
    dt_bias,
    mask,
    state,
    heads: int,
    groups: int,
    dt_min: float = 0.0,
    dt_max: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time in fp64, from the equations above; returns (out fp64 ``[b, t, H*P]``, state)."""
    x, B, C = _by_head(x, B, C, heads, groups, torch.float64)
    dt, A = _steps(dt, dt_bias, A_log, mask, dt_min, dt_max, torch.float64)
    S, outs = state.to(torch.float64), []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        S = decay * S + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        outs.append((S * C[:, t, :, None, :]).sum(-1) + D.to(torch.float64)[:, None] * x[:, t])
    return torch.stack(outs, dim=1).flatten(2), S


def chunk_ssd(x, dt, A, B, C, state, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan without the skip term, fp32, ``chunk`` tokens at a time: within a chunk, output t reads
    token s <= t through (C_t . B_s) dt_s exp(l_t - l_s) (l: the cumulative log decay), and the
    state entering the chunk through exp(l_t); between chunks the state is carried as in a step.
    x ``[b, t, H, P]``, dt ``[b, t, H]``, B/C ``[b, t, H, N]``, state ``[b, H, P, N]``."""
    b, t, heads, _ = x.shape
    pad = -t % chunk
    if pad:  # padded tokens take no step (dt = 0)
        x, B, C = (F.pad(z, (0, 0, 0, 0, 0, pad)) for z in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    n = (t + pad) // chunk
    x, B, C = (z.view(b, n, chunk, heads, -1) for z in (x, B, C))
    dt = dt.view(b, n, chunk, heads)
    log_decay = torch.cumsum(dt * A, dim=2)  # [b, n, L, H]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()[None, None, :, :, None]
    gaps = (log_decay[:, :, :, None] - log_decay[:, :, None]).masked_fill(~causal, -math.inf)
    weights = torch.einsum("bctHn,bcsHn->bctsH", C, B) * torch.exp(gaps) * dt[:, :, None]
    within = torch.einsum("bctsH,bcsHp->bctHp", weights, x)
    to_end = torch.exp(log_decay[:, :, -1:] - log_decay) * dt  # [b, n, L, H]
    added = torch.einsum("bclH,bclHn,bclHp->bcHpn", to_end, B, x)
    kept = torch.exp(log_decay[:, :, -1])  # [b, n, H]
    entering = []
    for c in range(n):
        entering.append(state)
        state = kept[:, c, :, None, None] * state + added[:, c]
    from_state = torch.einsum("bclHn,bcHpn->bclHp", C, torch.stack(entering, dim=1)) * torch.exp(log_decay)[..., None]
    return (within + from_state).reshape(b, n * chunk, heads, -1)[:, :t], state


def fused_recurrent_ssd(x, dt, A, B, C, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (``t`` = 1) in fp32, without the skip term: the step of the equations above."""
    state = (
        torch.exp(dt[:, 0] * A)[..., None, None] * state + (dt[:, 0, :, None] * x[:, 0])[..., None] * B[:, 0, :, None]
    )
    return (state * C[:, 0, :, None]).sum(-1)[:, None], state


class SSDCell(Cell):
    """Mamba-2's selective scan over H heads of width P with G groups of state width N.

    Its spec describes the scan in attention's terms: each of the H heads keeps a [P, N] state as a
    linear-attention head would, so ``num_heads`` = ``num_kv_heads`` = H, ``head_dim`` = N (B and C,
    keys and queries) and ``value_dim`` = P (x, values); ``scale`` is unused.
    """

    target = "ssd"
    own_layer = True
    state_names = ("ssm",)

    def __init__(self, spec: CellSpec, groups: int, dt_min: float = 0.0, dt_max: float | None = None):
        super().__init__(spec)
        self.groups = check_int("groups", groups)
        if spec.num_heads % self.groups:
            raise ValueError(f"num_heads ({spec.num_heads}) must be a multiple of groups ({self.groups})")
        if not (isinstance(dt_min, (int, float)) and dt_min >= 0 and (dt_max is None or dt_max >= dt_min)):
            raise ValueError(f"need 0 <= dt_min <= dt_max, got {dt_min!r}, {dt_max!r}")
        self.dt_min, self.dt_max = float(dt_min), None if dt_max is None else float(dt_max)

    @staticmethod
    def spec_for(heads: int, head_dim: int, state_size: int) -> CellSpec:
        """The spec of a scan over ``heads`` heads of width ``head_dim`` with states of width ``state_size``."""
        return CellSpec(num_heads=heads, num_kv_heads=heads, head_dim=state_size, value_dim=head_dim, scale=1.0)

    def options(self) -> dict[str, Any]:
        return {"groups": self.groups, "dt_min": self.dt_min, "dt_max": self.dt_max}

    def describe(self) -> str:
        return "the model's own Mamba-2 scan"

    def init_state(self, batch_size, device, dtype):
        """S of every head, ``[B, H, P, N]``."""
        return zero_fp32_state(batch_size, self.spec.num_heads, self.spec.value_dim, self.spec.head_dim, device=device)

    def forward(self, x, B, C, dt, A_log, D, dt_bias, mask, ssm):
        heads = self.spec.num_heads
        xs, B, C = _by_head(x, B, C, heads, self.groups, torch.float32)
        dt, A = _steps(dt, dt_bias, A_log, mask, self.dt_min, self.dt_max, torch.float32)
        scan = fused_recurrent_ssd if x.shape[1] == 1 else chunk_ssd
        y, ssm = scan(xs, dt, A, B, C, ssm.to(torch.float32))
        return (y + D.to(torch.float32)[:, None] * xs).flatten(2), ssm
