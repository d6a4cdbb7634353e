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
import collections
import contextlib
import functools
import gc
import importlib
import inspect
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import warnings
import zlib
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rnnify.kernels as K  # noqa: E402
from rnnify.kernels import utils  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OPS = (
    "chunk_linear_attn",
    "fused_recurrent_linear_attn",
    "linear_recurrence",
    "aaren_scan",
    "window_attn_step",
    "chunk_delta_rule",
    "fused_recurrent_delta_rule",
)
DELTA_VARIANTS = ("plain", "g")  # the delta rule, and gated (Gated DeltaNet)
VARIANTS = ("plain", "plain-tf32", "g", "gk", "normalize", "hedgehog")
DECODE_VARIANTS = ("plain", "g", "gk")
IMPLS = ("triton", "reference", "fla", "sdpa")
COLORS = {"triton": "C0", "reference": "C1", "fla": "C2", "sdpa": "C3"}  # the same in every panel
GOAL_SHAPE = (1, 32, 128, 8192)  # B, H, D, T where chunk_linear_attn should match fla's chunk kernel
GOAL_SDPA_T, GOAL_SDPA_RATIO = 32768, 5.0
GOAL_DECODE_SPREAD = 1.25  # slowest / fastest decode step over the contexts still counts as "independent of T"
ERR_FLAG = 2e-2  # bf16 rows further than this from the reference are flagged


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


@dataclass(frozen=True)
class Case:
    """One row: an implementation of an op at one size, in one mode."""

    section: str  # "prefill" (T tokens) or "decode" (one token after T)
    op: str  # the rnnify op (fla rows: the op they stand beside), or "sdpa"
    variant: str
    impl: str  # one of IMPLS
    mode: str  # "fwd", "fwd+bwd" or "step"
    B: int
    H: int
    D: int
    T: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.B, self.H, self.D, self.T


@dataclass
class Run:
    """Settings of one benchmark run."""

    device: torch.device
    dtype: torch.dtype
    repeat: int
    warmup: int
    case_seconds: float
    reference_max_len: int | None
    time_budget: float | None
    triton: bool
    fla: bool


# --------------------------------------------------------------------------- inputs


class Inputs:
    """Seeded tensors of one (B, H, D, T), each made on first use: a case builds only what it reads."""

    def __init__(self, shape, dtype, device, state_backend: str):
        self.shape, self.dtype, self.device, self.state_backend = shape, dtype, device, state_backend
        self._made: dict = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._made:
            self._made[name] = self._make(name)
        return self._made[name]

    def _randn(self, name, *size, dtype=None):
        gen = torch.Generator(self.device).manual_seed(zlib.crc32(name.encode()))
        return torch.randn(*size, generator=gen, device=self.device).to(dtype or self.dtype)

    def _make(self, name: str) -> torch.Tensor:
        B, H, D, T = self.shape
        f32, r = torch.float32, self._randn
        makers = {
            "q": lambda: r(name, B, T, H, D),
            "k": lambda: r(name, B, T, H, D),
            "v": lambda: r(name, B, T, H, D),
            "g": lambda: F.logsigmoid(r(name, B, T, H, dtype=f32) + 4),
            "gk": lambda: F.logsigmoid(r(name, B, T, H, D, dtype=f32) + 4),
            # hedgehog as the cells build it (W [H_kv, D, F/2], F = 2D), near its identity init
            "w": lambda: (torch.eye(D, device=self.device) + 0.1 * r(name, H, D, D, dtype=f32)).to(self.dtype),
            "a": lambda: torch.sigmoid(r(name, B, T, H * D, dtype=f32) + 2).to(self.dtype),
            "b": lambda: r(name, B, T, H * D),
            "s": lambda: r(name, B, T, H, dtype=f32),
            "q1": lambda: r(name, B, 1, H, D),
            "k1": lambda: r(name, B, 1, H, D),
            "v1": lambda: r(name, B, 1, H, D),
            "g1": lambda: F.logsigmoid(r(name, B, 1, H, dtype=f32) + 4),
            "gk1": lambda: F.logsigmoid(r(name, B, 1, H, D, dtype=f32) + 4),
            "cache_k": lambda: self["k"].transpose(1, 2).contiguous(),  # [B, H, T, D], a KV cache's layout
            "cache_v": lambda: self["v"].transpose(1, 2).contiguous(),
            "sink_k": lambda: self["cache_k"][:, :, :4].contiguous(),
            "sink_v": lambda: self["cache_v"][:, :, :4].contiguous(),
            "length": lambda: torch.full((B,), 10 * T, dtype=torch.long, device=self.device),
            # the delta rule: unit q, k and a writing strength beta in (0, 1)
            "qn": lambda: F.normalize(self["q"].float(), dim=-1).to(self.dtype),
            "kn": lambda: F.normalize(self["k"].float(), dim=-1).to(self.dtype),
            "beta": lambda: torch.sigmoid(r(name, B, T, H, dtype=f32)),
            "qn1": lambda: F.normalize(self["q1"].float(), dim=-1).to(self.dtype),
            "kn1": lambda: F.normalize(self["k1"].float(), dim=-1).to(self.dtype),
            "beta1": lambda: torch.sigmoid(r(name, B, 1, H, dtype=f32)),
        }
        if name.startswith("state_"):  # the recurrent state after the T-token context
            return self._context_state(name.removeprefix("state_"))
        if name.startswith("deltastate_"):
            with torch.no_grad():
                return K.chunk_delta_rule(
                    self["qn"],
                    self["kn"],
                    self["v"],
                    self["beta"],
                    **DELTA[name.removeprefix("deltastate_")](self),
                    output_final_state=True,
                    backend=self.state_backend,
                )[1]
        if name not in makers:
            raise KeyError(name)
        return makers[name]()

    def _context_state(self, variant: str) -> torch.Tensor:
        with torch.no_grad():
            return K.chunk_linear_attn(
                self["q"],
                self["k"],
                self["v"],
                **CHUNK[variant][0](self),
                output_final_state=True,
                backend=self.state_backend,
            )[1]

    def grad_out(self, o: torch.Tensor) -> torch.Tensor:
        """The output gradient of a forward+backward row (one per output shape)."""
        key = f"do{tuple(o.shape)}"
        if key not in self._made:
            self._made[key] = self._randn("do", *o.shape, dtype=o.dtype)
        return self._made[key]


