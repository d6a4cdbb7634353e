"""Tests for the pickle-free fx graph serializer (rnnify.runtime.serialize)."""

from __future__ import annotations

import copy
import json
import math
import operator
import os
import subprocess
import sys

import pytest
import torch
import torch.fx

from rnnify.runtime import serialize
from rnnify.runtime.serialize import GraphFormatError, graph_from_json, graph_to_json


def _dumps(data: dict) -> str:
    # allow_nan=False: the format must be strict JSON, not Python's NaN/Infinity extension.
    return json.dumps(data, allow_nan=False)


def _round_trip(graph: torch.fx.Graph, **kw) -> torch.fx.Graph:
    return graph_from_json(json.loads(_dumps(graph_to_json(graph))), **kw)


# --------------------------------------------------------------------------- real models


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _inputs(model, batch: int, length: int):
    """The step graph's inputs: ids, positions, mask and the state before any token."""
    ids = torch.randint(0, 100, (batch, length))
    pos = torch.arange(length).expand(batch, length).contiguous()
    mask = torch.ones(batch, length, dtype=torch.bool)
    return (ids, pos, mask, *model.init_state(batch).tensors)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def converted(request):
    """A converted model: its step graph is what graph.json holds."""
    import rnnify

    torch.manual_seed(0)
    model = {"gpt2": _gpt2, "llama": _llama}[request.param]()
    return rnnify.convert(model.eval(), to="linear")


def test_real_graph_round_trip_matches(converted):
    gm = converted.graph
    new_graph = _round_trip(gm.graph)
    loaded = torch.fx.GraphModule(gm, new_graph)

    old_nodes, new_nodes = list(gm.graph.nodes), list(new_graph.nodes)
    assert [(n.name, n.op) for n in old_nodes] == [(n.name, n.op) for n in new_nodes]
    assert [n.target for n in old_nodes] == [n.target for n in new_nodes]

    torch.manual_seed(1)
    for batch, length in [(2, 8), (1, 5), (3, 17)]:
        inputs = _inputs(converted, batch, length)
        with torch.no_grad():
            expected, actual = gm(*inputs), loaded(*inputs)
        assert type(expected) is type(actual)
        assert len(expected) == len(actual)
        assert actual[0].shape == (batch, length, 100)
        for want, got in zip(expected, actual):
            assert torch.equal(want, got)


def test_device_remap_replaces_every_device(converted):
    captured = converted.graph
    data = json.loads(_dumps(graph_to_json(captured.graph)))
    meta = torch.device("meta")

    def devices(value, found):
        if isinstance(value, torch.device):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                devices(v, found)
        elif isinstance(value, dict):
            for v in value.values():
                devices(v, found)
        return found

    original = [d for n in captured.graph.nodes for d in devices((n.args, n.kwargs), [])]
    assert original and all(d.type == "cpu" for d in original)

    remapped_graph = graph_from_json(data, device="meta")
    remapped = [d for n in remapped_graph.nodes for d in devices((n.args, n.kwargs), [])]
    assert len(remapped) == len(original)
    assert all(d == meta for d in remapped)
    # e.g. arange(..., device=cpu) now says device=meta in its kwargs
    aranges = [n for n in remapped_graph.nodes if n.target is torch.ops.aten.arange.default]
    if aranges:
        assert all(n.kwargs["device"] == meta for n in aranges)

    # the remapped graph actually runs there (meta stands in for CUDA on CPU-only machines);
    # deepcopy because .to() would move the parameters the fixture module shares
    on_meta = torch.fx.GraphModule(copy.deepcopy(captured), remapped_graph).to(meta)
    logits, *_ = on_meta(*(t.to(meta) for t in _inputs(converted, 2, 9)))
    assert logits.device == meta and logits.shape == (2, 9, 100)

    # without device= the stored devices are kept, and the data itself was not modified
    plain = graph_from_json(data)
    assert all(d.type == "cpu" for n in plain.nodes for d in devices((n.args, n.kwargs), []))


# --------------------------------------------------------------------------- values


