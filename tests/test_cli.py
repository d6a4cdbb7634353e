"""The ``rnnify`` commands doing their work (convert, verify, generate, info) and what a fresh user
sees, run in-process through ``rnnify.cli.main``."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_support import alter_weight, assert_user_error, copy_model, eos_id, run
from support import ROOT, load_script, reseal

import rnnify
from rnnify.errors import RnnifyWarning
from rnnify.runtime.manifest import MANIFEST_FILE
from rnnify.runtime.storage import WEIGHTS_FILE

# -- convert ------------------------------------------------------------------------------


@pytest.mark.parametrize("target, memory", [("exact", "grows with context"), ("linear", "constant")])
def test_convert_writes_a_loadable_directory(capsys, tmp_path, tiny_model_dir, target, memory):
    extra = ["--feature-map", "elu"] if target == "linear" else []
    code, out, err = run(
        capsys, "convert", tiny_model_dir("llama"), "--to", target, "-o", tmp_path / "out", *extra, "--no-compile"
    )
    assert code == 0, err
    assert f"saved to {tmp_path / 'out'}" in out
    assert f"{target}: 2 layers" in out and memory in out
    model = rnnify.load(tmp_path / "out")
    assert model.target == target and len(model.cells) == 2


def test_convert_per_layer_targets_and_options(capsys, tmp_path, tiny_model_dir):
    argv = ["convert", tiny_model_dir("llama"), "--to", "linear", "--keep-softmax", "1", "--option", "chunk_size=16"]
    code, _, err = run(capsys, *argv, "-o", tmp_path / "out", "--no-compile")
    assert code == 0, err
    model = rnnify.load(tmp_path / "out")
    assert [cell.target for cell in model.cells] == ["linear", "exact"]
    assert model.cells[0].options()["chunk_size"] == 16
    code, out, _ = run(capsys, "info", tmp_path / "out")
    assert code == 0 and "grows with context" in out


@pytest.mark.parametrize("target", [["window"], ["select", "--option", "keep=4", "--option", "chunk=4"]])
def test_convert_kv_dtype_stores_the_cache_in_int8_and_verifies(capsys, tmp_path, tiny_model_dir, target):
    """--kv-dtype int8: a window's or a selection cache's slots are int8 (rnnify.kernels.slots), info
    says so, and verify holds the step to the prefill, at half precision's tolerance."""
    out = tmp_path / "out"
    argv = ["convert", tiny_model_dir("llama"), "--to", *target, "--window", "4", "--kv-dtype", "int8"]
    code, _, err = run(capsys, *argv, "-o", out, "--no-compile")
    assert code == 0, err
    model = rnnify.load(out)
    assert all(cell.kv_dtype == "int8" and cell.target == target[0] for cell in model.cells)
    for cell in model.cells:
        state = dict(zip(cell.state_names, cell.init_state(1, torch.device("cpu"), torch.float32)))
        assert {state[name].dtype for name in state if name.endswith(("keys", "values"))} == {torch.int8}
    code, report, _ = run(capsys, "info", out)
    assert code == 0 and "stored as int8" in report
    code, report, err = run(capsys, "verify", out, "--tokens", "12")
    assert code == 0 and "all checks passed" in report, report + err
    assert "tolerance 0.02 relative" in report  # judged at its slots' rounding (agreement.rounding_dtype)


@pytest.mark.parametrize("memory", ["linear", "gla", "delta", "gated-delta"])
def test_convert_hybrid_memory_is_recorded_and_verifies(capsys, tmp_path, tiny_model_dir, memory):
    """--memory: each memory converts, is recorded in the manifest, and `verify` holds its step
    form to its prefill with the memory switched on (gate 0.5) and tokens leaving a 4-token window."""
    out = tmp_path / "out"
    argv = ["convert", tiny_model_dir("llama"), "--to", "hybrid", "--memory", memory, "--window", "4"]
    code, _, err = run(capsys, *argv, "--option", "memory_init=0.5", "-o", out, "--no-compile")
    assert code == 0, err
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["options"]["memory"] == memory and manifest["options"]["memory_init"] == 0.5
    model = rnnify.load(out)
    assert all(cell.memory == memory and float(cell.memory_gate.detach()[0]) == 0.5 for cell in model.cells)
    code, report, err = run(capsys, "verify", out, "--tokens", "12")
    assert code == 0, report + err
    assert "step == prefill" in report and "all checks passed" in report