# --------------------------------------------------------------------------- what each case runs

# chunk_linear_attn's arguments per variant, and the extra inputs a forward+backward differentiates
CHUNK = {
    "plain": (lambda x: {}, ()),
    "plain-tf32": (lambda x: {}, ()),
    "g": (lambda x: {"g": x["g"]}, ("g",)),
    "gk": (lambda x: {"gk": x["gk"]}, ("gk",)),
    "normalize": (lambda x: {"normalize": True, "feature_map": "elu"}, ()),
    "hedgehog": (lambda x: {"feature_map": "hedgehog", "feature_weight": x["w"]}, ("w",)),
}
DECODE = {"plain": lambda x: {}, "g": lambda x: {"g": x["g1"]}, "gk": lambda x: {"gk": x["gk1"]}}
# fla's counterparts: variant -> (module, function, arguments, extra inputs differentiated). fla's
# normalize divides by q . cumsum(k) of the raw q, k: the same work as ours, not the same numbers.
FLA_CHUNK = {
    "plain": ("fla.ops.linear_attn", "chunk_linear_attn", lambda x: {"normalize": False}, ()),
    "g": ("fla.ops.simple_gla", "chunk_simple_gla", lambda x: {"g": x["g"]}, ("g",)),
    "gk": ("fla.ops.gla", "chunk_gla", lambda x: {"g": x["gk"]}, ("gk",)),
    "normalize": ("fla.ops.linear_attn", "chunk_linear_attn", lambda x: {"normalize": True}, ()),
}
FLA_DECODE = {
    "plain": ("fla.ops.linear_attn", "fused_recurrent_linear_attn", lambda x: {"normalize": False}),
    "g": ("fla.ops.simple_gla", "fused_recurrent_simple_gla", lambda x: {"g": x["g1"]}),
    "gk": ("fla.ops.gla", "fused_recurrent_gla", lambda x: {"gk": x["gk1"]}),
}
# the delta rule: our arguments per variant (prefill, decode), fla's (module, function, arguments, extra inputs)
DELTA = {"plain": lambda x: {}, "g": lambda x: {"g": x["g"]}}
DELTA_DECODE = {"plain": lambda x: {}, "g": lambda x: {"g": x["g1"]}}
FLA_DELTA_CHUNK = {
    "plain": ("fla.ops.delta_rule", "chunk_delta_rule", lambda x: {"beta": x["beta"]}, ("beta",)),
    "g": (
        "fla.ops.gated_delta_rule",
        "chunk_gated_delta_rule",
        lambda x: {"g": x["g"], "beta": x["beta"]},
        ("g", "beta"),
    ),
}
FLA_DELTA_DECODE = {
    "plain": ("fla.ops.delta_rule", "fused_recurrent_delta_rule", lambda x: {"beta": x["beta1"]}),
    "g": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule", lambda x: {"g": x["g1"], "beta": x["beta1"]}),
}
FLA_SAME_MATH = ("plain", "g", "gk")  # variants whose fla rows are checked against our reference
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")  # tried in this order


