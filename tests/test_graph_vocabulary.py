"""A hostile graph.json is refused before anything runs (rnnify.runtime.op_vocabulary).

The attack these tests replay: a graph built from ops rnnify never emits (``aten.from_file`` with
``shared=True``, then ``copy_``) wrote a file during ``rnnify generate``, ``rnnify verify`` and the
transformers route. Every test records the changed files' sha256 again (``reseal``), as an attacker
who rewrites the whole directory would, so the digest check passes and the vocabulary is what refuses.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import TINY_MIXTRAL, reseal, tiny_causal_lm

import rnnify
from rnnify.cli import main
from rnnify.errors import GraphFormatError, RnnifyError
from rnnify.runtime.op_vocabulary import OPS, STRING_ARGUMENTS
from rnnify.runtime.serialize import graph_from_json, graph_to_json
from rnnify.runtime.storage import GRAPH_FILE


def _graph(directory: Path) -> dict:
    return json.loads((directory / GRAPH_FILE).read_text())


def _write_file_nodes(marker: Path) -> list[dict]:
    """The proof of concept: bytes from ``aten.full``, a file mapped by ``aten.from_file(shared=True)``,
    and ``aten.copy_`` of the one into the other."""
    size = 4
    return [
        {
            "name": "payload",
            "op": "call_function",
            "target": "torch.ops.aten.full.default",
            "args": [[size], 65],
            "kwargs": {"dtype": {"dtype": "uint8"}},
        },
        {
            "name": "mapped",
            "op": "call_function",
            "target": "torch.ops.aten.from_file.default",
            "args": [str(marker), True, size],
            "kwargs": {"dtype": {"dtype": "uint8"}},
        },
        {
            "name": "written",
            "op": "call_function",
            "target": "torch.ops.aten.copy_.default",
            "args": [{"node": "mapped"}, {"node": "payload"}],
            "kwargs": {},
        },
    ]


def _write_graph(directory: Path, data: dict) -> None:
    (directory / GRAPH_FILE).write_text(json.dumps(data))
    reseal(directory)


def _plant(directory: Path, nodes: list[dict]) -> None:
    """Insert ``nodes`` just before the graph's output, so they run on every call."""
    data = _graph(directory)
    data["nodes"][-1:-1] = nodes
    _write_graph(directory, data)


@pytest.fixture
def hostile(tmp_path, converted_dir) -> tuple[Path, Path]:
    """A copy of a converted model whose graph writes ``marker`` when it runs."""
    directory = Path(shutil.copytree(converted_dir("llama", "linear"), tmp_path / "model"))
    marker = tmp_path / "planted.pth"
    marker.touch()  # from_file maps an existing file (the attack created it the same way)
    marker.write_bytes(b"\0" * 4)
    _plant(directory, _write_file_nodes(marker))
    return directory, marker


def test_a_graph_that_writes_a_file_is_refused_at_load(hostile):
    directory, marker = hostile
    with pytest.raises(RnnifyError, match="aten.full.default' is outside rnnify's op vocabulary"):
        rnnify.load(directory)
    assert marker.read_bytes() == b"\0" * 4


@pytest.mark.parametrize("command", [["generate", "--ids", "1,2,3", "--max-new-tokens", "2"], ["verify"], ["info"]])
def test_the_commands_refuse_a_graph_that_writes_a_file(capsys, hostile, command):
    directory, marker = hostile
    code = main([command[0], str(directory), *command[1:]])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "op vocabulary" in err
    assert marker.read_bytes() == b"\0" * 4


def test_the_transformers_route_refuses_a_graph_that_writes_a_file(hostile):
    from transformers import AutoModelForCausalLM

    import rnnify.integrations.transformers  # noqa: F401 - registers the architecture

    directory, marker = hostile
    with pytest.raises(RnnifyError, match="op vocabulary"):
        AutoModelForCausalLM.from_pretrained(directory)
    assert marker.read_bytes() == b"\0" * 4


@pytest.mark.parametrize(
    ("change", "words"),
    [
        # a string where a tensor goes
        (lambda n: n["args"].__setitem__(0, "/etc/passwd"), "must be Tensor"),
        # a file path in a known op's string-free argument list
        (lambda n: n["args"].append("x.pt"), r"'bias' of aten.linear.default must be Optional\[Tensor\], got str"),
        (lambda n: n["args"].extend([None, 1]), "positional"),
        # an unknown keyword
        (lambda n: n["kwargs"].__setitem__("filename", "x"), "no argument 'filename'"),
        # an op outside the vocabulary, with the arguments it wants
        (
            lambda n: n.update(target="torch.ops.aten.save.default", args=[{"node": n["args"][0]["node"]}, "x.pt"]),
            "aten.save",
        ),
        # a required argument missing
        (lambda n: n.__setitem__("args", []), "needs argument"),
        # a cell called with a constant that is neither a number nor None
        (lambda n: n.update(op="call_module", target="cells.0", args=["/etc/passwd"]), "a cell takes nodes"),
    ],
)
def test_argument_types_are_checked_against_the_schema(converted_dir, change, words):
    data = _graph(converted_dir("llama", "linear"))
    node = next(n for n in data["nodes"] if n["target"] == "torch.ops.aten.linear.default")
    change(node)
    with pytest.raises(GraphFormatError, match=words):
        graph_from_json(data)


