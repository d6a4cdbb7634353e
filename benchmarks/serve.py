"""vLLM serving the original model and converted models under one memory budget: throughput and latency.

    python benchmarks/serve.py original=models/smollm2 window=models/smol-window512 auto=models/smol-auto \\
        --vllm-python venv-vllm/bin/python --concurrency 1,8,32 --prompt-tokens 512,2048 \\
        --json benchmarks/results/serve-smollm2.json

Each NAME=DIR runs in vLLM's engine (``LLMEngine``, the one under ``vllm.LLM`` and the OpenAI
server: the same scheduler, continuous batching and chunked prefill, without HTTP), started by
``benchmarks/serve_engine.py`` in ``--vllm-python``, with the same ``--cache-gib`` of cache memory
(vLLM's ``kv_cache_memory_bytes``): the original's paged KV cache, or a converted model's state
slots. How many requests that memory admits at once is vLLM's own decision: a request of the
original holds (prompt + new tokens) x the KV bytes of a token, one of a converted model a state
of constant size.

For each prompt length P the models take turns in the order given (the first is the reference of
the ratio column, normally the original), so a shared machine's load falls on each alike; a turn
starts that model's engine afresh, warms it with one short request, then for each N in
``--concurrency`` adds N requests at once, each P tokens of real text (consecutive slices of
``--data``: the same for every model, no two alike, so no prefix is shared) and ``--new-tokens``
greedy tokens with ``ignore_eos``, and steps the engine until all finish. Per (model, P, N):

- output tokens/s: all output tokens over the time from adding the requests to the last one done;
- time to first token (from a request's arrival) and inter-token latency (between a request's
  successive tokens, all requests pooled), p50 and p99: vLLM's own figures, from its stat-logger
  interface, once per engine step;
- max running: the most requests the scheduler ran at once (after any step): how many the memory
  admits; max waiting; preemptions (requests evicted to free memory); the highest share of the
  cache in use;
- peak RSS: the highest summed resident memory of the turn's processes (the driver, vLLM's engine
  core and worker), read every ``--poll`` seconds.

Threads: vLLM binds its worker's OpenMP threads to the last ``--threads`` CPUs of this process
(``VLLM_CPU_OMP_THREADS_BIND``); the others are left to the engine core and the driver. Results go to
``--json`` (rewritten after every measurement, so a stopped run keeps what it measured), a plot of
tokens/s against N, one panel per prompt length, beside it (``.png``), and a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
WARMUP_TOKENS = 16  # prompt and new tokens of the request that warms each engine before it is measured


def int_list(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``, each a positive integer."""
    try:
        values = [int(part.replace("_", "")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each option's default where it has one."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "models", nargs="*", metavar="NAME=DIR", help="model directories to serve, named; the first is the reference"
    )
    parser.add_argument("--concurrency", type=int_list, default="1,8,32,128", help="N: requests sent at once")
    parser.add_argument("--prompt-tokens", type=int_list, default="512,2048,8192", help="P: tokens of each prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens each request generates (ignore_eos)")
    parser.add_argument(
        "--cache-gib", type=float, default=2.0, help="cache memory of every engine, GiB: KV cache or state slots"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="OpenMP threads of vLLM's worker, bound to the last CPUs"
    )
    parser.add_argument("--dtype", default="float32", help="vLLM's --dtype (the converted models run in their own)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="vLLM's --max-num-seqs: sequences at once")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="vLLM's --max-num-batched-tokens: tokens a step"
    )
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "pydocs", help="text files the prompts come from")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (the first model's when not given)")
    parser.add_argument("--vllm-python", default=sys.executable, help="the Python of vLLM's environment")
    parser.add_argument(
        "--poll", type=float, default=0.5, help="seconds between reads of the engine's reports and of memory"
    )
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds an engine may take to start")
    parser.add_argument("--json", type=Path, help="results file (benchmarks/results/serve-<time>.json when not given)")
    parser.add_argument(
        "--markdown",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print earlier results files as Markdown tables and redraw the plot beside each; serve nothing",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        return args
    if not args.models:
        parser.error("give the models to serve as NAME=DIR (or --markdown JSON ...)")
    args.named = []
    for spec in args.models:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"expected NAME=DIR, got {spec!r}")
        if not Path(path, "config.json").is_file():
            parser.error(f"{path}: not a model directory (no config.json)")
        if name in dict(args.named):
            parser.error(f"the name {name!r} is given twice")
        args.named.append((name, path))
    for flag in ("new_tokens", "threads", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.cache_gib <= 0 or args.poll <= 0:
        parser.error("--cache-gib and --poll must be positive")
    cpus = sorted(os.sched_getaffinity(0))
    if args.threads > len(cpus):
        parser.error(f"--threads {args.threads}: this process may run on {len(cpus)} CPUs")
    args.bind = ",".join(str(c) for c in cpus[-args.threads :])
    args.tokenizer = args.tokenizer or Path(args.named[0][1])
    if args.json is None:
        args.json = ROOT / "benchmarks" / "results" / f"serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return args


# -- pure parts: prompts, summaries, the table and the plot ---------------------------------------


def slice_prompts(tokens: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens: consecutive slices of ``tokens``, no two alike."""
    if count * length > len(tokens):
        raise SystemExit(
            f"the text gives {len(tokens):,} tokens; {count} prompts of {length:,} need {count * length:,}"
        )
    return [tokens[i * length : (i + 1) * length] for i in range(count)]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between order statistics; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(name: str, length: int, result: dict) -> dict:
    """One row from what the engine reported for N requests of ``length`` tokens (a ``result`` event
    of serve_engine.py, with the turn's ``peak_rss_bytes``): tokens/s and the latency percentiles."""
    tokens, seconds = result["output_tokens"], result["duration_s"]
    return {
        "name": name,
        "prompt_tokens": length,
        "concurrency": result["concurrency"],
        "output_tokens": tokens,
        "duration_s": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "ttft_p50_s": percentile(result["ttft_s"], 50),
        "ttft_p99_s": percentile(result["ttft_s"], 99),
        "itl_p50_s": percentile(result["itl_s"], 50),
        "itl_p99_s": percentile(result["itl_s"], 99),
        **{key: result[key] for key in ("max_running", "max_waiting", "preemptions", "max_cache_usage")},
        "peak_rss_bytes": result["peak_rss_bytes"],
    }


def with_ratios(runs: list[dict], reference: str) -> list[dict]:
    """``runs`` with ``ratio``: tokens/s over the reference model's at the same P and N (None without one)."""
    base = {(r["prompt_tokens"], r["concurrency"]): r["tokens_per_s"] for r in runs if r["name"] == reference}
    out = []
    for run in runs:
        ref = base.get((run["prompt_tokens"], run["concurrency"]))
        ratio = run["tokens_per_s"] / ref if ref and run["tokens_per_s"] is not None else None
        out.append({**run, "ratio": ratio})
    return out


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def table(runs: list[dict], reference: str):
    """The results as a rich table, one row per (P, N, model), the ratio against ``reference``."""
    from rich.table import Table

    out = Table(title=f"vLLM serving: output tokens/s and latency (ratio: over {reference})")
    for column in ("P", "N", "model", "tok/s", "ratio", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms"):
        out.add_column(column, justify="left" if column == "model" else "right")
    for column in ("max running", "preempted", "cache used", "peak RSS GiB"):
        out.add_column(column, justify="right")
    for run in sorted(with_ratios(runs, reference), key=lambda r: (r["prompt_tokens"], r["concurrency"])):
        out.add_row(
            f"{run['prompt_tokens']:,}",
            str(run["concurrency"]),
            run["name"],
            _fmt(run["tokens_per_s"], digits=1),
            _fmt(run["ratio"], digits=2),
            _fmt(run["ttft_p50_s"], digits=2),
            _fmt(run["ttft_p99_s"], digits=2),
            _fmt(run["itl_p50_s"], 1e3, 1),
            _fmt(run["itl_p99_s"], 1e3, 1),
            _fmt(run["max_running"]),
            _fmt(run["preemptions"]),
            f"{run['max_cache_usage']:.0%}",
            _fmt(run["peak_rss_bytes"], 1 / GIB, 2),
        )
    return out


def markdown(result: dict) -> str:
    """A results file's runs as a Markdown table, under the command that wrote it."""
    lines = [
        f"`{result['command']}`",
        "",
        "| P | N | model | output tok/s | ratio | TTFT p50 / p99 s | ITL p50 / p99 ms | max running | preempted | peak RSS GiB |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in sorted(result["runs"], key=lambda r: (r["prompt_tokens"], r["concurrency"])):
        lines.append(
            f"| {run['prompt_tokens']:,} | {run['concurrency']} | {run['name']} | {_fmt(run['tokens_per_s'], digits=1)} "
            f"| {_fmt(run['ratio'], digits=2)} | {_fmt(run['ttft_p50_s'], digits=2)} / {_fmt(run['ttft_p99_s'], digits=2)} "
            f"| {_fmt(run['itl_p50_s'], 1e3, 0)} / {_fmt(run['itl_p99_s'], 1e3, 0)} | {run['max_running']} "
            f"| {run['preemptions']} | {_fmt(run['peak_rss_bytes'], 1 / GIB, 2)} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    """Output tokens/s against N, one panel per prompt length, one line per model."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in runs})
    names = list(dict.fromkeys(r["name"] for r in runs))
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for name in names:
            points = sorted(
                (r["concurrency"], r["tokens_per_s"])
                for r in runs
                if r["name"] == name and r["prompt_tokens"] == length and r["tokens_per_s"] is not None
            )
            if points:
                ax.plot(*zip(*points), "o-", label=name)
        ax.set(xscale="log", xlabel="concurrent requests N", title=f"prompts of {length:,} tokens")
        counts = sorted({r["concurrency"] for r in runs})
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output tokens/s")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- one model's turn: vLLM's engine in its own environment ---------------------------------------


def engine_arguments(args: argparse.Namespace, path: str, max_model_len: int) -> dict:
    """vLLM's ``EngineArgs`` for one model: the same cache memory, batch limits and dtype for every model."""
    return {
        "model": path,
        "dtype": args.dtype,
        "enforce_eager": True,
        "kv_cache_memory_bytes": int(args.cache_gib * GIB),
        "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": False,  # the prompts share no prefix; the plugin refuses it
        "seed": 0,
    }


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would override the budget
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=args.bind,
        # P + new tokens may pass the config's max_position_embeddings (8,192 + 128 for SmolLM2)
        VLLM_ALLOW_LONG_MAX_MODEL_LEN="1",
        VLLM_NO_USAGE_STATS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


class Turn:
    """One model served by ``serve_engine.py`` in vLLM's Python (its own process group) for every N
    at one prompt length; ``results()`` yields each N's measurement as the engine reports it."""

    def __init__(self, args: argparse.Namespace, name: str, job: dict, work: Path):
        self.name, self.args = name, args
        stem = f"{name}-{len(job['prompts'][0])}"
        self.job, self.events, self.log = work / f"{stem}.json", work / f"{stem}.events", work / f"{stem}.log"
        self.job.write_text(json.dumps(job))
        self.events.write_text("")
        self.length = len(job["prompts"][0])
        self.ready: dict | None = None  # serve_engine.py's ready event: startup time, vLLM's version, cache blocks

    def __enter__(self) -> Turn:
        command = [self.args.vllm_python, str(ROOT / "benchmarks" / "serve_engine.py"), str(self.job), str(self.events)]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=engine_env(self.args), start_new_session=True
            )
        self.launched = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        """Stops the whole process group (this script's process, vLLM's engine core and worker)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def failure(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line]
        return (errors or lines or ["no output"])[-1].strip() + f" (log: {self.log})"

    def rss(self) -> int:
        """Resident bytes of the turn's processes, summed."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def results(self):
        """Each N's measurement (the engine's, with the peak RSS seen while it ran), as it comes."""
        from tqdm import tqdm

        progress, peak, offset = None, 0, 0
        while True:
            exited = self.process.poll() is not None
            peak = max(peak, self.rss())
            with open(self.events) as events:
                events.seek(offset)
                lines = events.readlines()
            if lines and not lines[-1].endswith("\n"):  # a line still being written
                lines.pop()
            offset += sum(len(line) for line in lines)
            for event in map(json.loads, lines):
                if event["event"] == "ready":
                    self.ready = event
                elif event["event"] == "start":
                    peak = self.rss()
                    label = f"{self.name} P={self.length:,} N={event['concurrency']}"
                    progress = tqdm(
                        total=event["concurrency"] * self.args.new_tokens, desc=label, unit="tok", leave=False
                    )
                elif event["event"] == "tokens":
                    progress.update(event["count"])
                elif event["event"] == "result":
                    progress.close()
                    yield {**event, "peak_rss_bytes": peak}
            if exited and not lines:
                if self.process.returncode != 0:
                    raise SystemExit(f"vLLM with {self.name} stopped: {self.failure()}")
                return
            if self.ready is None and time.perf_counter() - self.launched > self.args.startup_timeout:
                raise SystemExit(
                    f"vLLM with {self.name} did not start in {self.args.startup_timeout:.0f} s (log: {self.log})"
                )
            time.sleep(self.args.poll)


def read_tokens(args: argparse.Namespace, needed: int) -> list[int]:
    """At least ``needed`` tokens of ``--data``'s text files, read in sorted order (fewer if it runs out)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    files = sorted(p for p in Path(args.data).rglob("*") if p.is_file()) if Path(args.data).is_dir() else [args.data]
    tokens: list[int] = []
    for path in files:
        tokens += tokenizer(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(tokens) >= needed:
            break
    return tokens


def save(args: argparse.Namespace, conditions: dict, runs: list[dict]) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    reference = args.named[0][0]
    result = {**conditions, "runs": with_ratios(runs, reference)}
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(runs, args.json.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    if args.markdown:
        results = {path: json.loads(path.read_text()) for path in args.markdown}
        for path, result in results.items():
            plot(result["runs"], path.with_suffix(".png"))
        print("\n\n".join(markdown(result) for result in results.values()))
        return 0
    # a stopped run still stops the engine's process group (Turn.__exit__)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    tokens = read_tokens(args, max(args.concurrency) * max(args.prompt_tokens))
    max_model_len = max(args.prompt_tokens) + args.new_tokens
    conditions = {
        "command": " ".join(["python", "benchmarks/serve.py", *(argv if argv is not None else sys.argv[1:])]),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "models": dict(args.named),
        "reference": args.named[0][0],
        "new_tokens": args.new_tokens,
        "cache_bytes": int(args.cache_gib * GIB),
        "threads": args.threads,
        "omp_bind": args.bind,
        "cpus": len(os.sched_getaffinity(0)),
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": max_model_len,
        "data": str(args.data),
        "poll_s": args.poll,
        "engines": {},  # per model and prompt length: startup seconds, the cache's blocks and their size
    }
    runs: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="rnnify-serve-"))
    print(f"jobs and vLLM's logs: {work}", flush=True)
    for length in args.prompt_tokens:
        prompts = slice_prompts(tokens, max(args.concurrency), length)
        for name, path in args.named:
            job = {
                "engine": engine_arguments(args, path, max_model_len),
                "prompts": prompts,
                "concurrency": args.concurrency,
                "new_tokens": args.new_tokens,
                "warmup_tokens": WARMUP_TOKENS,
            }
            with Turn(args, name, job, work) as turn:
                for result in turn.results():
                    # with the 1-minute load average as it ended: how busy the shared machine was
                    row = {**summarize(name, length, result), "load_1min": os.getloadavg()[0]}
                    runs.append(row)
                    conditions["vllm"], conditions["rnnify"] = turn.ready["vllm"], turn.ready["rnnify"]
                    conditions["engines"][f"{name}@{length}"] = {
                        key: turn.ready[key] for key in ("startup_s", "cache_blocks", "block_size")
                    }
                    save(args, conditions, runs)
                    print(
                        f"{name} P={length:,} N={row['concurrency']}: {_fmt(row['tokens_per_s'], digits=1)} tok/s, "
                        f"max running {row['max_running']}, preempted {row['preemptions']}",
                        flush=True,
                    )
    Console().print(table(runs, args.named[0][0]))
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