def fla_function(module: str, name: str):
    fn = getattr(importlib.import_module(module), name)
    if "head_first" in inspect.signature(fn).parameters:  # older fla took [B, H, T, D] unless told otherwise
        fn = functools.partial(fn, head_first=False)
    return fn


@functools.lru_cache(maxsize=None)
def sdpa_backend(device: str, dtype: torch.dtype, D: int, decode: bool) -> str:
    """The first SDPA backend, flash first, that runs such inputs (the rows record which one ran)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 1 if decode else 16, D, device=device, dtype=dtype)
    kv = torch.randn(1, 2, 16, D, device=device, dtype=dtype)
    for name in SDPA_BACKENDS:
        try:
            with warnings.catch_warnings(), sdpa_kernel(getattr(SDPBackend, name)):
                warnings.simplefilter("ignore")
                F.scaled_dot_product_attention(q, kv, kv, is_causal=not decode)
            return name
        except RuntimeError:
            continue
    raise NotImplementedError(f"no SDPA backend runs {dtype} D={D} on {device}")


def sdpa_call(case: Case, run: Run):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = sdpa_backend(str(run.device), run.dtype, case.D, case.section == "decode")

    def call(x):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            if case.section == "decode":  # one query against the T-key cache
                o = F.scaled_dot_product_attention(x["q1"].transpose(1, 2), x["cache_k"], x["cache_v"])
            else:
                q, k, v = (x[n].transpose(1, 2) for n in "qkv")
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return o.transpose(1, 2)

    return (
        call,
        ("q", "k", "v"),
        {"kernel": f"torch.nn.functional.scaled_dot_product_attention[{backend}]", "sdpa_backend": backend},
    )


def build(case: Case, run: Run):
    """What a case runs: ``(call(x) -> output, names of the inputs differentiated, row info)``."""
    if case.impl == "sdpa":
        return sdpa_call(case, run)
    if case.impl == "fla":
        return fla_call(case)
    b, qkv = case.impl, ("q", "k", "v")
    info = {"kernel": f"rnnify.kernels.{case.op}"}
    if case.op == "chunk_linear_attn":
        kw, extra = CHUNK[case.variant]
        return lambda x: K.chunk_linear_attn(x["q"], x["k"], x["v"], **kw(x), backend=b)[0], qkv + extra, info
    if case.op == "fused_recurrent_linear_attn":
        return (
            (
                lambda x: K.fused_recurrent_linear_attn(
                    x["q1"],
                    x["k1"],
                    x["v1"],
                    **DECODE[case.variant](x),
                    initial_state=x[f"state_{case.variant}"],
                    output_final_state=True,
                    backend=b,
                )[0]
            ),
            (),
            info,
        )
    if case.op == "linear_recurrence":
        return lambda x: K.linear_recurrence(x["a"], x["b"], backend=b)[0], ("a", "b"), info
    if case.op == "aaren_scan":
        return lambda x: K.aaren_scan(x["s"], x["v"], backend=b)[0], ("s", "v"), info
    if case.op == "chunk_delta_rule":
        extra = ("beta",) + (("g",) if case.variant == "g" else ())
        return (
            (lambda x: K.chunk_delta_rule(x["qn"], x["kn"], x["v"], x["beta"], **DELTA[case.variant](x), backend=b)[0]),
            ("qn", "kn", "v", *extra),
            info,
        )
    if case.op == "fused_recurrent_delta_rule":
        return (
            (
                lambda x: K.fused_recurrent_delta_rule(
                    x["qn1"],
                    x["kn1"],
                    x["v1"],
                    x["beta1"],
                    **DELTA_DECODE[case.variant](x),
                    initial_state=x[f"deltastate_{case.variant}"],
                    output_final_state=True,
                    backend=b,
                )[0]
            ),
            (),
            info,
        )
    if case.op == "window_attn_step":
        return (
            (
                lambda x: K.window_attn_step(
                    x["q1"],
                    x["k1"],
                    x["v1"],
                    x["cache_k"],
                    x["cache_v"],
                    x["length"],
                    x["sink_k"],
                    x["sink_v"],
                    backend=b,
                )[0]
            ),
            (),
            info,
        )
    raise ValueError(f"unknown op {case.op!r}")


def fla_call(case: Case):
    """fla's kernel beside ``case``'s op: its recurrent form after a state for a decode row, its
    chunked form over the prompt otherwise; the delta rule reads the L2-normalised q and k."""
    delta = case.op in ("chunk_delta_rule", "fused_recurrent_delta_rule")
    q, k = ("qn", "kn") if delta else ("q", "k")
    if case.section == "decode":
        module, name, kw = (FLA_DELTA_DECODE if delta else FLA_DECODE)[case.variant]
        fn, state = fla_function(module, name), f"{'deltastate' if delta else 'state'}_{case.variant}"

        def call(x):
            return fn(q=x[q + "1"], k=x[k + "1"], v=x["v1"], **kw(x), initial_state=x[state], output_final_state=True)[
                0
            ]

        return call, (), {"kernel": f"{module}.{name}"}
    module, name, kw, extra = (FLA_DELTA_CHUNK if delta else FLA_CHUNK)[case.variant]
    fn = fla_function(module, name)
    return lambda x: fn(q=x[q], k=x[k], v=x["v"], **kw(x))[0], (q, k, "v", *extra), {"kernel": f"{module}.{name}"}


@contextlib.contextmanager
def dot_precision(value: str):
    """tl.dot's precision for the kernels launched inside (read at launch, forward and backward)."""
    saved, utils.DOT_PRECISION = utils.DOT_PRECISION, value
    try:
        yield
    finally:
        utils.DOT_PRECISION = saved


