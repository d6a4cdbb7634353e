"""Values a user can type that the command line refuses as one ``error:`` line and exit 2, never a
traceback or a crash: text that is not UTF-8, temperatures, seeds and thread counts out of range."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import assert_user_error, run
from test_chat import make_chat_model

import rnnify

ROOT = Path(__file__).resolve().parents[1]


def test_prompt_bytes_that_are_not_utf8(converted_dir):
    """The bytes as a shell passes them: Python turns them into lone surrogates in ``sys.argv``."""
    directory = str(converted_dir("llama", "exact"))
    argv = [sys.executable, "-m", "rnnify", "generate", directory, "--prompt", b"hi \xff\xfe"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(argv, capture_output=True, env=env, timeout=300)
    assert_user_error(
        result.returncode, result.stderr.decode(), "--prompt is not UTF-8 text", "bytes ff fe", "character 4"
    )


def test_system_prompt_that_is_not_utf8(capsys, converted_dir):
    code, _, err = run(capsys, "chat", converted_dir("llama", "exact"), "--system", "be \udcff")
    assert_user_error(code, err, "--system is not UTF-8 text", "byte ff")


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    source = make_chat_model(tmp_path_factory.mktemp("chat-hf"))
    return rnnify.convert(source, to="exact").save(tmp_path_factory.mktemp("chat") / "model")


def test_chat_stdin_that_is_not_utf8(capsys, monkeypatch, chat_dir):
    """As a pipe delivers them: ``input()`` reads a line from ``sys.stdin``, which decodes what it buffered."""
    stdin = io.TextIOWrapper(io.BytesIO(b"hello\nbad \xff\xfe line\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    code, _, err = run(capsys, "chat", chat_dir, "--max-new-tokens", "2")
    assert_user_error(code, err, "stdin is not utf-8 text (invalid start byte: ff)")


def test_chat_stdin_decoded_with_surrogates_is_refused(capsys, monkeypatch, chat_dir):
    """Python decodes a pipe with ``surrogateescape`` under a C or UTF-8 locale: other bytes arrive as
    lone surrogates, which the tokenizer refused with a TypeError."""
    stdin = io.TextIOWrapper(io.BytesIO(b"bad \xff\xfe line\n"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdin", stdin)
    code, _, err = run(capsys, "chat", chat_dir, "--max-new-tokens", "2")
    assert_user_error(code, err, "stdin is not UTF-8 text (bytes ff fe at character 5)")


def test_chat_with_stdin_closed_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stdin", None)
    code, _, err = run(capsys, "chat", tmp_path / "no-model")
    assert_user_error(code, err, "chat reads its messages from stdin, which is closed")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "warm"])
def test_temperature_out_of_range(capsys, monkeypatch, value):
    monkeypatch.setattr("rnnify.cli.generate.run", lambda args, console: pytest.fail("ran with a bad --temperature"))
    code, _, err = run(capsys, "generate", "d", "--ids", "1", "--do-sample", f"--temperature={value}")
    assert_user_error(code, err, "--temperature", "finite number > 0" if value != "warm" else "expected a number")


def test_a_tiny_temperature_samples_the_most_likely_token(capsys, converted_dir):
    """1e-40 overflowed the scaled logits to inf and the softmax to nan; now it is greedy decoding's limit."""
    directory = converted_dir("llama", "exact")
    greedy = run(capsys, "generate", directory, "--ids", "1,2,3", "--max-new-tokens", "6")
    sampled = run(
        capsys,
        "generate",
        directory,
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "6",
        "--do-sample",
        "--temperature",
        "1e-40",
        "--seed",
        "0",
    )
    assert sampled == greedy and greedy[0] == 0


@pytest.mark.parametrize("value", [str(2**64), str(-(2**63) - 1), "1.5"])
@pytest.mark.parametrize("command", ["generate", "verify", "distill"])
def test_seed_out_of_range(capsys, monkeypatch, command, value):
    monkeypatch.setattr(f"rnnify.cli.{command}.run", lambda args, console: pytest.fail("ran with a bad --seed"))
    argv = {
        "generate": ["generate", "d", "--ids", "1", "--do-sample"],
        "verify": ["verify", "d"],
        "distill": ["distill", "d", "--data", ".", "-o", "out"],
    }[command]
    code, _, err = run(capsys, *argv, "--seed", value)
    assert_user_error(code, err, "--seed", "-2**63 to 2**64 - 1" if value != "1.5" else "expected an integer")


@pytest.mark.parametrize("value", [str(2**64 - 1), "-1"])
def test_seeds_torch_takes_are_taken(capsys, converted_dir, value):
    code, out, err = run(
        capsys,
        "generate",
        converted_dir("llama", "exact"),
        "--ids",
        "1",
        "--max-new-tokens",
        "2",
        "--do-sample",
        "--seed",
        value,
    )
    assert code == 0, err
    assert len(out.strip().split(",")) == 3


@pytest.mark.parametrize("value", ["100000", str(os.cpu_count() + 1), "0"])
def test_threads_out_of_range(capsys, monkeypatch, value):
    """100000 threads crashed torch (SIGSEGV) before the command ran."""
    monkeypatch.setattr("rnnify.cli.generate.run", lambda args, console: pytest.fail("ran with a bad --threads"))
    code, _, err = run(capsys, "generate", "d", "--ids", "1", "--threads", value)
    assert_user_error(code, err, f"--threads must be an integer from 1 to {os.cpu_count()}")


_BAD_VALUES = [
    ("--temperature", "-1", "--temperature must be a finite number > 0, got -1.0"),
    ("--temperature", "nan", "--temperature must be a finite number > 0, got nan"),
    ("--threads", "0", "--threads must be an integer from 1 to"),
    ("--threads", "x", "--threads 'x': expected an integer"),
]
_COMMANDS = {
    "generate": ["generate", "d", "--ids", "1", "--do-sample"],
    "chat": ["chat", "d"],
    "eval": ["eval", "d", "--data", "."],
}


@pytest.mark.parametrize(
    ("command", "flag", "value", "said"),
    [(command, *bad) for command in _COMMANDS for bad in _BAD_VALUES if command != "eval" or bad[0] == "--threads"],
)
def test_bad_sampling_and_thread_values_are_refused_before_torch_loads(command, flag, value, said):
    """Issue 43: the value checks of --temperature and --threads are torch-free, so that a mistyped value
    answers at once (one ``error:`` line, exit 2) in a fresh interpreter that never imports torch (eval
    does not sample: --threads only)."""
    argv = [*_COMMANDS[command], flag, value]
    probe = (
        "import json, sys\nfrom rnnify.cli import main\n"
        f"code = main({argv!r})\n"
        "print(json.dumps([code, sorted(m for m in ('torch', 'transformers', 'rich') if m in sys.modules)]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    code, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert_user_error(code, done.stderr, said)
    assert heavy == []
