"""The bundled model, its corpus split and the fidelity benchmark script."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import rnnify

ROOT = Path(__file__).resolve().parents[1]

BUNDLED = ROOT / "examples" / "models" / "stdlib-llama"


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def test_corpus_split_is_by_file_and_disjoint():
    corpus = _load(ROOT / "examples" / "stdlib_corpus.py")
    train, heldout = corpus.split()
    assert train and heldout and not set(train) & set(heldout)
    assert sorted(train + heldout) == corpus.stdlib_files()
    assert all(not {"test", "site-packages"} & set(f.split("/")) for f in train + heldout)
    assert 0.02 < len(heldout) / (len(train) + len(heldout)) < 0.1  # 1 in HELDOUT_EVERY = 20, by hash


def test_bundled_model_fits_the_budget_and_records_its_training():
    assert sum(f.stat().st_size for f in BUNDLED.iterdir()) <= 16 * 1024 * 1024
    record = json.loads((BUNDLED / "training.json").read_text())
    assert record["heldout_perplexity"] > 1 and record["command"].startswith("python examples/train_tiny_lm.py")


def test_bundled_model_converts_exactly():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED)
    ids = tokenizer(["def read_lines(path):\n    with open(path) as f:"], return_tensors="pt")["input_ids"]
    original = AutoModelForCausalLM.from_pretrained(BUNDLED).eval()
    model = rnnify.convert(BUNDLED, to="exact", progress=False)
    with torch.no_grad():
        expected = original(ids).logits
    logits, _ = model.prefill(ids)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # trained, not random: the original predicts held-in Python well above chance
    assert expected[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).mean().exp() > 1 / 100


def test_fidelity_script_end_to_end(tmp_path, tiny_model_dir):
    fidelity = _load(ROOT / "benchmarks" / "fidelity.py")
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
    fidelity = _load(ROOT / "benchmarks" / "fidelity.py")
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
        "--seq-len",
        "32",
        "--eval-rows",
        "1",
        "--batch-size",
        "2",
        "--threads",
        "1",
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


def test_python_docs_split_by_path_hash(tmp_path):
    import hashlib

    docs = _load(ROOT / "examples" / "python_docs_corpus.py")
    sources = tmp_path / "_sources"
    names = [f"library/mod{i}.rst.txt" for i in range(120)] + [f"howto/guide{i}.rst.txt" for i in range(30)]
    for name in names:
        (sources / name).parent.mkdir(parents=True, exist_ok=True)
        (sources / name).write_text(f"{name}\n=====\n\nSome prose about {name}.\n")
    (sources / "library" / "index.html").write_text("not a source")  # not .rst.txt: left out
    train_dir, heldout_dir, train, heldout = docs.write_split(tmp_path / "out", sources)
    want = {n for n in names if int(hashlib.sha1(n.encode()).hexdigest(), 16) % 20 == 0}  # 1 in 20, by path
    assert set(heldout) == want and set(train) == set(names) - want and 0 < len(want) < 20
    for directory, files in ((train_dir, train), (heldout_dir, heldout)):
        written = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
        assert written == sorted(files)
        assert all((directory / f).read_text() == (sources / f).read_text() for f in files)
    with pytest.raises(FileExistsError):  # never over an earlier split
        docs.write_split(tmp_path / "out", sources)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_needle_rows_pack_one_exercise_per_row(tmp_path):
    """Packed by rnnify's own data reader, every row is one exercise: the number stated once, at
    least min_gap tokens before the row's end, and the row ending with the question and the number."""
    import re

    from rnnify.data import load_tokenizer, token_batches

    needles = _load(ROOT / "examples" / "needle_corpus.py")
    tokenizer = load_tokenizer(BUNDLED)
    source = tmp_path / "text"
    source.mkdir()
    for i in range(4):
        (source / f"doc{i}.txt").write_text(f"Chapter {i}. " + "The quick brown fox jumps over the lazy dog. " * 200)
    rows = needles.needle_rows(tokenizer, list(source.iterdir()), rows=6, seq_len=128, min_gap=40, seed=0)
    data = tmp_path / "needles.jsonl"
    data.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    batches = list(token_batches(data, tokenizer, seq_len=128, batch_size=1))
    assert len(batches) == 6 and all(b["attention_mask"].all() for b in batches)
    for batch in batches:
        ids = batch["input_ids"][0].tolist()
        assert ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token_id not in ids[:-1]
        text = tokenizer.decode(ids[:-1])
        key = re.search(r" (\d{5})\.$", text).group(1)
        assert text.count(key) == 2  # stated once, answered once
        stated = text.index(key)
        assert len(tokenizer(text[stated:], add_special_tokens=False)["input_ids"]) >= 40
        assert "pass key" not in text  # the probe's wording stays held out


