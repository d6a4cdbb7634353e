"""Recurrent cells: one file per family, each with the equations it implements.

``CELLS`` (``cells/registry.py``) maps a ``--to`` target name to its cell class. ``HeadSplitCell``
(``"heads"``) is not a ``--to`` target: it holds cells of those targets, one per group of kv heads
(``--layers``'s ``heads(...)``), and ``build_cell`` builds it from its saved options.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.heads import HeadSplitCell
from rnnify.cells.registry import CELLS, build_target_cell, construct

__all__ = ["CELLS", "Cell", "CellSpec", "HeadSplitCell", "build_cell", "gate_parameters", "parameters"]


def build_cell(target: str, spec: CellSpec, options: dict[str, Any] | None = None) -> Cell:
    """The cell for ``target`` (or ``"heads"``: a ``HeadSplitCell``); unknown targets or options are a user error."""
    if target == HeadSplitCell.target:
        return construct(HeadSplitCell, target, spec, options)
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
