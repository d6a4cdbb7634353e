"""Tests for the ``rnnify`` command line, run in-process through ``rnnify.cli.main``."""

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
from safetensors.torch import load_file, save_file
from support import reseal

import rnnify
from rnnify.cli import main
from rnnify.errors import RnnifyWarning
from rnnify.runtime.manifest import MANIFEST_FILE
from rnnify.runtime.storage import WEIGHTS_FILE


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# the lines a command's stages print where stderr is not a terminal (``rnnify.progress``)
STAGE_LINE = re.compile(r"[\w ]+ \.\.\.|[\w ]+: \d+\.\d s")


def assert_user_error(code: int, err: str, *words: str) -> None:
    """One ``error:`` line and exit 2; before it, at most the lines of the stages that had started."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if not STAGE_LINE.fullmatch(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0]


def copy_model(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "copy"))


def alter_weight(directory: Path) -> None:
    tensors = load_file(directory / WEIGHTS_FILE)
    tensors["model.norm.weight"][0] += 1.0
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})


def edit_manifest(directory: Path, **changes) -> None:
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def eos_id(directory: Path) -> int:
    return json.loads((directory / "generation_config.json").read_text())["eos_token_id"]


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
    ],
)
def test_convert_bad_layer_flags(capsys, tmp_path, tiny_model_dir, flags, message):
    code, _, err = run(capsys, "convert", tiny_model_dir("llama"), "--to", "linear", *flags, "-o", tmp_path / "o")
    assert_user_error(code, err, message)
    assert not (tmp_path / "o").exists()


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
    from rnnify.verify import run_checks

    model = rnnify.convert(tiny_model_dir("llama"), to=target, window=8, keep=4, sinks=2)
    notes = [result.note for result in run_checks(model, tokens=10, batch=1)]
    assert "no window filled: the longest holds 10 tokens" in notes[1]  # the window and its sinks
    assert not any("no window" in note for note in (r.note for r in run_checks(model, tokens=16, batch=1)))


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


def test_info_shows_learned_positions(capsys, converted_dir):
    code, out, err = run(capsys, "info", converted_dir("gpt2", "exact"))
    assert code == 0, err
    assert "learned, 128 positions" in out


# -- bad input ----------------------------------------------------------------------------


@pytest.fixture
def t5_dir(tmp_path) -> Path:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    return tmp_path / "t5"


def _corrupted(tmp_path, converted_dir) -> Path:
    directory = copy_model(converted_dir("llama", "exact"), tmp_path)
    (directory / WEIGHTS_FILE).write_bytes(b"\x00garbage" * 64)
    return directory


def _from_the_future(tmp_path, converted_dir) -> Path:
    directory = copy_model(converted_dir("llama", "exact"), tmp_path)
    edit_manifest(directory, format_version=999)
    return directory


def _other_vocab(tmp_path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=400, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other")
    return tmp_path / "other"


def _no_attention(tmp_path) -> Path:
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=2)
    MambaForCausalLM(config).save_pretrained(tmp_path / "mamba")
    return tmp_path / "mamba"


def _empty(tmp_path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _file(directory: Path) -> Path:
    """A file that exists, where a model directory is expected."""
    (directory / "notes.txt").write_text("not a model")
    return directory / "notes.txt"


BAD_INPUT = {
    "convert missing path": (
        lambda t, c: ["convert", t / "missing", "--to", "exact", "-o", t / "out"],
        "no such directory",
    ),
    "verify missing path": (lambda t, c: ["verify", t / "missing"], "no such directory"),
    "info missing path": (lambda t, c: ["info", t / "missing"], "no such directory"),
    "info on a file": (lambda t, c: ["info", _file(t)], "a file, not a model directory"),
    "generate missing path": (lambda t, c: ["generate", t / "missing", "--ids", "1"], "no such directory"),
    "hub id offline": (
        lambda t, c: ["convert", "someone/some-model", "--to", "exact", "-o", t / "out"],
        "local Hugging Face cache",
    ),
    "no attention": (lambda t, c: ["convert", _no_attention(t), "--to", "exact", "-o", t / "out"], "no attention"),
    "no config.json": (lambda t, c: ["convert", _empty(t), "--to", "linear", "-o", t / "out"], "no config.json"),
    "not an rnnify dir": (lambda t, c: ["info", _empty(t)], "rnnify convert"),
    "corrupted weights": (lambda t, c: ["verify", _corrupted(t, c)], "corrupted weights"),
    "newer format": (lambda t, c: ["info", _from_the_future(t, c)], "upgrade rnnify"),
    "ids not integers": (lambda t, c: ["generate", c("llama", "exact"), "--ids", "1,x"], "'x' is not an integer"),
    "ids out of vocab": (lambda t, c: ["generate", c("llama", "exact"), "--ids", "1,320"], "outside the vocabulary"),
    "zero temperature": (
        lambda t, c: ["generate", c("llama", "exact"), "--ids", "1", "--do-sample", "--temperature", "0"],
        "temperature",
    ),
    "feature map on exact": (
        lambda t, c: ["convert", "unused", "--to", "exact", "--feature-map", "elu", "-o", t / "out"],
        "feature_map apply to none of the targets used (exact)",
    ),
    "against another model": (
        lambda t, c: ["verify", c("llama", "exact"), "--against", _other_vocab(t)],
        "compare against the model this one was converted from",
    ),
    "too few verify tokens": (
        lambda t, c: ["verify", t / "missing", "--tokens", "1"],
        "--tokens 1: must be at least 2",
    ),
    "empty verify batch": (lambda t, c: ["verify", t / "missing", "--batch", "0"], "--batch 0: must be at least 1"),
    "no eval tokens": (
        lambda t, c: ["eval", t / "missing", "--data", t, "--max-tokens", "0"],
        "--max-tokens 0: must be at least 1",
    ),
    "empty eval batch": (
        lambda t, c: ["eval", t / "missing", "--data", t, "--batch-size", "0"],
        "--batch-size 0: must be at least 1",
    ),
    "no pass-key trials": (
        lambda t, c: ["eval", t / "missing", "--data", t, "--passkey", "64", "--passkey-trials", "0"],
        "--passkey-trials 0: must be at least 1",
    ),
    "top-p past 1": (lambda t, c: ["generate", t / "missing", "--prompt", "a", "--top-p", "1.5"], "--top-p 1.5"),
    "top-k 0": (
        lambda t, c: ["generate", t / "missing", "--prompt", "a", "--top-k", "0"],
        "--top-k 0: must be at least 1",
    ),
    "no chat reply": (
        lambda t, c: ["chat", t / "missing", "--max-new-tokens", "0"],
        "--max-new-tokens 0: must be at least 1",
    ),
    "negative new tokens": (
        lambda t, c: ["generate", t / "missing", "--prompt", "a", "--max-new-tokens", "-1"],
        "--max-new-tokens -1: must be at least 0",
    ),
    "window below 1": (
        lambda t, c: ["convert", t / "missing", "--to", "window", "--window", "-5", "-o", t / "out"],
        "--window -5: must be at least 1",  # before the path is looked at
    ),
    "negative sinks": (
        lambda t, c: ["convert", t / "missing", "--to", "window", "--sinks", "-1", "-o", t / "out"],
        "--sinks -1: must be at least 0",
    ),
    "negative layer": (
        lambda t, c: ["convert", t / "missing", "--to", "linear", "--keep-softmax", "-1", "-o", t / "out"],
        "--keep-softmax '-1': expected comma-separated layer indices",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, converted_dir, case):
    make_argv, message = BAD_INPUT[case]
    code, _, err = run(capsys, *make_argv(tmp_path, converted_dir))
    assert_user_error(code, err, message)


@pytest.mark.parametrize(
    "source, message",
    [
        (lambda t, c: t / "missing", "no such directory"),
        (lambda t, c: t / "missing.gguf", "no such file"),
        (lambda t, c: _empty(t), "no config.json"),
        (lambda t, c: c("llama", "exact"), "already converted"),
    ],
    ids=["missing", "missing-gguf", "no-config", "converted"],
)
def test_a_wrong_source_is_said_before_any_stage_starts(capsys, tmp_path, converted_dir, source, message):
    """The whole of stderr is the one error line: no "load ..." stage line before it."""
    code, _, err = run(capsys, "convert", source(tmp_path, converted_dir), "--to", "exact", "-o", tmp_path / "out")
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_a_kept_layer_past_the_model_is_named_by_its_flag(capsys, tmp_path, tiny_model_dir):
    code, _, err = run(capsys, "convert", tiny_model_dir("llama"), "--to", "linear", "--keep-softmax", "9", "-o",
                       tmp_path / "out")  # fmt: skip
    assert_user_error(
        code, err, "keep_softmax (--keep-softmax) 9: layer 9 computes no attention (the model's attention layers: 0, 1)"
    )
    assert not (tmp_path / "out").exists()


def test_encoder_decoder_is_rejected(capsys, tmp_path, t5_dir):
    code, _, err = run(capsys, "convert", t5_dir, "--to", "exact", "-o", tmp_path / "out")
    assert_user_error(code, err, "encoder-decoder")


# the fewest arguments each command parses with, and one of its flags that takes a choice
COMMANDS = {
    "convert": (["convert", "m", "--to", "exact", "-o", "out"], "--dtype"),
    "verify": (["verify", "d"], "--kernels"),
    "generate": (["generate", "d", "--ids", "1"], "--kernels"),
    "chat": (["chat", "d"], "--kernels"),
    "info": (["info", "d"], None),
    "compile": (["compile", "d"], None),
    "bench": (["bench", "d"], "--dtype"),
    "eval": (["eval", "d", "--data", "x"], "--kernels"),
    "distill": (["distill", "d", "--data", "x", "-o", "out"], "--train"),
}


@pytest.mark.parametrize("name", COMMANDS)
def test_usage_errors_are_one_line_without_the_usage(capsys, monkeypatch, name):
    """A bad choice, a missing argument and an unknown flag: one line each, not argparse's usage block
    (convert's ran to 24 lines); --help still shows the usage."""
    argv, choice = COMMANDS[name]
    monkeypatch.setattr(f"rnnify.cli.{name}.run", lambda args, console: pytest.fail("ran with a usage error"))
    if choice is not None:
        code, _, err = run(capsys, *argv, choice, "x")
        assert_user_error(code, err, f"error: argument {choice}: invalid choice: 'x' (choose from ")
    code, _, err = run(capsys, name)
    assert_user_error(code, err, "error: the following arguments are required: ")
    code, _, err = run(capsys, *argv, "--bad-flag")
    assert_user_error(code, err, "error: unrecognized arguments: --bad-flag")
    code, out, _ = run(capsys, name, "--help")
    assert code == 0 and out.startswith(f"usage: rnnify {name} ")


def test_a_bad_target_and_command_are_one_line(capsys):
    code, _, err = run(capsys, "convert", "m", "--to", "x", "-o", "out")
    assert_user_error(code, err, "error: argument --to: invalid choice: 'x' (choose from 'exact', 'linear'", "'auto')")
    code, _, err = run(capsys, "convrt", "m")
    assert_user_error(code, err, "error: argument COMMAND: invalid choice: 'convrt'")
    assert_user_error(*run(capsys, "generate", "somewhere")[::2], "one of the arguments --prompt --ids is required")


# -- entry points -------------------------------------------------------------------------


def test_console_script_help():
    script = shutil.which("rnnify", path=str(Path(sys.executable).parent)) or shutil.which("rnnify")
    assert script, "the rnnify console script is not installed"
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in ("convert", "verify", "generate", "info"):
        assert command in result.stdout


def test_version_is_printed_without_a_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"rnnify {rnnify.__version__}\n"


def test_python_dash_m_runs_the_cli():
    command = [sys.executable, "-m", "rnnify", "info", "--help"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "DIR" in result.stdout


_HEAVY = ("torch", "transformers", "rich")


def _heavy_imports(code: str) -> list[str]:
    """The heavy modules a fresh interpreter has imported after running ``code``."""
    probe = f"import sys\n{code}\nprint(sorted(m for m in {_HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1].replace("'", '"'))


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["no-such-command"],
        [],
        *([name, "--help"] for name in COMMANDS),
        *([*COMMANDS[n][0], "--bad"] for n in COMMANDS),
    ],
)
def test_help_and_usage_errors_import_neither_torch_nor_rich(argv):
    """What keeps them fast: the commands import what they need when they run, and their arguments'
    choices and defaults come from rnnify.choices (convert --help imported torch, 2.6 s)."""
    code = f"from rnnify.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    assert _heavy_imports(code) == []