def test_a_model_with_layer_rules_is_named_with_them(capsys, tmp_path, tiny_model_dir):
    """convert's and verify's headers count the --layers rules (as --to auto's choice is made), so a
    per-head map is not called a plain window model."""
    out = tmp_path / "out"
    argv = ["convert", tiny_model_dir("llama"), "--to", "linear", "--layers", "0:heads(0=exact)", "-o", out]
    code, report, err = run(capsys, *argv, "--no-compile")
    assert code == 0 and "linear + 1 layer rule: 2 layers" in report, err
    code, report, err = run(capsys, "verify", out, "--tokens", "8")
    assert code == 0 and "linear + 1 layer rule model" in report, err


def test_convert_bad_memory_is_one_line(capsys, tmp_path, tiny_model_dir):
    code, _, err = run(
        capsys, "convert", tiny_model_dir("llama"), "--to", "hybrid", "--memory", "lstm", "-o", tmp_path / "o"
    )
    assert_user_error(code, err, "--memory 'lstm'", "linear, gla, delta, gated-delta")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--option", "chunk_size"], "expected KEY=VALUE"),
        (["--keep-softmax", "0,x"], "comma-separated layer indices"),
        (["--layers", "0-1"], "RANGE:TARGET"),
        (["--layers", "9:exact"], "matches no layer"),
        (["--keep-softmax", "0,,1"], "comma-separated layer indices, each once"),  # the empty item was dropped
        (["--window", "8", "--option", "window=9"], "--option window=9 and --window 8: give it once"),  # 9 won
    ],
)
def test_convert_bad_layer_flags(capsys, tmp_path, tiny_model_dir, flags, message):
    code, _, err = run(capsys, "convert", tiny_model_dir("llama"), "--to", "linear", *flags, "-o", tmp_path / "o")
    assert_user_error(code, err, message)
    assert not (tmp_path / "o").exists()


def test_convert_never_asks_to_run_a_sources_own_code(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """A source whose config.json maps its type to code of its own (``auto_map``): transformers asked on
    stdin whether to run it (and ran it on "y"); rnnify converts what transformers knows, and says so."""
    source = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "custom"))
    config = json.loads((source / "config.json").read_text())
    config.update(model_type="custom_llama", auto_map={"AutoConfig": "custom.Config"})
    (source / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (source / "custom.py").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    code, _, err = run(capsys, "convert", source, "--to", "exact", "-o", tmp_path / "o")
    assert_user_error(code, err, "cannot read the model config (it names code of its own (auto_map)")
    assert not marker.exists() and not (tmp_path / "o").exists()


def _no_weights(source: Path) -> None:
    for weights in source.glob("*.safetensors"):
        weights.unlink()


def _truncated_weights(source: Path) -> None:
    weights = next(source.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])


def _heads_not_dividing_the_width(source: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_attention_heads": 7}))


@pytest.mark.parametrize(
    "damage, words",
    [
        (_no_weights, "cannot read the model's weights"),
        (_truncated_weights, "cannot read the model's weights"),
        (_heads_not_dividing_the_width, "its config.json does not describe a model"),
    ],
)
def test_convert_of_a_damaged_source_is_one_line(capsys, tmp_path, tiny_model_dir, damage, words):
    source = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "source"))
    damage(source)
    code, _, err = run(capsys, "convert", source, "--to", "exact", "-o", tmp_path / "o")
    assert_user_error(code, err, words)
    assert not (tmp_path / "o").exists()


def _tokenizer_cut_short(text: str) -> str:
    return text[: len(text) // 2]


def _tokenizer_of_a_wrong_shape(text: str) -> str:
    return json.dumps({**json.loads(text), "model": {"type": "BPE", "vocab": 5}})


@pytest.mark.parametrize(
    "damage, words",
    [
        (_tokenizer_cut_short, "tokenizer.json is not valid JSON (Expecting"),
        (_tokenizer_of_a_wrong_shape, "tokenizer.json is not a tokenizer that tokenizers"),
    ],
    ids=["cut-short", "wrong-shape"],
)
def test_convert_of_a_source_whose_tokenizer_json_cannot_load_is_one_line(
    capfd, tmp_path, tiny_model_dir, damage, words
):
    """convert copied such a tokenizer.json beside the model and exited 0, and only generate failed:
    now it is refused before the load (no stage has started), with no Rust panic, nothing written;
    and by ``rnnify.convert`` too, before the capture."""
    source = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "source"))
    path = source / "tokenizer.json"
    path.write_text(damage(path.read_text()))
    code, _, err = run(capfd, "convert", source, "--to", "exact", "-o", tmp_path / "o", "--no-compile")
    assert_user_error(code, err, str(path), words, "replace it with a good copy", "move the source's tokenizer files")
    assert err.startswith("error: ") and "panic" not in err, err
    assert not (tmp_path / "o").exists()
    stages = []
    with pytest.raises(rnnify.RnnifyError, match=re.escape(words)):
        rnnify.convert(source, progress=stages.append)
    assert stages == ["load"]