def timed_function(case: Case, call, leaves, x: Inputs):
    """The function timed: the output (fwd, step) or the leaves' gradients (fwd+bwd)."""
    precision = "tf32" if case.variant == "plain-tf32" else utils.DOT_PRECISION
    if case.mode != "fwd+bwd":

        def fn():
            with torch.no_grad(), dot_precision(precision):
                return [call(x)]

        return fn
    params = {n: x[n].detach().requires_grad_() for n in leaves}
    xs = collections.ChainMap(params, x)

    def fn():
        with dot_precision(precision):
            o = call(xs)
            return list(torch.autograd.grad(o, list(params.values()), x.grad_out(o)))

    return fn


# --------------------------------------------------------------------------- timing


def call_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def time_ms(fn, run: Run):
    """(median ms, calls timed, the first call's output); the first call compiles or autotunes."""
    out = fn()
    for _ in range(run.warmup):
        fn()
    times, start = [], time.perf_counter()
    while len(times) < run.repeat and (len(times) < 3 or time.perf_counter() - start < run.case_seconds):
        times.append(call_ms(fn, run.device))
    return statistics.median(times), len(times), out


def rel_err(out: list, ref: list):
    """max |out - ref| / max |ref| over the tensors both return (outputs, or gradients in order);
    a string instead where they cannot be compared: "nan" (not finite) or the shapes that differ."""
    worst = 0.0
    for a, b in zip(out, ref):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
        if not math.isfinite(err):
            return "nan"
        worst = max(worst, err)
    return worst


def failure_status(e: BaseException) -> str:
    text = str(e).lower()
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text:
        return "oom"
    if isinstance(e, NotImplementedError) or type(e).__name__ == "OutOfResources" or "no available kernel" in text:
        return "unsupported"
    return "error"


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(case: Case, x: Inputs, refs: dict, run: Run) -> dict:
    """One case's row fields; a failure becomes the row's status instead of an exception."""
    failure = None
    try:
        call, leaves, info = build(case, run)
        ms, calls, out = time_ms(timed_function(case, call, leaves, x), run)
    except Exception as e:  # noqa: BLE001 - any size or backend that cannot run is a row, not a crash
        failure = {"status": failure_status(e), "error": f"{type(e).__name__}: {e}"[:500]}
    if failure:  # freed here, once the exception's frames (and their tensors) are gone
        free_memory(run.device)
        return failure
    row = {"status": "ok", "ms": ms, "calls": calls, **info}
    key = (case.section, case.op, case.variant, case.mode)
    if case.impl == "reference":
        refs[key] = out
    elif key in refs and (case.impl == "triton" or case.variant in FLA_SAME_MATH):
        row["err_vs_reference"] = rel_err(out, refs[key])
    return row


def context_lost(row: dict, device: torch.device) -> str | None:
    """After a CUDA error, whether the context still works: a sticky error fails every later row."""
    if device.type != "cuda" or row["status"] != "error":
        return None
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        return f"CUDA context lost after: {row['error']}"
    return None


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


def goal_case(c: Case) -> bool:
    """Rows the goals read: run first, so a run cut short by its time budget still answers them."""
    if c.section == "decode":
        pairs = {("fused_recurrent_linear_attn", "plain"), ("sdpa", "kv-cache")}
        return (c.op, c.variant) in pairs and c.shape[:3] == GOAL_SHAPE[:3]
    plain = {("chunk_linear_attn", "plain"), ("chunk_linear_attn", "plain-tf32"), ("sdpa", "causal")}
    return (c.op, c.variant) in plain and (c.shape == GOAL_SHAPE or c.T == GOAL_SDPA_T)


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


