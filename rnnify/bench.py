"""Decode latency, memory and prefill time of a converted model, and of the original (``rnnify bench``).

``benchmark`` runs the whole sweep and returns a ``Run``; the command prints it. Everything is
measured in one process so the ratios compare like with like. Reaching a context of
c tokens without an O(c^2) prefill (see ``docs/performance.md``):

* constant-state models read ``min(c, fill_tokens)`` random tokens with a real prefill, then their
  position counter is set to c: the state has the same shapes at any length past the sliding
  windows, so a step costs the same as after c real tokens;
* ``exact`` models (state grows) get random keys/values of length c in every exact cell;
* the original gets a ``DynamicCache`` holding random keys/values of length c in every layer.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rnnify.choices import BENCH_BATCHES, BENCH_CONTEXTS, BENCH_PREFILL_MAX, BENCH_STEPS
from rnnify.errors import RnnifyError
from rnnify.runtime.model import RecurrentModel

__all__ = [
    "Run",
    "Result",
    "Machine",
    "benchmark",
    "machine",
    "bandwidth",
    "bench_converted",
    "bench_original",
    "plot",
    "timing_warning",
    "busy_warning",
    "OpCount",
]

WARMUP = 2  # decode steps before timing
FILL_TOKENS = 256  # real tokens a constant-state model reads before its position jumps to the context
SPREAD = 2.0  # timings of the same work that disagree by more than this factor are not to be trusted


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while active (``ops``), and apart those while ``inside`` is set
    (``inside_ops``; hooks set it around the cells): on a CPU a small step's time is its op count."""

    def __init__(self):
        super().__init__()
        self.inside, self.ops, self.inside_ops = False, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.inside_ops += self.inside
        return func(*args, **(kwargs or {}))


@dataclass
class Result:
    """One (model, batch, context) measurement."""

    model: str  # "converted" or "original"
    batch: int
    context: int
    step_ms: float  # median per-token decode latency
    tokens_per_s: float  # batch / step time
    step_ms_min: float  # fastest and slowest of the timed steps
    step_ms_max: float
    memory_bytes: int  # state.nbytes, or the KV cache's bytes
    peak_delta_bytes: int  # peak memory while filling and decoding, above the level before


@dataclass
class Machine:
    cpu: str
    cores: int  # logical CPUs of the machine
    threads: int  # torch's intra-op threads in this run
    torch: str
    device: str
    bandwidth_gb_s: float  # measured by ``bandwidth``
    load: float  # the machine's 1-minute load average when the run started


@dataclass
class Run:
    """A whole ``benchmark`` sweep, as ``rnnify bench`` writes it to ``--json``."""

    command: str  # the command line that made it, or "" from Python
    machine: Machine
    target: str
    dtype: str
    weight_bytes: int  # bytes of weights read per decoded token
    results: list[Result] = field(default_factory=list)
    prefill_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # model -> context -> ms
    warnings: list[str] = field(
        default_factory=list
    )  # why the timings may not be trusted (busy_warning, timing_warning)

    @property
    def limit_ms(self) -> float:
        """Batch-1 decode limit: weights read per token over the measured memory bandwidth."""
        return self.weight_bytes / (self.machine.bandwidth_gb_s * 1e9) * 1e3

    def to_json(self) -> dict:
        return {**asdict(self), "limit_ms": self.limit_ms}


# -- the sweep -------------------------------------------------------------------------------