def _graph_with_args(args: tuple, kwargs: dict | None = None) -> torch.fx.Graph:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(operator.getitem, (x, *args), kwargs or {})
    g.output((y,))
    return g


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.fx.Node):
        return a.name == b.name
    if isinstance(a, slice):
        return _same((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    return a == b


def test_constant_values_round_trip():
    """Every value the format encodes decodes to itself (the vocabulary decides which ops may take which)."""
    values = (
        math.inf,
        -math.inf,
        math.nan,
        -0.0,
        1.5,
        1.0,
        1,
        True,
        False,
        None,
        "s",
        2**63 - 1,
        (1, 2),
        [1, 2],
        ((1,), [2, (3.0,)]),
        (),
        {"a": (1, [True]), "b": {"c": None}},
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.bool,
        torch.device("cpu"),
        torch.device("cuda", 1),
        torch.strided,
        torch.sparse_coo,
        torch.contiguous_format,
        torch.channels_last,
        slice(None, 3, None),
        slice(1, None, -1),
        Ellipsis,
    )
    encoded = json.loads(_dumps([serialize._encode(v, "test", "value") for v in values]))
    decoded = [serialize._Decoder({}, None).decode(v, "test") for v in encoded]
    assert _same(list(values), decoded)
    assert decoded[7] is True and type(decoded[6]) is int
    assert type(decoded[12]) is tuple and isinstance(decoded[13], list)


def test_infinite_constants_execute():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    big = g.call_function(torch.ops.aten.add.Tensor, (x, math.inf))
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, math.nan))
    g.output((big, y))
    gm = torch.fx.GraphModule(torch.nn.Module(), _round_trip(g))
    big_v, y_v = gm(torch.tensor([-1.0, 0.0, 2.0]))
    assert torch.equal(big_v, torch.full((3,), math.inf))
    assert torch.isnan(y_v).all()


def test_output_structure_round_trips_and_placeholder_defaults_are_refused():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    t = g.placeholder("flag")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    g.output(((y, x), [t]))
    g2 = _round_trip(g)
    out = list(g2.nodes)[-1]
    assert type(out.args[0]) is tuple and type(out.args[0][0]) is tuple
    gm = torch.fx.GraphModule(torch.nn.Module(), g2)
    (a, b), c = gm(torch.ones(2), None)
    assert torch.equal(a, torch.full((2,), 2.0)) and torch.equal(b, torch.ones(2)) and c == [None]
    # a default value would become a node's value unchecked (a string where a device goes): refused
    data = json.loads(_dumps(graph_to_json(g)))
    data["nodes"][1]["args"] = ["cuda"]
    with pytest.raises(GraphFormatError, match="takes no arguments"):
        graph_from_json(data)


def test_getitem_indices_round_trip():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    a = g.call_function(operator.getitem, (x, (Ellipsis, slice(None, n, None), None)))
    b = g.call_function(operator.getitem, (a, 1))
    g.output((a, b))
    data = graph_to_json(g)
    targets = [node["target"] for node in data["nodes"] if node["op"] == "call_function"]
    assert targets == ["torch.ops.aten.sym_size.int", "operator.getitem", "operator.getitem"]
    gm = torch.fx.GraphModule(torch.nn.Module(), graph_from_json(json.loads(_dumps(data))))
    x_val = torch.arange(8.0).reshape(2, 4)
    a_v, b_v = gm(x_val)
    assert torch.equal(a_v, x_val[..., :2, None]) and torch.equal(b_v, x_val[..., :2, None][1])


@pytest.mark.parametrize("fn", [operator.floordiv, math.floor, torch.sym_max, torch.sym_not])
def test_size_arithmetic_outside_the_vocabulary_is_refused(fn):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    g.output((g.call_function(fn, (n,), name="arith"),))
    with pytest.raises(GraphFormatError, match="arith"):
        graph_to_json(g)


