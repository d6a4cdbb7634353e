"""rnnify.evaluate and `rnnify eval`: metrics against an independent computation, the CLI, errors."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

import rnnify
from rnnify.cli import main
from rnnify.data import token_batches

TEXT = "def main(argv):\n    for arg in argv:\n        print(arg.upper(), len(arg))\n    return 0\n" * 6
OPTIONS = dict(seq_len=16, batch_size=2, max_tokens=100)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def _hf_perplexity(model_dir, corpus) -> float:
    """Perplexity from the original model's logits with transformers' own label masking."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for batch in token_batches(corpus, model_dir, **OPTIONS):
            labels = batch["input_ids"].masked_fill(~batch["attention_mask"], -100)[:, 1:]
            logits = hf(input_ids=batch["input_ids"]).logits[:, :-1]
            nll += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    return math.exp(nll / count)


def test_exact_matches_the_original(converted_dir, tiny_model_dir, corpus):
    result = rnnify.evaluate(converted_dir("llama", "exact"), corpus, **OPTIONS)
    want = _hf_perplexity(tiny_model_dir("llama"), corpus)
    assert result.perplexity == pytest.approx(want, rel=1e-4)
    assert result.teacher_perplexity == pytest.approx(want, rel=1e-5)
    assert result.tokens == 100 and result.against == rnnify.load(converted_dir("llama", "exact")).manifest.source
    assert 0 <= result.kl < 1e-6 and result.top1_agreement == 1.0
    assert [layer.layer for layer in result.layers] == [0, 1]
    assert all(layer.rel_error < 1e-4 and layer.tokens == 100 for layer in result.layers)
    assert result.state_bytes == rnnify.load(converted_dir("llama", "exact")).state_nbytes(16)
    assert json.loads(json.dumps(result.to_json()))["layers"][0]["module"] == "cells.0"


def test_approximate_target_has_a_cost(converted_dir):
    ids = torch.randint(0, 320, (4, 24), generator=torch.Generator().manual_seed(0))
    model = rnnify.load(converted_dir("llama", "linear"))
    result = rnnify.evaluate(model, ids, **OPTIONS)
    assert result.kl > 0 and result.perplexity != result.teacher_perplexity
    assert all(layer.rel_error > 1e-3 for layer in result.layers)
    other = rnnify.evaluate(model, ids, against=converted_dir("llama", "exact"), **OPTIONS)  # an rnnify dir
    assert other.teacher_perplexity == pytest.approx(result.teacher_perplexity, rel=1e-4)
    assert other.kl == pytest.approx(result.kl, rel=1e-2, abs=1e-7)


def test_cli_prints_and_writes_json(converted_dir, corpus, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(["eval", str(converted_dir("llama", "exact")), "--data", str(corpus), "--seq-len", "16",
                 "--batch-size", "2", "--max-tokens", "40", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "perplexity" in printed and "cells.1" in printed
    data = json.loads(out.read_text())
    assert data["tokens"] == 40 and data["seq_len"] == 16 and len(data["layers"]) == 2
    assert not list(tmp_path.glob(".eval.json*"))  # no temporary file left behind


def _source_elsewhere(converted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(converted, copy)
    manifest = json.loads((copy / "rnnify.json").read_text())
    manifest["source"] = "someone/some-model"
    (copy / "rnnify.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize(
    "args, match",
    [
        (lambda d, c, t: [d, "--data", str(t / "nope.txt")], "does not exist"),
        (lambda d, c, t: [d, "--data", str(c), "--against", str(t / "nope")], "nope"),
        (lambda d, c, t: [str(_source_elsewhere(d, t)), "--data", str(c)], "--against"),
        (lambda d, c, t: [d, "--data", str(c), "--batch-size", "0"], "batch_size must be"),
        (lambda d, c, t: [str(t), "--data", str(c)], "rnnify.json"),
    ],
)
def test_cli_errors(converted_dir, corpus, tmp_path, capsys, args, match):
    code = main(["eval", *args(str(converted_dir("llama", "exact")), corpus, tmp_path), "--seq-len", "16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and "Traceback" not in err
    assert match in err
