"""Peak memory and time of ``rnnify convert`` on Llama-3.2-1B's shape, against transformers loading it.

    python benchmarks/convert_memory.py                          # 2, 4, 8 and 16 layers
    python benchmarks/convert_memory.py --layers 2,4 --rnnify /path/to/another/checkout --label before
    python benchmarks/convert_memory.py --layers 16 --make llama-1b   # only write the 16-layer model

For each layer count the model (Llama-3.2-1B's shape: hidden 2048, intermediate 8192, 32 query and
8 key/value heads, 128,256-token vocabulary, tied embeddings, llama3 RoPE scaling; random weights)
is saved in bfloat16 with ``save_pretrained`` to a temporary directory, and two fresh processes
run on it, one after the other:

* transformers alone: import, ``from_pretrained(dtype=bfloat16)`` and one forward pass over 8
  tokens, which reads every weight once, as converting does;
* ``rnnify convert DIR --to linear --dtype bfloat16 -o OUT --no-compile``: the conversion, without
  the decode step compiled ahead of time that ``convert`` adds by default on a CPU for models under
  1 GiB of weights (``--convert-args=--compile`` measures that too, ``--convert-args=`` the default).

Each process's peak resident set size is its own ``ru_maxrss`` (``os.wait4``), against the bytes of
the weights; the time is wall-clock, and CPU time (user + system) is the steadier figure on a
machine that others share. Prints a table and writes ``benchmarks/results/convert-memory[-LABEL].json``.
The model and the converted output live in a temporary directory (``--workdir``), removed after
each point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Llama-3.2-1B's config, less the layer count.
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

_MAKE = """
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
config = LlamaConfig(num_hidden_layers=int(sys.argv[2]), **{config!r})
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.to_empty(device="cpu")
model.tie_weights()
generator = torch.Generator().manual_seed(0)
with torch.no_grad():
    for parameter in model.parameters():
        parameter.uniform_(-0.03, 0.03, generator=generator)
model.save_pretrained(sys.argv[1])
print(sum(p.numel() for p in model.parameters()))
"""

_TRANSFORMERS = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
with torch.no_grad():
    model(torch.zeros(1, 8, dtype=torch.long))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", default="2,4,8,16", help="layer counts to measure (default: 2,4,8,16)")
    p.add_argument("--target", default="linear", help="rnnify convert --to (default: linear)")
    p.add_argument(
        "--convert-args",
        default="--no-compile",
        help="more arguments of rnnify convert, space-separated (default: --no-compile)",
    )
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the measured processes (default: 1)")
    p.add_argument(
        "--rnnify", default=str(ROOT), help="checkout whose rnnify converts, to compare versions (default: this one)"
    )
    p.add_argument("--workdir", default=None, help="where the models are written (default: a temporary directory)")
    p.add_argument("--label", default=None, help="name of the result file (default: convert-memory.json)")
    p.add_argument(
        "--make",
        metavar="DIR",
        default=None,
        help="only write the model with the first --layers count to DIR, for other benchmarks (speed.py)",
    )
    return p.parse_args(argv)


def measure(command: list[str], env: dict[str, str], cwd: Path) -> dict:
    """Run ``command`` in ``cwd``; its wall time, CPU time and peak RSS (``ru_maxrss``, its own, via ``wait4``)."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        output, errors = stdout.read().decode(), stderr.read().decode()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{errors[-2000:]}")
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "stdout": output.strip()[-200:],
    }