def _squarings(times: int, start: int) -> dict:
    """A graph that multiplies ``x``'s first size by ``start``, then squares the product ``times`` times."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(operator.mul, (g.call_function(torch.ops.aten.sym_size.int, (x, 0)), 1))
    g.output((n,))
    data = json.loads(_dumps(graph_to_json(g)))
    nodes = data["nodes"]
    nodes[2]["args"][1] = start
    names = [nodes[2]["name"]] + [f"square{i}" for i in range(times)]
    for previous, name in zip(names, names[1:]):
        ref = {"node": previous}
        nodes.insert(
            -1, {"name": name, "op": "call_function", "target": "operator.mul", "args": [ref, ref], "kwargs": {}}
        )
    nodes[-1]["args"] = [{"tuple": [{"node": names[-1]}]}]
    return data


def test_integer_arithmetic_that_could_outgrow_a_size_is_refused_before_it_runs():
    """Python integers have no width: squaring a product 40 times would never finish at load."""
    with pytest.raises(GraphFormatError, match="node 'square3' .*may reach 1152 bits"):
        graph_from_json(_squarings(40, 2**7))  # 64 + 8 bits, doubled three times
    gm = torch.fx.GraphModule(torch.nn.Module(), graph_from_json(_squarings(3, 3)))
    assert gm(torch.zeros(5, 1)) == ((5 * 3) ** 8,)  # a step's size products: the bound leaves room


def test_custom_namespace_ops_are_refused():
    lib_name = "rnnify_serialize_test"

    @torch.library.custom_op(f"{lib_name}::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op = getattr(getattr(torch.ops, lib_name), "twice").default
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(op, (x,), name="custom"),))
    with pytest.raises(GraphFormatError, match="custom"):
        graph_to_json(g)
    data = _simple_data()
    data["nodes"][1]["target"] = f"torch.ops.{lib_name}.twice.default"
    with pytest.raises(GraphFormatError, match="act"):
        graph_from_json(data)


# --------------------------------------------------------------------------- errors


def _simple_data() -> dict:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.ops.aten.silu.default, (x,), name="act"),))
    return json.loads(_dumps(graph_to_json(g)))


@pytest.mark.parametrize(
    "target",
    [
        "torch.ops.aten.no_such_op_xyz.default",
        "torch.ops.aten.silu.no_such_overload",
        "torch.ops.aten.hardswish.default",
        "torch.ops.aten.from_file.default",
        "torch.ops.import_module.x.y",
        "torch.ops.aten.__class__.__init__",
        "os.system",
        "builtins.eval",
        "operator.call",
        "operator.attrgetter",
        "torch.load",
        "math.__loader__",
        "",
        42,
    ],
)
def test_unknown_target_on_load_raises(target):
    data = _simple_data()
    data["nodes"][1]["target"] = target
    with pytest.raises(GraphFormatError, match="act"):
        graph_from_json(data)


@pytest.mark.parametrize("fn", [lambda t: t, os.system, torch.load, torch.relu, print])
def test_non_whitelisted_callable_on_save_raises(fn):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(fn, (x,), name="bad_call"),))
    with pytest.raises(GraphFormatError, match="bad_call"):
        graph_to_json(g)


@pytest.mark.parametrize("value", [torch.ones(2), object(), {1: 2}, 1j, b"bytes"])
def test_unsupported_argument_on_save_raises(value):
    g = _graph_with_args((value,))
    with pytest.raises(GraphFormatError, match="getitem"):
        graph_to_json(g)


@pytest.mark.parametrize("fmt", [0, 2, "1", None])
def test_wrong_format_version_raises(fmt):
    data = _simple_data()
    if fmt is None:
        del data["format"]
    else:
        data["format"] = fmt
    with pytest.raises(GraphFormatError, match="format"):
        graph_from_json(data)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["nodes"][1]["args"].__setitem__(0, {"node": "missing"}),
        lambda d: d["nodes"][1]["args"].__setitem__(0, {"bogus": 1}),
        lambda d: d["nodes"][1]["args"].__setitem__(0, {"dtype": "not_a_dtype"}),
        lambda d: d["nodes"][1]["args"].__setitem__(0, {"dtype": "device"}),
        lambda d: d["nodes"][1]["args"].__setitem__(0, {"float": "big"}),
        lambda d: d["nodes"][1]["args"].__setitem__(0, {"device": "nowhere:7"}),
        lambda d: d["nodes"][1].__setitem__("op", "call_method"),
        lambda d: d["nodes"][1].__setitem__("name", "x"),  # duplicate name
        lambda d: d["nodes"][1].__setitem__("name", "a-b"),
        lambda d: d["nodes"].insert(0, d["nodes"].pop(1)),  # use before definition
        lambda d: d["nodes"][0].__setitem__("target", "x=__import__('os')"),  # code injection
        lambda d: d["nodes"][0].__setitem__("target", "*x"),  # fx would write invalid source
        lambda d: d["nodes"].insert(0, {"name": "kw", "op": "placeholder", "target": "**kw"}),
        lambda d: d["nodes"][1]["args"].__setitem__(0, {"dtype": "_inductor"}),  # a module, not a dtype
        lambda d: d["nodes"][1].update(op="get_attr", target='w") or os.system("1', args=[]),
        lambda d: d["nodes"][1]["kwargs"].__setitem__("a=1", 0),
        lambda d: d.__setitem__("nodes", "nope"),
    ],
)
def test_malformed_data_raises(mutate):
    data = _simple_data()
    mutate(data)
    with pytest.raises(GraphFormatError):
        graph_from_json(data)


def test_an_unknown_dtype_name_imports_nothing():
    """A dtype's name is looked up among torch's dtypes, never with getattr on torch, which would import
    a lazily loaded submodule (``torch._inductor``) named by a directory's graph."""
    data = _simple_data()
    data["nodes"][1]["args"][0] = {"dtype": "_inductor"}
    script = (
        "import json, sys\n"
        "from rnnify.runtime.serialize import GraphFormatError, graph_from_json\n"
        f"data = json.loads({json.dumps(json.dumps(data))})\n"
        "try:\n    graph_from_json(data)\nexcept GraphFormatError:\n    pass\n"
        "print('torch._inductor' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
