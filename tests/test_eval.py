"""rnnify.evaluate and `rnnify eval`: metrics against an independent computation, the CLI, errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import reseal

import rnnify
from rnnify.cli import main
from rnnify.data import token_batches
from rnnify.eval import copy_kinds, position_ranges

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


def test_a_short_last_batch_is_computed_at_its_real_length(converted_dir, corpus, monkeypatch):
    """100 tokens in rows of 1,000 (past the tiny model's 128 positions): both models read 100 columns, as
    if the rows were 100 long, and no position past the limit is read (no warning)."""
    import warnings

    model = rnnify.load(converted_dir("llama", "linear"))
    options = dict(batch_size=1, max_tokens=100, layer_errors=False, cache=False)
    want = rnnify.evaluate(model, corpus, seq_len=100, **options)
    widths = []
    prefill = type(model).prefill
    monkeypatch.setattr(
        type(model), "prefill", lambda self, ids, *a, **k: widths.append(ids.shape[1]) or prefill(self, ids, *a, **k)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = rnnify.evaluate(model, corpus, seq_len=1000, **options)
    assert widths == [100] and got.tokens == want.tokens == 100 and got.seq_len == 1000
    assert got.target == "linear"
    assert got.perplexity == pytest.approx(want.perplexity, rel=1e-6) and got.kl == pytest.approx(want.kl, rel=1e-5)


def test_the_target_counts_its_layer_rules(tiny_model_dir, corpus):
    """A per-layer (or per-head, ``--to auto``) model is not called a plain model of its default target."""
    model = rnnify.convert(tiny_model_dir("llama"), to="window", window=4, layers="1:linear")
    result = rnnify.evaluate(model, corpus, layer_errors=False, cache=False, **OPTIONS)
    assert result.target == "window + 1 layer rule"


@pytest.mark.parametrize("target", ["exact", "window"])
def test_rows_read_in_chunks_give_the_whole_rows_results(converted_dir, tiny_model_dir, corpus, target):
    """Both models read each row 5 tokens at a time (the converted one from its state, the original
    through its KV cache): the same metrics as whole rows, within float error; the exact model still
    matches transformers' own perplexity of whole rows."""
    options = dict(OPTIONS, layer_errors=False, cache=False)
    directory = converted_dir("llama", target) if target == "exact" else None
    model = rnnify.load(directory) if directory else rnnify.convert(tiny_model_dir("llama"), to="window", window=4)
    whole = rnnify.evaluate(model, corpus, **options)
    chunked = rnnify.evaluate(model, corpus, prefill_chunk=5, **options)
    assert chunked.tokens == whole.tokens == 100
    assert chunked.perplexity == pytest.approx(whole.perplexity, rel=1e-5)
    assert chunked.teacher_perplexity == pytest.approx(whole.teacher_perplexity, rel=1e-5)
    assert chunked.kl == pytest.approx(whole.kl, rel=1e-3, abs=1e-6)
    assert chunked.teacher_perplexity == pytest.approx(_hf_perplexity(tiny_model_dir("llama"), corpus), rel=1e-5)
    if target == "window":  # a window of 4 forgets: a KL the chunks match only by carrying the state
        assert chunked.kl > 1e-4


def test_row_metrics_held_a_few_positions_at_a_time_equal_whole_rows(converted_dir, corpus, monkeypatch):
    import importlib

    model = rnnify.load(converted_dir("llama", "linear"))
    whole = rnnify.evaluate(model, corpus, layer_errors=False, **OPTIONS).to_json()
    monkeypatch.setattr(importlib.import_module("rnnify.eval"), "METRIC_POSITIONS", 5)  # rows of 16: 4 pieces
    pieces = rnnify.evaluate(model, corpus, layer_errors=False, **OPTIONS).to_json()
    assert _close(pieces, whole)


def _close(a, b) -> bool:
    """Equal JSON results, numbers within float64 summation order."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def test_position_ranges_double_from_64():
    assert position_ranges(2048) == [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048)]
    assert position_ranges(300) == [(0, 64), (64, 128), (128, 256), (256, 300)]
    assert position_ranges(64) == [(0, 64)] and position_ranges(10) == [(0, 10)]


def test_kl_by_position_shows_where_a_window_stops_being_exact(tiny_model_dir):
    """A 64-token window computes the original exactly over a row's first 64 positions and not
    after; the ranges' token-weighted KL is the overall KL."""
    model = rnnify.convert(tiny_model_dir("llama"), to="window", window=64)
    ids = torch.randint(0, 320, (2, 100), generator=torch.Generator().manual_seed(0))
    result = rnnify.evaluate(model, ids, against=tiny_model_dir("llama"), seq_len=100, batch_size=2)
    first, rest = result.kl_by_position
    assert (first.start, first.end, first.tokens, rest.start, rest.end, rest.tokens) == (0, 64, 128, 64, 100, 72)
    assert first.kl < rest.kl / 100 and rest.kl > 1e-6, (first.kl, rest.kl)  # the first: fp32 rounding
    overall = (first.kl * first.tokens + rest.kl * rest.tokens) / (first.tokens + rest.tokens)
    assert overall == pytest.approx(result.kl, rel=1e-9)


def test_copy_kinds_find_repeats_by_distance():
    """Random tokens (no repeats by chance), then a copy of 20 of them from 140 positions back and
    one of 10 from 20 back: the 4-token spans inside each copy are copies, the seams are new."""
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(0))[:200]
    ids[150:170] = ids[10:30]  # far: 140 back
    ids[120:130] = ids[100:110]  # near: 20 back
    kinds = copy_kinds(ids, window=64)
    assert kinds.shape == (199,)
    far, near = set(range(152, 169)), set(range(122, 129))  # t whose span ids[t-2 : t+2] lies inside a copy
    assert {t for t in range(199) if kinds[t] == 2} == far
    assert {t for t in range(199) if kinds[t] == 1} == near
    assert copy_kinds(ids, window=200).eq(2).sum() == 0  # a window that sees the whole row: no far copy


