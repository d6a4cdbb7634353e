"""`rnnify distill` on the command line: a distilled directory written, convert and distil in one go,
mistakes as one-line errors, the default row length within learned positions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_support import run
from distill_support import (
    hybrid_dir,  # noqa: F401 - a fixture
)
from support import BUNDLED

import rnnify
from rnnify.distillation.checkpoint import CHECKPOINT_FILE


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("def main(argv):\n    for arg in argv:\n        print(arg.upper(), len(arg))\n" * 12)
    return path


def test_cli_distill_writes_a_distilled_model(capsys, hybrid_dir, corpus, tmp_path):
    out = tmp_path / "distilled"
    code, stdout, err = run(
        capsys,
        "distill",
        hybrid_dir,
        "--data",
        corpus,
        "-o",
        out,
        "--seq-len",
        16,
        "--batch-size",
        4,
        "--max-tokens",
        256,
        "--lr",
        "1e-2,1e-3",
        "--checkpoint-every",
        4,
        "--gate-lr-scale",
        "1,20",
        "--kernels",
        "none",
        "--device",
        "cpu",
        "--no-compile",
    )
    assert code == 0, err
    assert f"saved to {out}" in stdout and "transfer:" in err and "finetune:" in err
    manifest = json.loads((out / "rnnify.json").read_text())
    assert [r["tokens"] for r in manifest["distill"]["trained"]] == [128, 128]
    assert manifest["distill"]["gate_lr_scale"] == [1, 20]
    assert manifest["kernels"] == "none"  # trained and saved as --kernels said
    assert not (tmp_path / "distilled.checkpoints").exists()  # served its purpose once the model is saved
    assert rnnify.load(out).target == "hybrid"


def test_cli_convert_then_distill_in_one_go(capsys, tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "out"
    code, stdout, err = run(
        capsys,
        "convert",
        tiny_model_dir("gpt2"),
        "--to",
        "hybrid",
        "--window",
        4,
        "--distill",
        corpus,
        "-o",
        out,
        "--no-compile",
        "--seq-len",
        16,
        "--batch-size",
        4,
        "--max-tokens",
        128,
        "--stages",
        "finetune",
        "--lora-rank",
        2,
        "--tokenizer",
        tiny_model_dir("llama"),  # the same tokenizer files
        "--keep-checkpoints",
    )
    assert code == 0, err
    assert (tmp_path / "out.checkpoints" / CHECKPOINT_FILE).is_file() and "checkpoint kept in" in stdout
    record = json.loads((out / "rnnify.json").read_text())["distill"]
    assert record["stages"] == ["finetune"] and record["lora_rank"] == 2
    assert record["teacher"] == str(tiny_model_dir("gpt2"))


@pytest.mark.parametrize(
    "args, words",
    [
        (["--data", "missing.txt"], "does not exist"),
        (["--stages", "transfer,pretrain"], "stages"),
        (["--lr", "fast"], "--lr"),
        (["--gate-lr-scale", "1,x"], "--gate-lr-scale"),
        (["--gate-lr-scale", "1,2,3"], "gate_lr_scale"),
        (["--seq-len", "1"], "seq_len (--seq-len) must be"),
        (["--tokenizer", "no/such/dir"], "--tokenizer DIR"),
        (["--device", "cuda:0" if not torch.cuda.is_available() else "nope"], "--device"),
        (["-o", "{corpus}"], "not an rnnify model directory"),
        (["--teacher", "no/such/dir"], "no such directory"),
    ],
)
def test_cli_distill_mistakes_are_one_line_errors(capsys, hybrid_dir, corpus, tmp_path, args, words):
    argv = [
        "distill",
        hybrid_dir,
        "--data",
        corpus,
        "-o",
        tmp_path / "out",
        "--seq-len",
        16,
        "--batch-size",
        4,
        "--max-tokens",
        64,
        *(str(a).format(corpus=corpus) for a in args),
    ]
    code, _, err = run(capsys, *argv)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: ") and words in err, err
    assert not (tmp_path / "out").exists()


def test_cli_default_seq_len_stops_at_learned_positions(capsys, converted_dir, corpus, tmp_path):
    code, _, err = run(
        capsys,
        "distill",
        converted_dir("gpt2", "hybrid"),
        "--data",
        corpus,
        "-o",
        tmp_path / "out",
        "--stages",
        "finetune",
        "--kl-weight",
        0,
        "--batch-size",
        1,
        "--max-tokens",
        64,
        "--no-compile",
    )
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "rnnify.json").read_text())["distill"]["seq_len"] == 128  # not 1024


def test_an_interrupted_distill_says_where_its_checkpoint_is(capsys, hybrid_dir, corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"

    def interrupted(model, data, teacher, options):
        checkpoint = Path(options["checkpoint_dir"])
        checkpoint.mkdir(parents=True)
        (checkpoint / CHECKPOINT_FILE).write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr("rnnify.cli.distill.train", interrupted)
    code, _, err = run(capsys, "distill", hybrid_dir, "--data", corpus, "-o", out)
    assert code == 130 and err.strip().splitlines()[-1] == (
        f"interrupted; {out}.checkpoints/{CHECKPOINT_FILE} holds the last checkpoint: run the same command "
        "with --resume to continue"
    ), err


def test_convert_refuses_to_distill_an_exact_model_before_it_loads(capsys, corpus, tmp_path):
    code, _, err = run(capsys, "convert", BUNDLED, "--to", "exact", "--distill", corpus, "-o", tmp_path / "out")
    assert code == 2 and err.strip() == (
        "error: every attention of this model is exact softmax: it computes its original already, and distilling "
        "would only move it away; to train on your data, finetune the original, then convert it"
    ), err  # no stage had started: no "load ..." line before it