# --------------------------------------------------------------------------- goals, table, plot


def order(r: dict) -> tuple:
    """Rows and panels in reading order: section, op, variant, mode, size."""
    op = OPS.index(r["op"]) if r["op"] in OPS else len(OPS)
    variant = VARIANTS.index(r["variant"]) if r["variant"] in VARIANTS else len(VARIANTS)
    return (r["section"] != "prefill", op, variant, r["mode"], r["B"], r["H"], r["D"], r["T"])


def row_label(r: dict) -> str:
    size = f"B={r['B']} H={r['H']} D={r['D']} T={r['T']}"
    return f"{r['section']} {r['op']}[{r['variant']}] {r['impl']} {r['mode']} {size}"


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['ms']:.3f}" if r["status"] == "ok" else r["status"]


def find(rows, **key) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in key.items())), None)


def verdict(goal: str, met: bool | None, detail: str) -> dict:
    return {"goal": goal, "verdict": "not measured" if met is None else ("met" if met else "not met"), "detail": detail}


def missing(rows, why: dict, **key) -> str:
    """A row a goal reads: its time, its status and error, or why it never ran."""
    r, impl = find(rows, **key), key["impl"]
    if r is None:
        return f"{impl}: {why.get(impl, 'not run')}"
    return f"{impl}: " + (f"{r['ms']:.3f} ms" if r["status"] == "ok" else f"{r['status']} ({r.get('error', '')[:120]})")


def goal_fla(rows, why: dict, mode: str) -> dict:
    B, H, D, T = GOAL_SHAPE
    at = dict(section="prefill", op="chunk_linear_attn", variant="plain", mode=mode, B=B, H=H, D=D, T=T)
    goal = f"chunk_linear_attn {mode} at least as fast as fla's chunk kernel (B={B} H={H} D={D} T={T})"
    ours, fla = find(rows, impl="triton", **at), find(rows, impl="fla", **at)
    if not (ours and fla and ours["status"] == fla["status"] == "ok"):
        return verdict(goal, None, "; ".join(missing(rows, why, impl=i, **at) for i in ("triton", "fla")))
    tf32 = find(rows, impl="triton", **{**at, "variant": "plain-tf32"})
    extra = f"; with tf32 dots {tf32['ms']:.3f} ms" if tf32 and tf32["status"] == "ok" else ""
    return verdict(
        goal,
        ours["ms"] <= fla["ms"],
        f"rnnify {ours['ms']:.3f} ms, fla {fla['ms']:.3f} ms ({fla['ms'] / ours['ms']:.2f}x){extra}",
    )


def goal_sdpa(rows, mode: str) -> dict:
    goal = f"chunk_linear_attn {mode} at least {GOAL_SDPA_RATIO:g}x faster than SDPA at T={GOAL_SDPA_T}"
    ratios = []
    for ours in rows:
        if (ours["op"], ours["variant"], ours["impl"], ours["mode"], ours["T"], ours["status"]) == (
            "chunk_linear_attn",
            "plain",
            "triton",
            mode,
            GOAL_SDPA_T,
            "ok",
        ):
            sdpa = find(
                rows, op="sdpa", section="prefill", mode=mode, status="ok", **{k: ours[k] for k in ("B", "H", "D", "T")}
            )
            if sdpa:
                ratios.append(
                    (
                        sdpa["ms"] / ours["ms"],
                        f"B={ours['B']} H={ours['H']} D={ours['D']}: "
                        f"{ours['ms']:.2f} vs {sdpa['ms']:.2f} ms ({sdpa['ms'] / ours['ms']:.2f}x)",
                    )
                )
    if not ratios:
        return verdict(goal, None, f"no size at T={GOAL_SDPA_T} with both a Triton and an SDPA {mode} row")
    return verdict(goal, min(r for r, _ in ratios) >= GOAL_SDPA_RATIO, "; ".join(d for _, d in ratios))


def goal_decode(rows) -> dict:
    goal = f"fused_recurrent_linear_attn decode step independent of T (spread <= {GOAL_DECODE_SPREAD:g}x)"
    steps = collections.defaultdict(dict)
    for r in rows:
        if (r["op"], r["variant"], r["impl"], r["status"]) == ("fused_recurrent_linear_attn", "plain", "triton", "ok"):
            steps[r["B"], r["H"], r["D"]][r["T"]] = r["ms"]
    spreads = []
    for (B, H, D), t in steps.items():
        lo, hi = min(t.values()), max(t.values())
        if len(t) > 1:
            spreads.append(
                (hi / lo, f"B={B} H={H} D={D}: {lo:.4f}..{hi:.4f} ms over T={min(t)}..{max(t)} ({hi / lo:.2f}x)")
            )
    if not spreads:
        return verdict(goal, None, "no Triton decode rows at two or more context lengths")
    return verdict(goal, max(s for s, _ in spreads) <= GOAL_DECODE_SPREAD, "; ".join(d for _, d in spreads))


