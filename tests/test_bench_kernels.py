"""benchmarks/kernel_bench.py on CPU: the smoke preset's JSON, table and PNG; failures and the time budget
become rows; the goals' verdicts; the Triton rows and the parity check through the interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), since the GPU run gets one try."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import rnnify.kernels as K

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "benchmarks" / "kernel_bench.py")
bench = sys.modules["bench_kernels"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(bench)
import kernel_bench_cases as cases  # noqa: E402 - on sys.path once kernel_bench is loaded

needs_interpreter = pytest.mark.skipif(not bench.utils.INTERPRET, reason="needs triton and TRITON_INTERPRET=1")
needs_matplotlib = pytest.mark.skipif(  # the runs below draw their PNG
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed (pip install 'rnnify[plots]')"
)


def run_main(tmp_path, *args) -> dict:
    assert bench.main(["--device", "cpu", "--out", str(tmp_path), *args]) == 0
    (path,) = tmp_path.glob("kernels-*.json")
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    return json.loads(path.read_text())


@needs_matplotlib
def test_smoke_preset_writes_json_and_png(tmp_path):
    doc = run_main(tmp_path, "--preset", "smoke")
    assert doc["preset"] == "smoke" and "--preset smoke" in doc["command"]
    machine = doc["machine"]
    assert {"gpu", "driver", "cuda", "torch", "triton", "fla", "python", "dot_precision"} <= machine.keys()
    assert machine["device"] == "cpu" and machine["torch"] == torch.__version__
    assert doc["config"]["dtype"] == "bfloat16" and doc["note"]  # no Triton rows on CPU, and it says so
    rows = doc["rows"]
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["dtype"] == "bfloat16" for r in rows)
    assert {r["impl"] for r in rows} == {"reference", "sdpa"}
    assert {r["op"] for r in rows} == {*bench.OPS, "sdpa"}
    assert {(r["section"], r["mode"]) for r in rows} == {("prefill", "fwd"), ("prefill", "fwd+bwd"), ("decode", "step")}
    assert {r["variant"] for r in rows if r["op"] == "chunk_linear_attn"} == set(bench.VARIANTS) - {"plain-tf32"}
    assert {r["T"] for r in rows if r["op"] == "fused_recurrent_linear_attn"} == {16, 32}  # two contexts
    assert all(r["sdpa_backend"] in cases.SDPA_BACKENDS for r in rows if r["impl"] == "sdpa")
    assert [g["verdict"] for g in doc["goals"]] == ["not measured"] * 5


@needs_matplotlib
def test_failures_are_rows_not_crashes(tmp_path, monkeypatch):
    """A size that runs out of memory, or that a backend cannot run, is recorded and the run goes on."""
    build = cases.build

    def failing_build(case, run):
        if (case.op, case.mode) == ("aaren_scan", "fwd"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 GiB (simulated)")
        if (case.op, case.mode) == ("linear_recurrence", "fwd+bwd"):
            raise NotImplementedError("no kernel for this size (simulated)")
        return build(case, run)

    monkeypatch.setattr(cases, "build", failing_build)
    doc = run_main(tmp_path, "--preset", "smoke", "--ops", "linear_recurrence", "aaren_scan", "--lengths", "16")
    status = {(r["op"], r["mode"]): r["status"] for r in doc["rows"]}
    assert status == {
        ("aaren_scan", "fwd"): "oom",
        ("aaren_scan", "fwd+bwd"): "ok",
        ("linear_recurrence", "fwd"): "ok",
        ("linear_recurrence", "fwd+bwd"): "unsupported",
        ("sdpa", "fwd"): "ok",
        ("sdpa", "fwd+bwd"): "ok",
    }
    assert "96.00 GiB" in next(r["error"] for r in doc["rows"] if r["status"] == "oom")


@needs_matplotlib
def test_time_budget_skips_the_rest_and_replot_redraws(tmp_path):
    doc = run_main(tmp_path, "--preset", "smoke", "--ops", "window_attn_step", "--time-budget", "0")
    assert doc["rows"] and all(r["status"] == "skipped" and "time budget" in r["error"] for r in doc["rows"])

    (path,) = tmp_path.glob("kernels-*.json")
    path.with_suffix(".png").unlink()
    assert bench.main(["--replot", str(path)]) == 0  # what a killed run's JSON kept, drawn again
    assert path.with_suffix(".png").exists() and json.loads(path.read_text())["goals"]


def row(op, impl, mode, ms, B=1, H=32, D=128, T=8192, variant="plain", section="prefill"):
    return dict(section=section, op=op, variant=variant, impl=impl, mode=mode, B=B, H=H, D=D, T=T, ms=ms, status="ok")


def test_goals_verdicts():
    rows = [
        row("chunk_linear_attn", "triton", "fwd", 1.0),
        row("chunk_linear_attn", "fla", "fwd", 1.5),
        row("chunk_linear_attn", "triton", "fwd+bwd", 4.0),
        row("chunk_linear_attn", "fla", "fwd+bwd", 3.0),
        row("chunk_linear_attn", "triton", "fwd", 2.0, T=32768),
        row("sdpa", "sdpa", "fwd", 30.0, T=32768, variant="causal"),
        row("chunk_linear_attn", "triton", "fwd+bwd", 8.0, T=32768),
        *(
            row("fused_recurrent_linear_attn", "triton", "step", ms, T=T, section="decode")
            for T, ms in ((1024, 0.020), (32768, 0.022))
        ),
    ]
    doc = {"rows": rows, "machine": {"device": "cuda", "fla": "0.6.0"}}
    assert [g["verdict"] for g in bench.goals(doc)] == ["met", "not met", "met", "not measured", "met"]
    rows[-1]["ms"] = 0.05  # the step at 32k now takes 2.5x the step at 1k
    rows[4]["ms"] = 10.0  # and chunk at 32k is only 3x faster than SDPA
    assert [g["verdict"] for g in bench.goals(doc)][2:] == ["not met", "not measured", "not met"]
    doc = {"rows": [], "machine": {"device": "cpu", "fla": "not installed (ModuleNotFoundError)"}}
    assert "fla not installed" in bench.goals(doc)[0]["detail"]


@needs_interpreter
def test_triton_rows_are_checked_against_the_reference():
    """The Triton rows' code path (timing, gradients, err_vs_reference), through the interpreter."""
    run = bench.Run(
        torch.device("cpu"),
        torch.float32,
        repeat=1,
        warmup=0,
        case_seconds=0.0,
        reference_max_len=None,
        time_budget=None,
        triton=True,
        fla=False,
    )
    group = bench.Group(
        (1,),
        (2,),
        (16,),
        (16,),
        ops=("chunk_linear_attn", "fused_recurrent_linear_attn"),
        variants=("plain", "plain-tf32", "gk"),
    )
    rows = bench.run_cases(bench.plan([group], run), run, lambda rows: None)
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    checked = [r for r in rows if "err_vs_reference" in r]
    assert {(r["op"], r["variant"], r["mode"]) for r in checked} == {
        ("chunk_linear_attn", v, m) for v in ("plain", "gk") for m in ("fwd", "fwd+bwd")
    } | {("fused_recurrent_linear_attn", v, "step") for v in ("plain", "gk")}
    assert all(r["impl"] == "triton" and r["err_vs_reference"] < 1e-5 for r in checked)


