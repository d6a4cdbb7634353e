"""A directory whose files are each well formed but wrong is one line and exit 2, never a traceback.

Each case is written as someone who rewrote the directory would leave it: the files' sha256
recorded again (``reseal``), so the digest check passes and what is checked is the content.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import reseal

import rnnify
from rnnify.cli import main
from rnnify.runtime.manifest import MANIFEST_FILE, content_digest
from rnnify.runtime.storage import GRAPH_FILE, WEIGHTS_FILE


@pytest.fixture
def model_copy(tmp_path, converted_dir) -> Path:
    return Path(shutil.copytree(converted_dir("llama", "linear"), tmp_path / "model"))


def _manifest(directory: Path) -> dict:
    return json.loads((directory / MANIFEST_FILE).read_text())


def _edit_cell(directory: Path, key: str, change) -> None:
    cells = _manifest(directory)["cells"]
    change(cells[0][key])
    reseal(directory, cells=cells)


def _edit_cells(directory: Path, change) -> None:
    cells = _manifest(directory)["cells"]
    change(cells[0])
    reseal(directory, cells=cells)


def _edit_weights(directory: Path, name: str, change) -> None:
    tensors = load_file(directory / WEIGHTS_FILE)
    tensors[name] = change(tensors[name])
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    reseal(directory)


def _edit_graph(directory: Path, change) -> None:
    data = json.loads((directory / GRAPH_FILE).read_text())
    change(data)
    (directory / GRAPH_FILE).write_text(json.dumps(data))
    reseal(directory)


def _first(data: dict, target: str) -> dict:
    return next(n for n in data["nodes"] if n.get("target") == target)


CASES = {
    "alias to a missing name": (lambda d: reseal(d, aliases={"lm_head.weight": "no.such.tensor"}), "no.such.tensor"),
    "string num_heads": (lambda d: _edit_cell(d, "spec", lambda s: s.update(num_heads="4")), "num_heads"),
    "extra spec key": (lambda d: _edit_cell(d, "spec", lambda s: s.update(heads=4)), "'heads'"),
    "zero head_dim": (lambda d: _edit_cell(d, "spec", lambda s: s.update(head_dim=0)), "head_dim"),
    "positions null": (lambda d: reseal(d, positions=None), "positions"),
    "string graph limit": (
        lambda d: reseal(d, positions={"kind": "relative", "limit": None, "graph_limit": "31"}),
        "positions.graph_limit",
    ),
    "string vocab_size": (lambda d: reseal(d, vocab_size="320"), "vocab_size"),
    "unknown dtype": (lambda d: reseal(d, dtype="load"), "dtype"),
    "cells not a list": (lambda d: reseal(d, cells={"module": "cells.0"}), "cells"),
    "weight of another shape": (
        lambda d: _edit_weights(d, "model.layers.0.self_attn.q_proj.weight", lambda t: t[:, :-1].contiguous()),
        "does not run",
    ),
    "weight of another dtype": (
        lambda d: _edit_weights(d, "model.layers.0.self_attn.q_proj.weight", lambda t: t.to(torch.float16)),
        "does not run",
    ),
    "missing weight": (lambda d: _edit_weights(d, "model.norm.weight", lambda t: t[:0]), "does not run"),
    "graph op with too few args": (
        lambda d: _edit_graph(d, lambda g: _first(g, "torch.ops.aten.linear.default").__setitem__("args", [])),
        "needs argument",
    ),
    "graph op with a node where a size goes": (
        lambda d: _edit_graph(
            d, lambda g: _first(g, "torch.ops.aten.transpose.int")["args"].__setitem__(1, {"node": "input_ids"})
        ),
        "argument 'dim0' takes node 'input_ids'",
    ),
    "empty graph output": (
        lambda d: _edit_graph(d, lambda g: g["nodes"][-1].__setitem__("args", [{"tuple": []}])),
        "returns 0 values",
    ),
    # a spec's sizes are a few bytes that would fill memory: checked on the meta device before any is built
    "spec larger than its weights": (
        lambda d: _edit_cells(
            d, lambda c: c.update(target="delta", options={}, spec={**c["spec"], "hidden_size": 2**24})
        ),
        "spec hidden_size 16,777,216 is more than the weights hold",
    ),
    "spec of other weights": (
        lambda d: _edit_cells(d, lambda c: c.update(target="delta", options={}, spec={**c["spec"], "hidden_size": 48})),
        "its spec makes it",
    ),
    "a cell the graph never calls": (
        lambda d: reseal(d, cells=[*_manifest(d)["cells"], {**_manifest(d)["cells"][0], "module": "cells.extra"}]),
        "cell 'cells.extra' of the manifest is never called",
    ),
    "spec computing more than the weights": (
        lambda d: _edit_cells(
            d,
            lambda c: c.update(
                target="gated",
                options={"gate": "retnet"},
                spec={**c["spec"], "num_heads": 10**7, "num_kv_heads": 10**7},
            ),
        ),
        "more than the weights hold",
    ),
    "deeply nested graph": (
        lambda d: (
            (d / GRAPH_FILE).write_text('{"format": 1, "nodes": ' + "[" * 50_000 + "]" * 50_000 + "}"),
            reseal(d),
        ),
        "graph",
    ),
    "deeply nested manifest": (
        lambda d: (d / MANIFEST_FILE).write_text('{"format_version": 3, "x": ' + "[" * 50_000 + "]" * 50_000 + "}"),
        "manifest",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_directory_is_one_line(capsys, model_copy, case):
    corrupt, words = CASES[case]
    corrupt(model_copy)
    code = main(["generate", str(model_copy), "--ids", "1,2,3", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert words in err, err


def test_a_manifest_may_record_only_files_of_its_directory(model_copy, tmp_path, capsys):
    """A recorded name is a file beside the manifest: ``verify`` would otherwise hash files elsewhere."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not the model's")
    data = _manifest(model_copy)
    data["files"]["../outside.txt"] = "0" * 64
    data["digest"] = content_digest(data)  # sealed as a save seals it (``reseal`` records the directory's own files)
    (model_copy / MANIFEST_FILE).write_text(json.dumps(data))
    code = main(["verify", str(model_copy)])
    err = capsys.readouterr().err
    assert code == 2 and "not a file of the directory" in err and len(err.strip().splitlines()) == 1, err