def point(layers: int, args: argparse.Namespace, workdir: Path) -> dict:
    # a step cache of this point's own: with --compile, every point compiles (random weights of one
    # shape would otherwise find the step an earlier run compiled) and nothing is left in the user's
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": str(Path(args.rnnify).resolve()),
        "TQDM_DISABLE": "1",
        "RNNIFY_CACHE": str(workdir / f"step-cache-{layers}"),
    }
    load_average = round(os.getloadavg()[0], 2)
    model, out = workdir / f"llama-1b-{layers}", workdir / f"llama-1b-{layers}-{args.target}"
    try:
        made = measure([sys.executable, "-c", _MAKE.format(config=LLAMA_1B), str(model), str(layers)], env, workdir)
        params = int(made["stdout"].splitlines()[-1])
        weight_bytes = 2 * params
        hf = measure([sys.executable, "-c", _TRANSFORMERS, str(model)], env, workdir)
        convert = measure(
            [
                sys.executable,
                "-m",
                "rnnify",
                "convert",
                str(model),
                "--to",
                args.target,
                "--dtype",
                "bfloat16",
                "-o",
                str(out),
                *args.convert_args.split(),
            ],
            env,
            workdir,  # not this checkout: ``-m`` would import the rnnify beside it before PYTHONPATH's
        )
    finally:
        shutil.rmtree(model, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(env["RNNIFY_CACHE"], ignore_errors=True)
    for run in (hf, convert):
        del run["stdout"]
        run["peak_rss_x_weights"] = round(run["peak_rss_bytes"] / weight_bytes, 3)
    return {
        "layers": layers,
        "params": params,
        "weight_bytes": weight_bytes,
        "load_average_1min": load_average,
        "transformers": hf,
        "convert": convert,
    }


def run(args: argparse.Namespace) -> dict:
    layers = [int(n) for n in args.layers.split(",")]
    commit = subprocess.run(["git", "-C", args.rnnify, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="rnnify-convert-memory-", dir=args.workdir) as workdir:
        points = []
        for n in layers:
            points.append(point(n, args, Path(workdir)))
            show_point(points[-1])
    import torch
    import transformers

    return {
        "model": {"shape": "Llama-3.2-1B", "config": LLAMA_1B, "dtype": "bfloat16"},
        "target": args.target,
        "convert_args": args.convert_args,
        "threads": args.threads,
        "rnnify": "this checkout" if Path(args.rnnify).resolve() == ROOT else args.rnnify,
        "rnnify_commit": commit.stdout.strip() or None,  # the checkout's HEAD; its uncommitted changes not included
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "points": points,
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def show_point(p: dict) -> None:
    hf, cv = p["transformers"], p["convert"]
    print(
        f"{p['layers']} layers, {_gib(p['weight_bytes'])} of weights: transformers {hf['wall_s']} s, "
        f"{_gib(hf['peak_rss_bytes'])}; convert {cv['wall_s']} s, {_gib(cv['peak_rss_bytes'])}",
        file=sys.stderr,
    )


def show(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"rnnify convert --to {result['target']} --dtype bfloat16 against transformers' load and forward, "
        f"Llama-3.2-1B's shape ({result['threads']} thread, {result['machine']})"
    )
    for column in ("layers", "weights", "transformers", "peak RSS", "convert", "peak RSS", "difference"):
        table.add_column(column, justify="right")
    for p in result["points"]:
        hf, cv = p["transformers"], p["convert"]
        table.add_row(
            str(p["layers"]),
            _gib(p["weight_bytes"]),
            f"{hf['wall_s']:.1f} s, {hf['cpu_s']:.1f} CPU s",
            f"{_gib(hf['peak_rss_bytes'])}, {hf['peak_rss_x_weights']:.2f}x",
            f"{cv['wall_s']:.1f} s, {cv['cpu_s']:.1f} CPU s",
            f"{_gib(cv['peak_rss_bytes'])}, {cv['peak_rss_x_weights']:.2f}x",
            f"{cv['wall_s'] - hf['wall_s']:+.1f} s, {cv['cpu_s'] - hf['cpu_s']:+.1f} CPU s",
        )
    Console(width=max(Console().width, 130)).print(table)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.make:
        layers = args.layers.split(",")[0]
        subprocess.run([sys.executable, "-c", _MAKE.format(config=LLAMA_1B), args.make, layers], check=True)
        return
    result = run(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"convert-memory-{args.label}.json" if args.label else "convert-memory.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    show(result)
    print(f"wrote {RESULTS / name}", file=sys.stderr)


if __name__ == "__main__":
    main()
