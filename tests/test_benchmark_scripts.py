"""The benchmark scripts that write the measured pages (fidelity, per-head, retrieval windows, long
context, cell speed, the eval table), end to end on tiny models."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from support import ROOT, load_script

import rnnify

# fidelity.py's evaluation at the smallest size that still measures: one row of 32 tokens, one thread
SMALL_EVAL = ["--seq-len", "32", "--eval-rows", "1", "--batch-size", "2", "--threads", "1"]


def test_fidelity_script_end_to_end(tmp_path, tiny_model_dir):
    fidelity = load_script(ROOT / "benchmarks" / "fidelity.py")
    out = tmp_path / "fidelity"
    argv = [
        "fidelity.py",
        "--model",
        str(tiny_model_dir("llama")),
        "--variants",
        "exact",
        "linear-hedgehog",
        "--distill-tokens",
        "1024",
        "--goal-distill-tokens",
        "1024",
        "--eval-tokens",
        "512",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--threads",
        "1",
        "--json",
        str(out / "f.json"),
        "--doc",
        str(out / "f.md"),
        "--png",
        str(out / "f.png"),
    ]
    notes = "\n".join([fidelity.MEMORY_NOTES[0], "A further run, measured by hand.", fidelity.MEMORY_NOTES[1]])
    out.mkdir()
    (out / "f.md").write_text(f"# an earlier page\n\nits generated part\n\n{notes}\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", argv)
        fidelity.main()
    record = json.loads((out / "f.json").read_text())
    rows = {row["variant"]: row for row in record["rows"]}
    assert rows["exact"]["training_free"]["kl"] < 1e-6  # exact equals the original
    assert rows["linear-hedgehog"]["distilled"]["tokens"] > 0 and rows["linear-hedgehog"]["distill_tokens"] == 1024
    doc = (out / "f.md").read_text()
    assert "python benchmarks/fidelity.py" in doc and "`linear-hedgehog`" in doc and "goal" in doc
    assert "its generated part" not in doc and doc.count(notes) == 1  # the page is rewritten, its kept notes not
    assert doc.index(notes) < doc.index("![quality against state size]")  # after the memories' tables, as written
    assert (out / "f.png").stat().st_size > 0


def test_fidelity_stages_transfer_only_spends_the_budget_on_transfer(tmp_path, tiny_model_dir):
    """--stages transfer: the whole budget goes to attention transfer at the first --lr, no finetune."""
    fidelity = load_script(ROOT / "benchmarks" / "fidelity.py")
    argv = [
        "--model",
        str(tiny_model_dir("llama")),
        "--row",
        "h=hybrid,window=4,feature_map=hedgehog",
        "--distilled-only",
        "--distill-tokens",
        "512",
        "--stages",
        "transfer",
        "--lr",
        "0.03",
        "0.001",
        *SMALL_EVAL,
        "--json",
        str(tmp_path / "f.json"),
    ]
    seen = []
    distill = rnnify.distill
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rnnify, "distill", lambda *a, **k: seen.append(k) or distill(*a, **k))
        row = fidelity.main(argv)["rows"][0]
    assert seen[0]["stages"] == ["transfer"] and seen[0]["lr"] == [0.03]
    assert set(row["stage_tokens"]) == {"transfer"} and row["stage_tokens"]["transfer"] > 0
    assert row["distill_settings"]["stages"] == ["transfer"]


@pytest.mark.slow  # multi-process / end to end; the default suite stays under 10 minutes
@pytest.mark.filterwarnings("ignore:decoding past max_position_embeddings")
def test_fidelity_rows_are_saved_as_they_finish_and_reused(tmp_path, tiny_model_dir, capsys):
    fidelity = load_script(ROOT / "benchmarks" / "fidelity.py")
    out = tmp_path / "f.json"
    argv = [
        "--model",
        str(tiny_model_dir("llama")),
        "--variants",
        "exact",
        "--row",
        "lin=linear,feature_map=elu",
        "--seq-len",
        "64",
        "--eval-rows",
        "1",
        "--no-distill",
        "--passkey",
        "320",  # the multikey probe's four keys need 283 tokens of the tiny tokenizer
        "--passkey-trials",
        "1",
        "--threads",
        "1",
        "--json",
        str(out),
    ]
    evaluate, convert = rnnify.evaluate, rnnify.convert
    calls = []

    def dies_on_the_second_row(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt  # the run is killed during the second row
        calls.append(1)
        return evaluate(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rnnify, "evaluate", dies_on_the_second_row)
        with pytest.raises(KeyboardInterrupt):
            fidelity.main(argv)
    assert [row["variant"] for row in json.loads(out.read_text())["rows"]] == ["exact"]  # kept

    converted = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rnnify, "convert", lambda *a, **k: converted.append(k["to"]) or convert(*a, **k))
        fidelity.main(argv)
    assert converted == ["linear"]  # the finished row was not run again
    record = json.loads(out.read_text())
    assert [row["variant"] for row in record["rows"]] == ["exact", "lin"] and record["seq_len"] == 64
    for row in record["rows"]:
        result = row["training_free"]
        assert result["tokens"] == 64 and result["seq_len"] == 64 and "distilled" not in row
        assert {"perplexity", "kl", "top1_agreement"} <= set(result) and row["state_bytes"] > 0
        assert set(result["passkey"]["accuracy"]["converted"]) == {"320"}
    assert record["rows"][0]["training_free"]["kl"] < 1e-6 and record["rows"][1]["options"] == {"feature_map": "elu"}
    assert set(record["original_passkey"]["accuracy"]) == {"320"}
    assert out.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out  # the markdown table, the original first
    assert "| original | – | " in printed and f"| `lin` | {record['rows'][1]['state_bytes']:,} |" in printed

    with pytest.MonkeyPatch.context() as patch:  # all cached: nothing converts
        patch.setattr(rnnify, "convert", lambda *a, **k: pytest.fail("a cached row ran again"))
        assert fidelity.main(argv)["rows"] == record["rows"]
        only_exact = [a for a in argv if a not in ("--row", "lin=linear,feature_map=elu")]
        fidelity.main(only_exact)
    assert json.loads(out.read_text())["rows"] == record["rows"]  # another command's row is kept


@pytest.mark.slow  # multi-process / end to end; the default suite stays under 10 minutes
def test_fidelity_dir_rows_measure_a_saved_model_as_it_was_trained(tmp_path, tiny_model_dir):
    """--dir: a directory distilled elsewhere lands in the distilled columns (with its manifest's
    tokens), a plain conversion in the training-free ones, measured as the script's own rows are."""
    fidelity = load_script(ROOT / "benchmarks" / "fidelity.py")
    source = tiny_model_dir("llama")
    rnnify.convert(source, to="window", window=8).save(tmp_path / "plain")
    trained = rnnify.convert(source, to="window", window=8)
    trained.manifest.distill = {"trained": [{"stage": "transfer", "tokens": 300}, {"stage": "finetune", "tokens": 200}]}
    trained.save(tmp_path / "trained")
    argv = [
        "--model",
        str(source),
        "--row",
        "w8=window,window=8",
        "--dir",
        f"plain={tmp_path / 'plain'}",
        "--dir",
        f"trained={tmp_path / 'trained'},seconds=42",
        "--no-distill",
        "--seq-len",
        "32",
        "--eval-rows",
        "1",
        "--batch-size",
        "1",
        "--threads",
        "1",
        "--json",
        str(tmp_path / "f.json"),
    ]
    record = fidelity.main(argv)
    rows = {row["variant"]: row for row in record["rows"]}
    assert rows["plain"]["training_free"]["kl"] == pytest.approx(rows["w8"]["training_free"]["kl"])
    assert "distilled" not in rows["plain"]
    assert rows["trained"]["training_free"] is None and rows["trained"]["distill_tokens"] == 500
    assert rows["trained"]["distilled"]["kl"] == pytest.approx(rows["w8"]["training_free"]["kl"])
    assert "| `trained` |" in fidelity.table(record) and "300 + 200 | 42 s |" in fidelity.table(record)
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--dir", f"x={tmp_path}"])  # not an rnnify directory


