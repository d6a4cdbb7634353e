"""A short causal convolution over the tokens, carried as state (docs/math.md §Short convolution).

Hybrid models such as LFM2 mix tokens in some layers with a causal depthwise convolution instead
of attention: channel c of output t reads the last K inputs of its own channel,

    y_t = b + sum_{i=0}^{K-1} w_i * x_{t-K+1+i}          (per channel; x_t = 0 before the first token)

so the state that makes a step equal a prefill is the row's last K-1 inputs, ``[B, C, K-1]``. This
cell is not a ``--to`` target: ``rewrite_convolutions`` puts one wherever the model has such a
layer, whatever the attention layers become, and it computes the original unchanged (``exact``).
The graph keeps the weights (they are the source's, under their own names) and hands them to the
call: ``out, inputs = cell(x [B, C, T], weight [C, 1, K], bias [C] | None, mask [B, T], inputs)``.

Padding never enters the state (§Padding): a row's real inputs are moved to the end of the
window, after the state, before the convolution runs, so each real token reads the K-1 real inputs
before it, as it would alone, and the new state is the last K-1 of them.

``naive_recurrent_short_conv`` is the ground truth (a token at a time); ``short_conv`` is the
cell's form (one convolution over state and tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rnnify.cells.base import Cell, CellSpec, every_token_real
from rnnify.errors import check_int


def naive_recurrent_short_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor, inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time: a real token shifts itself into the state and reads it; padding reads 0
    and leaves the state as it was."""
    outs = []
    for t in range(x.shape[2]):
        window = torch.cat([inputs, x[:, :, t : t + 1]], dim=2)  # [B, C, K]
        out = (window * weight[:, 0]).sum(-1) + (0 if bias is None else bias)
        real = mask[:, t, None].to(torch.bool)
        outs.append(torch.where(real, out, 0))
        inputs = torch.where(real[..., None], window[:, :, 1:], inputs)
    return torch.stack(outs, dim=2), inputs


def short_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor, inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One depthwise convolution over ``[state, tokens]``; outputs at padding are whatever they read."""
    channels, held = x.shape[1], inputs.shape[2]
    window = torch.cat([inputs.to(x.dtype), x], dim=2)  # [B, C, K-1+T]
    if every_token_real(mask):
        out = F.conv1d(window, weight, bias, groups=channels)
        return out, window[:, :, window.shape[2] - held :]
    # stable sort: padding first, then the state and the real tokens in order; the K-1 state entries
    # count as real, so no real token's window reaches back into the padding
    real = torch.cat([mask.new_ones(mask.shape[0], held, dtype=torch.bool), mask.to(torch.bool)], dim=1)
    order = torch.sort(real.to(torch.uint8), dim=1, stable=True).indices  # [B, K-1+T]
    packed = window.gather(2, order[:, None].expand(-1, channels, -1))
    out = F.conv1d(packed, weight, bias, groups=channels)  # out[j]: packed position K-1+j
    where = torch.argsort(order, dim=1)[:, held:] - held  # each token's output in ``out`` (padding: < 0)
    out = out.gather(2, where.clamp_min(0)[:, None].expand(-1, channels, -1))
    return out, packed[:, :, packed.shape[2] - held :]


class ShortConvCell(Cell):
    """A causal depthwise convolution over the last ``kernel_size`` tokens, with their inputs as state.

    Its spec describes the convolution in attention's terms: each of the C channels is its own
    filter, as a head of width 1 (channels never mix), so ``num_heads`` = ``num_kv_heads`` = C and
    ``head_dim`` = ``value_dim`` = 1; ``scale`` is unused.
    """

    target = "short_conv"
    own_layer = True
    state_names = ("inputs",)

    def __init__(self, spec: CellSpec, kernel_size: int):
        super().__init__(spec)
        self.kernel_size = check_int("kernel_size", kernel_size, minimum=2, why=" (a 1-token kernel keeps no state)")

    @staticmethod
    def spec_for(channels: int) -> CellSpec:
        """The spec of a convolution over ``channels`` channels (see the class docstring)."""
        return CellSpec(num_heads=channels, num_kv_heads=channels, head_dim=1, value_dim=1, scale=1.0)

    def options(self) -> dict[str, Any]:
        return {"kernel_size": self.kernel_size}

    def describe(self) -> str:
        return f"causal convolution over the last {self.kernel_size} tokens"

    def init_state(self, batch_size, device, dtype):
        return (torch.zeros(batch_size, self.spec.num_heads, self.kernel_size - 1, device=device, dtype=dtype),)

    def forward(self, x, weight, bias, mask, inputs):
        out, held = short_conv(x, weight, bias, mask, inputs)
        return out, held.to(inputs.dtype)
