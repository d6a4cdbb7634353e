"""One attention cell of a converted model, timed alone: a whole prompt and a decode step.

    python benchmarks/cell_speed.py CONVERTED_DIR [--lengths 256,1024,2048] [--context 256] [--rounds 15]

A whole model's timing on a shared machine moves by more than a change to one cell is worth
(docs/performance.md), so this times the cell by itself, on the very inputs the model gives it:
the cell's call is captured from a prefill of random tokens (the prompt) and from one decode step
after a ``--context``-token prompt (the step), then replayed. Beside each, causal SDPA on the same
q, k and v (the original model's attention: the prompt over every key, the step over a
``--context``-token cache). Figures: the best of ``--rounds`` rounds, each the mean of enough calls
to last about 20 ms, and the aten ops one call dispatches. To compare two checkouts, run the script
from each in turn (``PYTHONPATH=CHECKOUT python CHECKOUT/benchmarks/cell_speed.py ...``), alternating.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import rnnify
from rnnify.bench import OpCount
from rnnify.runtime.threads import set_threads


def _captured(model, cell: torch.nn.Module, run) -> tuple[tuple, dict]:
    """The arguments ``cell`` is called with while ``run()`` runs the model (its first call)."""
    calls = []
    handle = cell.register_forward_pre_hook(lambda _, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return calls[0]


def _best_ms(fn, rounds: int) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < 0.02:
        fn()
        calls += 1
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def _ops(fn) -> int:
    count = OpCount()
    with count:
        fn()
    return count.ops


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def measure(model, layer: int, lengths: list[int], context: int, rounds: int) -> list[dict]:
    cell = model.cells[layer]
    vocab = model.manifest.vocab_size
    rows = []
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
            args, kwargs = _captured(model, cell, lambda: model.prefill(ids))
            q, k, v = args[:3]
            call = lambda: cell(*args, **kwargs)  # noqa: E731
            rows.append(
                {
                    "phase": "prompt",
                    "tokens": length,
                    "cell_ms": _best_ms(call, rounds),
                    "ops": _ops(call),
                    "sdpa_ms": _best_ms(_sdpa(q, k, v, True), rounds),
                }
            )
        ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(context))
        _, state = model.prefill(ids)
        args, kwargs = _captured(model, cell, lambda: model.step(ids[:, -1:], state))
        q = args[0]
        cache = torch.randn(1, args[1].shape[1], context + 1, args[1].shape[3])
        call = lambda: cell(*args, **kwargs)  # noqa: E731
        rows.append(
            {
                "phase": "step",
                "tokens": context,
                "cell_ms": _best_ms(call, rounds),
                "ops": _ops(call),
                "sdpa_ms": _best_ms(_sdpa(q, cache, cache, False), rounds),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converted", help="converted model directory")
    parser.add_argument("--layer", type=int, default=0, help="which cell (default: the first)")
    parser.add_argument("--lengths", default="256,1024,2048", help="prompt lengths")
    parser.add_argument("--context", type=int, default=256, help="tokens before the decode step")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before / after)")
    parser.add_argument("--json", help="append the run to this JSON file (a list of runs)")
    args = parser.parse_args()
    set_threads(args.threads)
    model = rnnify.load(args.converted, aot_step=False)  # the cells run inside the graph, where the hooks see them
    lengths = [int(x) for x in args.lengths.split(",") if x]
    rows = measure(model, args.layer, lengths, args.context, args.rounds)
    cell = model.cells[args.layer]
    print(f"{args.label or args.converted}: cell {args.layer} ({type(cell).__name__}), {args.threads} thread(s)")
    print("| phase | tokens | cell ms | ops | SDPA ms | cell / SDPA |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['phase']} | {row['tokens']:,} | {row['cell_ms']:.3f} | {row['ops']} | {row['sdpa_ms']:.3f} | "
            f"{row['cell_ms'] / row['sdpa_ms']:.2f} |"
        )
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text()) if path.exists() else []
        runs.append(
            {
                "command": " ".join(["python", "benchmarks/cell_speed.py", *sys.argv[1:]]),
                "label": args.label,
                "rnnify": str(Path(rnnify.__file__).parent),
                "threads": args.threads,
                "cell": type(cell).__name__,
                "rows": rows,
            }
        )
        path.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
