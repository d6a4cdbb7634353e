"""A few bytes of a directory cannot ask its load for gigabytes or hours.

The graph's ops make tensors of the sizes its constants give, and its integer arithmetic is
Python's: each case adds a few nodes (and aliases) to a converted directory and reseals it, as an
attacker who rewrites it whole would; the load refuses each in one line before it allocates or
computes (docs/security.md, "What rnnify.load checks").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file
from support import reseal

import rnnify
from rnnify.cli import main
from rnnify.errors import RnnifyError
from rnnify.runtime.storage import GRAPH_FILE, WEIGHTS_FILE


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("windowed") / "model"
    rnnify.convert(tiny_model_dir("llama"), to="window", window=4, sinks=1).save(out)
    return out


def _node(name: str, op: str, target: str, *args, **kwargs) -> dict:
    return {"name": name, "op": op, "target": target, "args": list(args), "kwargs": kwargs}


def _ref(name: str) -> dict:
    return {"node": name}


def _call(name: str, op: str, *args, dtype: str | None = None) -> dict:
    """A node calling ``torch.ops.aten.<op>``, with a ``dtype`` where given."""
    return _node(name, "call_function", f"torch.ops.aten.{op}", *args, **({"dtype": {"dtype": dtype}} if dtype else {}))


def _grafted(tmp_path: Path, windowed: Path, nodes, aliases: dict | None = None) -> Path:
    """A copy of ``windowed`` with ``nodes`` before its output (``w``: a norm weight, ``x``: its
    first input) and ``aliases`` in its manifest, resealed."""
    directory = Path(shutil.copytree(windowed, tmp_path / "model"))
    graph = json.loads((directory / GRAPH_FILE).read_text())
    norm = next(n["target"] for n in graph["nodes"] if n["op"] == "get_attr" and n["target"].endswith("norm.weight"))
    first_input = next(n["name"] for n in graph["nodes"] if n["op"] == "placeholder")
    graph["nodes"][-1:-1] = [
        _node("w", "get_attr", norm),
        _node("x", "call_function", "torch.ops.aten.alias.default", _ref(first_input)),
        *nodes,
    ]
    (directory / GRAPH_FILE).write_text(json.dumps(graph))
    if aliases:
        manifest = json.loads((directory / "rnnify.json").read_text())
        manifest["aliases"] = {**manifest.get("aliases", {}), **aliases}
        (directory / "rnnify.json").write_text(json.dumps(manifest))
    reseal(directory)
    return directory


def test_a_graph_that_squares_its_sizes_is_refused_before_its_dry_run(capsys, tmp_path, windowed):
    """Squaring a size again and again doubles its digits each time: the dry run at load would stall."""
    chain = [
        _call("size", "sym_size.int", _ref("x"), 0),
        _node("big", "call_function", "operator.mul", _ref("size"), 2**62),
    ]
    chain += [
        _node(f"square{i}", "call_function", "operator.mul", _ref(p), _ref(p))
        for i, p in enumerate(["big", *(f"square{i}" for i in range(11))])
    ]
    code = main(["info", str(_grafted(tmp_path, windowed, chain))])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "node 'square3'" in err and "integer arithmetic" in err, err


@pytest.mark.parametrize(
    "nodes",
    [
        # a few bytes of graph.json for 4 TB, and a view of a weight 10**12 rows long made whole
        [_call("bomb", "zeros.default", [10**12])],
        [_call("wide", "expand.default", _ref("w"), [10**12, -1]), _call("bomb", "contiguous.default", _ref("wide"))],
        # an op of one tensor that takes a size: histc's bins
        [_call("bomb", "histc.default", _ref("w"), 10**12)],
        # a boolean mask beside a long index: the meta device cannot size it from the mask's data
        [
            _call("y", "ones.default", [1 << 15, 2]),
            _call("mask", "ones.default", [1 << 15], dtype="bool"),
            _call("i", "zeros.default", [1 << 14, 1], dtype="int64"),
            _call("bomb", "index.Tensor", _ref("y"), [_ref("mask"), _ref("i")]),
        ],
        # a tensor of float64: bytes, not elements, are what fills the memory
        [_call("bomb", "zeros.default", [1 << 28], dtype="float64")],
    ],
    ids=["zeros", "expand", "histc", "mask index", "float64"],
)
def test_ops_that_would_make_more_than_the_weights_are_refused_before_they_run(tmp_path, windowed, nodes):
    with pytest.raises(RnnifyError, match=r"makes a tensor of [\d,]+ bytes, more than a step of its weights needs"):
        rnnify.load(_grafted(tmp_path, windowed, nodes))


def test_a_product_of_more_work_than_the_weights_is_refused_before_it_runs(tmp_path, windowed):
    """Two 8,192 x 8,192 matrices, each within the bytes allowed, multiplied: minutes of one thread."""
    nodes = [_call("a", "zeros.default", [1, 1 << 13, 1 << 13]), _call("bomb", "bmm.default", _ref("a"), _ref("a"))]
    with pytest.raises(RnnifyError, match=r"aten.bmm.default computes [\d,]+ multiply-adds, more than a step"):
        rnnify.load(_grafted(tmp_path, windowed, nodes))


def test_aliases_do_not_raise_what_a_step_may_make(tmp_path, windowed):
    """An alias names a weight again: counted once, or 14,000 aliases let a 2 GB tensor through."""
    head = next(k for k in load_file(windowed / WEIGHTS_FILE) if k.startswith("lm_head") or "embed" in k)
    aliases = {f"pad.a{i}": head for i in range(2000)}
    nodes = [*(_node(f"g{i}", "get_attr", name) for i, name in enumerate(aliases))]
    nodes.append(_call("bomb", "zeros.default", [(1 << 28) + 1]))
    with pytest.raises(RnnifyError, match="aten.zeros.default makes a tensor of 1,073,741,828 bytes"):
        rnnify.load(_grafted(tmp_path, windowed, nodes, aliases))
