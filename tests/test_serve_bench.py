"""benchmarks/serve.py's pure parts: its arguments, the prompts, the figures made from what vLLM's engine
reports, the ratio, the table and the plot. The serving run itself is a benchmark (it needs vLLM and
minutes per model), not a test."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from support import load_script

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "benchmarks" / "serve.py")
serve = sys.modules["bench_serve"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(serve)
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")


@pytest.fixture
def model_dirs(tmp_path):
    dirs = []
    for name in ("orig", "conv"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        dirs.append(str(tmp_path / name))
    return dirs


def test_defaults_are_the_issue_grid(model_dirs):
    args = serve.parse_args([f"original={model_dirs[0]}", f"window={model_dirs[1]}"])
    assert args.named == [("original", model_dirs[0]), ("window", model_dirs[1])]
    assert args.concurrency == [1, 8, 32, 128] and args.prompt_tokens == [512, 2048, 8192]
    assert args.new_tokens == 128 and args.cache_gib == 2.0 and args.threads == 1
    assert args.tokenizer == Path(model_dirs[0])  # the reference's tokenizer
    assert args.json.parent == ROOT / "benchmarks" / "results" and args.json.name.startswith("serve-")


def test_threads_bind_the_last_cpus(model_dirs, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # it would override the budget
    cpus = sorted(__import__("os").sched_getaffinity(0))
    args = serve.parse_args([f"a={model_dirs[0]}", "--threads", "1"])
    assert args.bind == str(cpus[-1])
    engine = serve.engine_env(args)
    assert engine["VLLM_CPU_OMP_THREADS_BIND"] == str(cpus[-1]) and "VLLM_CPU_KVCACHE_SPACE" not in engine


def test_grids_parse(model_dirs):
    args = serve.parse_args([f"a={model_dirs[0]}", "--concurrency", "1,8", "--prompt-tokens", "8_192"])
    assert args.concurrency == [1, 8] and args.prompt_tokens == [8192]
    engine = serve.engine_arguments(args, model_dirs[0], max_model_len=8192 + 128)
    assert engine["kv_cache_memory_bytes"] == 2 * 1024**3 and engine["max_model_len"] == 8320
    assert engine["enable_prefix_caching"] is False and engine["enforce_eager"] is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nodir"], "expected NAME=DIR"),
        (["a=/no/such/dir"], "not a model directory"),
        (["a={0}", "a={1}"], "given twice"),
        (["a={0}", "--concurrency", "1,x"], "comma-separated integers"),
        (["a={0}", "--prompt-tokens", "0"], "positive integers"),
        (["a={0}", "--threads", "999"], "may run on"),
        (["a={0}", "--cache-gib", "0"], "must be positive"),
        (["a={0}", "--new-tokens", "0"], "--new-tokens must be at least 1"),
    ],
)
def test_bad_arguments_fail_in_one_line(model_dirs, capsys, argv, message):
    with pytest.raises(SystemExit) as raised:
        serve.parse_args([a.format(*model_dirs) for a in argv])
    assert raised.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error and "Traceback" not in error


def test_prompts_are_distinct_consecutive_slices():
    tokens = list(range(100))
    prompts = serve.slice_prompts(tokens, 3, 32)
    assert [len(p) for p in prompts] == [32, 32, 32]
    assert sum(prompts, []) == tokens[:96]  # consecutive, none shared
    with pytest.raises(SystemExit, match="need 128"):
        serve.slice_prompts(tokens, 4, 32)


@pytest.mark.parametrize("q", [0, 37.5, 50, 99, 100])
def test_percentile_is_numpys_linear(q):
    values = list(np.random.default_rng(0).exponential(size=257))
    assert serve.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert serve.percentile([], q) is None


def fake_result(concurrency: int, seconds: float, **overrides) -> dict:
    result = {
        "event": "result",
        "concurrency": concurrency,
        "output_tokens": concurrency * 128,
        "duration_s": seconds,
        "ttft_s": [0.5 * (i + 1) for i in range(concurrency)],
        "itl_s": [0.01] * 98 + [0.2, 0.4],
        "preemptions": 0,
        "max_running": concurrency,
        "max_waiting": 0,
        "max_cache_usage": 0.25,
        "peak_rss_bytes": 3 * 1024**3,
    }
    return {**result, **overrides}


def test_summary_of_an_engine_result():
    row = serve.summarize("window", 2048, fake_result(8, seconds=4.0))
    assert row["name"] == "window" and row["prompt_tokens"] == 2048 and row["concurrency"] == 8
    assert row["tokens_per_s"] == pytest.approx(8 * 128 / 4.0)
    assert row["ttft_p50_s"] == pytest.approx(np.percentile([0.5 * (i + 1) for i in range(8)], 50))
    assert row["itl_p50_s"] == pytest.approx(0.01) and row["itl_p99_s"] == pytest.approx(
        np.percentile([0.01] * 98 + [0.2, 0.4], 99)
    )
    assert row["max_running"] == 8 and row["peak_rss_bytes"] == 3 * 1024**3


def test_the_summary_reads_what_the_engine_script_reports():
    source = (ROOT / "benchmarks" / "serve_engine.py").read_text()
    emitted = set(re.findall(r"^\s+(\w+)=", source.split('event="result"', 1)[1].split(")\n", 1)[0], re.M))
    assert emitted | {"event", "peak_rss_bytes"} == set(fake_result(1, 1.0))


def test_ratio_is_against_the_reference_at_the_same_grid_point():
    runs = [
        serve.summarize("original", 512, fake_result(8, seconds=2.0)),
        serve.summarize("auto", 512, fake_result(8, seconds=8.0)),
        serve.summarize("auto", 2048, fake_result(8, seconds=8.0)),  # no original at 2,048
    ]
    ratios = [r["ratio"] for r in serve.with_ratios(runs, "original")]
    assert ratios == [pytest.approx(1.0), pytest.approx(0.25), None]


def test_table_shows_every_run(model_dirs):
    from rich.console import Console

    runs = [
        serve.summarize("original", 512, fake_result(8, seconds=2.0, max_running=5, preemptions=3)),
        serve.summarize("auto", 512, fake_result(8, seconds=1.0)),
    ]
    console = Console(record=True, width=250)
    console.print(serve.table(runs, "original"))
    text = console.export_text()
    original = next(line for line in text.splitlines() if "original" in line and "512" in line)
    auto = next(line for line in text.splitlines() if "auto" in line)
    assert re.search(r"512 .* 8 .* original .* 512\.0 .* 1\.00 .* 5 .* 3 .* 25% .* 3\.00", original)
    assert re.search(r"auto .* 1,024\.0 .* 2\.00", auto)


@needs_matplotlib
def test_plot_writes_a_png(tmp_path):
    runs = [
        serve.summarize(name, length, fake_result(n, seconds=seconds * n))
        for name, seconds in (("original", 1.0), ("auto", 2.0))
        for length in (512, 2048)
        for n in (1, 8, 32)
    ]
    path = tmp_path / "serve.png"
    serve.plot(runs, path)
    assert path.read_bytes()[:4] == b"\x89PNG"


@needs_matplotlib
def test_markdown_of_a_results_file(tmp_path, capsys):
    runs = serve.with_ratios(
        [
            serve.summarize("original", 8192, fake_result(8, seconds=16.0, max_running=4, preemptions=2)),
            serve.summarize("auto", 8192, fake_result(8, seconds=4.0)),
        ],
        "original",
    )
    path = tmp_path / "serve-x.json"
    path.write_text(__import__("json").dumps({"command": "python benchmarks/serve.py a=A b=B", "runs": runs}))
    assert serve.main(["--markdown", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "`python benchmarks/serve.py a=A b=B`"
    assert "| 8,192 | 8 | original | 64.0 | 1.00 | 2.25 / 3.96 | 10 / 202 | 4 | 2 | 3.00 |" in lines
    assert "| 8,192 | 8 | auto | 256.0 | 4.00 |" in lines[-1]
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # the plot, redrawn beside the file


def test_no_models_and_no_markdown_is_an_error(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args([])
    assert "NAME=DIR" in capsys.readouterr().err.splitlines()[-1]


def test_state_copy_times_the_step_and_the_slot_copies(converted_dir, capsys, monkeypatch):
    """benchmarks/state_copy.py runs on any converted model: a row per batch size."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling decode_parser, as when run as a script
    module = load_script(ROOT / "benchmarks" / "state_copy.py")
    argv = [str(converted_dir("llama", "linear")), "--batches", "1,3", "--slots", "4", "--prompt", "6"]
    assert module.main([*argv, "--rounds", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\W+\d+\W+[\d.]+\W+\d+", line)]
    assert len(rows) == 2


def test_donated_step_times_each_step_and_writes_its_medians(converted_dir, tmp_path, capsys, monkeypatch):
    """benchmarks/donated_step.py times the copying and the in-place step of any converted model, a
    row per batch size (no compiled step here: its column is empty), medians in --json."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = load_script(ROOT / "benchmarks" / "donated_step.py")
    out = tmp_path / "donated.json"
    argv = [str(converted_dir("llama", "linear")), "--batches", "1,3", "--prompt", "6", "--rounds", "1"]
    assert module.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 3]
    assert all(row["eager"] > 0 and row["in place"] > 0 and "compiled" not in row for row in rows)