# -- verify -------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["exact", "linear"])
@pytest.mark.parametrize("against", [False, True])
def test_verify_passes_on_a_good_model(capsys, converted_dir, tiny_model_dir, target, against):
    extra = ["--against", tiny_model_dir("llama")] if against else []
    code, out, err = run(capsys, "verify", converted_dir("llama", target), *extra)
    assert code == 0, out + err
    assert "FAIL" not in out and "all checks passed" in out
    for check in ("integrity", "step == prefill", "split prefill"):
        assert check in out
    assert ("vs original" in out) == against
    if against and target == "linear":
        assert "approximate target" in out and "info" in out


def test_verify_fails_when_weights_differ_from_the_digest(capsys, tmp_path, converted_dir):
    directory = copy_model(converted_dir("llama", "exact"), tmp_path)
    alter_weight(directory)
    code, out, _ = run(capsys, "verify", directory)
    assert code == 1
    assert "FAIL" in out and "model.safetensors does not match the sha256" in " ".join(out.split())  # wrapped


@pytest.mark.parametrize("command", [["verify"], ["bench", "--contexts", "16", "--batch", "1", "--steps", "2"]])
def test_an_original_of_another_vocabulary_is_one_line(capsys, converted_dir, command):
    """The bundled model's 4,096 ids index past the tiny model's 320 embeddings (an IndexError, after
    every timing for bench)."""
    other = ROOT / "examples" / "models" / "stdlib-llama"
    code, _, err = run(capsys, command[0], converted_dir("llama", "exact"), *command[1:], "--against", other)
    assert_user_error(code, err, "has a vocabulary of 4096 tokens but the converted model has 320")


def test_verify_against_the_original_catches_an_altered_weight(capsys, tmp_path, converted_dir, tiny_model_dir):
    directory = copy_model(converted_dir("llama", "exact"), tmp_path)
    alter_weight(directory)
    reseal(directory)  # the record rewritten to match
    code, out, _ = run(capsys, "verify", directory)
    assert code == 0, out  # self-consistent: only the original can tell
    code, out, _ = run(capsys, "verify", directory, "--against", tiny_model_dir("llama"))
    assert code == 1
    assert "FAILED: vs original" in out


def test_verify_says_when_no_window_was_filled(capsys, converted_dir):
    """Checks shorter than a window pass without the window ever dropping a token: the note says so
    and how many tokens would; that many leave no such note."""
    directory = converted_dir("llama", "hybrid")  # a window with sinks, and a memory
    cell = rnnify.load(directory).cells[0]
    span = cell.window + cell.sinks
    code, out, _ = run(capsys, "verify", directory, "--tokens", 8)
    assert code == 0 and f"no window filled: the longest holds {span} tokens; --tokens {span + 8}" in " ".join(
        out.split()
    )
    code, out, _ = run(capsys, "verify", directory, "--tokens", span + 8, "--batch", 1)
    assert code == 0 and "no window filled" not in out


@pytest.mark.parametrize("target", ["select", "lola"])
def test_verify_counts_the_windows_of_selection_caches(tiny_model_dir, target):
    """A selection cache reads every token until the first chunk that starts past its window, sinks
    and kept tokens: checks of that many tokens still give the original's logits, and the note says
    so; longer ones drop some (the note goes)."""
    from rnnify.verify import run_checks

    model = rnnify.convert(tiny_model_dir("llama"), to=target, window=8, keep=4, sinks=2, chunk=4)
    span = 16  # chunks start at multiples of 4: the first past W + S + K = 14 reads without a token
    results = run_checks(model, against=tiny_model_dir("llama"), tokens=span, batch=1)
    assert f"no window filled: the longest holds {span} tokens" in results[1].note
    original = next(r for r in results if r.name == "vs original")
    assert original.rel_diff < 1e-4  # nothing dropped: softmax over every token
    results = run_checks(model, against=tiny_model_dir("llama"), tokens=2 * span, batch=1)
    assert not any("window filled" in r.note for r in results)
    assert next(r for r in results if r.name == "vs original").rel_diff > 1e-3


