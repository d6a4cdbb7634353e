"""The delta rule on a CPU: chunked prefill against the token loop, and decode against context.

    python benchmarks/delta_cpu.py                       # T = 2048, B = 1, H = 4, D = 64, 1 thread
    python benchmarks/delta_cpu.py --length 4096 --threads 2 --json /tmp/delta.json

Off CUDA the ops run their PyTorch references: ``chunk_delta_rule`` the chunked WY form (the
prefill path of the delta cells) and ``fused_recurrent_delta_rule`` the token loop. Prefill: the
median wall time of ``chunk_delta_rule`` and of ``naive_recurrent_delta_rule`` over the same T
tokens (plain and gated), in CPU seconds of this process, their ratio (the goal: at least 5x at T = 2048) and their largest
output difference. Decode: the time of one ``fused_recurrent_delta_rule`` step from the state a
context of C tokens left, for growing C (the goal: independent of C, the state is
``[B, H, D, D]`` whatever C is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rnnify.kernels as K  # noqa: E402

PREFILL_GOAL = 5.0
DECODE_SPREAD = 1.25  # slowest / fastest step over the contexts still counts as independent of C


def inputs(B: int, T: int, H: int, D: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 4)
    return q, k, v, beta, g


def median_seconds(fn, repeat: int) -> float:
    """Median CPU time of this process per call (``time.process_time``): on a machine other jobs
    share, wall time measures the neighbours as much as the code; with one thread CPU time does not."""
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--length", type=int, default=2048, help="prefill tokens")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384], help="decode contexts")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per prefill row (the median)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, H, D, T = args.batch, args.heads, args.head_dim, args.length
    result = {
        "command": "python " + " ".join(["benchmarks/delta_cpu.py", *sys.argv[1:]]),
        "threads": args.threads,
        "torch": torch.__version__,
        "shape": {"B": B, "H": H, "D": D, "T": T},
        "prefill": [],
        "decode": [],
    }
    console = Console()
    table = Table(title=f"delta rule prefill on CPU, B={B} H={H} D={D} T={T}, {args.threads} thread(s)")
    for col in ("variant", "chunked (CPU s)", "token loop (CPU s)", "speed-up", "max |diff|"):
        table.add_column(col)
    q, k, v, beta, g = inputs(B, T, H, D)
    with torch.no_grad():
        for variant, gate in (("delta", None), ("gated-delta", g)):
            chunked = median_seconds(lambda: K.chunk_delta_rule(q, k, v, beta, gate, backend="reference"), args.repeat)
            loop = median_seconds(lambda: K.naive_recurrent_delta_rule(q, k, v, beta, gate), max(1, args.repeat // 2))
            diff = (
                (
                    K.chunk_delta_rule(q, k, v, beta, gate, backend="reference")[0]
                    - K.naive_recurrent_delta_rule(q, k, v, beta, gate)[0]
                )
                .abs()
                .max()
                .item()
            )
            result["prefill"].append(
                {
                    "variant": variant,
                    "chunked_s": chunked,
                    "loop_s": loop,
                    "speedup": loop / chunked,
                    "max_abs_diff": diff,
                }
            )
            table.add_row(variant, f"{chunked:.4f}", f"{loop:.4f}", f"{loop / chunked:.1f}x", f"{diff:.1e}")
        console.print(table)
        steps = Table(title=f"one decode step (fused_recurrent_delta_rule, gated) after C tokens, B={B} H={H} D={D}")
        for col in ("context C", "step (CPU ms)", "state bytes"):
            steps.add_column(col)
        q1, k1, v1, beta1, g1 = inputs(B, 1, H, D, seed=1)
        for context in args.contexts:
            cq, ck, cv, cbeta, cg = inputs(B, context, H, D, seed=2)
            _, state = K.chunk_delta_rule(cq, ck, cv, cbeta, cg, output_final_state=True, backend="reference")
            step = median_seconds(
                lambda: K.fused_recurrent_delta_rule(
                    q1, k1, v1, beta1, g1, initial_state=state, output_final_state=True, backend="reference"
                ),
                200,
            )
            result["decode"].append({"context": context, "step_ms": 1e3 * step, "state_bytes": state.nbytes})
            steps.add_row(f"{context:,}", f"{1e3 * step:.3f}", f"{state.nbytes:,}")
        console.print(steps)
    times = [r["step_ms"] for r in result["decode"]]
    result["goals"] = {
        "prefill_speedup_at_least_5x": all(r["speedup"] >= PREFILL_GOAL for r in result["prefill"]),
        "decode_spread": max(times) / min(times),
        "decode_independent_of_context": max(times) / min(times) <= DECODE_SPREAD,
    }
    console.print(result["goals"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