@pytest.mark.slow  # multi-process / end to end; the default suite stays under 10 minutes
@pytest.mark.filterwarnings("ignore:decoding past max_position_embeddings")
def test_fidelity_rows_are_saved_as_they_finish_and_reused(tmp_path, tiny_model_dir, capsys):
    fidelity = _load(ROOT / "benchmarks" / "fidelity.py")
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
    fidelity = _load(ROOT / "benchmarks" / "fidelity.py")
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
    per_head = _load(ROOT / "benchmarks" / "per_head.py")
    data = tmp_path / "data"
    for part in ("train", "heldout"):
        (data / part).mkdir(parents=True)
        (data / part / "a.py").write_text("def f(x):\n    return [x + i for i in range(10)]\n" * 80)
    out = tmp_path / "out"
    record = per_head.main(
        [
            "--model",
            str(tiny_model_dir("llama")),
            "--data",
            str(data),
            "--budgets",
            "0.3",
            "--window",
            "8",
            "--sinks",
            "1",
            "--calib-len",
            "32",
            "--calib-rows",
            "2",
            "--calib-passkey",
            "0",
            "--seq-len",
            "32",
            "--eval-tokens",
            "256",
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
            "--model",
            str(tiny_model_dir("llama")),
            "--data",
            str(data),
            "--budgets",
            "0.3",
            "--window",
            "8",
            "--sinks",
            "1",
            "--calib-len",
            "32",
            "--calib-rows",
            "2",
            "--calib-passkey",
            "0",
            "--seq-len",
            "32",
            "--eval-tokens",
            "256",
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
    compare = _load(ROOT / "benchmarks" / "retrieval_windows.py")
    text = compare.main([str(out / "q.json"), "--png", str(out / "r.png"), "--per-layer"])
    assert "| window 8 + " in text and " heads at 16 (per head) |" in text and (out / "r.png").stat().st_size > 0
    with pytest.raises(SystemExit) as error:  # the first run kept its heads exact
        compare.main([str(out / "p.json")])
    assert error.value.code == 2


def test_retrieval_windows_table_orders_by_state_and_takes_plain_window_rows(tmp_path):
    compare = _load(ROOT / "benchmarks" / "retrieval_windows.py")

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
    long_context = _load(ROOT / "benchmarks" / "long_context.py")
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
    fidelity = _load(ROOT / "benchmarks" / "fidelity.py")
    common = [
        "--model",
        str(tiny_model_dir("llama")),
        "--seq-len",
        "32",
        "--eval-rows",
        "1",
        "--batch-size",
        "2",
        "--threads",
        "1",
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
    report = _load(ROOT / "benchmarks" / "fidelity_report.py")
    (tmp_path / report.MEMORY_RUNS[0]).write_text(json.dumps(record))
    section = report.memories_section(tmp_path / "fidelity.json")
    assert "| `h` |" in section and "Goals (issue 12)" in section


def test_cell_speed_replays_the_calls_the_model_makes(tmp_path, converted_dir):
    """The cell benchmark times the cell on the inputs the model gives it: a replayed capture gives
    the output the cell gave inside the model, for the prompt and the decode step."""
    cell_speed = _load(ROOT / "benchmarks" / "cell_speed.py")
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

    eval_table = _load(ROOT / "benchmarks" / "eval_table.py")
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


# -- the examples a user copies (issue 43): each run on the bundled model, or a tiny GGUF, at tiny sizes --


@pytest.fixture(scope="module")
def stdlib_text(tmp_path_factory):
    """A few files of the bundled model's corpus split (examples/stdlib_corpus.py): (train, heldout)."""
    corpus = _load(ROOT / "examples" / "stdlib_corpus.py")
    train, heldout = corpus.split()
    return corpus.write_files(tmp_path_factory.mktemp("stdlib"), (train[:3], heldout[:2]), corpus.read)


def test_example_convert_gguf_and_chat(tmp_path, capsys):
    from gguf_support import write_tiny_llama

    example = _load(ROOT / "examples" / "convert_gguf_and_chat.py")
    gguf = write_tiny_llama(tmp_path / "tiny.gguf")
    out = tmp_path / "chat-window"
    answers = example.main(
        [
            str(gguf),
            "-o",
            str(out),
            "--window",
            "16",
            "--sinks",
            "2",
            "--max-new-tokens",
            "4",
            "--message",
            "hello there",
            "--message",
            "tell me more",
        ]
    )
    printed = capsys.readouterr().out
    assert len(answers) == 2 and all(answers)
    assert "> hello there\n" in printed and "> tell me more\n" in printed and printed.startswith(f"saved to {out}")
    model = rnnify.load(out)  # the saved directory: a constant-memory window with the GGUF's chat template
    assert model.target == "window" and model.constant_memory and model.tokenizer.chat_template
    assert model.chat([{"role": "user", "content": "hello there"}], max_new_tokens=4) == answers[0]


def test_example_long_context_auto(tmp_path, capsys, stdlib_text):
    example = _load(ROOT / "examples" / "long_context_auto.py")
    train, heldout = stdlib_text
    out = tmp_path / "auto"
    record = example.main(
        [
            str(BUNDLED),
            "--data",
            str(train),
            "--heldout",
            str(heldout),
            "-o",
            str(out),
            "--state-budget",
            "8%",
            "--at-context",
            "512",
            "--window",
            "16",
            "--sinks",
            "2",
            "--retrieval-window",
            "64",
            "--calib-len",
            "64",
            "--calib-rows",
            "1",
            "--calib-passkey",
            "0",
            "--seq-len",
            "128",
            "--eval-tokens",
            "256",
            "--passkey",
            "160",
            "--passkey-trials",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    assert 0 < len(record["retrieval"]) < 8  # 8% of the KV cache at 512 tokens: some of the 8 kv heads, not all
    assert f"{len(record['retrieval'])} of 8 kv heads keep 64 tokens, the rest 16" in printed
    assert record["kl"] > 0 and f"KL {record['kl']:.4f} nats/token" in printed and "rows of 128 tokens" in printed
    assert set(record["passkey"]) == {"converted", "original"} and "pass key at 160 tokens: " in printed
    head_map = json.loads((out / "head_map.json").read_text())
    assert head_map["retrieval_window"] == 64 and len(head_map["retrieval"]) == len(record["retrieval"])
    assert rnnify.load(out).constant_memory


def test_example_distill_hybrid(tmp_path, capsys, stdlib_text):
    example = _load(ROOT / "examples" / "distill_hybrid.py")
    train, heldout = stdlib_text
    out = tmp_path / "hybrid"
    record = example.main(
        [
            str(BUNDLED),
            "--data",
            str(train),
            "--heldout",
            str(heldout),
            "-o",
            str(out),
            "--window",
            "16",
            "--sinks",
            "2",
            "--tokens",
            "1024",
            "--seq-len",
            "64",
            "--batch-size",
            "4",
            "--eval-tokens",
            "128",
        ]
    )
    printed = capsys.readouterr().out
    assert record["trained"] == {"transfer": 512, "finetune": 512}  # the budget split between the two stages
    assert (
        f"converted: KL {record['kl_before']:.4f}" in printed and f"distilled: KL {record['kl_after']:.4f}" in printed
    )
    saved = rnnify.load(out)
    assert saved.target == "hybrid" and [s["stage"] for s in saved.manifest.distill["trained"]] == [
        "transfer",
        "finetune",
    ]
