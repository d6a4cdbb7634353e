"""A model's own Mamba-1 layer (the selective scan), carried as state (docs/math.md §State space layers).

Hybrids such as Jamba and Zamba mix tokens in some layers with Mamba's selective scan instead of
attention. Per channel d (of D) and state entry n (of N), with a decay per channel, entry and token:

    dt_t = softplus(dt_raw_t + dt_bias)                     [D]      A = -exp(A_log)  [D, N]
    h_t  = exp(dt_t A) * h_{t-1} + (dt_t * x_t) B_t^T        [D, N]
    y_t  = (h_t C_t + D * x_t) * silu(z_t)                    [D]

with B and C ``[N]`` per token, shared by the channels. The state that makes a step equal a
prefill is h, ``[B, D, N]`` in fp32. This cell is not a ``--to`` target: ``rewrite_scans`` puts one
wherever the model has such a layer, whatever the attention layers become, and it computes the
original unchanged (``exact``). The graph keeps the layer's weights (the source's, under their own
names) and computes A, as the source does, before the call:
``out, h = cell(x [B, T, D], dt_raw [B, T, D], A [D, N], B [B, T, N], C [B, T, N], D [D], z [B, T, D],
dt_bias [D], mask [B, T], h)``; ``out`` ``[B, T, D]`` has the dtype the source's scan returns (its
inputs' promoted with the skip weights' and the gate's: fp32 for a half-precision model, whose scan
reads fp32 skip weights).

Padding never enters the state (§Padding): a padded token takes no step (dt = 0, so its decay is 1
and it adds nothing). ``naive_recurrent_selective_scan`` is the ground truth (a token at a time,
fp64); ``chunk_selective_scan`` is the prefill; ``fused_recurrent_selective_scan`` is the decode
step. Unlike Mamba-2's scalar decay per head (``ssd.py``), the decay here differs per channel and
entry, so the chunked matrix form of SSD would hold ``[L, L, D, N]`` decays per chunk of L tokens;
the prefill instead scans each chunk by doubling (Hillis and Steele 1986; the first-order linear
recurrence of §Scan operators): log2(L) vectorised steps over the chunk's ``[L, D, N]`` states, the
state carried from chunk to chunk, holding one chunk's states at a time.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rnnify.cells.base import Cell, CellSpec, zero_fp32_state
from rnnify.kernels.scan import doubling_linear_recurrence

# Tokens per chunk of the prefill: the doubling scan holds a chunk's [L, D, N] states and decays.
CHUNK = 64


def out_dtype(x: torch.Tensor, D: torch.Tensor, z: torch.Tensor) -> torch.dtype:
    """The dtype the source's scan returns: ``(scan + x * D) * silu(z)`` promotes the three."""
    return torch.promote_types(torch.promote_types(x.dtype, D.dtype), z.dtype)


def _steps(dt, dt_bias, mask, dtype: torch.dtype) -> torch.Tensor:
    """dt ``[b, t, D]`` in ``dtype``, zero at padding."""
    dt = F.softplus(dt.to(dtype) + dt_bias.to(dtype))
    return dt * mask[..., None].to(dtype)


def naive_recurrent_selective_scan(x, dt, A, B, C, D, z, dt_bias, mask, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time in fp64, from the equations above, skip term and gate included; returns
    (out fp64 ``[b, t, D]``, state)."""
    x, A, B, C, D, z = (v.to(torch.float64) for v in (x, A, B, C, D, z))
    dt = _steps(dt, dt_bias, mask, torch.float64)
    h, outs = state.to(torch.float64), []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        outs.append(((h * C[:, t, None, :]).sum(-1) + D * x[:, t]) * F.silu(z[:, t]))
    return torch.stack(outs, dim=1), h


def chunk_selective_scan(x, dt, A, B, C, state, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan without the skip term and gate, fp32, ``chunk`` tokens at a time. Within a chunk,
    the pairs (decay a_t, input u_t) of h_t = a_t h_{t-1} + u_t are combined by doubling
    (``doubling_linear_recurrence``), so h_t = a_t h_in + u_t with h_in the state entering the chunk.
    x, dt ``[b, t, D]``, A ``[D, N]``, B/C ``[b, t, N]``, state ``[b, D, N]``."""
    outs = []
    for start in range(0, x.shape[1], chunk):
        part = slice(start, start + chunk)
        decay = torch.exp(dt[:, part, :, None] * A)  # [b, L, D, N]
        added = (dt[:, part] * x[:, part])[..., None] * B[:, part, None, :]
        decay, added = doubling_linear_recurrence(decay, added)
        states = decay * state[:, None] + added
        outs.append(torch.einsum("bldn,bln->bld", states, C[:, part]))
        state = states[:, -1]
    return torch.cat(outs, dim=1), state


def fused_recurrent_selective_scan(x, dt, A, B, C, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (``t`` = 1) in fp32, without the skip term and gate: the step of the equations above."""
    state = torch.exp(dt[:, 0, :, None] * A) * state + (dt[:, 0] * x[:, 0])[..., None] * B[:, 0, None, :]
    return (state * C[:, 0, None, :]).sum(-1)[:, None], state


class SelectiveScanCell(Cell):
    """Mamba-1's selective scan over D channels with states of width N.

    Its spec describes the scan in attention's terms: each of the D channels keeps an [N] state as
    a linear-attention head of value width 1 would, so ``num_heads`` = ``num_kv_heads`` = D,
    ``head_dim`` = N (B and C, keys and queries) and ``value_dim`` = 1 (x, values); ``scale`` is
    unused. Nothing else is an option: the sizes are the spec's, and the weights are the graph's.
    """

    target = "selective_scan"
    own_layer = True
    state_names = ("ssm",)

    @staticmethod
    def spec_for(channels: int, state_size: int) -> CellSpec:
        """The spec of a scan over ``channels`` channels with states of width ``state_size``."""
        return CellSpec(num_heads=channels, num_kv_heads=channels, head_dim=state_size, value_dim=1, scale=1.0)

    def options(self) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        return "the model's own Mamba scan"

    def init_state(self, batch_size, device, dtype):
        """h of every channel, ``[B, D, N]``."""
        return zero_fp32_state(batch_size, self.spec.num_heads, self.spec.head_dim, device=device)

    def forward(self, x, dt, A, B, C, D, z, dt_bias, mask, ssm):
        xs = x.to(torch.float32)
        steps = _steps(dt, dt_bias, mask, torch.float32)
        scan = fused_recurrent_selective_scan if x.shape[1] == 1 else chunk_selective_scan
        y, ssm = scan(xs, steps, A.to(torch.float32), B.to(torch.float32), C.to(torch.float32), ssm.to(torch.float32))
        y = (y + D.to(torch.float32) * xs) * F.silu(z.to(torch.float32))
        return y.to(out_dtype(x, D, z)), ssm
