"""Tests for the pickle-free fx graph serializer (rnnify.runtime.serialize)."""

from __future__ import annotations

import copy
import json
import math
import operator
import os

import pytest
import torch
import torch.fx

from rnnify.capture import capture
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
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _inputs(batch: int, length: int):
    ids = torch.randint(0, 100, (batch, length))
    pos = torch.arange(length).expand(batch, length).contiguous()
    return ids, pos


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def captured(request) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    model = {"gpt2": _gpt2, "llama": _llama}[request.param]()
    return capture(model.eval())


def test_real_graph_round_trip_matches(captured):
    gm = captured
    new_graph = _round_trip(gm.graph)
    loaded = torch.fx.GraphModule(gm, new_graph)

    old_nodes, new_nodes = list(gm.graph.nodes), list(new_graph.nodes)
    assert [(n.name, n.op) for n in old_nodes] == [(n.name, n.op) for n in new_nodes]
    assert [n.target for n in old_nodes] == [n.target for n in new_nodes]

    torch.manual_seed(1)
    for batch, length in [(2, 8), (1, 5), (3, 17)]:
        ids, pos = _inputs(batch, length)
        with torch.no_grad():
            expected, actual = gm(ids, pos), loaded(ids, pos)
        assert type(expected) is type(actual)
        assert len(expected) == len(actual) == 1
        assert actual[0].shape == (batch, length, 100)
        assert torch.equal(expected[0], actual[0])


def test_device_remap_replaces_every_device(captured):
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
    ids, pos = _inputs(2, 9)
    (logits,) = on_meta(ids.to(meta), pos.to(meta))
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
    args = (
        math.inf, -math.inf, math.nan, -0.0, 1.5, 1.0, 1, True, False, None, "s",
        2**63 - 1,
        (1, 2), [1, 2], ((1,), [2, (3.0,)]), (),
        {"a": (1, [True]), "b": {"c": None}},
        torch.float16, torch.bfloat16, torch.int64, torch.bool,
        torch.device("cpu"), torch.device("cuda", 1),
        torch.strided, torch.sparse_coo, torch.contiguous_format, torch.channels_last,
        slice(None, 3, None), slice(1, None, -1), Ellipsis,
    )
    kwargs = {"kw_float": math.inf, "kw_tuple": (math.nan, 1)}
    g = _graph_with_args(args, kwargs)
    g2 = _round_trip(g)
    get_old = [n for n in g.nodes if n.op == "call_function"][0]
    get_new = [n for n in g2.nodes if n.op == "call_function"][0]
    assert _same(tuple(get_old.args), tuple(get_new.args))
    assert _same(dict(get_old.kwargs), dict(get_new.kwargs))
    # bool stays bool, tuple stays tuple, list stays list (fx stores lists as immutable_list)
    new_args = get_new.args[1:]  # args[0] is the placeholder x
    assert new_args[7] is True and type(new_args[6]) is int
    assert type(new_args[12]) is tuple and isinstance(new_args[13], list)
    assert get_new.args[0] is not None and get_new.args[0].name == "x"


def test_infinite_constants_execute():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    lo = g.call_function(torch.ops.aten.clamp.default, (x,), {"min": -math.inf, "max": math.inf})
    y = g.call_function(torch.ops.aten.add.Scalar, (lo, math.nan))
    g.output((lo, y))
    gm = torch.fx.GraphModule(torch.nn.Module(), _round_trip(g))
    x_val = torch.tensor([-1.0, 0.0, 2.0])
    lo_v, y_v = gm(x_val)
    assert torch.equal(lo_v, x_val)
    assert torch.isnan(y_v).all()


def test_placeholder_default_and_output_structure():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    s = g.placeholder("scale", default_value=2.0)
    t = g.placeholder("flag", default_value=None)
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, s))
    g.output(((y, x), [t]))
    g2 = _round_trip(g)
    ph = [n for n in g2.nodes if n.op == "placeholder"]
    assert [p.args for p in ph] == [(), (2.0,), (None,)]
    out = list(g2.nodes)[-1]
    assert type(out.args[0]) is tuple and type(out.args[0][0]) is tuple
    gm = torch.fx.GraphModule(torch.nn.Module(), g2)
    (a, b), c = gm(torch.ones(2))
    assert torch.equal(a, torch.full((2,), 2.0)) and torch.equal(b, torch.ones(2)) and c == [None]


def test_whitelisted_function_targets_round_trip():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    n = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    m = g.call_function(operator.mul, (n, 2))
    f = g.call_function(torch.sym_float, (m,))
    r = g.call_function(torch.sym_sqrt, (f,))
    fl = g.call_function(math.floor, (r,))
    mx = g.call_function(torch.sym_max, (fl, 1))
    nt = g.call_function(torch.sym_not, (False,))
    si = g.call_function(torch.sym_int, (f,))
    pk = g.call_function(torch.ops.aten.add, (x, mx))  # an OpOverloadPacket
    g.output((pk, nt, si))

    data = graph_to_json(g)
    targets = [node["target"] for node in data["nodes"] if node["op"] == "call_function"]
    assert targets == [
        "torch.ops.aten.sym_size.int", "operator.mul", "torch.sym_float", "torch.sym_sqrt",
        "math.floor", "torch.sym_max", "torch.sym_not", "torch.sym_int", "torch.ops.aten.add",
    ]
    g2 = graph_from_json(json.loads(_dumps(data)))
    assert [n.target for n in g.nodes] == [n.target for n in g2.nodes]
    gm = torch.fx.GraphModule(torch.nn.Module(), g2)
    out, not_false, as_int = gm(torch.zeros(8))
    assert torch.equal(out, torch.full((8,), 4.0)) and not_false is True and as_int == 16


def test_custom_namespace_op_round_trip():
    lib_name = "rnnify_serialize_test"

    @torch.library.custom_op(f"{lib_name}::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op = getattr(getattr(torch.ops, lib_name), "twice").default
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(op, (x,)),))
    data = graph_to_json(g)
    assert data["nodes"][1]["target"] == f"torch.ops.{lib_name}.twice.default"
    gm = torch.fx.GraphModule(torch.nn.Module(), graph_from_json(json.loads(_dumps(data))))
    assert torch.equal(gm(torch.ones(3))[0], torch.full((3,), 2.0))


# --------------------------------------------------------------------------- errors

def _simple_data() -> dict:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.ops.aten.relu.default, (x,), name="act"),))
    return json.loads(_dumps(graph_to_json(g)))


@pytest.mark.parametrize(
    "target",
    [
        "torch.ops.aten.no_such_op_xyz.default",
        "torch.ops.aten.relu.no_such_overload",
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