@pytest.mark.slow
def test_per_head_script_end_to_end(tmp_path, tiny_model_dir):
    per_head = load_script(ROOT / "benchmarks" / "per_head.py")
    data = tmp_path / "data"
    for part in ("train", "heldout"):
        (data / part).mkdir(parents=True)
        (data / part / "a.py").write_text("def f(x):\n    return [x + i for i in range(10)]\n" * 80)
    out = tmp_path / "out"
    small = ["--model", str(tiny_model_dir("llama")), "--data", str(data), "--budgets", "0.3"]
    small += ["--window", "8", "--sinks", "1", "--calib-len", "32", "--calib-rows", "2", "--calib-passkey", "0"]
    small += ["--seq-len", "32", "--eval-tokens", "256"]
    record = per_head.main(
        [
            *small,
            "--json",
            str(out / "p.json"),
            "--doc",
            str(out / "p.md"),
        ]
    )
    rows = {row["variant"]: row for row in record["rows"]}
    assert set(rows) == {"window-sinks", "window", "auto-kl-0.3", "auto-mass-0.3", "layers-kl-0.3"}
    for name in ("auto-kl-0.3", "auto-mass-0.3"):  # one exact head of four fits 30% of the KV cache
        assert len(rows[name]["retrieval"]) == 1 and rows[name]["state_bytes"] <= 0.3 * record["kv_cache_bytes"]
    assert rows["layers-kl-0.3"]["retrieval"] == []  # a whole layer (two heads) does not fit
    assert rows["layers-kl-0.3"]["training_free"] == rows["window-sinks"]["training_free"]
    doc = (out / "p.md").read_text()
    assert doc.startswith(per_head.SECTION_START) and "python benchmarks/per_head.py" in doc
    assert (out / "p.png").stat().st_size > 0
    # the same scores, the chosen heads a 16-token window: more of them fit, and the doc says so
    again = per_head.main(
        [
            *small,
            "--fixed",
            "",
            "--scores-from",
            str(out / "p.json"),
            "--retrieval-window",
            "16",
            "--json",
            str(out / "q.json"),
            "--doc",
            str(out / "q.md"),
        ]
    )
    assert again["scores"] == record["scores"]
    assert len(next(r for r in again["rows"] if r["variant"] == "auto-kl-0.3")["retrieval"]) > 1
    assert "16-token window" in (out / "q.md").read_text() and "not measured again" in (out / "q.md").read_text()
    compare = load_script(ROOT / "benchmarks" / "retrieval_windows.py")
    text = compare.main([str(out / "q.json"), "--png", str(out / "r.png"), "--per-layer"])
    assert "| window 8 + " in text and " heads at 16 (per head) |" in text and (out / "r.png").stat().st_size > 0
    with pytest.raises(SystemExit) as error:  # the first run kept its heads exact
        compare.main([str(out / "p.json")])
    assert error.value.code == 2