DEEP = "[" * 100_000 + "]" * 100_000
# what info and generate read beside the manifest, weights and graph: (file, content, generate's code, words)
TEXT_CASES = {
    "deep config.json": ("config.json", DEEP, 2, "cannot load a tokenizer"),  # info: no source config
    "deep generation_config.json": ("generation_config.json", DEEP, 0, ""),  # no end ids then: it stops at N
    "float eos_token_id": ("generation_config.json", '{"eos_token_id": 1.5}', 2, "eos_token_id must be"),
    "deep tokenizer_config.json": ("tokenizer_config.json", DEEP, 2, "cannot load a tokenizer"),
}


@pytest.mark.parametrize("case", sorted(TEXT_CASES))
def test_odd_json_beside_the_model_is_one_line_or_none(capsys, model_copy, case):
    """Deep nesting raises RecursionError and a wrong type a TypeError, which ``json`` errors do not cover."""
    name, content, expected, words = TEXT_CASES[case]
    (model_copy / name).write_text(content)
    reseal(model_copy)
    for command in (["info"], ["generate", "--prompt", "def", "--max-new-tokens", "2"]):
        code = main([command[0], str(model_copy), *command[1:]])
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
    assert code == expected and words in err, err


@pytest.mark.parametrize(
    "change, words",
    [
        # verify and bench draw ids below the manifest's vocab_size: past the embeddings, an IndexError
        (lambda d: reseal(d, vocab_size=1_000_000), "vocabulary has 1,000,000 tokens, the step gives logits over 320"),
        # a window past int64 loaded, then overflowed at the first prompt of several tokens
        (lambda d: _edit_cell(d, "spec", lambda s: s.update(window=10**30)), "spec window is past int64"),
        # a cell's state is sized by its options: the load's dry run allocated 3.9 GB for this
        (lambda d: _edit_cell(d, "options", lambda o: o.update(window=10**9)), "one sequence's state"),
    ],
    ids=["vocab_size", "window past int64", "state of a huge window"],
)
def test_sizes_that_the_weights_do_not_back_are_refused_at_load(capsys, tmp_path, tiny_model_dir, change, words):
    directory = tmp_path / "model"
    rnnify.convert(tiny_model_dir("llama"), to="window", window=4, sinks=1).save(directory)
    change(directory)
    code = main(["verify", str(directory)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and words in err, err