def benchmark(
    model_or_dir: RecurrentModel | str | os.PathLike,
    contexts: Sequence[int] = BENCH_CONTEXTS,
    batches: Sequence[int] = BENCH_BATCHES,
    *,
    against: str | os.PathLike | torch.nn.Module | None = None,
    device: torch.device | str | None = None,
    dtype: str | None = None,
    kernels: str | None = None,
    steps: int = BENCH_STEPS,
    prefill_max: int = BENCH_PREFILL_MAX,
    compile: bool = False,
    command: str = "",
    progress: bool = False,
) -> Run:
    """Time decode steps after each context length at each batch size, and prefill up to ``prefill_max``.

    ``against`` is the original model (a Hugging Face directory, cached hub id or loaded model),
    measured the same way decoding with transformers' KV cache. ``device`` and ``kernels`` are how
    a directory is loaded (``rnnify.load``'s meanings); a loaded model runs as it is. ``dtype``, when
    given, must be the model's: a check that the numbers are for the dtype meant. ``compile``
    decodes with ``torch.compile`` of the step graph (the model is changed in place); otherwise a
    directory whose step this machine compiled ahead of time (``rnnify compile``) decodes with it. ``progress``
    shows a tqdm bar of runs on a terminal. ``Run.warnings`` says when the numbers may not be
    trusted: a busy machine at the start (``busy_warning``), timings that disagree (``timing_warning``).
    """
    from rnnify.runtime.storage import load_or_take

    load = _load_average()  # before this run's own work adds to it

    _check_counts("contexts (--contexts)", contexts)
    _check_counts("batches (--batch)", batches)
    if not isinstance(steps, int) or steps < 1:
        raise RnnifyError(f"steps (--steps) must be an integer >= 1, got {steps!r}")
    model = load_or_take(model_or_dir, device, kernels, "benchmark")
    if dtype is not None and dtype != model.manifest.dtype:
        where = model.path if model.path is not None else "the model"
        raise RnnifyError(
            f"{where} holds {model.manifest.dtype} weights; convert with --dtype {dtype} to bench {dtype}"
        )
    limit, what = model.manifest.token_limit() or (None, None)
    if limit is not None and max(contexts) + steps + WARMUP >= limit:
        raise RnnifyError(
            f"contexts (--contexts) {max(contexts)}: past the model's {limit} {what}; "
            f"keep contexts below {limit - steps - WARMUP}"
        )
    device = model.device
    if compile:
        model.compile_step()
    aot = " (step compiled ahead of time)" if model.step_package is not None else ""
    original = None
    if against is not None:
        from rnnify.compiler.capture import load_source, source_name
        from rnnify.original.teacher import check_vocabulary

        original = load_source(against, dtype=model.dtype).to(device)
        check_vocabulary(original, model, source_name(against) or type(against).__name__)
    run = Run(
        command=command,
        machine=machine(device, load),
        target=model.target + (" (compiled step)" if compile else aot),
        dtype=str(model.dtype).removeprefix("torch."),
        weight_bytes=model.weight_nbytes_per_token(),
    )
    # Read every weight once (they are memory-mapped) so page-ins do not count as decode memory.
    bench_converted(model, 1, 1, 1, 0, 1)
    if original is not None:
        bench_original(original, 1, 1, 1, 0)
    jobs = [(b, c) for b in batches for c in contexts]
    prefills = [c for c in contexts if c <= prefill_max]
    models = 1 + (original is not None)
    from rnnify.progress import bar as progress_bar

    with progress_bar(progress, total=(len(jobs) + len(prefills)) * models, unit="run", leave=False) as bar:
        for b, c in jobs:
            bar.set_description_str(f"converted, batch {b}, context {c}")
            run.results.append(bench_converted(model, c, b, steps, WARMUP, FILL_TOKENS))
            bar.update()
            if original is not None:
                bar.set_description_str(f"original, batch {b}, context {c}")
                run.results.append(bench_original(original, c, b, steps, WARMUP))
                bar.update()
        runners = {"converted": model.prefill}
        if original is not None:
            runners["original"] = lambda ids: original(input_ids=ids, use_cache=False)
        for name, call in runners.items():
            for c in prefills:
                bar.set_description_str(f"{name} prefill, context {c}")
                run.prefill_ms.setdefault(name, {})[c] = prefill_ms(call, model.manifest.vocab_size, c, device)
                bar.update()
    warnings = [
        busy_warning(run.machine) if device.type == "cpu" else None,
        timing_warning(run.results, model.constant_memory),
    ]
    run.warnings = [w for w in warnings if w is not None]
    return run


def _check_counts(name: str, values: Sequence[int]) -> None:
    if not values or any(not isinstance(v, int) or v < 1 for v in values):
        raise RnnifyError(f"{name} must be positive integers, e.g. 256,1024; got {list(values)!r}")


# -- the machine ------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bandwidth(device: torch.device, nbytes: int = 1 << 28, repeats: int = 7) -> float:
    """Memory bandwidth in GB/s: the best of reading a large tensor (sum) and copying it (read + write)."""
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)
    best = 0.0
    for op, moved in ((lambda: x.sum(), nbytes), (lambda: y.copy_(x), 2 * nbytes)):
        op()
        best = max(best, moved / min(_timed(op, device) for _ in range(repeats)) / 1e9)
    return best


def machine(device: torch.device, load: float | None = None) -> Machine:
    """This machine, ``load`` being its load average when the run started (default: now)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    load = _load_average() if load is None else load
    return Machine(
        _cpu_model(), os.cpu_count() or 0, torch.get_num_threads(), torch.__version__, name, bandwidth(device), load
    )


def _load_average() -> float:
    """Runnable tasks over the last minute, averaged over the whole machine (0 where unknown)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


# -- whether to trust the numbers -------------------------------------------------------------


BUSY_SLACK = 0.25  # load an idle machine shows anyway (daemons, this process starting)


