"""A directory cannot reach past its own cells and weights through the names it gives them.

The attack these tests replay (found by a red-team review): a graph node named ``self`` rebinds the
parameter of fx's generated ``forward`` through which every ``get_attr`` and ``call_module`` is
read, to a tensor; cells and aliases the manifest installs at paths such as
``stft.__code__.co_code.__add__.__objclass__`` then walk from that tensor to ``bytes``, torch's
module globals and Python's builtins, and a chain of vocabulary ops evaluates a string stored as a
weight. Every directory here is resealed (``reseal``), as an attacker who rewrites it whole would.
"""

from __future__ import annotations

import copy
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import reseal

import rnnify
from rnnify.cli import main
from rnnify.errors import GraphFormatError, RnnifyError
from rnnify.runtime.serialize import graph_from_json
from rnnify.runtime.storage import GRAPH_FILE, WEIGHTS_FILE


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tiny_model_dir) -> Path:
    """A converted model whose cells keep a window (the cell the attack copies)."""
    out = tmp_path_factory.mktemp("windowed") / "model"
    rnnify.convert(tiny_model_dir("llama"), to="window", window=4, sinks=1).save(out)
    return out


def _node(name: str, op: str, target: str, *args) -> dict:
    return {"name": name, "op": op, "target": target, "args": list(args), "kwargs": {}}


def _ref(name: str) -> dict:
    return {"node": name}


def _plant_escape(directory: Path, marker: Path) -> None:
    """Rewrite ``directory`` so that running its graph evaluates code that writes ``marker``."""
    strings = {
        "p_int": "int",
        "p_isinstance": "isinstance",
        "p_eval": "eval",
        "p_code": f"__import__('pathlib').Path({str(marker)!r}).write_text('ran') or 1",
    }
    tensors = load_file(directory / WEIGHTS_FILE)
    tensors.update({k: torch.tensor(list(s.encode()), dtype=torch.int64) for k, s in strings.items()})
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    manifest = json.loads((directory / "rnnify.json").read_text())
    graph = json.loads((directory / GRAPH_FILE).read_text())
    nodes = graph["nodes"]
    calls = {
        "bytes": "stft.__code__.co_code.__add__.__objclass__",
        "decode": "istft.__code__.co_code.__add__.__objclass__.decode",
        "setitem": "lu.__globals__.__setitem__",  # torch._tensor's module globals
        "delitem": "eig.__globals__.__delitem__",
        "split": "split",  # Tensor.split calls int(split_size) once isinstance() says it is an int
    }
    state = []
    for i, path in enumerate(calls.values()):
        manifest["cells"].append({**copy.deepcopy(manifest["cells"][0]), "module": path})
        state += [f"x{i}_{s}" for s in ("keys", "values", "sink_keys", "sink_values", "length")]
    manifest["aliases"] = {"norm.__builtins__": "lm_head.weight", "solve.__builtins__.get": "lm_head.weight"}
    manifest["buffers"] = [*manifest.get("buffers", []), *strings]
    last_input = max(i for i, n in enumerate(nodes) if n["op"] == "placeholder")
    nodes[last_input + 1 : last_input + 1] = [_node(s, "placeholder", s) for s in state]
    chain = [_node(k, "get_attr", k) for k in strings]
    chain += [
        _node("self", "call_function", "torch.ops.aten.clone.default", _ref("p_int")),
        _node("builtins_dict", "get_attr", "norm.__builtins__"),
        _node("dict_get", "get_attr", "solve.__builtins__.get"),
    ]
    for k in strings:
        chain += [
            _node(f"b_{k}", "call_module", calls["bytes"], _ref(k)),
            _node(f"s_{k}", "call_module", calls["decode"], _ref(f"b_{k}")),
        ]
    chain += [
        _node("eval_fn", "call_function", "operator.getitem", _ref("builtins_dict"), _ref("s_p_eval")),
        _node("set1", "call_module", calls["setitem"], _ref("s_p_isinstance"), _ref("dict_get")),
        _node("set2", "call_module", calls["setitem"], _ref("s_p_int"), _ref("eval_fn")),
        _node("boom", "call_module", calls["split"], _ref("b_p_code")),
        _node("del1", "call_module", calls["delitem"], _ref("s_p_isinstance")),
        _node("del2", "call_module", calls["delitem"], _ref("s_p_int")),
        _node("keepalive", "call_function", "torch.ops.aten.neg.default", _ref("self")),
    ]
    nodes[-1:-1] = chain
    nodes[-1]["args"][0]["tuple"] += [_ref(s) for s in state]
    (directory / GRAPH_FILE).write_text(json.dumps(graph))
    (directory / "rnnify.json").write_text(json.dumps(manifest))
    reseal(directory)


@pytest.fixture
def escape(tmp_path, windowed) -> tuple[Path, Path]:
    directory = Path(shutil.copytree(windowed, tmp_path / "model"))
    marker = tmp_path / "ran"
    _plant_escape(directory, marker)
    return directory, marker


@pytest.mark.parametrize("verify", [True, False])
def test_a_graph_that_rebinds_self_runs_nothing(escape, verify):
    directory, marker = escape
    with pytest.raises(RnnifyError, match="not a dotted attribute path"):
        rnnify.load(directory, verify=verify)
    assert not marker.exists()


@pytest.mark.parametrize("command", [["generate", "--ids", "1,2", "--max-new-tokens", "1"], ["info"]])
def test_the_commands_refuse_the_escape_in_one_line(capsys, escape, command):
    directory, marker = escape
    code = main([command[0], str(directory), *command[1:]])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists()


