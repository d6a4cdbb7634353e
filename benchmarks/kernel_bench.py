"""Time rnnify.kernels: Triton path vs PyTorch reference, SDPA and fla, prefill and decode.

    python benchmarks/kernel_bench.py --preset issue           # the issue's grid on a GPU: 300 s of rows at most
    python benchmarks/kernel_bench.py --preset smoke           # tiny, any machine, seconds
    python benchmarks/kernel_bench.py --batch 1 8 --heads 16 32 --head-dim 64 128 --lengths 1024 32768 --dtype bfloat16
    python benchmarks/kernel_bench.py --parity                 # fp32 Triton-vs-reference check on this device
    python benchmarks/kernel_bench.py --replot RESULTS.json    # table, goals and PNG again from a JSON

Prefill (T tokens): forward and forward+backward of chunk_linear_attn (variants: plain, plain-tf32
(tl.dot in tf32), scalar gate g, per-channel gate gk, elu + normalize, fused hedgehog map),
linear_recurrence and aaren_scan, each with backend="triton" and backend="reference", against
causal SDPA on the same q/k/v (flash where it runs; the backend that ran is recorded) and fla's chunk
kernels. Decode (one token after a T-token context): fused_recurrent_linear_attn from the state of
that context (its step should not depend on T), window_attn_step over a T-slot window, against SDPA
over a T-key cache and fla's fused_recurrent kernels. Triton and fla rows need CUDA; on CPU only
the reference and SDPA run, so numbers exist everywhere.

Timing: the first call (Triton compile, fla autotune) and --warmup more are not timed; then the
median of up to --repeat calls (CUDA events on GPU), at least 3, stopping after --case-seconds.
A size that runs out of memory, or that a kernel or backend cannot run, becomes a row with status
"oom", "unsupported" or "error"; past --time-budget the remaining rows are "skipped". The JSON is
rewritten after every row, so a killed run keeps what it measured (--replot then draws it). Rows
checked against the reference at the same size carry err_vs_reference (max |diff| / max |ref|).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # the kernel_bench_* modules beside this file

from kernel_bench_cases import (  # noqa: E402
    DECODE_VARIANTS,
    DELTA_VARIANTS,
    FLA_CHUNK,
    OPS,
    VARIANTS,
    Case,
    Inputs,
    Run,
    context_lost,
    free_memory,
    measure,
)
from kernel_bench_parity import PARITY, PARITY_TOL, parity  # noqa: E402
from kernel_bench_report import cell, checks, goal_case, goals, plot, print_report, row_label  # noqa: E402

from rnnify.kernels import utils  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Group:
    """One grid: every (B, H, D, T) of these lengths, for these ops and chunk_linear_attn variants."""

    batch: tuple[int, ...]
    heads: tuple[int, ...]
    head_dim: tuple[int, ...]
    lengths: tuple[int, ...]
    ops: tuple[str, ...] = OPS
    variants: tuple[str, ...] = VARIANTS

    def shapes(self) -> list[tuple[int, int, int, int]]:
        return [(B, H, D, T) for B in self.batch for H in self.heads for D in self.head_dim for T in self.lengths]


PRESETS = {
    # The grid, frugal enough for ~6 minutes on an H200: every op and variant over T = 1k..32k
    # at B=1 H=32 D=128 (the goals' sizes); the plain ops at every B/H/D corner at T=4k; the largest
    # batch at long T. The reference stops at T=4k (its Python chunk loop is slow and not the point).
    "issue": dict(
        groups=[
            Group((1,), (32,), (128,), (1024, 2048, 4096, 8192, 16384, 32768)),
            Group((1, 8), (16, 32), (64, 128), (4096,), ops=OPS[:2], variants=("plain",)),
            Group((8,), (16, 32), (128,), (16384, 32768), ops=OPS[:1], variants=("plain",)),
        ],
        dtype="bfloat16",
        repeat=20,
        warmup=1,
        case_seconds=0.1,
        reference_max_len=4096,
        time_budget=300.0,
    ),
    "smoke": dict(
        groups=[Group((1,), (2,), (16,), (16, 32))],
        dtype="bfloat16",
        repeat=3,
        warmup=0,
        case_seconds=0.02,
        reference_max_len=None,
        time_budget=None,
    ),
    "default": dict(
        groups=[Group((1,), (16,), (64,), (1024, 4096))],
        dtype="bfloat16",
        repeat=10,
        warmup=1,
        case_seconds=0.2,
        reference_max_len=None,
        time_budget=None,
    ),
}


# --------------------------------------------------------------------------- planning


def available(section: str, T: int, run: Run) -> set[str]:
    impls = {"sdpa"}
    if section == "decode" or run.reference_max_len is None or T <= run.reference_max_len:
        impls.add("reference")
    if run.triton:
        impls.add("triton")
    if run.fla:
        impls.add("fla")
    return impls


def shape_cases(group: Group, shape, run: Run) -> list[Case]:
    """One shape's cases, each reference before the implementations checked against it."""
    out = []

    def add(section, op, variant, impls, modes):
        have = available(section, shape[3], run)
        out.extend(Case(section, op, variant, i, m, *shape) for m in modes for i in impls if i in have)

    both = ("fwd", "fwd+bwd")
    if "chunk_linear_attn" in group.ops:
        for variant in group.variants:
            impls = ("reference", "triton", "fla") if variant in FLA_CHUNK else ("reference", "triton")
            impls = ("triton",) if variant == "plain-tf32" else impls
            add("prefill", "chunk_linear_attn", variant, impls, both)
    for op in ("linear_recurrence", "aaren_scan"):
        if op in group.ops:
            add("prefill", op, "plain", ("reference", "triton"), both)
    delta_variants = [v for v in DELTA_VARIANTS if v in group.variants]
    if "chunk_delta_rule" in group.ops:
        for variant in delta_variants:
            add("prefill", "chunk_delta_rule", variant, ("reference", "triton", "fla"), both)
    if "fused_recurrent_delta_rule" in group.ops:
        for variant in delta_variants:
            add("decode", "fused_recurrent_delta_rule", variant, ("reference", "triton", "fla"), ("step",))
    if {"chunk_linear_attn", "linear_recurrence", "aaren_scan", "chunk_delta_rule"} & set(
        group.ops
    ):  # the baseline of every prefill op
        add("prefill", "sdpa", "causal", ("sdpa",), both)
    if "fused_recurrent_linear_attn" in group.ops:
        for variant in (v for v in DECODE_VARIANTS if v in group.variants):
            add("decode", "fused_recurrent_linear_attn", variant, ("reference", "triton", "fla"), ("step",))
    if "window_attn_step" in group.ops:
        add("decode", "window_attn_step", "plain", ("reference", "triton"), ("step",))
    if {"fused_recurrent_linear_attn", "window_attn_step", "fused_recurrent_delta_rule"} & set(group.ops):
        add("decode", "sdpa", "kv-cache", ("sdpa",), ("step",))
    return out


