"""Recurrent cells: one file per family, each with the equations it implements.

``CELLS`` maps a ``--to`` target name to its cell class.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch import nn

from rnnify.cells.aaren import AarenCell
from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.delta import DeltaCell, GatedDeltaCell
from rnnify.cells.exact import ExactCell
from rnnify.cells.gated import GatedCell
from rnnify.cells.gated_rnn import GatedRNNCell
from rnnify.cells.hybrid import HybridCell
from rnnify.cells.linear import LinearCell
from rnnify.cells.window import WindowCell
from rnnify.errors import RnnifyError

__all__ = ["CELLS", "Cell", "CellSpec", "build_cell", "parameters"]

CELLS: dict[str, type[Cell]] = {cls.target: cls for cls in (ExactCell, LinearCell, AarenCell, GatedCell, WindowCell, HybridCell, GatedRNNCell,
                                                           DeltaCell, GatedDeltaCell)}


def build_cell(target: str, spec: CellSpec, options: dict[str, Any] | None = None) -> Cell:
    """The cell for ``target``; unknown targets or options are a user error."""
    if target not in CELLS:
        raise RnnifyError(f"unknown target {target!r}; choose from: {', '.join(CELLS)}")
    try:
        return CELLS[target](spec, **(options or {}))
    except (TypeError, ValueError) as exc:
        raise RnnifyError(f"target {target!r}: {exc}") from exc


def parameters(module: nn.Module) -> Iterator[nn.Parameter]:
    """The trainable parameters of every cell in ``module`` (and nothing else)."""
    for sub in module.modules():
        if isinstance(sub, Cell):
            yield from sub.parameters()
