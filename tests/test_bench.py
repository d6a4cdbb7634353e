"""``rnnify bench`` and the step path: a step does no work that grows with the context (not timed)."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest
import torch
from support import ROOT, load_script
from torch.utils._python_dispatch import TorchDispatchMode

import rnnify
from rnnify.bench import Machine, Result, benchmark, busy_warning, fill_state, timing_warning
from rnnify.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:decoding past max_position_embeddings")


class _Work(TorchDispatchMode):
    """Counts every aten op a call runs and the bytes its outputs hold."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[str(func)] += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes += t.numel() * t.element_size()
        return out


def _step_work(model, context: int) -> _Work:
    state = fill_state(model, context, batch=2, fill_tokens=8)
    token = torch.tensor([[3], [5]])
    _, state = model.step(token, state)  # the first step after a fill may differ (e.g. a ring buffer)
    with _Work() as work:
        model.step(token, state)
    return work


@pytest.fixture(scope="module")
def window_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rnn-window") / "model"
    rnnify.convert(tiny_model_dir("llama"), to="window", window=32).save(out)
    return out


@pytest.mark.parametrize("target", ["linear", "gated", "hybrid", "window", "exact"])
def test_step_work_does_not_grow_with_context_for_constant_state(converted_dir, window_dir, target):
    model = rnnify.load(window_dir if target == "window" else converted_dir("llama", target))
    short, long = _step_work(model, 100), _step_work(model, 1000)
    if target == "exact":  # the KV-cache-like target reads every past key: work grows
        assert long.bytes > short.bytes + 2 * 900 * model.cells[0].spec.head_dim * 4
    else:
        assert model.constant_memory
        assert long.ops == short.ops
        assert long.bytes == short.bytes


def test_weight_bytes_counts_a_lookup_table_once_per_row(converted_dir):
    model = rnnify.load(converted_dir("llama", "linear"))
    tensors = [*model.graph.parameters(), *model.graph.buffers()]
    total = sum({t.untyped_storage().data_ptr(): t.nbytes for t in tensors}.values())
    embed = model.graph.model.embed_tokens.weight  # llama: not tied, only looked up
    assert model.weight_nbytes_per_token() == total - embed.nbytes + embed[0].nbytes