def test_verify_says_when_not_every_window_was_filled(tiny_model_dir):
    """Layers of different windows: checks longer than the short ones and shorter than the long one
    say that not every window filled, and how many tokens fill them all."""
    from rnnify.verify import run_checks

    model = rnnify.convert(tiny_model_dir("llama"), to="window", window=4, layers="0:window(window=16)")
    for tokens, note in (
        (3, "no window filled: the longest holds 16 tokens; --tokens 19"),
        (8, "not every window filled: the longest holds 16 tokens; --tokens 24"),
        (17, None),
    ):
        notes = " ".join(r.note for r in run_checks(model, tokens=tokens, batch=1))
        assert (note in notes) if note else "window filled" not in notes, (tokens, notes)


def test_verify_clamps_to_learned_positions(capsys, converted_dir):
    code, out, err = run(capsys, "verify", converted_dir("gpt2", "exact"), "--tokens", 500, "--batch", 1)
    assert code == 0, out + err
    assert "clamped to the model's 128 learned positions" in " ".join(out.split())  # the note column wraps


# -- generate -----------------------------------------------------------------------------


def test_generate_ids_streams_what_generate_returns(capsys, converted_dir):
    directory = converted_dir("llama", "exact")
    code, out, err = run(capsys, "generate", directory, "--ids", "1,2,3", "--max-new-tokens", 8)
    assert code == 0, err
    expected = rnnify.load(directory).generate(torch.tensor([[1, 2, 3]]), 8, eos_token_id=eos_id(directory))
    assert out.strip() == ",".join(map(str, expected[0].tolist()))


def test_sampling_flags_without_do_sample_are_named_in_a_warning(capsys, converted_dir):
    """Greedy decoding reads none of them (transformers warns too); the tokens are the greedy ones."""
    directory = converted_dir("llama", "exact")
    code, greedy, err = run(capsys, "generate", directory, "--ids", "1,2,3", "--max-new-tokens", 4)
    assert code == 0 and "warning" not in err
    code, out, err = run(capsys, "generate", directory, "--ids", "1,2,3", "--max-new-tokens", 4, "--top-k", 5)
    assert code == 0 and out == greedy
    assert err.strip() == "warning: --top-k applies only with --do-sample: decoding greedily"


def test_generate_prompt_streams_decoded_text(capsys, converted_dir):
    from transformers import AutoTokenizer

    directory = converted_dir("llama", "linear")
    code, out, err = run(capsys, "generate", directory, "--prompt", "def main():", "--max-new-tokens", 6)
    assert code == 0, err
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer("def main():", return_tensors="pt").input_ids
    expected = rnnify.load(directory).generate(ids, 6, eos_token_id=eos_id(directory))
    assert out.startswith("def main():")
    assert out.rstrip("\n") == tokenizer.decode(expected[0], skip_special_tokens=True)


def test_generate_samples_repeatably_with_a_seed(capsys, converted_dir):
    argv = [
        "generate",
        converted_dir("llama", "exact"),
        "--ids",
        "5,6",
        "--do-sample",
        "--top-k",
        20,
        "--top-p",
        0.9,
        "--temperature",
        0.8,
        "--seed",
        3,
        "--max-new-tokens",
        5,
    ]
    first, second = run(capsys, *argv), run(capsys, *argv)
    assert first[0] == 0 and first[1] == second[1]


def test_generate_prompt_needs_a_tokenizer(capsys, tmp_path, converted_dir):
    directory = copy_model(converted_dir("llama", "exact"), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).unlink()
    reseal(directory)  # saved so
    code, _, err = run(capsys, "generate", directory, "--prompt", "hello")
    assert_user_error(code, err, f"{directory} holds no tokenizer files", "with --ids")


# -- info ---------------------------------------------------------------------------------


@pytest.mark.parametrize("target, memory", [("exact", "grows with context"), ("linear", "constant")])
def test_info_describes_target_and_memory(capsys, converted_dir, target, memory):
    code, out, err = run(capsys, "info", converted_dir("llama", target))
    assert code == 0, err
    assert target in out and memory in out
    assert "model.layers.1.self_attn" in out and "16,384 tokens" in out and "relative" in out