def plan(groups: list[Group], run: Run) -> list[Case]:
    cases = list(dict.fromkeys(c for g in groups for s in g.shapes() for c in shape_cases(g, s, run)))
    return sorted(cases, key=lambda c: not goal_case(c))  # stable: otherwise in grid order


def run_cases(cases: list[Case], run: Run, write) -> list[dict]:
    rows, refs, x, lost = [], {}, None, None
    start = time.perf_counter()
    for i, case in enumerate(cases, 1):
        row = {**asdict(case), "dtype": str(run.dtype).removeprefix("torch.")}
        if lost:
            row.update(status="skipped", error=lost)
        elif run.time_budget is not None and time.perf_counter() - start > run.time_budget:
            row.update(status="skipped", error=f"time budget of {run.time_budget:g} s spent")
        else:
            if x is None or x.shape != case.shape:
                x = refs = None
                free_memory(run.device)
                x, refs = Inputs(case.shape, run.dtype, run.device, "triton" if run.triton else "reference"), {}
            row.update(measure(case, x, refs, run))
            lost = context_lost(row, run.device)
        rows.append(row)
        write(rows)
        print(f"[{i}/{len(cases)}] {row_label(row)}: {cell(row)}", flush=True)
    return rows


# --------------------------------------------------------------------------- machine, files, CLI