def goals(doc: dict) -> list[dict]:
    """The issue's goals, each met, not met or not measured (with what was missing)."""
    rows, m = doc["rows"], doc["machine"]
    why = {
        "triton": "not run" if m["device"] == "cuda" else "no Triton rows without CUDA",
        "fla": "not run" if m["device"] == "cuda" else "no fla rows without CUDA",
    }
    if m["fla"].startswith("not installed"):
        why["fla"] = f"fla {m['fla']}"
    return [
        goal_fla(rows, why, "fwd"),
        goal_fla(rows, why, "fwd+bwd"),
        goal_sdpa(rows, "fwd"),
        goal_sdpa(rows, "fwd+bwd"),
        goal_decode(rows),
    ]


def checks(rows) -> dict:
    """How far the Triton and fla rows are from the reference at the same sizes."""
    errs = [r for r in rows if "err_vs_reference" in r]
    flagged = [
        f"{row_label(r)}: {r['err_vs_reference']}"
        for r in errs
        if isinstance(r["err_vs_reference"], str) or r["err_vs_reference"] > ERR_FLAG
    ]
    worst = max((r["err_vs_reference"] for r in errs if not isinstance(r["err_vs_reference"], str)), default=None)
    return {"compared": len(errs), "max_err": worst, "threshold": ERR_FLAG, "flagged": flagged}


