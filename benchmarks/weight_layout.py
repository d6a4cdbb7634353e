"""How fast a model's ``linear`` weights stream in each memory layout, at decode's few rows.

    python benchmarks/weight_layout.py /tmp/ds/gpt2-linear /tmp/ds/smol-hybrid \\
        --json benchmarks/results/weight-layout-cpu.json

For each converted model directory: every distinct weight its graph's ``aten.linear`` calls read,
called once each in graph order on ``--batch`` rows of random input, as a decode step reads them
(the head alone too), in float32 and bfloat16, with the weights stored three ways: row-major
([out, in] contiguous, as checkpoints hold them), all column-major (the transpose of a contiguous
[in, out] matrix), and as rnnify keeps them (``rnnify.runtime.weight_layout.laid_out``: float32
heads column-major with padded columns, the rest row-major). One thread; best of ``--repeats``
passes after one warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import timeit
from functools import reduce
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rnnify  # noqa: E402
from rnnify.bench import machine  # noqa: E402
from rnnify.runtime.weight_layout import TALL, linear_weight_names  # noqa: E402
from rnnify.runtime.weight_layout import laid_out as rnnify_layout  # noqa: E402

LAYOUTS = ("row-major", "column-major", "rnnify")
DTYPES = ("float32", "bfloat16")


def linear_weights(path: str) -> list[torch.Tensor]:
    """The distinct weights the model's ``aten.linear`` calls read, in graph order, row-major."""
    graph = rnnify.load(path, aot_step=False).graph
    return [reduce(getattr, name.split("."), graph).detach().contiguous() for name in linear_weight_names(graph)]


def laid_out(weight: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    weight = weight.to(dtype).contiguous()
    return {"row-major": weight, "column-major": weight.t().contiguous().t(), "rnnify": rnnify_layout(weight)}[layout]


def _parts(weights: list[torch.Tensor]) -> list[tuple[str, list[torch.Tensor]]]:
    """Every linear weight, and the heads alone (at least ``TALL`` times taller than wide)."""
    heads = [w for w in weights if w.shape[0] >= TALL * w.shape[1]]
    return [("all", weights)] + ([("heads", heads)] if heads else [])


def stream_ms(weights: list[torch.Tensor], batch: int, repeats: int) -> float:
    """Best time of one pass of ``linear`` over every weight, in ms."""
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}

    def one_pass() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    one_pass()
    return min(timeit.repeat(one_pass, number=1, repeat=repeats)) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="converted model directories")
    parser.add_argument("--batch", default="1,8", help="rows of input per call (comma-separated)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for path, part, weights in [
        (path, part, chosen) for path in args.models for part, chosen in _parts(linear_weights(path))
    ]:
        for dtype_name in DTYPES:
            dtype = getattr(torch, dtype_name)
            nbytes = sum(w.numel() for w in weights) * dtype.itemsize
            for batch in (int(b) for b in args.batch.split(",")):
                ms = {
                    layout: stream_ms([laid_out(w, layout, dtype) for w in weights], batch, args.repeats)
                    for layout in LAYOUTS
                }
                rows.append(
                    {
                        "model": path,
                        "weights": part,
                        "linears": len(weights),
                        "bytes": nbytes,
                        "dtype": dtype_name,
                        "batch": batch,
                        **{f"{layout}_ms": v for layout, v in ms.items()},
                    }
                )
    table = Table(title="linear weights streamed once, 1 thread (ms, lower is better)")
    for column in ("model", "weights", "dtype", "batch", *LAYOUTS, "row / rnnify"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for row in rows:
        table.add_row(
            Path(row["model"]).name,
            f"{row['weights']}: {row['linears']} ({row['bytes'] / 2**20:.0f} MiB)",
            row["dtype"],
            str(row["batch"]),
            *(f"{row[f'{layout}_ms']:.2f}" for layout in LAYOUTS),
            f"{row['row-major_ms'] / row['rnnify_ms']:.2f}",
        )
    Console(width=150).print(table)
    if args.json:
        info = machine(torch.device("cpu"))
        args.json.write_text(
            json.dumps(
                {"command": "python " + " ".join(sys.argv), "machine": dataclasses.asdict(info), "rows": rows}, indent=1
            )
        )


if __name__ == "__main__":
    main()