def driver_version() -> str | None:
    """The NVIDIA driver's version (torch.cuda reports only the CUDA versions): nvidia-smi, else NVML."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - no NVML: the driver stays unknown
        return None


def fla_version() -> str:
    try:
        import fla
    except Exception as e:  # noqa: BLE001 - fla's import can fail in more ways than ImportError
        return f"not installed ({type(e).__name__}: {e})"[:200]
    return getattr(fla, "__version__", "unknown")


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine(device: torch.device) -> dict:
    info = {
        "device": device.type,
        "device_name": "cpu",
        "gpu": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": getattr(utils.triton, "__version__", None),
        "fla": fla_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_threads": torch.get_num_threads(),
        "dot_precision": utils.DOT_PRECISION,
        "triton_interpret": utils.INTERPRET,
        "git": git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            driver=driver_version(),
        )
    return info


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def settings(args) -> dict:
    """The preset's settings, with the ones given on the command line instead."""
    s = dict(PRESETS[args.preset or "default"])
    grid = {
        k: tuple(v)
        for k, v in (
            ("batch", args.batch),
            ("heads", args.heads),
            ("head_dim", args.head_dim),
            ("lengths", args.lengths),
        )
        if v
    }
    groups = [replace(s["groups"][0], **grid)] if grid else s["groups"]
    if args.ops:
        groups = [replace(g, ops=tuple(o for o in g.ops if o in args.ops)) for g in groups]
    if args.variants:
        groups = [replace(g, variants=tuple(v for v in g.variants if v in args.variants)) for g in groups]
    s["groups"] = groups
    for k in ("dtype", "repeat", "warmup", "case_seconds", "reference_max_len", "time_budget"):
        if getattr(args, k) is not None:
            s[k] = getattr(args, k)
    return s


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, nargs="+")
    p.add_argument("--heads", type=int, nargs="+")
    p.add_argument("--head-dim", type=int, nargs="+")
    p.add_argument("--lengths", type=int, nargs="+", help="prompt lengths, and the decode steps' context lengths")
    p.add_argument("--ops", nargs="+", choices=OPS)
    p.add_argument("--variants", nargs="+", choices=VARIANTS)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", help="default: cuda when available, else cpu")
    p.add_argument("--repeat", type=int, help="most calls timed per row")
    p.add_argument("--warmup", type=int, help="untimed calls after the first (compiling) one")
    p.add_argument("--case-seconds", type=float, help="stop timing a row after this long (at least 3 calls)")
    p.add_argument("--reference-max-len", type=int, help="no reference prefill rows above this T")
    p.add_argument("--time-budget", type=float, help="seconds; rows after it are recorded as skipped")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--parity", action="store_true", help="check the Triton path against the reference (fp32) instead")
    p.add_argument("--replot", type=Path, metavar="JSON", help="table, goals and PNG again from a results JSON")
    return p.parse_args(argv)


def stem(kind: str, device_name: str) -> str:
    tag = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return f"kernels-{kind}-{tag}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def replot(path: Path) -> int:
    doc = json.loads(path.read_text())
    doc["goals"], doc["checks"] = goals(doc), checks(doc["rows"])
    write_json(path, doc)
    plot(doc, path.with_suffix(".png"))
    print_report(doc)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def parity_main(device: torch.device, out: Path, cases=PARITY, command: str = "") -> int:
    if device.type != "cuda" and not utils.INTERPRET:
        print(
            "parity: not run; the Triton path runs on CUDA, or on CPU under TRITON_INTERPRET=1 "
            "(set before triton is imported)"
        )
        return 0
    rows = parity(device, cases)
    doc = {
        "command": command,
        "time": datetime.now(timezone.utc).isoformat(),
        "machine": machine(device),
        "tolerance": PARITY_TOL,
        "results": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem('parity', doc['machine']['device_name'])}.json"
    write_json(path, doc)
    for r in rows:
        print(
            f"{r['status']:>5}  {r['op']} B={r['B']} T={r['T']} H={r['H']}/{r['H_kv']} D={r['D']} {r['options']}  "
            f"max |diff| {r.get('max_abs_err', '-')}  {r.get('error', '')[:300]}"
        )
    print(f"wrote {path}")
    return 0 if all(r["status"] == "pass" for r in rows) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = shlex.join([sys.executable, str(Path(__file__).resolve().relative_to(ROOT)), *argv])
    args = parse(argv)
    if args.replot:
        return replot(args.replot)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and utils.INTERPRET:
        raise SystemExit("TRITON_INTERPRET is set: the Triton rows would time the interpreter. Unset it.")
    if args.parity:
        return parity_main(device, args.out, command=command)
    s = settings(args)
    info = machine(device)
    run = Run(
        device,
        getattr(torch, s["dtype"]),
        s["repeat"],
        s["warmup"],
        s["case_seconds"],
        s["reference_max_len"],
        s["time_budget"],
        triton=device.type == "cuda" and utils.HAS_TRITON,
        fla=device.type == "cuda" and not info["fla"].startswith("not installed"),
    )
    doc = {
        "command": command,
        "time": datetime.now(timezone.utc).isoformat(),
        "preset": args.preset,
        "machine": info,
        "config": {**{k: v for k, v in s.items() if k != "groups"}, "groups": [asdict(g) for g in s["groups"]]},
        "note": None if run.triton else "no Triton rows: they need CUDA (this run has the reference and SDPA)",
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stem(args.preset or 'custom', info['device_name'])}.json"
    start = time.perf_counter()
    doc["rows"] = run_cases(plan(s["groups"], run), run, lambda rows: write_json(path, {**doc, "rows": rows}))
    doc["seconds"] = round(time.perf_counter() - start, 1)
    doc["goals"], doc["checks"] = goals(doc), checks(doc["rows"])
    write_json(path, doc)
    plot(doc, path.with_suffix(".png"))
    print_report(doc)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
