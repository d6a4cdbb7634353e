"""A short causal convolution over the tokens, carried as state (docs/math.md §Short convolution).

Hybrid models such as LFM2 mix tokens in some layers with a causal depthwise convolution instead
of attention: channel c of output t reads the last K inputs of its own channel,

    y_t = b + sum_{i=0}^{K-1} w_i * x_{t-K+1+i}          (per channel; x_t = 0 before the first token)

so the state that makes a step equal a prefill is the row's last K-1 inputs, ``[B, C, K-1]``. Some
layers run a chain of such convolutions, each over the last one's outputs and any of them grouped
(ZAYA's attention: a depthwise, then a grouped convolution of its queries and keys); the chain
reads the last K = 1 + sum(k_i - 1) inputs, so its state is the same. This cell is not a ``--to``
target: ``rewrite_convolutions`` puts one wherever the model has such a layer, whatever the
attention layers become, and it computes the original unchanged (``exact``). The graph keeps the
weights (they are the source's, under their own names) and hands them to the call:
``out, inputs = cell(x [B, C, T], weight_1, bias_1 | None, ..., mask [B, T], inputs)``.

Padding never enters the state (§Padding): a row's real inputs are moved to the end of the
window, after the state, before the convolution runs, so each real token reads the K-1 real inputs
before it, as it would alone, and the new state is the last K-1 of them.

``naive_recurrent_short_conv`` is the ground truth (a token at a time); ``short_conv`` is the
cell's form (one pass of the chain over state and tokens).

``TokenWindowCell`` keeps the same state for a convolution whose taps each token computes
(Inkling 2's keys and values): captured as ``pad(x, [K-1, 0]).unfold(-1, K, 1)``, the windows of
the last K inputs that the graph then weighs itself; the cell hands those windows to the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rnnify.cells.base import Cell, CellSpec, channel_spec, every_token_real
from rnnify.errors import check_int

# One convolution of a chain: (weight [C_out, C_in / groups, k], bias [C_out] or None, groups).
Conv = tuple[torch.Tensor, torch.Tensor | None, int]


def convolve(x: torch.Tensor, convs: list[Conv]) -> torch.Tensor:
    """The chain over ``x [B, C, L]``, each convolution without padding: ``L - (K-1)`` outputs."""
    for weight, bias, groups in convs:
        x = F.conv1d(x, weight, bias, groups=groups)
    return x


def naive_recurrent_short_conv(
    x: torch.Tensor, convs: list[Conv], mask: torch.Tensor, inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time: a real token shifts itself into the state and reads it; padding reads 0
    and leaves the state as it was."""
    outs = []
    for t in range(x.shape[2]):
        window = torch.cat([inputs, x[:, :, t : t + 1]], dim=2)  # [B, C, K]
        real = mask[:, t, None].to(torch.bool)
        outs.append(torch.where(real, convolve(window, convs)[:, :, 0], 0))
        inputs = torch.where(real[..., None], window[:, :, 1:], inputs)
    return torch.stack(outs, dim=2), inputs


