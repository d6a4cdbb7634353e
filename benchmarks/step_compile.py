"""Does ``torch.compile`` make a decode step faster? Eager vs compiled step graph, in one run.

    python benchmarks/step_compile.py CONVERTED_DIR [--context 1024] [--steps 15] [--threads 1]

Times the step graph alone (batch 1, one token, after ``--context`` tokens reached as
``rnnify bench`` does), eager, then compiled (``torch.compile``, static shapes), then eager
again, and prints the medians and the compile time. docs/performance.md quotes its output.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rnnify
from rnnify.bench import fill_state


def median_ms(graph, inputs: tuple, steps: int) -> float:
    with torch.no_grad():
        for _ in range(3):
            graph(*inputs)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            graph(*inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="converted model directory")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = rnnify.load(args.dir)
    state = fill_state(model, args.context, 1, 256)
    ids = torch.tensor([[5]])
    inputs = (ids, state.positions[:, None], torch.ones_like(ids, dtype=torch.bool), *state.tensors)
    eager = median_ms(model.graph, inputs, args.steps)
    start = time.perf_counter()
    compiled = torch.compile(model.graph, dynamic=False)
    with torch.no_grad():
        compiled(*inputs)
    compile_s = time.perf_counter() - start
    fast = median_ms(compiled, inputs, args.steps)
    again = median_ms(model.graph, inputs, args.steps)
    print(f"eager {eager:.2f} ms, compiled {fast:.2f} ms (compile {compile_s:.0f} s), eager again {again:.2f} ms")


if __name__ == "__main__":
    main()