def busy_warning(machine: Machine) -> str | None:
    """A warning when, at the start, other work left fewer idle CPUs than this run has threads.

    The load average counts the whole machine's runnable tasks, so it is compared with the
    machine's CPUs (not this process's share of them): threads beyond the idle CPUs share a core
    with other work, and every operation then waits for its slowest thread.
    """
    idle = machine.cores - machine.load
    if idle + BUSY_SLACK >= machine.threads:
        return None
    fewer = "fewer threads (--threads) or " if machine.threads > 1 else ""
    return (
        f"the machine was busy: load average {machine.load:.1f} on {machine.cores} CPUs leaves "
        f"{max(idle, 0):.1f} idle for {machine.threads} thread{'s' * (machine.threads > 1)}; timings may be "
        f"slow and erratic (try {fewer}an idle machine)"
    )


def timing_warning(results: Sequence[Result], constant_memory: bool) -> str | None:
    """A warning when timings of the same work disagree by more than ``SPREAD``: the timed steps of
    one measurement, or (``constant_memory``) the converted model's median steps at one batch size
    over the contexts, whose state and work are the same at every context (docs/performance.md)."""
    spreads = [
        (
            r.step_ms_max / r.step_ms_min,
            f"{r.model}, batch {r.batch}, context {r.context:,}: steps took "
            f"{r.step_ms_min:.3g} to {r.step_ms_max:.3g} ms",
        )
        for r in results
        if r.step_ms_min > 0
    ]
    if constant_memory:
        for batch in sorted({r.batch for r in results}):
            rows = [r for r in results if r.model == "converted" and r.batch == batch]
            if len(rows) > 1:
                fast, slow = min(rows, key=lambda r: r.step_ms), max(rows, key=lambda r: r.step_ms)
                spreads.append(
                    (
                        slow.step_ms / fast.step_ms,
                        f"converted, batch {batch}: {fast.step_ms:.3g} ms at "
                        f"{fast.context:,} tokens but {slow.step_ms:.3g} ms at {slow.context:,}, same work",
                    )
                )
    bad = [(spread, text) for spread, text in spreads if spread > SPREAD]
    if not bad:
        return None
    worst = max(bad)[1]
    return (
        f"timings disagree by more than {SPREAD:g}x in {len(bad)} of {len(spreads)} comparisons (worst: {worst}); "
        "other work on the machine, or more threads than idle cores: rerun on an idle machine, with fewer threads"
    )


