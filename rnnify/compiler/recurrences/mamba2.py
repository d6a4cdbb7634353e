"""Mamba-2's scan (``mamba2_scan_forward``: Granite 4, Bamba, Falcon-H1, Nemotron-H, Zamba2) as
``rnnify::ssd_scan``, carried by ``SSDCell``."""

from __future__ import annotations

import math

import torch

from rnnify.cells.ssd import SSDCell
from rnnify.compiler.recurrences.family import OwnRecurrence, from_zero_state, shape


@torch.library.custom_op("rnnify::ssd_scan", mutates_args=())
def ssd_scan(
    x: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    heads: int,
    groups: int,
    dt_min: float,
    dt_max: float,
) -> torch.Tensor:
    """A whole sequence from the zero state, every token real (the captured graph's own meaning)."""
    cell = SSDCell(SSDCell.spec_for(heads, x.shape[-1] // heads, B.shape[-1] // groups), groups, dt_min, _limit(dt_max))
    return from_zero_state(cell, x, B, C, dt, A_log, D, dt_bias)


@ssd_scan.register_fake
def _(x, B, C, dt, A_log, D, dt_bias, heads, groups, dt_min, dt_max):
    return x.new_empty(x.shape, dtype=torch.float32)


def _limit(dt_max: float) -> float | None:
    """``dt_max`` as SSDCell takes it: None for no upper limit (a custom op's float cannot be None)."""
    return None if math.isinf(dt_max) else dt_max


def _stand_in(mixer, hidden_states, B, C, dt, cache, **kwargs):
    """``mamba2_scan_forward`` without a cache."""
    dt_min, dt_max = (float(limit) for limit in mixer.time_step_limit)
    return torch.ops.rnnify.ssd_scan(
        hidden_states, B, C, dt, mixer.A_log, mixer.D, mixer.dt_bias, mixer.num_heads, mixer.n_groups, dt_min, dt_max
    )


def _cell(args):
    x, B, C, dt, A_log, D, dt_bias, heads, groups, dt_min, dt_max = args
    spec = SSDCell.spec_for(heads, shape(x)[-1] // heads, shape(B)[-1] // groups)
    return SSDCell(spec, groups, dt_min, _limit(dt_max)), (x, B, C, dt, A_log, D, dt_bias)


MAMBA2 = OwnRecurrence("mamba2_scan_forward", _stand_in, torch.ops.rnnify.ssd_scan.default, _cell)
