"""Time ``rnnify distill``: tokens/s of each stage after warm-up, and where a step's time goes.

    python benchmarks/distill_speed.py out/hybrid                           # batch 4 x 512, both stages
    python benchmarks/distill_speed.py out/hybrid --threads 2 --steps 3 --profile
    python benchmarks/distill_speed.py out/hybrid --stages finetune --train all --label full-ft

Runs ``rnnify.distill`` itself (its trainer, losses and optimizer) on random token rows of the
model's vocabulary, ``--warmup`` + ``--steps`` optimizer steps per stage, and times every step:
tokens/s is the timed steps' tokens over their wall-clock time, tokens/CPU s over the process's
CPU time (all threads), the steadier figure on a machine that others share. ``--profile`` runs the timed steps under
``torch.profiler`` and adds the share of each named part of a step (teacher forward, student
forward, losses, backward, optimizer; ``rnnify/distillation/train.py`` names them). Speed does not
depend on what the tokens say, so random ones do; the KL term's teacher is the model's source
(``--teacher`` to override). Prints a table and writes ``benchmarks/results/distill-speed-LABEL.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rnnify  # noqa: E402
from rnnify.distillation import train  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
REGIONS = ("teacher forward", "student forward", "losses", "backward", "optimizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="converted model directory (rnnify convert ... -o DIR)")
    p.add_argument("--stages", default="transfer,finetune", help="stages to time (default: transfer,finetune)")
    p.add_argument("--batch-size", type=int, default=4, help="rows per step (default: 4)")
    p.add_argument(
        "--seq-len", default="512", help="tokens per row, or a schedule as rnnify distill takes it (default: 512)"
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per stage (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, per stage (default: 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as OMP_NUM_THREADS gives)")
    p.add_argument("--kernels", default=None, help="override the model's kernels backend (none, reference, ...)")
    p.add_argument("--teacher", default=None, help="teacher for the KL term (default: the model's source)")
    p.add_argument("--kl-weight", type=float, default=1.0, help="0: no teacher (default: 1)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="another rnnify.distill keyword, e.g. --option train='\"all\"' (repeatable)",
    )
    p.add_argument("--profile", action="store_true", help="also break each timed step down by part (torch.profiler)")
    p.add_argument("--label", default=None, help="name of the result file (default: the model directory's name)")
    p.add_argument(
        "--matmul",
        action="store_true",
        help="only time one [B*T, hidden] x [hidden, intermediate] product in float32 and bfloat16 "
        "(is bfloat16 faster on this CPU?)",
    )
    return p.parse_args(argv)


def extra_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def run(args: argparse.Namespace) -> dict:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = rnnify.load(args.model, kernels=args.kernels)
    stages = [s for s in args.stages.split(",") if s]
    options = extra_options(args.option)
    seq = [int(x) for x in str(args.seq_len).split(",")]
    steps_per_stage = args.warmup + args.steps
    rows = steps_per_stage * args.batch_size * (len(seq) if len(seq) > 1 else 1)
    data = torch.randint(0, model.manifest.vocab_size, (rows, max(seq)), generator=torch.Generator().manual_seed(0))
    per_stage_tokens = steps_per_stage * args.batch_size * (seq[0] if len(seq) == 1 else max(seq))

    times: dict[str, list[float]] = {s: [] for s in stages}
    cpu: dict[str, list[float]] = {s: [] for s in stages}
    tokens: dict[str, list[int]] = {s: [] for s in stages}
    parts: dict[str, dict[str, float]] = {s: {} for s in stages}
    step = train._Trainer.step

    def timed(self, stage, *rest):
        index = len(times[stage])
        profiling = args.profile and index >= args.warmup
        start, start_cpu = time.perf_counter(), time.process_time()
        with (
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            if profiling
            else nullcontext() as prof
        ):
            loss, count = step(self, stage, *rest)
        times[stage].append(time.perf_counter() - start)  # before reading the profile, which takes a while
        cpu[stage].append(time.process_time() - start_cpu)
        if profiling:
            for event in prof.key_averages():
                if event.key.startswith("distill: "):
                    name = event.key[len("distill: ") :]
                    parts[stage][name] = parts[stage].get(name, 0.0) + event.cpu_time_total / 1e6
        tokens[stage].append(rest[-1]["input_ids"].numel())
        return loss, count

    train._Trainer.step = timed
    try:
        rnnify.distill(
            model,
            data,
            stages=stages,
            max_tokens=per_stage_tokens * len(stages),
            seq_len=args.seq_len if len(seq) > 1 else seq[0],
            batch_size=args.batch_size,
            kl_weight=args.kl_weight,
            teacher=args.teacher,
            progress=False,
            **options,
        )
    finally:
        train._Trainer.step = step
    result = {
        "model": os.fspath(args.model),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "kernels": model.kernels,
        "options": options,
        "kl_weight": args.kl_weight,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/distill_speed.py " + " ".join(sys.argv[1:]),
        "stages": {},
    }
    for stage in stages:
        timed_steps = times[stage][args.warmup :]
        timed_tokens = tokens[stage][args.warmup :]
        if not timed_steps:
            continue
        seconds = sum(timed_steps)
        entry = {
            "steps": len(timed_steps),
            "seconds": seconds,
            "median_step_s": statistics.median(timed_steps),
            "tokens_per_s": sum(timed_tokens) / seconds,
            "tokens_per_cpu_s": sum(timed_tokens) / sum(cpu[stage][args.warmup :]),
        }
        if parts[stage]:
            entry["parts_s"] = {k: v / len(timed_steps) for k, v in parts[stage].items()}
        result["stages"][stage] = entry
    return result


def matmul(args: argparse.Namespace) -> dict:
    """GFLOP/s of the MLP's up-projection at this batch in float32 and bfloat16, median of 5 calls."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    config = json.loads((Path(args.model) / "rnnify.json").read_text())
    hidden = config["cells"][0]["spec"]["hidden_size"]
    rows, width = args.batch_size * int(str(args.seq_len).split(",")[-1]), 4 * hidden
    out = {"rows": rows, "hidden": hidden, "width": width, "threads": torch.get_num_threads()}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(rows, hidden, dtype=dtype), torch.randn(width, hidden, dtype=dtype)
        torch.nn.functional.linear(x, w)
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            seconds.append(time.perf_counter() - start)
        out[str(dtype).removeprefix("torch.") + "_gflop_s"] = (
            2 * rows * hidden * width / statistics.median(seconds) / 1e9
        )
    print(json.dumps(out))
    return out


def show(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"rnnify distill speed: {result['model']} (batch {result['batch_size']} x {result['seq_len']}, "
        f"{result['dtype']}, {result['threads']} threads)"
    )
    table.add_column("stage")
    table.add_column("tokens/s", justify="right")
    table.add_column("tokens/CPU s", justify="right")
    table.add_column("s/step", justify="right")
    for region in REGIONS:
        table.add_column(region, justify="right")
    for stage, entry in result["stages"].items():
        parts = entry.get("parts_s", {})
        table.add_row(
            stage,
            f"{entry['tokens_per_s']:,.0f}",
            f"{entry['tokens_per_cpu_s']:,.0f}",
            f"{entry['median_step_s']:.2f}",
            *(f"{parts[r]:.2f}" if r in parts else "" for r in REGIONS),
        )
    Console().print(table)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.matmul:
        matmul(args)
        return
    result = run(args)
    show(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    label = args.label or Path(args.model).name
    path = RESULTS / f"distill-speed-{label}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
