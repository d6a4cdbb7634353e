"""A decode step that writes its state in place (``step(donate=True)``) against the steps that copy it.

    python benchmarks/donated_step.py models/smol-auto --batches 1,8,32 --threads 1

A window's decode step writes one token into its ring; a step that returns a new state copies the
whole ring to do so, a step given the state to overwrite (``RecurrentModel.step(donate=True)``)
writes that one slot. The in-place step runs eagerly: a step compiled ahead of time
(``rnnify compile``) cannot write into its inputs. This times, in one process, rounds taken in turn
(median of ``--rounds``), per batch of sequences that read ``--prompt`` tokens: the compiled step
(where the directory has one in this machine's cache), the eager step that copies, and the eager
step in place. ``IN_PLACE_FROM_ROWS`` in rnnify/runtime/model.py is where the in-place one starts to
win against the compiled one.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from decode_parser import decode_parser
from rich.console import Console
from rich.table import Table

import rnnify
from rnnify.runtime.threads import set_threads

MODES = ("compiled", "eager", "in place")


def _time_steps(model, batch: int, prompt: int, rounds: int, generator: torch.Generator) -> dict[str, float]:
    """Median ms of one decode step of ``batch`` rows, per mode that ``model`` can run."""
    vocab = model.manifest.vocab_size
    package = model._step_package
    states, tokens = {}, torch.randint(0, vocab, (batch, 1), generator=generator)
    modes = [m for m in MODES if m != "compiled" or model.step_package is not None]
    with torch.inference_mode():
        _, state = model.prefill(torch.randint(0, vocab, (batch, prompt), generator=generator))
        for mode in modes:
            states[mode] = type(state)(
                tuple(t.clone() for t in state.tensors), state.positions.clone(), state.model_uid
            )
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for round_ in range(rounds + 1):  # the first round warms up
            for mode in modes:
                model._step_package = package if mode == "compiled" else None
                started = time.perf_counter()
                _, states[mode] = model.step(tokens, states[mode], donate=mode == "in place")
                if round_:
                    times[mode].append(time.perf_counter() - started)
        model._step_package = package
    return {mode: statistics.median(values) * 1e3 for mode, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = decode_parser(__doc__, prompt=512, rounds=7)
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.rounds < 1 or min(batches) < 1:
        parser.error("--rounds and every batch must be at least 1")
    set_threads(args.threads)
    model = rnnify.load(args.model)
    generator = torch.Generator().manual_seed(0)
    table = Table(title=f"{args.model}: one decode step, median ms ({args.threads} thread(s))")
    for column in ("sequences", *MODES, "in place / compiled", "in place / eager"):
        table.add_column(column, justify="right")
    rows = []
    for batch in batches:
        medians = _time_steps(model, batch, args.prompt, args.rounds, generator)
        rows.append({"batch": batch, **medians})
        compiled = medians.get("compiled")
        table.add_row(
            str(batch),
            *(f"{medians[m]:.1f}" if m in medians else "-" for m in MODES),
            f"{medians['in place'] / compiled:.2f}" if compiled else "-",
            f"{medians['in place'] / medians['eager']:.2f}",
        )
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "threads": args.threads, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