def test_info_shows_the_options_the_target_was_given_not_a_layer_rules(capsys, tmp_path, tiny_model_dir):
    """The target line shows the options of a cell the target made (its defaults filled in); where
    layer rules made every cell, the options the target was given, never another target's."""
    source = tiny_model_dir("llama")
    for rules, shown in (
        ("0:window(window=16)", "window (window=8, sinks=0, block_size=64)"),
        ("0-:window(window=16)", "window (window=8)"),
    ):
        out_dir = tmp_path / rules.replace(":", "_").replace("(", "_").replace(")", "").replace("=", "")
        argv = ["convert", source, "--to", "window", "--window", 8, "--layers", rules, "-o", out_dir, "--no-compile"]
        assert run(capsys, *argv)[0] == 0
        code, out, err = run(capsys, "info", out_dir)
        assert code == 0, err
        assert f"target          {shown}\n" in out or " ".join(out.split()).count(f"target {shown} ") == 1, out


def test_info_shows_learned_positions(capsys, converted_dir):
    code, out, err = run(capsys, "info", converted_dir("gpt2", "exact"))
    assert code == 0, err
    assert "learned, 128 positions" in out


# -- what a fresh user sees ---------------------------------------------------------------


def test_altered_weights_are_an_error_at_load_unless_not_verified(capsys, tmp_path, converted_dir):
    directory = copy_model(converted_dir("llama", "linear"), tmp_path)
    data = bytearray((directory / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor's data: the file still parses
    (directory / WEIGHTS_FILE).write_bytes(bytes(data))
    code, _, err = run(capsys, "generate", directory, "--ids", "1,2", "--max-new-tokens", "1")
    assert_user_error(code, err, "does not match the sha256", "--no-verify")
    code, out, err = run(capsys, "generate", directory, "--ids", "1,2", "--max-new-tokens", "1", "--no-verify-weights")
    assert code == 0, err
    assert out.startswith("1,2,")


def test_the_position_warning_says_memory_stays_constant_only_where_it_does(capsys, converted_dir):
    for target, constant in (("linear", True), ("exact", False)):
        code, _, err = run(capsys, "generate", converted_dir("llama", target), "--ids", "1", "--max-new-tokens", "130")
        assert code == 0 and "decoding past max_position_embeddings=128" in err, err
        assert ("memory stays constant" in err) == constant, err


def test_rnnify_warnings_are_one_clean_line(capsys, converted_dir):
    # the tiny llama has 128 positions: decoding past them warns once
    code, _, err = run(capsys, "generate", converted_dir("llama", "linear"), "--ids", "1", "--max-new-tokens", "130")
    assert code == 0, err
    lines = err.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("warning: decoding past max_position_embeddings=128"), err
    assert ".py" not in err and "Warning" not in err
    with pytest.warns(RnnifyWarning, match="max_position_embeddings"):  # outside the CLI: a warning
        model = rnnify.load(converted_dir("llama", "linear"))
        model.generate(torch.tensor([[1]]), 130)


def test_piped_info_fits_120_columns_and_keeps_names_whole(capsys, monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.delenv("COLUMNS", raising=False)  # capsys's stdout is not a terminal: piped
    out = tmp_path / "mixed"
    assert (
        run(
            capsys,
            "convert",
            tiny_model_dir("llama"),
            "--to",
            "hybrid",
            "--keep-softmax",
            "1",
            "--kernels",
            "reference",
            "-o",
            out,
            "--no-compile",
        )[0]
        == 0
    )
    code, text, err = run(capsys, "info", out)
    assert code == 0, err
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "…" not in text and "..." not in text
    assert "model.layers.0.self_attn" in text and "model.layers.1.self_attn" in text


def test_convert_onto_a_converted_model_needs_overwrite(capsys, monkeypatch, tmp_path, tiny_model_dir, converted_dir):
    """Refused before anything loads, rather than replacing a model unasked; --overwrite replaces it."""
    out = copy_model(converted_dir("llama", "exact"), tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(rnnify, "convert", lambda *a, **k: pytest.fail("converted onto a model without --overwrite"))
        code, _, err = run(capsys, "convert", tiny_model_dir("llama"), "--to", "linear", "-o", out, "--no-compile")
    assert_user_error(code, err, f"error: {out} already holds a converted model; pass --overwrite to replace it")
    assert rnnify.load(out).target == "exact"
    code, _, err = run(
        capsys, "convert", tiny_model_dir("llama"), "--to", "linear", "-o", out, "--no-compile", "--overwrite"
    )
    assert code == 0, err
    assert rnnify.load(out).target == "linear"


def test_distill_onto_a_converted_model_needs_overwrite(capsys, monkeypatch, tmp_path, converted_dir):
    """Into its own directory too (the in-place distillation of tests/test_aot.py passes --overwrite)."""
    model = copy_model(converted_dir("llama", "hybrid"), tmp_path)
    monkeypatch.setattr(rnnify, "load", lambda *a, **k: pytest.fail("loaded for a distillation it may not save"))
    code, _, err = run(capsys, "distill", model, "--data", tmp_path, "-o", model)
    assert_user_error(code, err, f"error: {model} already holds a converted model; pass --overwrite to replace it")


def test_piped_convert_prints_a_line_as_each_stage_starts_and_ends(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """Not a bar (tqdm prints nothing off a terminal), which left a log silent for minutes."""
    from rnnify.compiler.passes import PIPELINE

    monkeypatch.setattr("rnnify.cli.convert.compile_step", lambda *a, **k: "decode step: eager (not compiled here)")
    code, _, err = run(capsys, "convert", tiny_model_dir("llama"), "--to", "linear", "-o", tmp_path / "out")
    assert code == 0, err
    stages = ["load", "capture", *(p.__name__ for p in PIPELINE), "save", "decode step"]
    lines = err.splitlines()
    assert lines[0::2] == [f"{stage} ..." for stage in stages], err
    assert all(re.fullmatch(rf"{stage}: \d+\.\d s", line) for stage, line in zip(stages, lines[1::2], strict=True)), err


def test_a_spinning_stage_moves_on_a_terminal(monkeypatch):
    """The decode step's compile, one call of up to minutes: a spinner and the bar's elapsed time move."""
    from rnnify import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(progress, "SPIN_SECONDS", 0.01)
    with progress.stages(2, "stage") as start:
        start("save")
        start("decode step", spin=True)
        time.sleep(0.2)
    drawn = terminal.getvalue()
    assert "decode step" in drawn and sum(f"stage/s, {frame}]" in drawn for frame in "|/-\\") == 4, drawn
    assert "2/2" in drawn


def test_piped_eval_prints_its_progress_as_lines(capsys, monkeypatch, converted_dir, tmp_path):
    """A pass that runs past LOG_SECONDS prints a line now and then and one at the end; off a terminal
    tqdm printed nothing for a whole evaluation. A short pass prints none (nor before its error)."""
    from rnnify import progress

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 40)
    argv = ["eval", converted_dir("llama", "exact"), "--data", corpus, "--seq-len", "16", "--no-layer-errors"]
    code, _, err = run(capsys, *argv)
    assert code == 0 and "evaluate" not in err, err
    monkeypatch.setattr(progress, "LOG_SECONDS", 0.0)
    code, _, err = run(capsys, *argv)
    lines = [line for line in err.splitlines() if line.startswith("evaluate:")]
    assert code == 0 and len(lines) > 1 and re.search(r" [1-9]\d*tok ", lines[-1]) and "\r" not in err, err


def test_help_says_what_distill_and_chat_verbose_do(capsys):
    """distill's default fine-tunes every weight of a small model (--train auto), not LoRA; chat --verbose's
    "tokens rule" said nothing of what a rule is."""
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "fine-tuning of every weight (LoRA above 1B parameters)" in " ".join(out.split())
    code, out, _ = run(capsys, "chat", "--help")
    assert code == 0 and "how they were told from the history the state holds" in " ".join(out.split())


def test_the_smollm2_example_writes_what_git_ignores_with_the_umasks_modes(tmp_path, monkeypatch):
    """examples/smollm2.py writes models/ (README), which git ignores, and its weights with the modes the
    umask gives, not the 0600 safetensors writes (here on a tiny model in place of the GGUF's)."""
    import os
    import stat

    from transformers import LlamaConfig, LlamaForCausalLM

    ignored = subprocess.run(["git", "check-ignore", "-q", "models/smollm2/model.safetensors"], cwd=ROOT)
    assert ignored.returncode == 0, "models/ is not git-ignored"
    example = load_script(ROOT / "examples" / "smollm2.py")
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    monkeypatch.setattr(example, "load_gguf", lambda path: LlamaForCausalLM(config))
    monkeypatch.setattr(example, "tokenizer_files", lambda path: {})
    old = os.umask(0o022)
    try:
        assert example.main([str(tmp_path / "models" / "smol"), "--gguf", str(tmp_path / "x.gguf")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "models" / "smol").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