def print_report(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    rows = doc["rows"]
    table = Table(title=f"rnnify.kernels on {doc['machine']['device_name']} ({doc['config']['dtype']}), ms")
    for name in (
        "section",
        "op",
        "variant",
        "mode",
        "B",
        "H",
        "D",
        "T",
        "triton",
        "reference",
        "fla",
        "sdpa",
        "fla/ours",
        "sdpa/ours",
        "err",
    ):
        table.add_column(name, justify="right" if name not in ("section", "op", "variant", "mode") else "left")
    by_key = collections.defaultdict(dict)
    for r in sorted(rows, key=order):
        by_key[tuple(r[k] for k in ("section", "op", "variant", "mode", "B", "H", "D", "T"))][r["impl"]] = r
    for key, impls in by_key.items():
        if key[1] == "sdpa":
            continue
        sdpa = find(rows, op="sdpa", section=key[0], mode=key[3], B=key[4], H=key[5], D=key[6], T=key[7])
        ours = impls.get("triton") or impls.get("reference")
        errs = " ".join(
            f"{i} {e if isinstance(e, str) else f'{e:.1e}'}"
            for i, r in impls.items()
            if (e := r.get("err_vs_reference")) is not None
        )
        table.add_row(
            *map(str, key),
            cell(impls.get("triton")),
            cell(impls.get("reference")),
            cell(impls.get("fla")),
            cell(sdpa),
            ratio(impls.get("fla"), ours),
            ratio(sdpa, ours),
            errs,
        )
    console.print(table)
    console.print("[bold]Goals[/bold]")
    for g in doc["goals"]:
        console.print(f"  {g['verdict']:>12}  {g['goal']}\n                {g['detail']}")
    c = doc["checks"]
    console.print(
        f"Checks: {c['compared']} rows compared with the reference at the same size, max err {c['max_err']}; "
        f"{len(c['flagged'])} over {c['threshold']}" + "".join(f"\n  {f}" for f in c["flagged"])
    )


def ratio(other: dict | None, ours: dict | None) -> str:
    if not (other and ours and other["status"] == ours["status"] == "ok"):
        return "-"
    return f"{other['ms'] / ours['ms']:.2f}"


def plot(doc: dict, path: Path) -> None:
    """Time vs T, log-log, one panel per op/variant/mode, at the (B, H, D) with the most rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in doc["rows"] if r["status"] == "ok"]
    size = collections.Counter((r["B"], r["H"], r["D"]) for r in ok).most_common(1)
    ok = [r for r in ok if size and (r["B"], r["H"], r["D"]) == size[0][0]]
    panels = list(
        dict.fromkeys(
            (r["section"], r["op"], r["variant"], r["mode"]) for r in sorted(ok, key=order) if r["op"] != "sdpa"
        )
    )
    cols = min(4, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, (section, op, variant, mode) in zip(axes.flat, panels):
        for impl in IMPLS:
            pts = sorted(
                (r["T"], r["ms"])
                for r in ok
                if (r["section"], r["mode"], r["impl"]) == (section, mode, impl)
                and ((r["op"], r["variant"]) == (op, variant) or impl == "sdpa")
            )
            if pts:
                ax.loglog(
                    *zip(*pts),
                    marker="o",
                    ms=3,
                    label=impl,
                    color=COLORS[impl],
                    linestyle="--" if impl == "sdpa" else "-",
                )
        lengths = sorted({r["T"] for r in ok})
        ax.set_xticks(lengths, [f"{t // 1024}k" if t >= 1024 else str(t) for t in lengths], fontsize=7)
        ax.minorticks_off()
        ax.set_title(f"{op}[{variant}] {mode}", fontsize=9)
        ax.set_xlabel("context T" if section == "decode" else "T", fontsize=8)
        ax.set_ylabel("ms", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if not panels:
        axes.flat[0].text(0.5, 0.5, "no measurements", ha="center", va="center")
    m = doc["machine"]
    where = f"B={size[0][0][0]} H={size[0][0][1]} D={size[0][0][2]}" if size else ""
    fig.suptitle(
        f"rnnify.kernels on {m['device_name']} {doc['config']['dtype']} {where} | torch {m['torch']} "
        f"triton {m['triton']} fla {m['fla'].split(' (')[0]}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------- parity (fp32)

# (op, B, T, H, H_kv, D, options): odd lengths, GQA, initial states, gates, fused maps, masks
PARITY = [
    ("chunk_linear_attn", 2, 70, 4, 2, 64, {"state": True}),
    ("chunk_linear_attn", 1, 70, 2, 2, 64, {"gates": "g+gk", "normalize": True, "feature_map": "elu"}),
    ("chunk_linear_attn", 1, 37, 2, 1, 128, {"gates": "gk", "state": True}),
    ("chunk_linear_attn", 2, 70, 2, 2, 64, {"feature_map": "hedgehog", "normalize": True, "mask": True}),
    ("fused_recurrent_linear_attn", 2, 37, 4, 2, 64, {"gates": "g", "state": True}),
    (
        "fused_recurrent_linear_attn",
        2,
        37,
        2,
        2,
        128,
        {"gates": "gk", "normalize": True, "feature_map": "elu", "mask": True},
    ),
    ("fused_recurrent_linear_attn", 2, 1, 4, 4, 128, {"state": True}),
    ("linear_recurrence", 2, 70, 1, 1, 40, {}),
    ("linear_recurrence", 2, 70, 1, 1, 40, {"reverse": True}),
    ("aaren_scan", 2, 37, 3, 3, 70, {}),
    ("window_attn_step", 2, 1, 4, 2, 64, {"window": 37, "sinks": 2}),
    ("chunk_delta_rule", 2, 70, 4, 2, 64, {"state": True, "mask": True}),
    ("chunk_delta_rule", 1, 70, 2, 2, 128, {"gates": "g", "state": True}),
    ("fused_recurrent_delta_rule", 2, 37, 4, 2, 64, {"gates": "g", "state": True, "mask": True}),
]
PARITY_TOL = dict(rtol=1e-3, atol=1e-3)  # fp32 with exact dots: a bug is off by far more


def parity_scan(op, B, T, H, D, opts, r):
    if op == "linear_recurrence":
        x = {"a": torch.sigmoid(r(B, T, D)), "b": r(B, T, D), "initial_state": r(B, D)}

        def call(b, x):
            reverse = opts.get("reverse", False)
            return list(K.linear_recurrence(**x, reverse=reverse, output_final_state=True, backend=b))

        return x, call
    x = {"s": r(B, T, H), "v": r(B, T, H, D), "initial_state": (r(B, H), r(B, H).abs() + 0.5, r(B, H, D))}

    def call(b, x):
        o, state = K.aaren_scan(**x, output_final_state=True, backend=b)
        return [o, *state]

    return x, call


def parity_window(B, H, Hkv, D, opts, r):
    W, S = opts["window"], opts["sinks"]
    x = {
        "q": r(B, 1, H, D),
        "k": r(B, 1, Hkv, D),
        "v": r(B, 1, Hkv, D),
        "keys": r(B, Hkv, W, D),
        "values": r(B, Hkv, W, D),
        "sink_keys": r(B, Hkv, S, D),
        "sink_values": r(B, Hkv, S, D),
    }
    length = torch.tensor([W + S + 5, 3][:B], device=x["q"].device)  # one full window, one barely started

    def call(b, x):
        o, _, (m, u) = K.window_attn_step(**x, length=length, return_stats=True, backend=b)
        return [o, m, u]

    return x, call


def parity_delta(op, B, T, H, Hkv, D, opts, r):
    x = {
        "q": F.normalize(r(B, T, H, D), dim=-1),
        "k": F.normalize(r(B, T, Hkv, D), dim=-1),
        "v": r(B, T, Hkv, D),
        "beta": torch.sigmoid(r(B, T, Hkv)),
    }
    if "g" in opts.get("gates", ""):
        x["g"] = F.logsigmoid(r(B, T, Hkv) + 3)
    if opts.get("state"):
        x["initial_state"] = r(B, Hkv, D, D)
    mask = None
    if opts.get("mask"):  # left padding: the last sequence starts a third of the way in
        mask = torch.ones(B, T, dtype=torch.bool, device=x["q"].device)
        mask[-1, : T // 3] = False

    def call(b, x):
        return list(getattr(K, op)(**x, mask=mask, output_final_state=True, backend=b))

    return x, call


def parity_linear_attn(op, B, T, H, Hkv, D, opts, r):
    fmap, normalize = opts.get("feature_map"), opts.get("normalize", False)
    Fd = 2 * D if fmap == "hedgehog" else D
    gates = opts.get("gates", "").split("+")
    x = {"q": r(B, T, H, D), "k": r(B, T, Hkv, D) / D**0.5, "v": r(B, T, Hkv, D)}
    device = x["q"].device
    if "g" in gates:
        x["g"] = F.logsigmoid(r(B, T, Hkv) + 3)
    if "gk" in gates:
        x["gk"] = F.logsigmoid(r(B, T, Hkv, Fd) + 3)
    if fmap == "hedgehog":
        x["feature_weight"] = torch.eye(D, device=device) + 0.1 * r(Hkv, D, D)
    if opts.get("state"):
        x["initial_state"] = (r(B, Hkv, Fd, D).abs(), r(B, Hkv, Fd).abs()) if normalize else r(B, Hkv, Fd, D)
    mask = None
    if opts.get("mask"):  # left padding: the second sequence starts a third of the way in
        mask = torch.arange(T, device=device) >= torch.tensor([0, T // 3][:B], device=device)[:, None]

    def call(b, x):
        o, h = getattr(K, op)(**x, normalize=normalize, feature_map=fmap, mask=mask, output_final_state=True, backend=b)
        return [o, *(h if isinstance(h, tuple) else (h,))]

    return x, call


def parity_inputs(op, B, T, H, Hkv, D, opts, device):
    """(inputs, call(backend, inputs) -> outputs) of one parity case, seeded, fp32."""
    gen = torch.Generator(device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    if op in ("linear_recurrence", "aaren_scan"):
        return parity_scan(op, B, T, H, D, opts, r)
    if op == "window_attn_step":
        return parity_window(B, H, Hkv, D, opts, r)
    if op in ("chunk_delta_rule", "fused_recurrent_delta_rule"):
        return parity_delta(op, B, T, H, Hkv, D, opts, r)
    return parity_linear_attn(op, B, T, H, Hkv, D, opts, r)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def flat(x: dict) -> list[torch.Tensor]:
    return [t for v in x.values() for t in (v if isinstance(v, tuple) else (v,))]


def parity_case(op, B, T, H, Hkv, D, opts, device) -> dict:
    """Outputs, final states and input gradients of backend="triton" against backend="reference"."""
    row = {"op": op, "B": B, "T": T, "H": H, "H_kv": Hkv, "D": D, "options": opts}
    try:
        x, call = parity_inputs(op, B, T, H, Hkv, D, opts, device)
        results = []
        for backend in ("reference", "triton"):
            xs = {k: tuple(map(leaf, v)) if isinstance(v, tuple) else leaf(v) for k, v in x.items()}
            outs = call(backend, xs)
            gen = torch.Generator(device).manual_seed(1)
            loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=device)).sum() for o in outs)
            results.append([o.detach() for o in outs] + list(torch.autograd.grad(loss, flat(xs), allow_unused=True)))
        pairs = [(a, b) for a, b in zip(*results) if a is not None and b is not None]
        row["max_abs_err"] = max(((a.float() - b.float()).abs().max().item() for a, b in pairs), default=0.0)
        for a, b in pairs:
            torch.testing.assert_close(b.float(), a.float(), **PARITY_TOL)
        row["status"] = "pass"
    except AssertionError as e:
        row.update(status="fail", error=str(e)[:500])
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
    return row


def parity(device: torch.device, cases=PARITY) -> list[dict]:
    """Every case with exact fp32 dots and the kernels' output buffers filled with NaN first, as
    tests/test_kernels.py does, so memory a kernel leaves unwritten fails the comparison."""
    empty = utils.empty
    utils.empty = lambda shape, device, dtype=torch.float32: torch.full(shape, float("nan"), device=device, dtype=dtype)
    try:
        with dot_precision("ieee"):
            return [parity_case(*case, device) for case in cases]
    finally:
        utils.empty = empty


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
