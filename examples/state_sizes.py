"""State bytes per sequence of every target for GPT-2 small (12 layers, 12 heads, head size 64).

    python examples/state_sizes.py

Evaluates the cells' own ``state_nbytes`` (the code the runtime uses), without building the model.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from rnnify.cells import CELLS, CellSpec, build_cell

LAYERS, HEADS, HEAD_DIM = 12, 12, 64
LENGTHS = (1, 1024, 16384)


def main() -> None:
    spec = CellSpec(HEADS, HEADS, HEAD_DIM, HEAD_DIM, HEAD_DIM**-0.5)
    table = Table(title="GPT-2 small: state bytes per sequence (fp32), all 12 layers")
    table.add_column("target")
    for length in LENGTHS:
        table.add_column(f"after {length:,} tokens", justify="right")
    for target in CELLS:
        cell = build_cell(target, spec)
        table.add_row(target, *(f"{LAYERS * cell.state_nbytes(n, 1, torch.float32):,}" for n in LENGTHS))
    Console().print(table)


if __name__ == "__main__":
    main()