def test_a_node_or_input_named_self_is_refused(windowed):
    """fx's generated forward reads every weight and cell through its first parameter, ``self``."""
    data = json.loads((windowed / GRAPH_FILE).read_text())
    first_input = next(n["name"] for n in data["nodes"] if n["op"] == "placeholder")
    renamed = copy.deepcopy(data)
    renamed["nodes"][-1:-1] = [_node("self", "call_function", "torch.ops.aten.clone.default", _ref(first_input))]
    with pytest.raises(GraphFormatError, match="invalid node name 'self'"):
        graph_from_json(renamed)
    next(n for n in data["nodes"] if n["op"] == "placeholder")["target"] = "self"
    with pytest.raises(GraphFormatError, match="invalid placeholder target 'self'"):
        graph_from_json(data)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda m, t: m["cells"][0].update(module="cells.__class__"),
            "manifest names a module or tensor 'cells.__class__'",
        ),
        (lambda m, t: m.update(aliases={"norm.__builtins__": "lm_head.weight"}), "'norm.__builtins__', not a dotted"),
        (lambda m, t: m.update(buffers=["__dict__"]), "'__dict__', not a dotted attribute path"),
        (lambda m, t: t.update({"model.__init__.weight": torch.zeros(1)}), "'model.__init__.weight' is not a dotted"),
        # a method, not a submodule: installed through submodules alone
        (lambda m, t: t.update({"model.forward.weight": torch.zeros(1)}), "attribute 'forward' already exists"),
    ],
    ids=["cell module", "alias", "buffer", "weight", "method"],
)
def test_names_that_leave_the_modules_are_refused(tmp_path, windowed, change, message):
    directory = Path(shutil.copytree(windowed, tmp_path / "model"))
    manifest = json.loads((directory / "rnnify.json").read_text())
    tensors = load_file(directory / WEIGHTS_FILE)
    change(manifest, tensors)
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    (directory / "rnnify.json").write_text(json.dumps(manifest))
    reseal(directory)
    with pytest.raises(RnnifyError, match=message):
        rnnify.load(directory)


def _rename(directory: Path, old: str, new: str) -> None:
    """Give the tensor or cell ``old`` the name ``new`` everywhere: weights, manifest and graph."""
    tensors = {
        (new + k[len(old) :] if k == old or k.startswith(old + ".") else k): v
        for k, v in load_file(directory / WEIGHTS_FILE).items()
    }
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    manifest = json.loads((directory / "rnnify.json").read_text())
    for cell in manifest["cells"]:
        cell["module"] = new if cell["module"] == old else cell["module"]
    graph = json.loads((directory / GRAPH_FILE).read_text())
    for node in graph["nodes"]:
        node["target"] = new if node["target"] == old else node["target"]
    (directory / GRAPH_FILE).write_text(json.dumps(graph))
    (directory / "rnnify.json").write_text(json.dumps(manifest))
    reseal(directory)


@pytest.mark.parametrize(
    "kind, name",
    [("cell", "to_folder"), ("tensor", "_wrapped_call"), ("cell", "print_readable")],
)
def test_a_name_the_step_module_has_itself_is_refused(tmp_path, windowed, kind, name):
    """The generated step reads ``self.<name>``: a method of the step module (``to_folder`` writes files
    where its argument says) or fx's own attributes come first, whatever was installed under it."""
    directory = Path(shutil.copytree(windowed, tmp_path / "model"))
    graph = json.loads((directory / GRAPH_FILE).read_text())
    old = next(n["target"] for n in graph["nodes"] if n["op"] == ("call_module" if kind == "cell" else "get_attr"))
    _rename(directory, old, name)
    with pytest.raises(RnnifyError, match=f"'{name}' names an attribute of the step itself"):
        rnnify.load(directory)


def test_an_input_named_twice_is_one_line(capsys, tmp_path, windowed):
    """Two placeholders of one target made fx write ``def forward(self, ..., x, x)``: a SyntaxError."""
    directory = Path(shutil.copytree(windowed, tmp_path / "model"))
    graph = json.loads((directory / GRAPH_FILE).read_text())
    inputs = [n for n in graph["nodes"] if n["op"] == "placeholder"]
    inputs[-1]["target"] = inputs[-2]["target"]
    (directory / GRAPH_FILE).write_text(json.dumps(graph))
    reseal(directory)
    code = main(["info", str(directory)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and f"input {inputs[-2]['target']!r} appears twice" in err, err


def test_info_writes_out_the_control_characters_of_a_manifest(capsys, tmp_path, windowed):
    """A manifest's words reach the terminal: escape sequences there would clear it or set its title."""
    directory = Path(shutil.copytree(windowed, tmp_path / "model"))
    manifest = json.loads((directory / "rnnify.json").read_text())
    manifest["cells"][0]["module_path"] = "model.layers.0\x1b[2J\x1b]0;pwn\x07"
    manifest["versions"] = {"rnnify\x1b[31m": "1"}
    (directory / "rnnify.json").write_text(json.dumps(manifest))
    reseal(directory)
    assert main(["info", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J" in out, out


def test_an_error_line_writes_out_the_control_characters_of_a_directory(capsys, monkeypatch, tmp_path, windowed):
    """A chat template's raise_exception() reaches the error line: its escape sequences are written out."""
    directory = Path(shutil.copytree(windowed, tmp_path / "model"))
    (directory / "chat_template.jinja").write_text("{{ raise_exception('\x1b]0;pwned\x07\x1b[2Jall good') }}")
    reseal(directory)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    code = main(["chat", str(directory), "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "\x1b" not in err and "\x07" not in err and "\\x1b]0;pwned" in err, err
