"""The bundled model, the corpora the examples write, and the examples a user copies, each run on the
bundled model or a tiny GGUF."""

from __future__ import annotations

import json

import pytest
import torch
from support import BUNDLED, ROOT, load_script

import rnnify


def test_corpus_split_is_by_file_and_disjoint():
    corpus = load_script(ROOT / "examples" / "stdlib_corpus.py")
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


def test_python_docs_split_by_path_hash(tmp_path):
    import hashlib

    docs = load_script(ROOT / "examples" / "python_docs_corpus.py")
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

    needles = load_script(ROOT / "examples" / "needle_corpus.py")
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


# -- the examples a user copies (issue 43): each run on the bundled model, or a tiny GGUF, at tiny sizes --


@pytest.fixture(scope="module")
def stdlib_text(tmp_path_factory):
    """A few files of the bundled model's corpus split (examples/stdlib_corpus.py): (train, heldout)."""
    corpus = load_script(ROOT / "examples" / "stdlib_corpus.py")
    train, heldout = corpus.split()
    return corpus.write_files(tmp_path_factory.mktemp("stdlib"), (train[:3], heldout[:2]), corpus.read)


def test_example_convert_gguf_and_chat(tmp_path, capsys):
    from gguf_support import write_tiny_llama

    example = load_script(ROOT / "examples" / "convert_gguf_and_chat.py")
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
    example = load_script(ROOT / "examples" / "long_context_auto.py")
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
    example = load_script(ROOT / "examples" / "distill_hybrid.py")
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
