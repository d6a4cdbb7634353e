"""``rnnify info``: what a converted model directory holds, and its recurrent state per layer."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rnnify.cli.common import add_dir, load, nbytes, printable

if TYPE_CHECKING:
    from rich.console import Console

_LENGTHS = (1, 1024, 16384)  # context lengths at which the state size is shown

HELP = "describe a converted model: source, target, positions, state size per layer"
DESCRIPTION = (
    "Print what DIR holds: its source model, target cell and options, dtype, the versions "
    "it was converted with, how it encodes positions, and the recurrent state per layer at "
    f"{', '.join(map(str, _LENGTHS))} tokens."
)
COMPUTES = False  # no --threads: it reads DIR and computes nothing
add_arguments = add_dir


def run(args: argparse.Namespace, console: Console) -> int:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from rnnify.runtime.step_cache import describe

    model = load(args)
    manifest = model.manifest
    # the options of the first cell the target made (of its kind, with the options it was given: not
    # a layer rule's) show the defaults it filled in; where rules made every cell, the options given
    given = manifest.options or {}
    first = next(
        (
            entry
            for entry in manifest.cells
            if entry.target == manifest.target and all(entry.options.get(k) == v for k, v in given.items())
        ),
        None,
    )
    options = first.options if first is not None else given
    positions = manifest.positions
    if positions.get("kind") == "learned":
        where = f"learned, {positions.get('limit')} positions (cannot decode past them)"
    else:
        limit = positions.get("limit")
        where = f"{positions.get('kind', 'unknown')}" + (f", trained up to {limit} positions" if limit else "")
    if positions.get("graph_limit") is not None:
        where += f"; its graph holds for {positions['graph_limit']} tokens (cannot decode past them)"
    fused_ops = ["\n".join(f"{phase} {op}" for phase, op in entry.kernels.items()) for entry in manifest.cells]
    same_ops = len(set(fused_ops)) == 1  # then said once, above the table
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold", no_wrap=True)
    header.add_column(overflow="fold")
    rows = {
        "directory": str(model.path),
        "source": manifest.source or "(unknown)",
        "target": manifest.target + (" (" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")" if options else ""),
        **({"layers": ", ".join(manifest.layers)} if manifest.layers else {}),
        "dtype": manifest.dtype,
        "vocab size": str(manifest.vocab_size),
        "positions": where,
        "kernels": _kernels_line(model),
        "decode step": describe(model, args.trust_compiled_step),
        "digest": (manifest.digest or "none (saved by an older rnnify)") + ("" if args.verify else " (not checked)"),
        **({"fused ops": f"{', '.join(fused_ops[0].splitlines())} (every layer)"} if same_ops and fused_ops[0] else {}),
        "converted with": ", ".join(f"{k} {v}" for k, v in manifest.versions.items()) or "(unknown)",
    }
    for key, value in rows.items():
        header.add_row(key, Text(printable(value)))  # the manifest's words: anyone may have written them
    console.print(header)

    windowed = any(cell.spec.keys_read is not None for cell in model.cells)
    notes = any(cell.describe() for cell in model.cells)
    fused = any(fused_ops) and not same_ops
    chunked = any(cell.spec.chunk is not None for cell in model.cells)
    columns = ["layer", "module path", "cell", "heads (kv) × dim"]
    columns += ["window / chunk" if chunked else "window"] if windowed else []
    columns += (["notes"] if notes else []) + (["fused ops"] if fused else [])
    lengths = " / ".join(f"{length:,}" for length in _LENGTHS)
    table = Table(
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
        title=f"recurrent state per sequence after {lengths} tokens",
    )
    for column in columns:  # names wrap at spaces and fold where they must, never cut short
        text = column in ("module path", "cell", "notes", "fused ops")
        table.add_column(column, justify="left" if text else "right", overflow="fold")
    for length in _LENGTHS:
        table.add_column(f"{length:,}", justify="right")
    for entry, cell, ops in zip(manifest.cells, model.cells, fused_ops):
        spec = cell.spec
        row = [str(entry.layer), Text(printable(entry.module_path)), Text(printable(entry.target))]
        row.append(f"{spec.num_heads} ({spec.num_kv_heads}) × {spec.head_dim}")
        if windowed:
            row.append("" if spec.keys_read is None else str(spec.window or f"chunk {spec.chunk}"))
        if notes:
            row.append(Text(cell.describe()))
        if fused:
            row.append(Text(ops or "-"))
        table.add_row(*row, *(nbytes(cell.state_nbytes(length, 1, model.dtype)) for length in _LENGTHS))
    table.add_section()
    table.add_row("total", *[""] * (len(columns) - 1), *(nbytes(model.state_nbytes(length)) for length in _LENGTHS))
    console.print(table)
    console.print(Text(_memory_line(model), "bold"), soft_wrap=True)
    return 0


def _kernels_line(model) -> str:
    """The backend of the fused ops and how many layers run them, in words."""
    if model.kernels == "none":
        return "none: every cell runs its own PyTorch forms"
    meaning = {
        "auto": " (Triton on CUDA; elsewhere, per phase, the faster of the ops' PyTorch reference and the cell's form)",
        "reference": " (the ops' PyTorch references)",
    }
    count = sum(bool(entry.kernels) for entry in model.manifest.cells)
    return f"{model.kernels}{meaning.get(model.kernels, '')}; fused ops in {count} of {len(model.cells)} layers"


def _memory_line(model) -> str:
    """Whether the state grows with the context, in words."""
    if not model.constant_memory:
        per_token = model.state_nbytes(1025) - model.state_nbytes(1024)
        return f"state grows with context, like a KV cache: {nbytes(per_token)} per token per sequence"
    if any(cell.spec.keys_read is not None for cell in model.cells if cell.grows_with_context):
        return "state is constant once the model's sliding window or chunk is full: memory does not grow with context"
    return "state is constant: memory does not grow with context"