def test_the_names_the_command_line_offers_are_the_cells_and_feature_maps():
    """rnnify.choices states them without torch; rnnify.cells builds them from their classes."""
    from rnnify import choices
    from rnnify.cells import CELLS
    from rnnify.cells.linear import FEATURE_MAPS

    assert list(choices.TARGETS) == list(CELLS) and choices.FEATURE_MAPS == tuple(FEATURE_MAPS)


@pytest.mark.parametrize("argv", [["convert", "--help"], ["verify", "--bad-flag"]])
def test_help_and_usage_errors_answer_at_once(argv):
    """0.05 s here, 2.2-2.6 s before; 1 s leaves room for a loaded machine (the import check above is the
    robust one)."""

    def seconds() -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rnnify", *argv], capture_output=True, timeout=60)
        return time.perf_counter() - start

    assert min(seconds() for _ in range(3)) < 1.0


def test_import_rnnify_is_light_and_its_names_still_resolve():
    assert _heavy_imports("import rnnify") == []
    assert "torch" in _heavy_imports("import rnnify\nrnnify.load")  # imported on first use
    # importing the modules that define them first must leave rnnify.convert and distill functions
    check = "import rnnify\nimport rnnify.compiler.convert, rnnify.distillation.train\nassert rnnify.convert.__name__ == 'convert'"
    assert "torch" in _heavy_imports(check)
    assert rnnify.distill.__module__ == "rnnify.distillation.train"
    assert rnnify.benchmark.__module__ == "rnnify.bench"


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
    import importlib.util
    import os
    import stat

    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(__file__).resolve().parents[1]
    ignored = subprocess.run(["git", "check-ignore", "-q", "models/smollm2/model.safetensors"], cwd=root)
    assert ignored.returncode == 0, "models/ is not git-ignored"
    spec = importlib.util.spec_from_file_location("smollm2_example", root / "examples" / "smollm2.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
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
