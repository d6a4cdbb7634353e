"""bf16 against fp32 on the CPU: decode and prefill speed, and what the rounding costs on held-out text.

    python examples/stdlib_corpus.py data/
    python benchmarks/bf16.py --model examples/models/stdlib-llama --data data/heldout \\
        --json benchmarks/results/bf16-cpu.json

Each target is converted twice from the same model, ``--dtype float32`` and ``--dtype bfloat16``
(weights in the dtype, the cells' states that accumulate in fp32 either way). Speed, one thread,
batch 1: a decode step after a context of ``--context`` tokens (reached as ``rnnify bench`` does,
``rnnify.bench.fill_state``), and one prefill call of ``--prefill`` tokens. Both are timed in this
process's CPU time (``time.process_time``), which, with one thread, other jobs on a shared machine
barely move, and in wall time; the medians are reported. Accuracy: ``rnnify.evaluate`` of the bf16
model against the fp32 one on ``--data``: KL(fp32 || bf16) per token, top-1 agreement, and both
perplexities.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rnnify  # noqa: E402
from rnnify.bench import FILL_TOKENS, fill_state, machine  # noqa: E402

DTYPES = ("float32", "bfloat16")


def timed(fn: Callable[[], object], repeat: int, warmup: int) -> tuple[float, float]:
    """Median (CPU seconds, wall seconds) of ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    cpu, wall = [], []
    for _ in range(repeat):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


@torch.no_grad()
def speed(model, context: int, prefill: int, steps: int, repeat: int) -> dict:
    """Decode ms/token after ``context`` tokens and prefill tokens/s of ``prefill`` tokens, batch 1."""
    holder = [fill_state(model, context, 1, FILL_TOKENS)]
    token = torch.tensor([[1]])

    def step() -> None:
        _, holder[0] = model.step(token, holder[0])

    step_cpu, step_wall = timed(step, steps, warmup=3)
    ids = torch.randint(0, model.manifest.vocab_size, (1, prefill), generator=torch.Generator().manual_seed(0))
    prefill_cpu, prefill_wall = timed(lambda: model.prefill(ids), repeat, warmup=1)
    return {
        "decode_ms_cpu": step_cpu * 1e3,
        "decode_ms_wall": step_wall * 1e3,
        "prefill_tokens_per_s_cpu": prefill / prefill_cpu,
        "prefill_tokens_per_s_wall": prefill / prefill_wall,
    }


def parse_target(text: str) -> tuple[str, str, dict]:
    """``NAME`` or ``NAME=TARGET,key=value,...`` (values as JSON where they parse)."""
    name, _, spec = text.partition("=")
    if not spec:
        return name, name, {}
    target, *pairs = spec.split(",")
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return name, target, options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, help="held-out text (file, folder or .jsonl)")
    p.add_argument(
        "--targets",
        nargs="+",
        default=["exact", "gated=gated,gate=gla", "hybrid=hybrid,window=64,sinks=0,feature_map=elu"],
        help="NAME or NAME=TARGET,key=value,... (default: exact, gated with the gla gate, hybrid)",
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per evaluated row (default: 256)")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens evaluated (default: 16384)")
    p.add_argument("--context", type=int, default=256, help="context before the timed decode steps (default: 256)")
    p.add_argument("--prefill", type=int, default=1024, help="tokens of the timed prefill (default: 1024)")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps (default: 50)")
    p.add_argument("--repeat", type=int, default=3, help="timed prefills (default: 3)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.disable_progress_bar()
    result = {
        "command": "python " + " ".join(["benchmarks/bf16.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": vars(machine(torch.device("cpu"))),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "rows": [],
    }
    console = Console()
    for name, target, options in map(parse_target, args.targets):
        models = {dtype: rnnify.convert(args.model, to=target, dtype=dtype, **options) for dtype in DTYPES}
        timing = {
            dtype: speed(model, args.context, args.prefill, args.steps, args.repeat) for dtype, model in models.items()
        }
        ev = rnnify.evaluate(
            models["bfloat16"],
            args.data,
            against=models["float32"],
            seq_len=args.seq_len,
            max_tokens=args.max_tokens,
            progress=True,
        )
        row = {
            "name": name,
            "target": target,
            "options": options,
            "tokens": ev.tokens,
            "perplexity_fp32": ev.teacher_perplexity,
            "perplexity_bf16": ev.perplexity,
            "perplexity_ratio": ev.perplexity / ev.teacher_perplexity,
            "kl_fp32_bf16": ev.kl,
            "top1_agreement": ev.top1_agreement,
            "state_bytes": {dtype: model.state_nbytes(args.seq_len) for dtype, model in models.items()},
            **{f"{key}_{dtype}": value for dtype, t in timing.items() for key, value in t.items()},
        }
        result["rows"].append(row)
        console.print(row)
        del models
    table = Table(title=f"bf16 vs fp32, batch 1, {result['threads']} thread(s), CPU time")
    for column in (
        "target",
        "decode ms fp32",
        "decode ms bf16",
        "prefill tok/s fp32",
        "prefill tok/s bf16",
        "ppl fp32",
        "ppl bf16",
        "ratio",
        "KL",
        "top-1",
    ):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(
            r["name"],
            f"{r['decode_ms_cpu_float32']:.2f}",
            f"{r['decode_ms_cpu_bfloat16']:.2f}",
            f"{r['prefill_tokens_per_s_cpu_float32']:.0f}",
            f"{r['prefill_tokens_per_s_cpu_bfloat16']:.0f}",
            f"{r['perplexity_fp32']:.3f}",
            f"{r['perplexity_bf16']:.3f}",
            f"{r['perplexity_ratio']:.4f}",
            f"{r['kl_fp32_bf16']:.2e}",
            f"{r['top1_agreement']:.1%}",
        )
    console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
