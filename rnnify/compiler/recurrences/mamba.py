"""Mamba-1's selective scan (Jamba's ``mamba_scan_forward``; Zamba's ``mamba_selective_scan``, once per
Mamba head) as ``rnnify::selective_scan``, carried by ``SelectiveScanCell``.

The source lays the scan's inputs out channels first (x ``[B, D, T]``); the stand-ins hand the op
the cell's layout, tokens second, and give its output back channels first, so the captured graph
holds the transposes around the op and the cell needs no layout of its own.
"""

from __future__ import annotations

import torch

from rnnify.cells.selective_scan import SelectiveScanCell, out_dtype
from rnnify.compiler.recurrences.family import OwnRecurrence, from_zero_state, shape
from rnnify.errors import UnsupportedModelError


@torch.library.custom_op("rnnify::selective_scan", mutates_args=())
def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    dt_bias: torch.Tensor,
) -> torch.Tensor:
    """A whole sequence from the zero state, every token real (the captured graph's own meaning)."""
    cell = SelectiveScanCell(SelectiveScanCell.spec_for(x.shape[-1], B.shape[-1]))
    return from_zero_state(cell, x, dt, A, B, C, D, z, dt_bias)


@selective_scan.register_fake
def _(x, dt, A, B, C, D, z, dt_bias):
    return x.new_empty(x.shape, dtype=out_dtype(x, D, z))


def _scan(x, dt, A, B, C, D, z, dt_bias):
    """The op on the source's layout (x, dt, z ``[B, D, T]``; B, C ``[B, T, N]``), its output ``[B, D, T]``."""
    if D is None or z is None or dt_bias is None:
        raise UnsupportedModelError("a Mamba scan without its skip weights, gate or time-step bias is not supported")
    x, dt, z = (v.transpose(1, 2) for v in (x, dt, z))
    return torch.ops.rnnify.selective_scan(x, dt, A, B, C, D, z, dt_bias).transpose(1, 2)


def _selective_scan_stand_in(
    hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, **kwargs
):
    """``mamba_selective_scan`` without a returned state (the source is captured without a cache)."""
    if not delta_softplus:
        raise UnsupportedModelError("a Mamba scan whose time step takes no softplus is not supported")
    return _scan(hidden_states, dt, A, B.transpose(1, 2), C.transpose(1, 2), D, z, delta_bias)


def _scan_forward_stand_in(module, hidden_states, time_step, B, C, gate, cache, **kwargs):
    """``mamba_scan_forward`` without a cache: the one ``mamba_selective_scan`` it then calls, without
    splitting the tokens for the states a cache keeps."""
    bias = module.dt_proj.bias
    A = -torch.exp(module.A_log.float())
    return _scan(hidden_states, time_step, A, B, C, module.D.float(), gate, None if bias is None else bias.float())


def _cell(args):
    x, B = args[0], args[3]
    return SelectiveScanCell(SelectiveScanCell.spec_for(shape(x)[-1], shape(B)[-1])), tuple(args)


# Jamba's mixer calls ``mamba_scan_forward``, which calls ``mamba_selective_scan``; Zamba's calls the latter per head
MAMBA_SCAN_FORWARD = OwnRecurrence(
    "mamba_scan_forward", _scan_forward_stand_in, torch.ops.rnnify.selective_scan.default, _cell
)
MAMBA_SELECTIVE_SCAN = OwnRecurrence(
    "mamba_selective_scan", _selective_scan_stand_in, torch.ops.rnnify.selective_scan.default, _cell
)
