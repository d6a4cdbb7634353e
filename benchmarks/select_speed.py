"""Decode step time of converted models side by side, after a long prompt: does selection slow decoding?

    python benchmarks/select_speed.py window=DIR select=DIR [NAME=DIR ...] --context 8192 --threads 1 \
        --json benchmarks/results/select-speed-smollm2-8192.json

Each model reads the same random ``--context``-token prompt (one prefill), then the models take
turns: a round is ``--steps`` greedy decode steps of each model in turn (a multiple of the
selection chunk, so every round holds the same number of boundary decisions), and a model's figure
is the median over ``--rounds`` rounds of its mean step time. Taking turns within one process
exposes every model to the same load on a shared machine, which timing them one after the other
does not. The first model is the reference of the ratio column.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import rnnify
from rnnify.runtime.threads import set_threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", metavar="NAME=DIR", help="converted model directories, named")
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per model per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    named = [spec.split("=", 1) for spec in args.models]
    models = {name: rnnify.load(path) for name, path in named}
    vocab = min(m.manifest.vocab_size for m in models.values())
    prompt = torch.randint(0, vocab, (1, args.context), generator=torch.Generator().manual_seed(0))
    states, tokens = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            start = time.perf_counter()
            logits, state = model.prefill(prompt)
            print(f"{name}: prefill of {args.context:,} tokens in {time.perf_counter() - start:.1f} s", flush=True)
            states[name], tokens[name] = state, logits[:, -1:].argmax(-1)
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                state, token = states[name], tokens[name]
                start = time.perf_counter()
                for _ in range(args.steps):
                    logits, state = model.step(token, state)
                    token = logits[:, -1:].argmax(-1)
                times[name].append((time.perf_counter() - start) / args.steps)
                states[name], tokens[name] = state, token
    reference = statistics.median(times[named[0][0]])
    rows = []
    print(f"{'model':>12} {'state':>12} {'ms/step':>9} {'ratio':>6}")
    for name, model in models.items():
        median = statistics.median(times[name])
        rows.append(
            {
                "name": name,
                "dir": str(model.path),
                "target": model.target,
                "state_bytes": model.state_nbytes(args.context),
                "ms_per_step": median * 1e3,
                "ratio": median / reference,
                "rounds_ms": [t * 1e3 for t in times[name]],
            }
        )
        print(f"{name:>12} {rows[-1]['state_bytes']:>12,} {median * 1e3:>9.2f} {median / reference:>6.2f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "context": args.context,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "threads": args.threads,
                    "torch": torch.__version__,
                    "models": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