def test_kl_by_copy_splits_the_predicted_positions(tiny_model_dir):
    model = rnnify.convert(tiny_model_dir("llama"), to="window", window=16)
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:100]
    ids[70:90] = ids[5:25]
    result = rnnify.evaluate(model, ids[None], against=tiny_model_dir("llama"), seq_len=100, batch_size=1)
    new, near, far = result.kl_by_copy
    assert (new.kind, near.kind, far.kind) == ("new", "copy within 64", "copy beyond 64")
    assert (new.tokens, near.tokens, far.tokens) == (82, 0, 17)
    assert far.kl > 0 and new.kl > 0
    total = sum(part.kl * part.tokens for part in result.kl_by_copy)
    last = result.kl * result.tokens - total  # the last position has no next token: in no kind
    assert 0 <= last < result.kl * result.tokens, (total, result.kl * result.tokens)


def test_cli_prints_and_writes_json(converted_dir, corpus, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(
        [
            "eval",
            str(converted_dir("llama", "exact")),
            "--data",
            str(corpus),
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--max-tokens",
            "40",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0 and "perplexity" in printed and "cells.1" in printed and "copy beyond 64" in printed
    data = json.loads(out.read_text())
    assert data["tokens"] == 40 and data["seq_len"] == 16 and len(data["layers"]) == 2
    assert not list(tmp_path.glob(".eval.json*"))  # no temporary file left behind


def _source_elsewhere(converted, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(converted, copy)
    reseal(copy, source="someone/some-model")
    return copy


@pytest.mark.parametrize(
    "args, match",
    [
        (lambda d, c, t: [d, "--data", str(t / "nope.txt")], "does not exist"),
        (lambda d, c, t: [d, "--data", str(c), "--against", str(t / "nope")], "nope"),
        (lambda d, c, t: [str(_source_elsewhere(d, t)), "--data", str(c)], "--against"),
        (lambda d, c, t: [d, "--data", str(c), "--batch-size", "0"], "--batch-size 0: must be at least 1"),
        (lambda d, c, t: [str(t), "--data", str(c)], "rnnify.json"),
        (lambda d, c, t: [d, "--data", str(c), "--prefill-chunk", "8"], "--prefill-chunk needs --no-layer-errors"),
        (lambda d, c, t: [d, "--data", str(c), "--prefill-chunk", "0", "--no-layer-errors"], "at least 1"),
    ],
)
def test_cli_errors(converted_dir, corpus, tmp_path, capsys, args, match):
    code = main(["eval", *args(str(converted_dir("llama", "exact")), corpus, tmp_path), "--seq-len", "16"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error:") and "Traceback" not in err
    assert match in err


def _without_tokenizer(converted, tmp_path, source=None):
    """A copy of ``converted`` holding no tokenizer files (its source kept, or ``source``)."""
    from rnnify.data import TOKENIZER_FILES

    copy = tmp_path / "no-tokenizer"
    shutil.copytree(converted, copy)
    for name in TOKENIZER_FILES:
        (copy / name).unlink(missing_ok=True)
    reseal(copy, **({} if source is None else {"source": source}))  # saved without them
    return copy


def test_a_directory_without_tokenizer_files_reads_text_with_its_sources(
    converted_dir, tiny_model_dir, corpus, tmp_path
):
    result = rnnify.evaluate(_without_tokenizer(converted_dir("llama", "exact"), tmp_path), corpus, **OPTIONS)
    assert result.perplexity == pytest.approx(_hf_perplexity(tiny_model_dir("llama"), corpus), rel=1e-4)


def test_cli_tokenizer_flag_and_its_error(converted_dir, tiny_model_dir, corpus, tmp_path, capsys):
    bare = str(_without_tokenizer(converted_dir("llama", "exact"), tmp_path, source=str(tmp_path / "gone")))
    argv = [
        "eval",
        bare,
        "--data",
        str(corpus),
        "--against",
        str(tiny_model_dir("llama")),
        "--seq-len",
        "16",
        "--max-tokens",
        "32",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "no tokenizer files" in err and "--tokenizer DIR" in err
    assert main([*argv, "--tokenizer", str(tiny_model_dir("llama"))]) == 0, capsys.readouterr().err


def test_kernels_and_device_choose_how_a_directory_loads(converted_dir, monkeypatch):
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    calls, op = [], rnnify.kernels.chunk_linear_attn
    monkeypatch.setattr(rnnify.kernels, "chunk_linear_attn", lambda *a, **kw: calls.append(1) or op(*a, **kw))
    fused = rnnify.evaluate(converted_dir("llama", "linear"), ids, kernels="reference", device="cpu", **OPTIONS)
    assert calls
    calls.clear()
    own = rnnify.evaluate(converted_dir("llama", "linear"), ids, kernels="none", **OPTIONS)
    assert not calls and fused.perplexity == pytest.approx(own.perplexity, rel=1e-5)
    with pytest.raises(rnnify.RnnifyError, match="a loaded model runs as it is"):
        rnnify.evaluate(rnnify.load(converted_dir("llama", "linear")), ids, kernels="none", **OPTIONS)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--seq-len", "1"], "seq_len (--seq-len) must be an integer >= 2"),
        (
            ["--json", "{tmp}/missing/eval.json"],
            "--json {tmp}/missing/eval.json: directory {tmp}/missing does not exist",
        ),
        (["--json", "{tmp}"], "--json {tmp} is a directory"),
        (["--json", "/proc/eval.json"], "--json /proc/eval.json: cannot write in /proc"),  # root too
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "nope"], "--device"),
    ],
)
def test_cli_checks_flags_before_the_work(converted_dir, corpus, tmp_path, capsys, args, match):
    # --against names nothing: an error about it would mean the flags were checked only after loading it
    argv = [
        "eval",
        str(converted_dir("llama", "exact")),
        "--data",
        str(corpus),
        "--against",
        str(tmp_path / "nope"),
        *(a.format(tmp=tmp_path) for a in args),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and match.format(tmp=tmp_path) in err
    assert str(tmp_path / "nope") not in err


def test_a_sharded_originals_index_is_part_of_its_digest(tmp_path, tiny_model_dir):
    """The index says which shard holds each tensor: another index is another model."""
    from rnnify.original.outputs import content_digest

    source = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "original"))
    before = content_digest(source)
    (source / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert content_digest(source) != before


def test_the_originals_logits_come_back_from_the_cache(converted_dir, tiny_model_dir, corpus, tmp_path, monkeypatch):
    source = tmp_path / "original"
    shutil.copytree(tiny_model_dir("llama"), source)
    monkeypatch.setenv("RNNIFY_CACHE", str(tmp_path / "cache"))
    model = rnnify.load(converted_dir("llama", "linear"))
    fresh = rnnify.evaluate(model, corpus, against=source, cache=False, **OPTIONS)
    first = rnnify.evaluate(model, corpus, against=source, **OPTIONS)
    assert list((tmp_path / "cache" / "original" / "logits").rglob("*.safetensors"))
    assert first.to_json() | {"against": ""} == fresh.to_json() | {"against": ""}

    def unloadable(*args, **kwargs):
        raise AssertionError("the original was loaded although the cache holds its logits")

    monkeypatch.setattr(rnnify.eval, "load_teacher", unloadable)
    again = rnnify.evaluate(model, corpus, against=source, layer_errors=False, **OPTIONS)
    assert again.kl == first.kl and again.teacher_perplexity == first.teacher_perplexity and again.layers == []
    # other weights are other content: recomputed, never a stale hit
    weights = next(source.glob("*.safetensors"))
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("o_proj.weight"))
    tensors[name] = tensors[name] * 0.5
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="the original was loaded"):
        rnnify.evaluate(model, corpus, against=source, **OPTIONS)