# -- measuring --------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss() -> int:
    """Resident set size of this process now (Linux), in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


class _Peak:
    """Peak memory above the level at entry: CUDA's allocator peak, or RSS sampled by ``sample``."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> "_Peak":
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = _rss()
        self.peak = self.base
        return self

    def sample(self) -> None:
        if self.device.type != "cuda":
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self.sample()

    @property
    def delta(self) -> int:
        return max(0, self.peak - self.base)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _time_steps(step: Callable[[], None], device: torch.device, steps: int, warmup: int, sample) -> list[float]:
    """Milliseconds of each of ``steps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        times.append(_timed(step, device) * 1e3)
        sample()
    return times


def _result(model: str, batch: int, context: int, times: list[float], nbytes: int, peak: "_Peak") -> Result:
    ms = statistics.median(times)
    return Result(model, batch, context, ms, batch / ms * 1e3, min(times), max(times), nbytes, peak.delta)


def _tokens(vocab: int, batch: int, length: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).to(device)


# -- the converted model ----------------------------------------------------------------------


def fill_state(model, context: int, batch: int, fill_tokens: int, seed: int = 0):
    """A state as if ``context`` tokens had been read (see the module docstring for how)."""
    device, vocab = model.device, model.manifest.vocab_size
    if model.constant_memory:
        windows = [getattr(cell, "window", None) or cell.spec.keys_read or 0 for cell in model.cells]
        read = min(context, max(fill_tokens, *windows))  # every sliding window full
        _, state = model.prefill(_tokens(vocab, batch, read, device, seed))
        return replace(state, positions=torch.full_like(state.positions, context))
    leaves = [part for cell in model.cells for part in getattr(cell, "parts", [cell])]  # a per-head cell's parts
    if any(c.grows_with_context and c.target != "exact" for c in leaves):
        raise RnnifyError("bench can fill the growing state of 'exact' cells only")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = []
    for cell in leaves:
        spec = cell.spec
        if cell.grows_with_context:
            # an exact cache keeps fewer valid keys than its chunk (the next token starts a chunk when full)
            n = context if spec.keys_read is None else min(context, spec.window or spec.chunk - 1)
            keys = torch.randn(batch, spec.num_kv_heads, n, spec.head_dim, generator=gen, dtype=model.dtype)
            values = torch.randn(batch, spec.num_kv_heads, n, spec.value_dim, generator=gen, dtype=model.dtype)
            valid = torch.ones(batch, n, dtype=torch.bool)
            index = [torch.randn(batch, n, spec.index_dim, generator=gen, dtype=model.dtype)] if spec.selects else []
            tensors += [t.to(device) for t in (keys, values, valid, *index)]
        else:
            tensors += list(cell.init_state(batch, device, model.dtype))
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    return replace(model.init_state(batch), tensors=tuple(tensors), positions=positions)


@torch.no_grad()
def bench_converted(model, context: int, batch: int, steps: int, warmup: int, fill_tokens: int) -> Result:
    device = model.device
    with _Peak(device) as peak:
        state = fill_state(model, context, batch, fill_tokens)
        peak.sample()
        nbytes = state.nbytes
        token = _tokens(model.manifest.vocab_size, batch, 1, device, 1)
        holder = [state]

        def step() -> None:
            _, holder[0] = model.step(token, holder[0])  # noqa: F821 (ruff misreads the closure)

        times = _time_steps(step, device, steps, warmup, peak.sample)
        del holder, state
    return _result("converted", batch, context, times, nbytes, peak)


@torch.no_grad()
def prefill_ms(run: Callable[[torch.Tensor], object], vocab: int, context: int, device: torch.device) -> float:
    """Milliseconds to read ``context`` random tokens in one call (batch 1, after one short warm-up)."""
    run(_tokens(vocab, 1, min(context, 16), device, 2))
    ids = _tokens(vocab, 1, context, device, 3)
    _sync(device)
    start = time.perf_counter()
    run(ids)
    _sync(device)
    return (time.perf_counter() - start) * 1e3


# -- the original with its KV cache -----------------------------------------------------------


def kv_cache(hf_model, context: int, batch: int, seed: int = 0):
    """A ``DynamicCache`` holding random keys/values of ``context`` tokens in every layer."""
    from transformers import DynamicCache

    config = hf_model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    device, dtype = hf_model.device, hf_model.dtype
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        keys = torch.randn(batch, kv_heads, context, head_dim, generator=gen, dtype=dtype).to(device)
        values = torch.randn(batch, kv_heads, context, head_dim, generator=gen, dtype=dtype).to(device)
        cache.update(keys, values, layer)
    return cache


def cache_nbytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.no_grad()
def bench_original(hf_model, context: int, batch: int, steps: int, warmup: int) -> Result:
    device = hf_model.device
    with _Peak(device) as peak:
        cache = kv_cache(hf_model, context, batch)
        peak.sample()
        nbytes = cache_nbytes(cache)
        token = _tokens(hf_model.config.get_text_config().vocab_size, batch, 1, device, 1)
        position = [context]

        def step() -> None:
            ids = torch.full((batch, 1), position[0], device=device)
            hf_model(input_ids=token, cache=cache, position_ids=ids, use_cache=True)  # noqa: F821 (as above)
            position[0] += 1

        times = _time_steps(step, device, steps, warmup, peak.sample)
        del cache
    return _result("original", batch, context, times, nbytes, peak)


# -- plots ------------------------------------------------------------------------------------


def check_plot(path: str) -> None:
    """Refuse a plot file that cannot be written (matplotlib missing, a format it does not know) now,
    rather than after the benchmark."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:
        raise RnnifyError("--plot needs matplotlib: pip install 'rnnify[plots]'") from exc
    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lower().lstrip(".") not in formats:
        raise RnnifyError(f"--plot {path}: the file's extension names its format, one of {', '.join(sorted(formats))}")


def plot(run: Run, path: str) -> None:
    """Two panels: decode latency vs context, and state / KV-cache bytes vs context (log scales)."""
    check_plot(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (latency, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"converted": "o-", "original": "s--"}
    labels = {"converted": f"rnnify {run.target}", "original": "original + KV cache"}
    for (model, batch), rows in _series(run).items():
        contexts = [r.context for r in rows]
        latency.plot(contexts, [r.step_ms for r in rows], styles[model], label=f"{labels[model]}, batch {batch}")
        memory.plot(
            contexts, [r.memory_bytes / 2**20 for r in rows], styles[model], label=f"{labels[model]}, batch {batch}"
        )
    latency.axhline(run.limit_ms, color="grey", lw=0.8, label="weight-bandwidth limit (batch 1)")
    latency.set(
        xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per decode step", title="decode latency"
    )
    memory.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="MiB", title="state vs KV cache")
    for ax in (latency, memory):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    threads = run.machine.threads
    fig.suptitle(f"{run.machine.device}, {run.dtype}, {threads} thread{'s' * (threads > 1)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series(run: Run) -> dict[tuple[str, int], list[Result]]:
    series: dict[tuple[str, int], list[Result]] = {}
    for r in run.results:
        series.setdefault((r.model, r.batch), []).append(r)
    return series