def test_retrieval_windows_table_orders_by_state_and_takes_plain_window_rows(tmp_path):
    compare = load_script(ROOT / "benchmarks" / "retrieval_windows.py")

    def result(kl, keys):
        return {"perplexity": 12.0, "teacher_perplexity": 10.0, "kl": kl, "passkey": {"accuracy": {"converted": keys}}}

    per_head = {
        "window": 128,
        "retrieval_window": 1024,
        "rows": [
            {
                "kind": "auto-kl",
                "retrieval": [[0, 1]] * 21,
                "state_bytes": 300,
                "training_free": result(0.08, {"1024": 1.0}),
            },
            {
                "kind": "layers-kl",
                "retrieval": [[0, 0]] * 3,
                "state_bytes": 100,
                "training_free": result(0.2, {"1024": 0.25}),
            },
        ],
    }
    windows = {
        "rows": [
            {
                "target": "window",
                "options": {"window": 256, "sinks": 4},
                "state_bytes": 200,
                "training_free": result(0.1, {"1024": 0.25}),
            },
            {
                "target": "window",
                "options": {"window": 64},
                "state_bytes": 50,
                "training_free": result(1.6, {}),
            },  # no sinks
            {
                "target": "hybrid",
                "options": {"window": 64, "sinks": 4},
                "state_bytes": 60,
                "training_free": result(0.4, {}),
            },
            {"target": "window", "options": {"window": 64, "sinks": 4}, "state_bytes": 70, "training_free": None},
        ]
    }
    (tmp_path / "a.json").write_text(json.dumps(per_head))
    (tmp_path / "w.json").write_text(json.dumps(windows))
    doc = tmp_path / "page.md"
    doc.write_text(f"1. an item:\n\n   {compare.START}\n   old table\n   {compare.END}\n\n   more\n")
    text = compare.main(
        [str(tmp_path / "a.json"), "--windows", str(tmp_path / "w.json"), "--per-layer", "--doc", str(doc)]
    )
    lines = text.splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| window 128 + 3 heads at 1,024 (per layer)",
        "| window 256 (every head)",
        "| window 128 + 21 heads at 1,024 (per head)",
    ]
    assert lines[-1].endswith("| 300 | 1.200 | 0.0800 | 100% |")
    page = doc.read_text()
    assert "old table" not in page and "".join(f"   {line}\n" for line in lines) in page and page.endswith("   more\n")
    assert "per layer" not in compare.main([str(tmp_path / "a.json")])  # per-layer rows only when asked