def test_bench_smoke(tmp_path, tiny_model_dir, converted_dir, capsys, monkeypatch):
    """On an 80-column terminal every measurement of both decode tables is printed whole."""
    monkeypatch.setenv("COLUMNS", "80")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(
        [
            "bench",
            str(converted_dir("llama", "linear")),
            "--against",
            str(tiny_model_dir("llama")),
            "--contexts",
            "8,32",
            "--batch",
            "1,2",
            "--steps",
            "2",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert "speedup" in text and "limit" in text
    run = json.loads(out.read_text())
    assert {(r["model"], r["batch"], r["context"]) for r in run["results"]} == {
        (m, b, c) for m in ("converted", "original") for b in (1, 2) for c in (8, 32)
    }
    assert all(r["step_ms"] > 0 and r["memory_bytes"] > 0 for r in run["results"])
    assert all(f" {r['tokens_per_s']:.1f} " in text for r in run["results"])
    tables = text[: text.index("batch-1 limit")]  # the one-line summaries after them wrap where they fall
    assert max(len(line) for line in tables.splitlines()) <= 80
    assert run["machine"]["bandwidth_gb_s"] > 0 and run["limit_ms"] > 0
    assert run["command"].startswith("rnnify bench ")
    assert png.stat().st_size > 0


def test_benchmark_returns_every_measurement_of_the_sweep(converted_dir):
    model = rnnify.load(converted_dir("llama", "exact"), aot_step=False)  # whatever the cache holds
    run = benchmark(model, [8, 32], [1, 2], steps=1, prefill_max=8)
    assert [(r.model, r.batch, r.context) for r in run.results] == [
        ("converted", b, c) for b in (1, 2) for c in (8, 32)
    ]
    # the bytes of the state reached are what the cells' own formula gives for that many tokens
    assert [r.memory_bytes for r in run.results] == [model.state_nbytes(c, b) for b in (1, 2) for c in (8, 32)]
    assert list(run.prefill_ms) == ["converted"] and list(run.prefill_ms["converted"]) == [8]
    assert run.command == "" and run.target == "exact" and run.dtype == "float32"
    with pytest.raises(rnnify.RnnifyError, match="loaded model runs as it is"):
        benchmark(model, [8], [1], device="cpu")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--contexts", "8,x"], ["--contexts"]),
        (["--contexts", "16,,16"], ["--contexts", "each once"]),  # 16 was timed twice
        (["--prefill-max", "-1"], ["--prefill-max"]),  # no prefill was timed, silently
        (["--batch", "0"], ["--batch"]),
        (["--steps", "0"], ["--steps"]),
        (["--dtype", "bfloat16"], ["float32", "--dtype"]),
        (["--plot", "plot.txt"], ["--plot plot.txt", "png"]),  # before the benchmark runs, not after
    ],
)
def test_bench_bad_input_exits_2(converted_dir, capsys, argv, words):
    code = main(["bench", str(converted_dir("llama", "linear")), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert all(word in err for word in words)


def test_bench_context_past_learned_positions_exits_2(converted_dir, capsys):
    code = main(["bench", str(converted_dir("gpt2", "linear")), "--contexts", "4096"])
    assert code == 2
    assert "learned positions" in capsys.readouterr().err


def test_compiled_step_matches_the_eager_step(converted_dir):
    model = rnnify.load(converted_dir("llama", "linear"))
    _, state = model.prefill(torch.tensor([[1, 2, 3, 4]]))
    token = torch.tensor([[7]])
    want, want_state = model.step(token, state)
    got, got_state = model.compile_step().step(token, state)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_state.tensors, want_state.tensors):
        torch.testing.assert_close(a, b)


def _steps(model, state, tokens):
    logits = []
    for token in tokens:
        out, state = model.step(torch.tensor([[token]], device=model.device), state)
        logits.append(out)
    return torch.cat(logits, dim=1), state


@pytest.mark.slow
def test_compiled_step_of_a_growing_state_matches_the_eager_steps(converted_dir):
    """``exact``'s state grows every step: the compiled step follows it (dynamic shapes)."""
    model = rnnify.load(converted_dir("llama", "exact"))
    _, state = model.prefill(torch.tensor([[1, 2, 3, 4]]))
    want, want_state = _steps(model, state, [7, 8, 9, 10])
    got, got_state = _steps(model.compile_step(), state, [7, 8, 9, 10])
    torch.testing.assert_close(got, want)
    for a, b in zip(got_state.tensors, want_state.tensors):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_step_matches_eager_and_keeps_earlier_states(converted_dir):
    model = rnnify.load(converted_dir("llama", "hybrid"), device="cuda")
    _, state = model.prefill(torch.tensor([[1, 2, 3, 4]], device="cuda"))
    want, want_state = _steps(model, state, [7, 8, 9])
    model.compile_step()
    _, early = _steps(model, state, [7])
    got, got_state = _steps(model, state, [7, 8, 9])
    torch.testing.assert_close(got, want)
    for a, b in zip(got_state.tensors, want_state.tensors):
        torch.testing.assert_close(a, b)
    # a replay overwrites the graph's outputs: the state returned before must not have changed
    again, _ = _steps(model, early, [8])
    torch.testing.assert_close(again[:, 0], want[:, 1])


def test_speed_script_measures_side_by_side_and_counts_ops(tiny_model_dir, converted_dir, tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    speed = load_script(ROOT / "benchmarks" / "speed.py")
    out = tmp_path / "speed.json"
    converted = str(converted_dir("llama", "linear"))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "speed.py",
            str(tiny_model_dir("llama")),
            converted,
            "--contexts",
            "8",
            "--batch",
            "1,2",
            "--prefill",
            "16",
            "--repeats",
            "1",
            "--steps",
            "1",
            "--kernels",
            "none",
            "--breakdown",
            "--json",
            str(out),
        ],
    )
    threads = torch.get_num_threads()
    try:
        speed.main()
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    name = Path(converted).name
    assert {(r["model"], r["batch"]) for r in data["decode"]} == {
        (m, b) for m in (name, f"{name}[none]") for b in (1, 2)
    }
    for row in data["decode"] + data["prefill"]:
        assert row["ratio"] == pytest.approx(row["original_ms"] / row["ms"])
    assert {r["length"] for r in data["prefill"]} == {16}
    ops = data["breakdown"][name]
    assert 0 < ops["ops_in_cells"] < ops["ops_total"] and data["breakdown"]["original"]["ops_total"] > 0


def test_speed_script_times_the_original_without_autograd_in_either_mode(tiny_model_dir):
    """The original's decode step records no autograd graph: under the caller's no_grad (as
    transformers' generate runs it) and under --original-inference-mode alike."""
    from transformers import AutoModelForCausalLM

    speed = load_script(ROOT / "benchmarks" / "speed.py")
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    seen = []
    hf.register_forward_hook(lambda module, args, out: seen.append((torch.is_grad_enabled(), out.logits.requires_grad)))
    for inference in (False, True):
        with torch.no_grad():
            speed.original_step(hf, torch.full((1, 1), 5), 8, inference=inference)()
    assert seen == [(False, False), (False, False)]