def test_the_graph_may_reach_only_stored_tensors_and_manifest_cells(tmp_path, converted_dir):
    directory = Path(shutil.copytree(converted_dir("llama", "linear"), tmp_path / "model"))
    data = _graph(directory)
    get_attr = next(n for n in data["nodes"] if n["op"] == "get_attr")
    get_attr["target"] = "cells.0.forward"
    _write_graph(directory, data)
    with pytest.raises(RnnifyError, match="not a tensor of the weights file"):
        rnnify.load(directory)
    get_attr["target"] = "cells.0.forward.__globals__"  # no name reaches a special attribute at all
    _write_graph(directory, data)
    with pytest.raises(RnnifyError, match="invalid get_attr target 'cells.0.forward.__globals__'"):
        rnnify.load(directory)


@pytest.mark.parametrize("output", [[], [{"tuple": []}], [{"tuple": [1, 2]}]])
def test_an_empty_or_malformed_output_is_one_error(tmp_path, converted_dir, output):
    directory = Path(shutil.copytree(converted_dir("llama", "linear"), tmp_path / "model"))
    data = _graph(directory)
    data["nodes"][-1]["args"] = output
    _write_graph(directory, data)
    with pytest.raises(RnnifyError, match="graph"):
        rnnify.load(directory)


def test_deep_nesting_is_one_error(tmp_path, converted_dir):
    directory = Path(shutil.copytree(converted_dir("llama", "linear"), tmp_path / "model"))
    text = (directory / GRAPH_FILE).read_text()
    deep = "[" * 100_000 + "]" * 100_000  # deeper than json's recursion limit
    (directory / GRAPH_FILE).write_text(text.replace('"args": [', f'"args": [{deep}, ', 1))
    reseal(directory)
    with pytest.raises(RnnifyError, match="graph"):
        rnnify.load(directory)
    data = _graph(converted_dir("llama", "linear"))
    nested: list = [1]
    for _ in range(20):
        nested = [nested]
    data["nodes"][-2]["args"].append(nested)
    with pytest.raises(GraphFormatError, match="nested deeper"):
        graph_from_json(data)


@pytest.mark.parametrize(
    ("arch", "target"),
    [
        ("llama", "exact"),
        ("llama", "linear"),
        ("llama", "hybrid"),
        ("gpt2", "exact"),
        ("gpt2", "hybrid"),
    ],
)
def test_what_conversion_emits_is_in_the_vocabulary(converted_dir, arch, target):
    """Saving checks the vocabulary too: these graphs saved, so their ops are in it; and the graph
    that loads back runs only ops of it."""
    model = rnnify.load(converted_dir(arch, target))
    calls = {n.target for n in model.graph.graph.nodes if n.op == "call_function"}
    names = {node["target"] for node in graph_to_json(model.graph.graph)["nodes"] if node["op"] == "call_function"}
    assert calls and names <= OPS


def test_the_vocabulary_is_what_the_architecture_sweep_found():
    """``OPS`` is the union of the call targets in the step graphs of every architecture and target
    that ``benchmarks/arch_sweep.py`` converted, in float32 and in bfloat16: rerun both on a
    transformers upgrade, and review what they add before adding it here."""
    results = Path(__file__).resolve().parents[1] / "benchmarks/results"
    sweeps = [json.loads((results / name).read_text()) for name in ("arch_sweep.json", "arch_sweep_bfloat16.json")]
    assert set().union(*(sweep["ops"] for sweep in sweeps)) == OPS
    strings = {value for sweep in sweeps for op in sweep["ops"].values() for value in op["strings"]}
    assert all(any(p.fullmatch(value) for p in STRING_ARGUMENTS.values()) for value in strings)
    assert not [name for sweep in sweeps for name, r in sweep["results"].items() if "serialize_error" in r]


def test_saving_refuses_an_op_outside_the_vocabulary():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.ops.aten.hardswish.default, (x,), name="act"),))
    with pytest.raises(GraphFormatError, match="act.*vocabulary"):
        graph_to_json(g)


# -- fuzzing -------------------------------------------------------------------------------

_DANGEROUS = [
    "torch.ops.aten.from_file.default",
    "torch.ops.aten.save.default",
    "torch.ops.aten.copy_.default",
    "torch.ops.aten.empty.memory_format",
    "torch.ops.aten.full.default",
    "torch.ops.aten.hardswish.default",
    "torch.ops.aten._grouped_mm.default",  # a kernel that reads and writes by the offsets it is given
    "torch.ops.rnnify.window_attn_step.default",
    "operator.setitem",
    "operator.call",
    "builtins.open",
    "torch.load",
    "torch.ops.aten.linear",
    "torch.sym_max",
    "math.floor",
]
_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.sampled_from(["/tmp/x.pth", "../../x", "x' or 1", "trunc", "none"]),
)
_json_value = st.recursive(
    _json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["node", "tuple", "dtype", "device", "float", "slice", "dict", "x"]),
            inner,
            min_size=1,
            max_size=2,
        ),
    ),
    max_leaves=12,
)


