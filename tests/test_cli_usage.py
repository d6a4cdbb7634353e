"""The ``rnnify`` command line's front: bad input is one line and exit 2, usage errors and --help
answer at once without importing torch, and the entry points run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_support import assert_user_error, copy_model, edit_manifest, run
from support import BUNDLED

import rnnify
from rnnify.cli import main
from rnnify.runtime.storage import WEIGHTS_FILE

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
    "training flag without distill": (
        lambda t, c: ["convert", BUNDLED, "--to", "hybrid", "--lr", "1e-3", "-o", t / "out"],
        "--lr: only --distill PATH uses it; add --distill or leave it out",
    ),
    "distill an exact model": (
        lambda t, c: ["convert", BUNDLED, "--to", "exact", "--distill", t, "-o", t / "out"],
        "every attention of this model is exact softmax",
    ),
    "no command": (lambda t, c: [], "the following arguments are required: COMMAND; rnnify --help lists them"),
    "budget and max kl": (
        lambda t, c: [
            "convert",
            "unused",
            "--to",
            "auto",
            "--data",
            t,
            "--state-budget",
            "30%",
            "--max-kl",
            "0.1",
            "-o",
            t / "o",
        ],
        "--to auto needs only one of --state-budget",
    ),
    "kv dtype on lola": (
        lambda t, c: ["convert", "unused", "--to", "lola", "--window", "8", "--kv-dtype", "int8", "-o", t / "out"],
        "kv_dtype apply to none of the targets used (lola)",
    ),
    "kv dtype on auto": (
        lambda t, c: ["convert", "unused", "--to", "auto", "--data", t, "--kv-dtype", "int8", "-o", t / "out"],
        "--kv-dtype: --to auto scores and counts its windows in the model's dtype",
    ),
    "feature map on exact": (
        lambda t, c: ["convert", "unused", "--to", "exact", "--feature-map", "elu", "-o", t / "out"],
        "feature_map apply to none of the targets used (exact)",
    ),
    "against another model": (
        lambda t, c: ["verify", c("llama", "exact"), "--against", _other_vocab(t)],
        "pass the model it was converted from",
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
    "unknown gate": (  # refused after loading and capturing the model before
        lambda t, c: ["convert", BUNDLED, "--to", "gated", "--gate", "nope", "-o", t / "o"],
        "argument --gate: invalid choice: 'nope'",
    ),
    "empty output": (lambda t, c: ["convert", BUNDLED, "--to", "exact", "-o", ""], "name a new directory"),
    "output under a file": (
        lambda t, c: ["convert", BUNDLED, "--to", "exact", "-o", _file(t) / "sub"],
        "is a file, not a directory",
    ),
    "empty model": (lambda t, c: ["convert", "", "--to", "exact", "-o", t / "o"], "the model is an empty name"),
    "digest not hex": (
        lambda t, c: ["verify", t / "missing", "--expect-digest", "zz"],
        "--expect-digest 'zz': expected a sha256, 64 hexadecimal digits",
    ),
    "ids with an empty item": (
        lambda t, c: ["generate", t / "missing", "--ids", "1,,2"],
        "--ids: '' is not an integer",
    ),
    "empty prompt": (lambda t, c: ["generate", t / "missing", "--prompt", ""], "--prompt is empty"),
    "missing eval data": (
        lambda t, c: ["eval", t / "missing", "--data", t / "no-text"],
        "no-text does not exist; pass a text file",
    ),
    "missing distill data": (
        lambda t, c: ["convert", BUNDLED, "--to", "hybrid", "--distill", t / "no-text", "-o", t / "out"],
        "no-text does not exist; pass a text file",
    ),
    "top-k -1": (
        lambda t, c: ["generate", t / "missing", "--prompt", "a", "--top-k=-1"],
        "--top-k -1: must be at least 0",
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
    "eval": (["eval", "d", "--data", "."], "--kernels"),
    "distill": (["distill", "d", "--data", ".", "-o", "out"], "--train"),
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
    from rnnify.cells.gated import GATES
    from rnnify.cells.linear import FEATURE_MAPS

    assert list(choices.TARGETS) == list(CELLS) and choices.FEATURE_MAPS == tuple(FEATURE_MAPS)
    assert choices.GATES == GATES


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
