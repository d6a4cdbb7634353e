"""State bytes per sequence of every target for GPT-2 small (12 layers, 12 heads, head size 64).

    python examples/state_sizes.py

Evaluates the cells' own ``state_nbytes`` (the code the runtime uses), without building the model.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from rnnify.cells import CELLS, CellSpec, build_cell

LAYERS, HEADS, HEAD_DIM, HIDDEN = 12, 12, 64, 768
LENGTHS = (1, 1024, 16384)

# (target, options) rows; every registered target appears at least once.
VARIANTS = [
    ("exact", {}),
    ("window", {"window": 64, "sinks": 4}),
    ("window", {"window": 1024, "sinks": 4}),
    ("window", {"window": 1024, "sinks": 4, "kv_dtype": "int8"}),
    ("linear", {"feature_map": "elu"}),
    ("linear", {"feature_map": "relu"}),
    ("linear", {"feature_map": "performer"}),
    ("linear", {"feature_map": "taylor"}),
    ("linear", {"feature_map": "hedgehog"}),
    ("linear", {"feature_map": "t2r"}),
    ("gated", {"gate": "retnet"}),
    ("gated", {"gate": "gla"}),
    ("gated", {"gate": "gateloop"}),
    ("gated-rnn", {}),
    ("aaren", {}),
    ("hybrid", {"window": 64, "sinks": 0, "feature_map": "elu"}),
    ("hybrid", {"window": 64, "sinks": 4, "feature_map": "elu"}),
    ("hybrid", {"window": 64, "sinks": 0, "feature_map": "hedgehog"}),
    ("hybrid", {"window": 64, "sinks": 0, "memory": "gla", "feature_map": "hedgehog"}),
    ("hybrid", {"window": 64, "sinks": 0, "memory": "gated-delta"}),
    ("delta", {}),
    ("gated-delta", {}),
    ("select", {"window": 64, "sinks": 4, "keep": 64, "chunk": 32}),
    ("lola", {"window": 64, "sinks": 4, "keep": 64, "chunk": 32, "feature_map": "taylor"}),
    ("lola", {"window": 64, "sinks": 4, "keep": 64, "chunk": 32, "feature_map": "hedgehog"}),
]


def main() -> None:
    missing = set(CELLS) - {target for target, _ in VARIANTS}
    assert not missing, f"add a row for {missing}"
    spec = CellSpec(HEADS, HEADS, HEAD_DIM, HEAD_DIM, HEAD_DIM**-0.5, hidden_size=HIDDEN)
    table = Table(title="GPT-2 small: state bytes per sequence (fp32 weights), all 12 layers")
    table.add_column("target")
    table.add_column("options")
    for length in LENGTHS:
        table.add_column(f"after {length:,} tokens", justify="right")
    for target, options in VARIANTS:
        cell = build_cell(target, spec, options)
        sizes = (f"{LAYERS * cell.state_nbytes(n, 1, torch.float32):,}" for n in LENGTHS)
        table.add_row(target, " ".join(f"{k}={v}" for k, v in options.items()), *sizes)
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