@st.composite
def _mutation(draw):
    kind = draw(st.sampled_from(["target", "arg", "kwarg", "drop_arg", "op", "nest", "node_ref"]))
    return kind, draw(st.integers(0, 10_000)), draw(st.sampled_from(sorted(OPS) + _DANGEROUS)), draw(_json_value)


def _mutate(data: dict, mutations) -> dict:
    data = copy.deepcopy(data)
    nodes = data["nodes"]
    for kind, where, target, value in mutations:
        node = nodes[where % len(nodes)]
        if kind == "target":
            node["target"] = target
        elif kind == "arg" and node["args"]:
            node["args"][where % len(node["args"])] = value
        elif kind == "kwarg":
            node["kwargs"][["dtype", "device", "rounding_mode", "filename", "out"][where % 5]] = value
        elif kind == "drop_arg" and node["args"]:
            node["args"].pop(where % len(node["args"]))
        elif kind == "op":
            node["op"] = ["call_function", "call_module", "get_attr", "placeholder", "call_method"][where % 5]
        elif kind == "nest":
            nested = value
            for _ in range(where % 30):
                nested = [nested]
            node["args"].append(nested)
        elif kind == "node_ref":
            node["args"].append({"node": nodes[(where * 7) % len(nodes)]["name"]})
    return data


@pytest.fixture(scope="module")
def real_graph(tmp_path_factory) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from make_tiny_model import make_tiny_model

    source = make_tiny_model(tmp_path_factory.mktemp("fuzz-src"), "llama")
    return graph_to_json(rnnify.convert(source, to="hybrid").graph.graph)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutation(), min_size=1, max_size=4))
def test_fuzzed_graphs_are_refused_or_made_of_allowed_ops(real_graph, mutations):
    data = _mutate(real_graph, mutations)
    try:
        graph = graph_from_json(json.loads(json.dumps(data)))
    except GraphFormatError:
        return
    # saved again, as saving would write it (which checks every node's arguments again)
    names = {n["target"] for n in graph_to_json(graph)["nodes"] if n["op"] == "call_function"}
    assert names <= OPS


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutation(), min_size=1, max_size=3))
def test_fuzzed_directories_load_only_as_allowed_graphs(tmp_path_factory, converted_dir, mutations):
    """Through the whole loader: a one-line ``RnnifyError``, or a model whose graph holds only allowed ops."""
    source = converted_dir("llama", "linear")
    directory = Path(shutil.copytree(source, tmp_path_factory.mktemp("fuzz") / "model"))
    _write_graph(directory, _mutate(_graph(source), mutations))
    try:
        model = rnnify.load(directory)
    except RnnifyError as exc:
        assert "\n" not in str(exc)
        return
    names = {n["target"] for n in graph_to_json(model.graph.graph)["nodes"] if n["op"] == "call_function"}
    assert names <= OPS


def test_a_mixture_of_experts_in_bfloat16_saves_and_loads(tmp_path):
    """In bfloat16 transformers' experts would run torch's grouped matmul (``aten._grouped_mm``), which
    trusts its offsets and so stays out of the vocabulary: the graph takes transformers' fallback op in
    every dtype, saves, and loads to the original's logits."""
    source = tiny_causal_lm("mixtral", **TINY_MIXTRAL).to(torch.bfloat16)
    model = rnnify.convert(source, to="exact")
    targets = {n["target"] for n in graph_to_json(model.graph.graph)["nodes"]}
    assert "torch.ops.transformers.grouped_mm_fallback.default" in targets
    from transformers.integrations import moe

    assert moe._can_use_grouped_mm(  # transformers' own choice again after the capture
        torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4, 4, dtype=torch.bfloat16), None
    )
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    loaded = rnnify.load(model.save(tmp_path / "moe"))
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    got = loaded.prefill(ids)[0]
    assert torch.equal(got, model.prefill(ids)[0]) and (got - want).abs().max() <= 1e-3 * want.abs().max()


def test_an_op_another_library_registers_resolves_in_a_fresh_process(tmp_path):
    """A mixture-of-experts layer exports transformers' own grouped matmul op, which exists only once
    transformers' MoE module is imported: a process that only loads the model has not imported it."""
    import subprocess
    import sys

    model = rnnify.convert(tiny_causal_lm("mixtral", **TINY_MIXTRAL), to="exact")
    assert "torch.ops.transformers.grouped_mm_fallback.default" in {
        n["target"] for n in graph_to_json(model.graph.graph)["nodes"]
    }
    model.save(tmp_path / "moe")
    ids = torch.tensor([[1, 2, 3]])
    want = model.prefill(ids)[0]
    code = (
        "import sys, torch, rnnify; m = rnnify.load(sys.argv[1]); "
        "torch.save(m.prefill(torch.tensor([[1, 2, 3]]))[0], sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "moe"), str(tmp_path / "logits.pt")], check=True)
    assert torch.equal(torch.load(tmp_path / "logits.pt"), want)
