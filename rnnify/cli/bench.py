"""``rnnify bench``: decode latency, memory and prefill time of a converted model (and of its original
with a KV cache), as tables, JSON and plots."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rnnify import arguments
from rnnify.cli.common import (
    add_device_flag,
    add_dir,
    add_dtype_flag,
    add_eager_step_flag,
    add_kernels_flag,
    check_writable,
    int_list,
    load,
    nbytes,
)
from rnnify.errors import RnnifyError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


HELP = "measure decode latency, memory and prefill time (and against the original with its KV cache)"
DESCRIPTION = (
    "Time decode steps after each context length at each batch size, the state's bytes, "
    "peak memory and prefill time of DIR, and with --against the same for the original model "
    "decoding with transformers' KV cache; and the batch-1 limit set by reading the weights at the "
    "memory bandwidth measured here (rnnify.bench.benchmark). See docs/performance.md for how "
    "contexts are reached."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import (
        BENCH_BATCHES,
        BENCH_CONTEXTS,
        BENCH_PREFILL_MAX,
        BENCH_STEPS,
    )

    add_dir(p)
    add_eager_step_flag(p)
    p.add_argument("--against", metavar="MODEL", help="original model (directory or cached hub id) to compare with")
    p.add_argument("--contexts", default=",".join(map(str, BENCH_CONTEXTS)), metavar="LIST", help="context lengths")
    p.add_argument("--batch", default=",".join(map(str, BENCH_BATCHES)), metavar="LIST", help="batch sizes")
    add_device_flag(p)
    add_dtype_flag(p, None, "dtype; must be the one DIR was converted to (default: DIR's)")
    p.add_argument(
        "--steps",
        type=arguments.at_least(1, "--steps"),
        default=BENCH_STEPS,
        metavar="N",
        help="timed decode steps, median reported",
    )
    p.add_argument(
        "--torch-compile",
        action="store_true",
        help="decode with torch.compile of the step graph, compiled in this process on every run; without "
        "it, a directory whose step was compiled ahead of time (convert --compile, rnnify compile) decodes "
        "with that",
    )
    p.add_argument(
        "--prefill-max",
        type=arguments.at_least(0, "--prefill-max"),
        default=BENCH_PREFILL_MAX,
        metavar="N",
        help="longest context whose prefill is timed, as prefill is slow on a CPU (0: none)",
    )
    p.add_argument("--json", metavar="OUT", help="write the results and the machine to OUT as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write latency and memory vs context plots to OUT.png")
    add_kernels_flag(p)


def run(args: argparse.Namespace, console: Console) -> int:
    import shlex

    from rich.text import Text

    from rnnify.bench import benchmark, check_plot, plot
    from rnnify.eval import write_json

    contexts, batches = int_list("--contexts", args.contexts), int_list("--batch", args.batch, "1,8")
    check_writable("--json", args.json)
    check_writable("--plot", args.plot)
    if args.plot is not None:
        check_plot(args.plot)
    result = benchmark(
        load(args),
        contexts,
        batches,
        against=args.against,
        dtype=args.dtype,
        steps=args.steps,
        prefill_max=args.prefill_max,
        compile=args.torch_compile,
        command="rnnify " + shlex.join(args.argv),
        progress=True,
    )
    for table in _bench_tables(result):
        console.print(table)
    console.print(_prefill_table(result, args.prefill_max))
    step = next((r.step_ms for r in result.results if r.model == "converted" and r.batch == 1), None)
    line = (
        f"batch-1 limit: {nbytes(result.weight_bytes)} of weights per token / "
        f"{result.machine.bandwidth_gb_s:.1f} GB/s measured = {result.limit_ms:.2f} ms"
    )
    if step is not None:
        line += f"; measured step {step:.2f} ms = {step / result.limit_ms:.2f}x the limit"
    console.print(Text(line), soft_wrap=True)
    for warning in result.warnings:  # also in --json
        console.print(Text(f"warning: {warning}", "yellow"), soft_wrap=True)
    if args.json is not None:
        write_json(args.json, result.to_json())
    if args.plot is not None:
        try:
            plot(result, args.plot)
        except OSError as exc:
            raise RnnifyError(f"cannot write {args.plot}: {exc.strerror or exc}") from exc
    return 0


def _bench_tables(result) -> list[Table]:
    """The converted model's decode table and, with ``--against``, the original's beside its ratios:
    two tables of a width a terminal holds, rather than one rich would cut numbers of."""
    rows = {(r.batch, r.context, r.model): r for r in result.results}
    ours = [
        [
            str(b),
            f"{c:,}",
            f"{r.step_ms:.2f}",
            f"{r.tokens_per_s:.1f}",
            nbytes(r.memory_bytes),
            nbytes(r.peak_delta_bytes),
        ]
        for (b, c, model), r in rows.items()
        if model == "converted"
    ]
    tables = [
        _table(
            f"decode, {result.target}, {result.dtype}, {result.machine.device}",
            ["batch", "context", "step ms", "tokens/s", "state", "peak +"],
            ours,
        )
    ]
    theirs = [
        [
            str(b),
            f"{c:,}",
            f"{o.step_ms:.2f}",
            f"{o.tokens_per_s:.1f}",
            nbytes(o.memory_bytes),
            nbytes(o.peak_delta_bytes),
            f"{o.step_ms / r.step_ms:.2f}x",
            f"{o.memory_bytes / r.memory_bytes:.1f}x",
        ]
        for (b, c, model), r in rows.items()
        if model == "converted" and (o := rows.get((b, c, "original"))) is not None
    ]
    if theirs:
        columns = ["batch", "context", "step ms", "tokens/s", "KV cache", "peak +", "speedup", "KV / state"]
        title = (
            f"decode, original with KV cache, {result.dtype}; speedup = original ms / {result.target} ms, "
            f"KV / state = KV cache / {result.target} state"
        )
        tables.append(_table(title, columns, theirs))
    return tables


def _table(title: str, columns: list[str], rows: list[list[str]]) -> Table:
    """A right-justified table whose columns are never narrower than their values or a word of their
    header (a header wraps between words)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, title=Text(title), pad_edge=False, collapse_padding=True)
    for i, column in enumerate(columns):
        widest = max([len(row[i]) for row in rows] + [len(word) for word in column.split()])
        table.add_column(column, justify="right", min_width=widest)
    for row in rows:
        table.add_row(*row)
    return table


def _prefill_table(result, cap: int) -> Table:
    contexts = sorted({c for times in result.prefill_ms.values() for c in times})
    rows = [[f"{c:,}", *(f"{times[c]:.0f}" for times in result.prefill_ms.values())] for c in contexts]
    columns = ["context", *(f"{name} ms" for name in result.prefill_ms)]
    return _table(f"prefill, batch 1, one call (contexts up to {cap:,})", columns, rows)
