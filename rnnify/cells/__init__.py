"""Recurrent cells: one file per family, each with the equations it implements.

``CELLS`` (``cells/registry.py``) maps a ``--to`` target name to its cell class. Other cells are
not ``--to`` targets, and ``build_cell`` builds them from their saved options too:
``HeadSplitCell`` (``"heads"``) holds cells of those targets, one per group of kv heads
(``--layers``'s ``heads(...)``), and the ``Cell.own_layer`` cells (``OWN_LAYERS``) carry a model's
own recurrent layers, which stay as they are whatever the attention becomes: ``ShortConvCell``
(``"short_conv"``), ``SSDCell`` (``"ssd"``, Mamba-2), ``SelectiveScanCell`` (``"selective_scan"``,
Mamba-1), ``GatedDeltaRuleCell`` (``"gated_delta_rule"``, Gated DeltaNet),
``KimiDeltaAttentionCell`` (``"kda"``, Kimi Delta Attention), ``RGLRUCell`` (``"rg_lru"``,
Griffin's RG-LRU), ``LightningAttentionCell`` (``"lightning_attention"``, MiniMax),
``TokenShiftCell`` (``"token_shift"``, ZAYA's delayed values) and ``TokenWindowCell``
(``"token_window"``, the inputs of Inkling 2's convolutions whose taps each token computes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.gated_delta import GatedDeltaRuleCell
from rnnify.cells.heads import HeadSplitCell
from rnnify.cells.kda import KimiDeltaAttentionCell
from rnnify.cells.lightning import LightningAttentionCell
from rnnify.cells.registry import CELLS, build_target_cell, construct
from rnnify.cells.rg_lru import RGLRUCell
from rnnify.cells.selective_scan import SelectiveScanCell
from rnnify.cells.short_conv import ShortConvCell, TokenWindowCell
from rnnify.cells.ssd import SSDCell
from rnnify.cells.token_shift import TokenShiftCell

__all__ = [
    "CELLS",
    "Cell",
    "CellSpec",
    "GatedDeltaRuleCell",
    "HeadSplitCell",
    "KimiDeltaAttentionCell",
    "LightningAttentionCell",
    "OWN_LAYERS",
    "RGLRUCell",
    "SSDCell",
    "SelectiveScanCell",
    "ShortConvCell",
    "TokenWindowCell",
    "TokenShiftCell",
    "build_cell",
    "gate_parameters",
    "parameters",
]

_NOT_TARGETS: dict[str, type[Cell]] = {
    cls.target: cls
    for cls in (
        HeadSplitCell,
        ShortConvCell,
        SSDCell,
        GatedDeltaRuleCell,
        KimiDeltaAttentionCell,
        SelectiveScanCell,
        RGLRUCell,
        LightningAttentionCell,
        TokenShiftCell,
        TokenWindowCell,
    )
}
# targets of the cells that carry a model's own recurrent layers (``Cell.own_layer``), as manifests name them
OWN_LAYERS = frozenset(target for target, cls in _NOT_TARGETS.items() if cls.own_layer)


def build_cell(target: str, spec: CellSpec, options: dict[str, Any] | None = None) -> Cell:
    """The cell for ``target`` (or one of the cells that are not ``--to`` targets: ``"heads"`` and
    ``OWN_LAYERS``); unknown targets or options are a user error."""
    if target in _NOT_TARGETS:
        return construct(_NOT_TARGETS[target], target, spec, options)
    return build_target_cell(target, spec, options)


def parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """The trainable parameters of every cell in ``module`` (and nothing else), each once (a
    ``HeadSplitCell``'s parts are cells inside a cell)."""
    seen: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, Cell):
            for parameter in sub.parameters():
                if id(parameter) not in seen:
                    seen.add(id(parameter))
                    yield parameter


def gate_parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """The ``Cell.gates`` parameters of every cell in ``module``: the per-head scalars that weigh a
    cell's parts (distillation trains them at a multiple of the stage's rate)."""
    for sub in module.modules():
        if isinstance(sub, Cell):
            for name in sub.gates:
                parameter = getattr(sub, name, None)  # e.g. the window share, which a delta memory lacks
                if isinstance(parameter, nn.Parameter):
                    yield parameter
