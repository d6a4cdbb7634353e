"""Recurrent cells: one file per family, each with the equations it implements.

``CELLS`` maps a ``--to`` target name to its cell class. ``HeadSplitCell`` (``"heads"``) is not a
``--to`` target: it holds cells of those targets, one per group of kv heads (``--layers``'s
``heads(...)``), and ``build_cell`` builds it from its saved options.
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
from rnnify.cells.heads import HeadSplitCell
from rnnify.cells.hybrid import HybridCell
from rnnify.cells.linear import LinearCell
from rnnify.cells.select import SelectCell
from rnnify.cells.window import WindowCell
from rnnify.errors import RnnifyError

__all__ = ["CELLS", "Cell", "CellSpec", "HeadSplitCell", "build_cell", "gate_parameters", "parameters"]

CELLS: dict[str, type[Cell]] = {cls.target: cls for cls in (ExactCell, LinearCell, AarenCell, GatedCell, WindowCell, HybridCell, GatedRNNCell,
                                                           DeltaCell, GatedDeltaCell, SelectCell)}


def build_cell(target: str, spec: CellSpec, options: dict[str, Any] | None = None) -> Cell:
    """The cell for ``target`` (or ``"heads"``: a ``HeadSplitCell``); unknown targets or options are a user error."""
    if target not in CELLS and target != HeadSplitCell.target:
        raise RnnifyError(f"unknown target {target!r}; choose from: {', '.join(CELLS)}")
    try:
        return CELLS.get(target, HeadSplitCell)(spec, **(options or {}))
    except (TypeError, ValueError) as exc:
        raise RnnifyError(f"target {target!r}: {exc}") from exc


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
