"""Pass-key retrieval (rnnify/passkey.py, `rnnify eval --passkey`): prompts, scoring, exact answers."""

from __future__ import annotations

import json
import re

import pytest
import torch

import rnnify
from rnnify.cli import main
from rnnify.data import load_tokenizer
from rnnify.passkey import answer_tokens, passkey_trials, score, usable_probes
from rnnify.probes import CALIBRATION, EVALUATION, PROBES, build_prompt, prompts, prose_sentences

HEADER, QUESTION, FILLER = CALIBRATION.header, CALIBRATION.question, CALIBRATION.filler
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROSE = (
    "The committee met on a grey morning to discuss the harbour. Nobody agreed about the lighthouse. "
    "In 1987 the old pier burned down. A long quarrel followed over who should pay for the repairs, "
    "and the minutes of those meetings fill several volumes. Children still fish from the new pier. "
) * 40


def passkey_prompts(tokenizer, lengths, trials, seed):
    return prompts(tokenizer, lengths, trials, seed, [CALIBRATION])


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
    before = text[len(HEADER) : needle.start()].count(".")  # filler sentences each end with one period
    after = text[needle.end() : -len(QUESTION)].count(".")
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
    trials = passkey_trials(
        {"right": _answering(tokenizer, False), "wrong": _answering(tokenizer, True)}, tokenizer, prompts
    )
    assert all(t.correct == {"right": True, "wrong": False} for t in trials)
    assert all(t.answers["right"].strip().startswith(t.key) for t in trials)
    result = rnnify.PasskeyResult("m", None, 1, trials)
    assert result.accuracy() == {"right": {200: 1.0, 300: 1.0}, "wrong": {200: 0.0, 300: 0.0}}


