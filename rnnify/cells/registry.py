"""The ``--to`` targets by name, and building a cell of one.

Apart from the package's ``__init__`` so that ``HeadSplitCell`` (``cells/heads.py``), which builds
a cell of one of these targets per group of kv heads, imports them without importing the package
that imports it: no import cycle, not even a lazy one inside a function.
"""

from __future__ import annotations

from typing import Any

from rnnify.cells.aaren import AarenCell
from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.delta import DeltaCell, GatedDeltaCell
from rnnify.cells.exact import ExactCell
from rnnify.cells.gated import GatedCell
from rnnify.cells.gated_rnn import GatedRNNCell
from rnnify.cells.hybrid import HybridCell
from rnnify.cells.linear import LinearCell
from rnnify.cells.lola import LolaCell
from rnnify.cells.select import SelectCell
from rnnify.cells.window import WindowCell
from rnnify.errors import RnnifyError

CELLS: dict[str, type[Cell]] = {
    cls.target: cls
    for cls in (
        ExactCell,
        LinearCell,
        AarenCell,
        GatedCell,
        WindowCell,
        HybridCell,
        GatedRNNCell,
        DeltaCell,
        GatedDeltaCell,
        SelectCell,
        LolaCell,
    )
}


def construct(cls: type[Cell], target: str, spec: CellSpec, options: dict[str, Any] | None) -> Cell:
    """``cls(spec, **options)``; a bad option is a user error that names ``target``."""
    try:
        return cls(spec, **(options or {}))
    except (TypeError, ValueError) as exc:
        raise RnnifyError(f"target {target!r}: {exc}") from exc


def build_target_cell(target: str, spec: CellSpec, options: dict[str, Any] | None = None) -> Cell:
    """The cell of the ``--to`` target ``target``; an unknown target is a user error."""
    return construct(CELLS[check_target(target)], target, spec, options)


def check_target(target: str) -> str:
    """``target`` if it names a cell; else a user error listing those that do, and for ``auto`` (a
    choice of cells per kv head, made from scores on calibration text) where that is made."""
    if target == "auto":
        raise RnnifyError(
            "target 'auto' chooses each kv head's cell from scores on calibration text: call "
            "rnnify.auto.auto_convert(model, data, ...), which `rnnify convert --to auto` runs; "
            f"one cell for every head: {', '.join(CELLS)}"
        )
    if target not in CELLS:
        raise RnnifyError(f"unknown target {target!r}; choose from: {', '.join(CELLS)}")
    return target
