"""Recurrent cells: one file per family, each with the equations it implements.

``CELLS`` (``cells/registry.py``) maps a ``--to`` target name to its cell class. Two cells are not
``--to`` targets, and ``build_cell`` builds them from their saved options too: ``HeadSplitCell``
(``"heads"``) holds cells of those targets, one per group of kv heads (``--layers``'s
``heads(...)``), and ``ShortConvCell`` (``"short_conv"``) carries a model's own short convolution
layers, which stay as they are whatever the attention becomes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.heads import HeadSplitCell
from rnnify.cells.registry import CELLS, build_target_cell, construct
from rnnify.cells.short_conv import ShortConvCell

__all__ = [
    "CELLS",
    "Cell",
    "CellSpec",
    "HeadSplitCell",
    "ShortConvCell",
    "build_cell",
    "gate_parameters",
    "parameters",
]

_NOT_TARGETS: dict[str, type[Cell]] = {cls.target: cls for cls in (HeadSplitCell, ShortConvCell)}


def build_cell(target: str, spec: CellSpec, options: dict[str, Any] | None = None) -> Cell:
    """The cell for ``target`` (or one of the cells that are not ``--to`` targets: ``"heads"``,
    ``"short_conv"``); unknown targets or options are a user error."""
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