def test_exact_conversion_answers_as_the_original(converted_dir, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    result = rnnify.evaluate_passkey(
        converted_dir("llama", "exact"), [200, 256], trials=2, seed=3, probes=["calibration", "reworded"]
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    assert len(result.trials) == 8
    for trial in result.trials:
        prompt = build_prompt(tokenizer, trial.length, trial.depth, trial.key, PROBES[trial.probe])
        new = answer_tokens(tokenizer, prompt)
        with torch.no_grad():  # transformers' own greedy decoding as the reference
            out = hf.generate(torch.tensor([prompt.ids]), max_new_tokens=new, do_sample=False, pad_token_id=0)
        want = tokenizer.decode(out[0, len(prompt.ids) :], skip_special_tokens=True)
        assert trial.tokens == len(prompt.ids)
        assert trial.answers["converted"] == trial.answers["original"]
        assert trial.answers["original"].startswith(want) and want
        assert trial.correct["converted"] == trial.correct["original"]


def test_cli_reports_passkey(converted_dir, tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    out = tmp_path / "eval.json"
    base = [
        "eval",
        str(converted_dir("llama", "exact")),
        "--data",
        str(corpus),
        "--seq-len",
        "16",
        "--max-tokens",
        "32",
    ]
    assert main([*base, "--passkey", "320,400", "--passkey-trials", "2", "--json", str(out), "--no-layer-errors"]) == 0
    printed = capsys.readouterr().out
    assert "pass-key" in printed and "multikey" in printed and "attention error per layer" not in printed
    data = json.loads(out.read_text())
    assert data["layers"] == []
    passkey = data["passkey"]
    assert set(passkey["accuracy"]) == {"converted", "original"} and set(passkey["accuracy"]["converted"]) == {
        "320",
        "400",
    }
    # the corpus has digits in every sentence, so no prose; the tiny tokenizer has no chat template
    assert set(passkey["accuracy_by_probe"]) == {"reworded", "multikey"}
    assert len(passkey["trials"]) == 8 and passkey["seed"] == 0
    assert main([*base, "--passkey", "300", "--passkey-trials", "1", "--passkey-probes", "calibration"]) == 0
    assert "calibration" in capsys.readouterr().out
    for bad, message in (
        (["--passkey", "big"], "--passkey"),
        (["--passkey", "20"], "at least"),
        (["--passkey", "200", "--passkey-trials", "0"], "--passkey-trials"),
        (["--passkey", "300", "--passkey-probes", "nope"], "choose from"),
        (["--passkey-probes", "reworded"], "needs --passkey"),
        (["--passkey", "300", "--passkey-probes", "chat"], "chat template"),
    ):
        assert main([*base, *bad]) == 2
        assert message in capsys.readouterr().err
    # a context too short for the prompts is refused before the perplexity pass, not after it
    monkeypatch.setattr("rnnify.eval.evaluate", lambda *a, **k: pytest.fail("the perplexity pass ran first"))
    assert main([*base, "--passkey", "20"]) == 2
    assert "at least" in capsys.readouterr().err


@pytest.mark.parametrize("name", [probe.name for probe in EVALUATION])
def test_every_probe_fills_its_length_with_the_key_once(tokenizer, name):
    tokenizer.chat_template = CHAT_TEMPLATE
    probe = PROBES[name]
    for length in (300, 500):
        for depth in (0.0, 0.5, 1.0):
            others = ["22222", "33333", "44444"][: max(len(probe.labels) - 1, 0)]
            prompt = build_prompt(tokenizer, length, depth, "12345", probe, prose_sentences(PROSE), others)
            text = tokenizer.decode(prompt.ids, skip_special_tokens=True)
            assert len(prompt.ids) <= length and len(prompt.ids) > length - 60
            assert text.count("12345") == 1 and all(text.count(k) == 1 for k in others)
            if probe.labels:  # the question asks for the first label, whose needle holds the key
                assert probe.needle.format(key="12345", label=probe.labels[0]) in text
                assert text.rstrip().endswith(probe.question.format(label=probe.labels[0]))
            assert ("<|assistant|>" in text) == probe.chat


def test_evaluation_probes_share_nothing_with_calibration(tokenizer):
    calibration = {CALIBRATION.header, CALIBRATION.needle, CALIBRATION.question, *CALIBRATION.filler}
    for probe in EVALUATION:
        sentences = {probe.header, probe.needle, probe.question, *probe.filler}
        assert not any(a in b or b in a for a in calibration for b in sentences), probe.name
    # nor the same keys: each family draws from its own stream
    calibrated = {p.key for _, p in prompts(tokenizer, [300], 8, 0, [CALIBRATION])}
    evaluated = {p.key for _, p in prompts(tokenizer, [300], 8, 0, [PROBES["reworded"], PROBES["multikey"]])}
    assert len(calibrated) == 8 and not calibrated & evaluated


def test_default_probes_are_those_that_can_be_built(tokenizer):
    tokenizer.chat_template = None
    assert [p.name for p in usable_probes(tokenizer)] == ["reworded", "multikey"]
    tokenizer.chat_template = CHAT_TEMPLATE
    assert [p.name for p in usable_probes(tokenizer, ("Some sentence here.",))] == [p.name for p in EVALUATION]


def test_prose_filler_leaves_out_numbers_and_changes_per_prompt(tokenizer):
    sentences = prose_sentences(PROSE)
    assert sentences and not any(c.isdigit() for s in sentences for c in s)
    built = prompts(tokenizer, [300], 3, 0, [PROBES["prose"]], sentences)
    texts = [tokenizer.decode(p.ids, skip_special_tokens=True) for _, p in built]
    assert all("The magic number is" in t for t in texts)


def test_unbuildable_probes_fail_in_one_line(converted_dir):
    with pytest.raises(rnnify.RnnifyError, match="real text"):
        rnnify.evaluate_passkey(converted_dir("llama", "exact"), [200], trials=1, probes=["prose"])
    with pytest.raises(rnnify.RnnifyError, match="unknown pass-key probe"):
        rnnify.evaluate_passkey(converted_dir("llama", "exact"), [200], trials=1, probes=["nope"])


def test_the_originals_answers_come_back_from_the_cache(converted_dir, tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    source = tmp_path / "original"
    shutil.copytree(tiny_model_dir("llama"), source)
    monkeypatch.setenv("RNNIFY_CACHE", str(tmp_path / "cache"))
    options = dict(trials=2, seed=5, probes=["reworded"], against=source)
    first = rnnify.evaluate_passkey(converted_dir("llama", "linear"), [200], **options)

    def unloadable(*args, **kwargs):
        raise AssertionError("the original was loaded although the cache holds its answers")

    monkeypatch.setattr(rnnify.original, "load_teacher", unloadable)
    again = rnnify.evaluate_passkey(converted_dir("llama", "linear"), [200], **options)
    assert [t.answers for t in again.trials] == [t.answers for t in first.trials]
    with pytest.raises(AssertionError, match="was loaded"):  # other prompts are not in the cache
        rnnify.evaluate_passkey(converted_dir("llama", "linear"), [200], **{**options, "seed": 6})