def _result(context: int, median: float, low: float, high: float, model: str = "converted", batch: int = 1) -> Result:
    return Result(model, batch, context, median, batch / median * 1e3, low, high, 1, 0)


def test_timing_warning_fires_when_one_measurements_steps_disagree_by_more_than_2x():
    steady = [_result(256, 4.5, 4.4, 4.6), _result(1024, 4.4, 4.3, 8.6)]  # 8.6 / 4.3 = 2.0: not more
    assert timing_warning(steady, constant_memory=True) is None
    erratic = [_result(256, 4.5, 4.4, 4.6), _result(1024, 5.0, 4.3, 312.0)]
    warning = timing_warning(erratic, constant_memory=True)
    assert "more than 2x" in warning and "context 1,024" in warning and "312" in warning
    assert "\n" not in warning


def test_timing_warning_compares_contexts_only_where_the_work_is_the_same():
    # the table: 316 ms at 256 tokens, 13 ms at 1,024, each row steady in itself
    rows = [
        _result(256, 316.0, 310.0, 320.0),
        _result(1024, 13.0, 12.9, 13.1),
        _result(256, 5.0, 5.0, 5.0, model="original"),
        _result(1024, 20.0, 19.9, 20.1, model="original"),
    ]
    warning = timing_warning(rows, constant_memory=True)
    assert "316 ms at 256" in warning and "13 ms at 1,024" in warning
    # a growing state (exact) and the original with its KV cache may rightly cost more at longer contexts
    assert timing_warning(rows, constant_memory=False) is None


@pytest.mark.parametrize("load, threads, busy", [(0.1, 2, False), (0.9, 2, True), (0.9, 1, False), (1.9, 1, True)])
def test_busy_warning_when_other_work_leaves_fewer_idle_cpus_than_threads(load, threads, busy):
    machine = Machine("cpu", 2, threads, torch.__version__, "cpu", 10.0, load)
    warning = busy_warning(machine)
    assert (warning is not None) == busy
    if busy:
        assert f"load average {load:.1f} on 2 CPUs" in warning


def test_bench_prints_and_records_the_warning_of_disagreeing_timings(tmp_path, converted_dir, capsys, monkeypatch):
    import rnnify.bench as bench

    times = iter([1.0, 5.0] * 100)  # every measurement's two timed steps: 1 ms, then 5 ms
    monkeypatch.setattr(bench, "_time_steps", lambda step, device, steps, warmup, sample: [next(times), next(times)])
    monkeypatch.setattr(bench, "bandwidth", lambda device: 10.0)  # not what is tested here
    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            str(converted_dir("llama", "linear")),
            "--contexts",
            "8,16",
            "--batch",
            "1",
            "--steps",
            "2",
            "--prefill-max",
            "1",
            "--json",
            str(out),
        ]
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: timings disagree")]
    assert code == 0 and len(lines) == 1
    assert "in 2 of 3 comparisons" in lines[0]  # two measurements 1 to 5 ms; their medians (3 ms) agree
    run = json.loads(out.read_text())
    assert any(w.startswith("timings disagree") for w in run["warnings"])
    assert [(r["step_ms_min"], r["step_ms_max"]) for r in run["results"]] == [(1.0, 5.0), (1.0, 5.0)]


def test_the_decode_tables_keep_every_number_whole_on_80_columns():
    """Wide but plausible values (a 128k context, GiB of KV cache, a speedup in the thousands) are
    printed whole in tables no wider than a terminal of 80 columns."""
    from types import SimpleNamespace

    from rich.console import Console

    from rnnify.cli.bench import _bench_tables

    def row(model, step_ms, tokens_per_s, memory, peak):
        return SimpleNamespace(
            batch=64,
            context=131072,
            model=model,
            step_ms=step_ms,
            tokens_per_s=tokens_per_s,
            memory_bytes=memory,
            peak_delta_bytes=peak,
        )

    result = SimpleNamespace(
        results=[
            row("converted", 0.07, 914285.7, 19 * 2**20, 999 * 2**30),
            row("original", 1234.56, 51.8, 1000 * 2**30, 999 * 2**30),
        ],
        target="hybrid",
        dtype="bfloat16",
        machine=SimpleNamespace(device="AMD EPYC 9R14 96-Core Processor"),
    )
    console = Console(width=80, record=True, file=io.StringIO())
    for table in _bench_tables(result):
        console.print(table)
    text = console.export_text()
    for value in ("131,072", "914285.7", "1234.56", "51.8", "1000.0 GiB", "999.0 GiB", "17636.57x", "53894.7x"):
        assert f" {value}" in text, value
    assert max(len(line) for line in text.splitlines()) <= 80