def short_conv(
    x: torch.Tensor, convs: list[Conv], mask: torch.Tensor, inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain over ``[state, tokens]``; outputs at padding are whatever they read."""
    return carried(x, lambda window: convolve(window, convs), mask, inputs)


def carried(
    x: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor], mask: torch.Tensor, inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``read`` (one output per K inputs, along dimension 2: a convolution chain, the windows
    themselves) over ``[state, tokens]`` ``[B, C, K-1+T]``, the real tokens packed after the state;
    outputs at padding are whatever they read. Returns (outputs, the new state)."""
    channels, held = x.shape[1], inputs.shape[2]
    window = torch.cat([inputs.to(x.dtype), x], dim=2)  # [B, C, K-1+T]
    if every_token_real(mask):
        return read(window), window[:, :, window.shape[2] - held :]
    # stable sort: padding first, then the state and the real tokens in order; the K-1 state entries
    # count as real, so no real token's window reaches back into the padding
    real = torch.cat([mask.new_ones(mask.shape[0], held, dtype=torch.bool), mask.to(torch.bool)], dim=1)
    order = torch.sort(real.to(torch.uint8), dim=1, stable=True).indices  # [B, K-1+T]
    packed = window.gather(2, order[:, None].expand(-1, channels, -1))
    out = read(packed)  # out[j]: packed position K-1+j
    where = torch.argsort(order, dim=1)[:, held:] - held  # each token's output in ``out`` (padding: < 0)
    index = where.clamp_min(0).view(*where.shape[:1], 1, where.shape[1], *[1] * (out.dim() - 3))
    out = out.gather(2, index.expand(-1, out.shape[1], -1, *out.shape[3:]))
    return out, packed[:, :, packed.shape[2] - held :]


class ShortConvCell(Cell):
    """A causal convolution, or a chain of them, over the last ``kernel_size`` tokens, with their inputs
    as state.

    Its spec is ``channel_spec`` of the C input channels (the state is theirs). ``groups``: each
    convolution's groups, in the chain's order; None for one depthwise convolution (groups = C).
    """

    target = "short_conv"
    own_layer = True
    state_names = ("inputs",)

    def __init__(self, spec: CellSpec, kernel_size: int, groups: list[int] | None = None):
        super().__init__(spec)
        self.kernel_size = check_int("kernel_size", kernel_size, minimum=2, why=" (a 1-token kernel keeps no state)")
        if groups is not None:
            if not isinstance(groups, list) or not groups:
                raise ValueError(f"groups must be a list of each convolution's groups, got {groups!r}")
            groups = [check_int("groups", g) for g in groups]
        self.groups = groups

    spec_for = staticmethod(channel_spec)

    def options(self) -> dict[str, Any]:
        return {"kernel_size": self.kernel_size, **({} if self.groups is None else {"groups": list(self.groups)})}

    def describe(self) -> str:
        chain = "" if self.groups is None or len(self.groups) == 1 else f" (a chain of {len(self.groups)})"
        return f"causal convolution over the last {self.kernel_size} tokens{chain}"

    def init_state(self, batch_size, device, dtype):
        return (torch.zeros(batch_size, self.spec.num_heads, self.kernel_size - 1, device=device, dtype=dtype),)

    def forward(self, x, *args):
        """``x``, each convolution's weight and bias, ``mask``, ``inputs`` (module docstring)."""
        *tensors, mask, inputs = args
        groups = self.groups or [x.shape[1]]
        if len(tensors) != 2 * len(groups):
            raise ValueError(f"{len(groups)} convolutions take a weight and a bias each, got {len(tensors)} tensors")
        convs = [(w, b, g) for w, b, g in zip(tensors[0::2], tensors[1::2], groups, strict=True)]
        out, held = short_conv(x, convs, mask, inputs)
        return out, held.to(inputs.dtype)


class TokenWindowCell(ShortConvCell):
    """The last ``kernel_size`` inputs of each token, ``[B, C, T, K]`` (oldest first), as
    ``pad(x, [K-1, 0]).unfold(-1, K, 1)`` reads them, with those inputs as state: a convolution
    whose taps each token computes weighs them in the graph (module docstring)."""

    target = "token_window"

    def __init__(self, spec: CellSpec, kernel_size: int):
        super().__init__(spec, kernel_size)

    def options(self) -> dict[str, Any]:
        return {"kernel_size": self.kernel_size}

    def describe(self) -> str:
        return f"the last {self.kernel_size} tokens' inputs, for a convolution whose taps each token computes"

    def forward(self, x, mask, inputs):
        """``x [B, C, T]``, ``mask``, ``inputs``: (windows ``[B, C, T, K]``, the new inputs)."""
        out, held = carried(x, lambda window: window.unfold(2, self.kernel_size, 1), mask, inputs)
        return out, held.to(inputs.dtype)
