"""Pass-key retrieval (rnnify/passkey.py, `rnnify eval --passkey`): prompts, scoring, exact answers."""

from __future__ import annotations

import json
import re

import pytest
import torch

import rnnify
from rnnify.cli import main
from rnnify.data import load_tokenizer
from rnnify.passkey import (ANSWER_MARGIN, FILLER, HEADER, QUESTION, build_prompt, passkey_prompts, passkey_trials,
                            score)

# the tiny Llama's prompts run past its 128 configured positions (RoPE still runs there)
pytestmark = pytest.mark.filterwarnings("ignore:decoding past max_position_embeddings")


@pytest.fixture
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir("llama"))


@pytest.mark.parametrize("length", [200, 256, 400])
def test_prompt_fills_the_requested_length(tokenizer, length):
    # whole filler sentences: the prompt falls short by less than one sentence's tokens (plus joins)
    sentence = max(len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in FILLER)
    for depth in (0.0, 0.5, 1.0):
        ids = build_prompt(tokenizer, length, depth, "12345").ids
        assert length - sentence - 2 <= len(ids) <= length


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.6, 1.0])
def test_key_sits_at_the_requested_depth(tokenizer, depth):
    text = tokenizer.decode(build_prompt(tokenizer, 400, depth, "54321").ids, skip_special_tokens=True)
    assert text.count("54321") == 1 and text.startswith(HEADER) and text.endswith(QUESTION)
    needle = re.search(r"The pass key is 54321\. Remember it\.", text)
    before = text[len(HEADER):needle.start()].count(".")  # filler sentences each end with one period
    after = text[needle.end():-len(QUESTION)].count(".")
    assert before + after > 10
    assert abs(before / (before + after) - depth) <= 0.5 / (before + after) + 1e-9


def test_score_takes_the_first_number():
    assert score(" 12345. Remember", "12345") and score(":\n12345", "12345")
    assert not score(" 123456", "12345") and not score(" 1234 5", "12345") and not score(" none", "12345")
    assert not score(" 54321 12345", "12345")


def _answering(tokenizer, wrong: bool):
    """A fake model that reads the key from the prompt's text and states it, or a different number."""
    def generate(ids, new):
        key = re.search(r"pass key is (\d{5})\.", tokenizer.decode(ids)).group(1)
        answer = str(int(key) % 90_000 + 10_001) if wrong else key
        return tokenizer(f" {answer}. Remember", add_special_tokens=False)["input_ids"][:new]
    return generate


def test_trials_score_each_generator(tokenizer):
    prompts = passkey_prompts(tokenizer, [200, 300], trials=3, seed=1)
    assert [(n, p.depth) for n, p in prompts] == [(n, d) for n in (200, 300) for d in (0.0, 0.5, 1.0)]
    keys = [p.key for _, p in prompts]
    assert all(re.fullmatch(r"\d{5}", k) for k in keys) and len(set(keys)) == 6
    assert keys == [p.key for _, p in passkey_prompts(tokenizer, [200, 300], trials=3, seed=1)]  # seeded
    trials = passkey_trials({"right": _answering(tokenizer, False), "wrong": _answering(tokenizer, True)},
                            tokenizer, prompts)
    assert all(t.correct == {"right": True, "wrong": False} for t in trials)
    assert all(t.answers["right"].strip().startswith(t.key) for t in trials)
    result = rnnify.PasskeyResult("m", None, 1, trials)
    assert result.accuracy() == {"right": {200: 1.0, 300: 1.0}, "wrong": {200: 0.0, 300: 0.0}}


def test_exact_conversion_answers_as_the_original(converted_dir, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    result = rnnify.evaluate_passkey(converted_dir("llama", "exact"), [200, 256], trials=2, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    assert len(result.trials) == 4
    for trial in result.trials:
        prompt = build_prompt(tokenizer, trial.length, trial.depth, trial.key)
        new = len(tokenizer(f" {trial.key}.", add_special_tokens=False)["input_ids"]) + ANSWER_MARGIN
        with torch.no_grad():  # transformers' own greedy decoding as the reference
            out = hf.generate(torch.tensor([prompt.ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)
        want = tokenizer.decode(out[0, len(prompt.ids):], skip_special_tokens=True)
        assert trial.tokens == len(prompt.ids)
        assert trial.answers["converted"] == trial.answers["original"]
        assert trial.answers["original"].startswith(want) and want
        assert trial.correct["converted"] == trial.correct["original"]


def test_cli_reports_passkey(converted_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    out = tmp_path / "eval.json"
    base = ["eval", str(converted_dir("llama", "exact")), "--data", str(corpus), "--seq-len", "16", "--max-tokens", "32"]
    assert main([*base, "--passkey", "200,256", "--passkey-trials", "2", "--json", str(out)]) == 0
    assert "pass-key" in capsys.readouterr().out
    data = json.loads(out.read_text())["passkey"]
    assert set(data["accuracy"]) == {"converted", "original"} and set(data["accuracy"]["converted"]) == {"200", "256"}
    assert len(data["trials"]) == 4 and data["seed"] == 0
    for bad, message in ((["--passkey", "big"], "--passkey"), (["--passkey", "20"], "at least"),
                         (["--passkey", "200", "--passkey-trials", "0"], "--passkey-trials")):
        assert main([*base, *bad]) == 2
        assert message in capsys.readouterr().err