def test_long_context_table_merges_short_ranges_and_writes_the_page(tmp_path):
    long_context = load_script(ROOT / "benchmarks" / "long_context.py")
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "num_hidden_layers": 3}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))

    def result(kls):  # KL per range [0, 512), [512, 1024), [1024, 2048), [2048, 4096) of 4,096-token rows
        edges = [0, 512, 1024, 2048, 4096]
        return {
            "perplexity": 11.0,
            "teacher_perplexity": 10.0,
            "kl": 0.5,
            "top1_agreement": 0.9,
            "kl_by_position": [
                {"start": a, "end": b, "kl": kl, "tokens": 2 * (b - a)} for a, b, kl in zip(edges, edges[1:], kls)
            ],
        }

    record = {
        "model": str(tmp_path / "model"),
        "seq_len": 4096,
        "eval_tokens": 8192,
        "rows": [
            {"variant": "big", "state_bytes": 9000, "training_free": result([0.0, 0.3, 0.2, 0.4])},
            {
                "variant": "small",
                "state_bytes": 1000,
                "training_free": None,
                "distilled": result([0.1, 0.1, 0.6, 0.8]),
                "distill_tokens": 5000,
            },
        ],
    }
    (tmp_path / "r.json").write_text(json.dumps(record))
    doc = tmp_path / "page.md"
    start, end = long_context.MARKERS
    doc.write_text(f"intro\n{start}\nold\n{end}\nafter\n")
    text = long_context.main([str(tmp_path / "r.json"), "--png", str(tmp_path / "k.png"), "--doc", str(doc)])
    cache = 2 * 3 * 2 * 8 * 4096 * 4  # K and V, layers, kv heads, head dim 32 / 4, tokens, fp32
    assert f"KV cache there: {cache:,} bytes" in text
    lines = text.splitlines()
    assert lines[2].endswith("| KL at positions 0-1,023 | 1,024-2,047 | 2,048-4,095 |")
    assert (
        lines[4]
        == f"| `small` (distilled, 5,000 tokens) | 1,000 ({1000 / cache:.1%}) | 1.100 | 0.5000 | 90.0% | 0.1000 | 0.6000 | 0.8000 |"
    )
    assert lines[5].endswith("| 0.1500 | 0.2000 | 0.4000 |")  # 512 tokens at 0.0 and 512 at 0.3
    assert (tmp_path / "k.png").stat().st_size > 0
    page = doc.read_text()
    assert "old" not in page and text in page and page.endswith(f"{end}\nafter\n")
    other = {**record, "rows": [{"variant": "more", "state_bytes": 5000, "training_free": result([0.0] * 4)}]}
    (tmp_path / "o.json").write_text(json.dumps(other))
    assert "| `more` | 5,000" in long_context.main([str(tmp_path / "r.json"), str(tmp_path / "o.json")])
    (tmp_path / "o.json").write_text(json.dumps({**other, "seq_len": 2048}))  # other rows: not one table
    with pytest.raises(SystemExit) as error:
        long_context.main([str(tmp_path / "r.json"), str(tmp_path / "o.json")])
    assert error.value.code == 2
    record["rows"][0]["training_free"].pop("kl_by_position")  # measured by an older fidelity.py
    (tmp_path / "r.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit) as error:
        long_context.main([str(tmp_path / "r.json")])
    assert error.value.code == 2


def test_fidelity_distilled_only_saves_what_dir_rows_measure_again(tmp_path, tiny_model_dir):
    """--distilled-only skips the training-free step; --save keeps each distilled model, and a
    --dir row of it measures the same numbers; the memories section renders such runs."""
    fidelity = load_script(ROOT / "benchmarks" / "fidelity.py")
    common = [
        "--model",
        str(tiny_model_dir("llama")),
        *SMALL_EVAL,
    ]
    record = fidelity.main(
        [
            *common,
            "--row",
            "h=hybrid,window=8,memory=gla",
            "--distilled-only",
            "--distill-tokens",
            "128",
            "--save",
            str(tmp_path / "models"),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-every",
            "1",
            "--json",
            str(tmp_path / "a.json"),
        ]
    )
    row = record["rows"][0]
    assert row["training_free"] is None and row["distilled"]["tokens"] > 0 and row["stage_tokens"]
    again = fidelity.main([*common, "--dir", f"h={tmp_path / 'models' / 'h'}", "--json", str(tmp_path / "b.json")])
    assert again["rows"][0]["distilled"]["kl"] == pytest.approx(row["distilled"]["kl"])
    report = load_script(ROOT / "benchmarks" / "fidelity_report.py")
    (tmp_path / report.MEMORY_RUNS[0]).write_text(json.dumps(record))
    section = report.memories_section(tmp_path / "fidelity.json")
    assert "| `h` |" in section and "Goals (issue 12)" in section


def test_cell_speed_replays_the_calls_the_model_makes(tmp_path, converted_dir):
    """The cell benchmark times the cell on the inputs the model gives it: a replayed capture gives
    the output the cell gave inside the model, for the prompt and the decode step."""
    cell_speed = load_script(ROOT / "benchmarks" / "cell_speed.py")
    # eager: a decode step another test compiled into the run's cache would run without the cell
    model = rnnify.load(converted_dir("llama", "hybrid"), aot_step=False)
    cell = model.cells[1]
    outputs = []
    handle = cell.register_forward_hook(lambda _, args, out: outputs.append(out[0]))
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        args, kwargs = cell_speed._captured(model, cell, lambda: model.prefill(ids))
        expected = outputs[-1]
        assert args[0].shape[2] == 12
        torch.testing.assert_close(cell(*args, **kwargs)[0], expected, rtol=0, atol=0)
        _, state = model.prefill(ids)
        args, kwargs = cell_speed._captured(model, cell, lambda: model.step(ids[:, -1:], state))
        expected = outputs[-1]
        assert args[0].shape[2] == 1
        torch.testing.assert_close(cell(*args, **kwargs)[0], expected, rtol=0, atol=0)
    handle.remove()
    rows = cell_speed.measure(model, 1, [12], 8, rounds=1)
    assert [(row["phase"], row["tokens"]) for row in rows] == [("prompt", 12), ("step", 8)]
    assert all(row["cell_ms"] > 0 and row["sdpa_ms"] > 0 and row["ops"] > 0 for row in rows)


def test_eval_table_groups_by_length_and_reads_passkey(tmp_path, converted_dir, tiny_model_dir):
    """Real ``rnnify eval`` results at two row lengths, one model's pass keys from two runs (one row),
    into tables and a plot."""
    from rnnify.cli import main

    eval_table = load_script(ROOT / "benchmarks" / "eval_table.py")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The river runs past the mill and the children play in the park. " * 200)
    files = []
    for run, (name, length, extra) in enumerate(
        (
            ("exact", 32, ["--passkey", "320", "--passkey-trials", "1", "--passkey-probes", "reworded"]),
            ("exact", 32, ["--passkey", "160", "--passkey-trials", "1", "--passkey-probes", "reworded"]),
            ("linear", 32, []),
            ("linear", 64, []),
        )
    ):
        out = tmp_path / f"{run}-{name}-{length}.json"
        assert (
            main(
                [
                    "eval",
                    str(converted_dir("llama", name)),
                    "--data",
                    str(corpus),
                    "--seq-len",
                    str(length),
                    "--max-tokens",
                    str(2 * length),
                    "--no-layer-errors",
                    "--json",
                    str(out),
                    *extra,
                ]
            )
            == 0
        )
        files.append(f"{name}={out}")
    doc = tmp_path / "page.md"
    doc.write_text(f"intro\n\n{eval_table.MARKERS[0]}\nold\n{eval_table.MARKERS[1]}\n")
    assert (
        eval_table.main(
            [*files, "--model", str(tiny_model_dir("llama")), "--png", str(tmp_path / "p.png"), "--doc", str(doc)]
        )
        == 0
    )
    page = doc.read_text()
    assert "old" not in page and "Rows of 32 tokens" in page and "Rows of 64 tokens" in page
    assert "| original (KV cache) |" in page and " pass key 160 | pass key 320 |" in page
    exact = next(line for line in page.splitlines() if line.startswith("| `exact` |"))
    original = next(line for line in page.splitlines() if line.startswith("| original (KV cache) |"))
    for line in (exact, original):  # both pass-key lengths filled in, on one row each
        assert all(cell.strip().endswith("%") for cell in line.strip("|").split("|")[-2:]), line
    assert page.count("| `exact` |") == 1
    assert (tmp_path / "p.png").stat().st_size > 0