PARITY_CASES = [
    ("linear_recurrence", 1, 9, 1, 1, 8, {"reverse": True}),
    ("fused_recurrent_linear_attn", 1, 5, 2, 1, 16, {"gates": "g", "state": True}),
]


@needs_interpreter
def test_parity_passes_and_catches_a_wrong_kernel(tmp_path, monkeypatch):
    assert bench.parity_main(torch.device("cpu"), tmp_path, PARITY_CASES) == 0
    (path,) = tmp_path.glob("kernels-parity-*.json")
    assert [r["status"] for r in json.loads(path.read_text())["results"]] == ["pass", "pass"]

    scan = K.linear_recurrence

    def off_by_one(*args, backend="auto", **kwargs):
        x, h = scan(*args, backend=backend, **kwargs)
        return (x + 1, h) if backend == "triton" else (x, h)

    monkeypatch.setattr(K, "linear_recurrence", off_by_one)
    assert [r["status"] for r in bench.parity(torch.device("cpu"), PARITY_CASES)] == ["fail", "pass"]


@pytest.mark.parametrize(
    "section, op, table",
    [
        ("prefill", "chunk_linear_attn", "FLA_CHUNK"),
        ("decode", "fused_recurrent_linear_attn", "FLA_DECODE"),
        ("prefill", "chunk_delta_rule", "FLA_DELTA_CHUNK"),
        ("decode", "fused_recurrent_delta_rule", "FLA_DELTA_DECODE"),
    ],
)
def test_fla_rows_call_fla_with_the_inputs_of_their_op(monkeypatch, section, op, table):
    """Without fla here: each fla row calls its table's function with the op's inputs (the delta rule's
    normalised q and k, a decode row's one token and state) and differentiates those of a prompt."""
    calls = []

    def fake_fla_function(module, name):
        return lambda **kwargs: calls.append((module, name, kwargs)) or ["out"]

    class Named(dict):  # every input is its own name
        def __missing__(self, key):
            return key

    monkeypatch.setattr(cases, "fla_function", fake_fla_function)
    delta = "delta" in op
    for variant, entry in getattr(cases, table).items():
        call, leaves, info = cases.fla_call(cases.Case(section, op, variant, "fla", "fwd", 1, 2, 16, 32))
        assert call(Named()) == "out" and info == {"kernel": f"{entry[0]}.{entry[1]}"}
        module, name, kwargs = calls.pop()
        assert (module, name) == entry[:2]
        q, k = ("qn", "kn") if delta else ("q", "k")
        if section == "decode":
            state = f"{'deltastate' if delta else 'state'}_{variant}"
            assert kwargs == {
                "q": q + "1",
                "k": k + "1",
                "v": "v1",
                **entry[2](Named()),
                "initial_state": state,
                "output_final_state": True,
            }
            assert leaves == ()
        else:
            assert kwargs == {"q": q, "k": k, "v": "v", **entry[2](Named())}
            assert leaves == (q, k, "v", *entry[3])
