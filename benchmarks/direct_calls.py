"""What do direct torch calls save an eager step? The graph module against ``direct_forward``, in one run.

    python benchmarks/direct_calls.py CONVERTED_DIR [...] [--context 256] [--batch 1,8]
        [--rounds 7] [--steps 50] [--threads 1] [--json FILE]

For each model and batch size: one decode step (after ``--context`` tokens, as ``rnnify bench``
fills a state) through ``model.graph`` (the aten overloads export wrote) and through
``rnnify.runtime.direct_calls.direct_forward`` (what ``prefill``/``step`` run since), alternating
the two every round so that both see the same load; the best round of each, in ms a step.
docs/performance.md ("Direct calls") quotes its output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import rnnify
from rnnify.bench import fill_state
from rnnify.runtime.direct_calls import DIRECT, direct_forward


def ms_per_call(call, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        call()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="converted model directories")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50, help="steps timed per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for directory in args.dirs:
        model = rnnify.load(directory)
        graph, direct = model.graph, direct_forward(model.graph)
        rewritten = sum(n.op == "call_function" and n.target in DIRECT for n in graph.graph.nodes)
        for batch in (int(b) for b in args.batch.split(",")):
            state = fill_state(model, args.context, batch, 256)
            ids = torch.full((batch, 1), 5)
            inputs = (ids, state.positions[:, None], torch.ones_like(ids, dtype=torch.bool), *state.tensors)
            times: dict[str, list[float]] = {"module": [], "direct": []}
            with torch.no_grad():
                for a, b in zip(graph(*inputs), direct(graph, *inputs)):
                    assert torch.equal(a, b), "direct calls changed the step's output"
                for _ in range(args.rounds):
                    times["module"].append(ms_per_call(lambda: graph(*inputs), args.steps))
                    times["direct"].append(ms_per_call(lambda: direct(graph, *inputs), args.steps))
            module_ms, direct_ms = min(times["module"]), min(times["direct"])
            rows.append(
                {
                    "model": directory,
                    "target": model.manifest.target,
                    "batch": batch,
                    "context": args.context,
                    "rewritten_calls": rewritten,
                    "module_ms": module_ms,
                    "direct_ms": direct_ms,
                    "rounds": times,
                }
            )
            print(
                f"{directory} ({model.manifest.target}) batch {batch} @ {args.context}: module {module_ms:.3f} ms, "
                f"direct {direct_ms:.3f} ms, {module_ms / direct_ms:.3f}x ({rewritten} calls rewritten)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(["python", "benchmarks/direct_calls.py", *sys.argv[1:]]),
                    "threads": args.threads,
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
