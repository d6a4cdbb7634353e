"""What one row of kernel_bench.py runs and how it is timed: the seeded inputs of a size, each
implementation's call (rnnify's Triton and reference backends, SDPA, fla), and the timing that records
a size or backend that cannot run as the row's status instead of an exception."""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import importlib
import inspect
import math
import statistics
import time
import warnings
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import rnnify.kernels as K
from rnnify.kernels import utils

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
