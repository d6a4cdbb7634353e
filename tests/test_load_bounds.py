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
import torch
from safetensors.torch import load_file
from support import reseal

import rnnify
from rnnify.cli import main
from rnnify.errors import RnnifyError
from rnnify.runtime import aot
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
        _call("size", "sym_size.int", _ref("input_ids"), 0),
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


@pytest.mark.parametrize(
    "nodes, refusal",
    [
        # a number read from the positions sizes a tensor: nothing at the dry run's position 0,
        # 4 GB at position 10**9 of a later prompt
        (
            [
                _call("p", "sum.dim_IntList", _ref("position_ids"), [0, 1]),
                _call("n", "item.default", _ref("p")),
                _call("bomb", "zeros.default", [_ref("n")]),
            ],
            "argument 'size' takes node 'n'",
        ),
        # or cuts a tensor to a length, whose pieces a broadcast could then multiply
        (
            [
                _call("p", "sum.dim_IntList", _ref("position_ids"), [0, 1]),
                _call("n", "item.default", _ref("p")),
                _node("cut", "call_function", "operator.getitem", _ref("w"), {"slice": [None, _ref("n"), None]}),
            ],
            "argument 'index' takes node 'n'",
        ),
        # a tensor where a slice bound goes is read as a number too (Python calls its __index__)
        (
            [
                _node("t", "call_function", "operator.getitem", _ref("input_ids"), {"tuple": [0, -1]}),
                _node("cut", "call_function", "operator.getitem", _ref("w"), {"slice": [None, _ref("t"), None]}),
            ],
            "argument 'index' takes node 't'",
        ),
        # so is the product of one, and a size read from a tensor the graph made (its shape could follow data)
        (
            [
                _call("n", "item.default", _ref("w")),
                _node("big", "call_function", "operator.mul", _ref("n"), 8),
            ],
            "integer arithmetic takes numbers and sizes, not node 'n'",
        ),
        (
            [_call("size", "sym_size.int", _ref("x"), 0), _call("bomb", "zeros.default", [_ref("size")])],
            "reads the sizes of its token inputs",
        ),
        (
            [_node("size", "call_function", "torch.ops.aten.sym_size.int", self={"node": "w"}, dim=0)],
            "reads the sizes of its token inputs",
        ),
        # a cell's returns read whole, the new state with them
        (
            [_call("whole", "broadcast_tensors.default", _ref("cells_0"))],
            "cell 'cells.0' returns a tuple, which a step reads by getitem",
        ),
        # a cache that grows with every token, read by an op: its square would grow as the square of positions
        (
            [_call("outer", "mul.Tensor", _ref("state_0_keys"), _ref("state_0_keys"))],
            "a state of cell 'cells.0': it goes to that cell alone, in that place",
        ),
    ],
    ids=[
        "item size",
        "item slice",
        "tensor slice",
        "item product",
        "size of an activation",
        "size by keyword",
        "cell returns whole",
        "state read",
    ],
)
def test_sizes_that_could_follow_what_a_step_reads_are_refused_at_load(tmp_path, windowed, nodes, refusal):
    with pytest.raises(RnnifyError, match=refusal):
        rnnify.load(_grafted(tmp_path, windowed, nodes))


def test_a_step_split_by_values_it_reads_runs_guarded(tmp_path, windowed):
    """A mixture of experts splits its tokens where values it reads say: pieces of a tensor, each no
    larger than it, but whose outer product follows the data. Token 0 at the dry run makes nothing;
    token 1 would make 1 GB, and is stopped before it allocates. A model of no such step is unguarded."""
    nodes = [
        _call("s", "sum.dim_IntList", _ref("input_ids"), [0, 1]),
        _call("s16", "mul.Tensor", _ref("s"), 1 << 14),
        _call("rest", "rsub.Scalar", _ref("s16"), (1 << 15) + 2),
        _call("n", "item.default", _ref("s16")),
        _call("m", "item.default", _ref("rest")),
        _call("line", "zeros.default", [(1 << 15) + 2]),
        _call("pieces", "split_with_sizes.default", _ref("line"), [_ref("n"), _ref("m")]),
        _node("a", "call_function", "operator.getitem", _ref("pieces"), 0),
        _node("b", "call_function", "operator.getitem", _ref("pieces"), 1),
        _call("column", "unsqueeze.default", _ref("a"), 1),
        _call("bomb", "add.Tensor", _ref("column"), _ref("b")),
    ]
    model = rnnify.load(_grafted(tmp_path, windowed, nodes))
    assert rnnify.load(windowed).guard_budget is None and model.guard_budget is not None
    _, state = model.prefill(torch.tensor([[0, 2]]))
    with pytest.raises(
        RnnifyError, match=r"its step was stopped: aten.add.Tensor makes a tensor of 1,073,872,896 bytes"
    ):
        model.step(torch.tensor([[1]]), state)


@pytest.mark.parametrize("dtype", ["bool", "uint8"])
def test_a_step_that_indexes_with_a_mask_runs_guarded(tmp_path, windowed, dtype):
    """A mask's selection has the size of its data (``aten.index`` takes uint8 as a mask too): the
    dry run cannot bound later tokens, so every step, its head too, runs guarded, and none compiled."""
    nodes = [
        _call("mask", "gt.Scalar", _ref("w"), 0.0),
        _call("as_dtype", "to.dtype", _ref("mask"), {"dtype": dtype}),
        _call("picked", "index.Tensor", _ref("w"), [_ref("as_dtype")]),
    ]
    model = rnnify.load(_grafted(tmp_path, windowed, nodes))
    assert model.guard_budget is not None and "size guard" in aot.refusal(model)
    with pytest.raises(RnnifyError, match="its step runs eagerly, under a size guard"):
        model.compile_step()
    model._step_graph = lambda *inputs: pytest.fail("a compiled step ran unguarded")
    plain = rnnify.load(windowed)
    (logits, state), (want, plain_state) = (
        model.prefill(torch.tensor([[1, 2, 3]])),
        plain.prefill(torch.tensor([[1, 2, 3]])),
    )
    assert torch.equal(logits, want)
    assert torch.equal(model.step(torch.tensor([[4]]), state)[0], plain.step(torch.tensor([[4]]), plain_state)[0])


def _rewired(tmp_path: Path, base: Path, rewire) -> Path:
    """A copy of ``base`` whose graph's nodes (a list) ``rewire`` changed, resealed."""
    directory = Path(shutil.copytree(base, tmp_path / "model"))
    graph = json.loads((directory / GRAPH_FILE).read_text())
    rewire(graph["nodes"])
    (directory / GRAPH_FILE).write_text(json.dumps(graph))
    reseal(directory)
    return directory


def _named(nodes: list) -> dict:
    return {node["name"]: node for node in nodes}


def _swap_returned(nodes: list) -> None:
    returned = _named(nodes)["output"]["args"][0]["tuple"]
    returned[1], returned[6] = returned[6], returned[1]  # cell 0's new keys for cell 1's, and back


def _keys_as_values(nodes: list) -> None:
    _named(nodes)["cells_0"]["args"][5] = _ref("state_0_keys")


def _other_cells_state(nodes: list) -> None:
    named = _named(nodes)
    named["cells_0"]["args"][4], named["cells_1"]["args"][4] = _ref("state_1_keys"), _ref("state_0_keys")


@pytest.mark.parametrize(
    "rewire, refusal",
    [
        (_swap_returned, "node 'state_0_keys' .*a state of cell 'cells.1': it goes to that cell alone"),
        (_keys_as_values, "node 'state_0_keys' .*cell 'cells.0' takes a state twice"),
        (_other_cells_state, "node 'state_0_keys' .*a state of cell 'cells.0': it goes to that cell alone"),
    ],
    ids=["returned swapped", "keys as values", "another cell's state"],
)
def test_each_cell_keeps_its_own_state(tmp_path, windowed, rewire, refusal):
    """Handed another cell's cache beside its own, or its keys as its values, an exact cell's cache
    grew as the sum of two every step: exponentially in the tokens read, from a load that passed."""
    with pytest.raises(RnnifyError, match=refusal):
        rnnify.load(_rewired(tmp_path, windowed, rewire))


@pytest.fixture(scope="module")
def exact(tmp_path_factory, tiny_model_dir) -> Path:
    out = tmp_path_factory.mktemp("exact") / "model"
    rnnify.convert(tiny_model_dir("llama"), to="exact").save(out)
    return out


def _widened_mask(nodes: list) -> None:
    """Cell 0's mask as wide as 2**20 tokens: the cache grows by a megabyte a token, the step as much."""
    at = next(i for i, node in enumerate(nodes) if node["name"] == "cells_0")
    nodes[at:at] = [
        _call("last", "slice.Tensor", _ref("attention_mask"), 1, -1, (1 << 63) - 1),
        _call("wide", "expand.default", _ref("last"), [-1, 1 << 20]),
    ]
    nodes[at + 2]["args"][3] = _ref("wide")


def _more_rows(nodes: list) -> None:
    """Logits for 2**16 rows: the head's guard, sized by its rows, would have grown with them."""
    output = _named(nodes)["output"]
    nodes.insert(-1, _call("rows", "expand.default", output["args"][0]["tuple"][0], [1 << 16, -1, -1]))
    output["args"][0]["tuple"][0] = _ref("rows")


@pytest.mark.parametrize(
    "rewire, refusal",
    [
        (_widened_mask, r"its step grew the state by [\d,]+ bytes for 1 tokens, where its cells add [\d,]+ a token"),
        (_more_rows, r"its step returned \(65536, 1, \d+\) for \(1, 1\) tokens"),
    ],
    ids=["widened mask", "more rows"],
)
def test_a_step_returns_what_its_tokens_make(tmp_path, exact, rewire, refusal):
    with pytest.raises(RnnifyError, match=refusal):
        rnnify.load(_rewired(tmp_path, exact, rewire))


@pytest.mark.parametrize(
    "nodes, refusal",
    [
        # a mask's places, found before the op selects: a long index per dimension of it (184 bytes a place)
        (
            [
                _call("m", "ones.default", [2] * 23, dtype="bool"),
                _call("xx", "zeros.default", [2] * 23),
                _call("picked", "index.Tensor", _ref("xx"), [_ref("m")]),
            ],
            "aten.index.Tensor makes a tensor of 1,543,503,872 bytes",
        ),
        # a dtype 16 times wider than a bool: refused before it allocates ("makes"), not after ("made")
        (
            [
                _call("one", "ones.default", [1], dtype="bool"),
                _call("many", "expand.default", _ref("one"), [1 << 27]),
                _call("wide", "zeros_like.default", _ref("many"), dtype="complex128"),
            ],
            "aten.zeros_like.default makes a tensor of 2,147,483,648 bytes",
        ),
        # a batched product copies both operands out to its batch shape first: N * N * K each, for an
        # output of N * N and N * N * K multiply-adds, both within bounds (N = 4,096, K = 16)
        (
            [
                _call("a", "zeros.default", [1 << 12, 1, 1, 16], dtype="float64"),
                _call("b", "zeros.default", [1, 1 << 12, 16, 1], dtype="float64"),
                _call("product", "matmul.default", _ref("a"), _ref("b")),
            ],
            "aten.matmul.default makes a tensor of 2,147,483,648 bytes",
        ),
        # a sort returns its indices beside its values: int64, 8 times what a bool tensor held
        (
            [
                _call("one", "ones.default", [1], dtype="bool"),
                _call("many", "expand.default", _ref("one"), [1 << 28]),
                _call("in_order", "sort.default", _ref("many")),
            ],
            "aten.sort.default makes a tensor of 2,147,483,648 bytes",
        ),
    ],
    ids=["mask places", "wider dtype", "broadcast product", "sort indices"],
)
def test_what_an_op_makes_inside_is_bounded_before_it_runs(tmp_path, windowed, nodes, refusal):
    with pytest.raises(RnnifyError, match=refusal):
        rnnify.load(_grafted(tmp_path, windowed, nodes))


def test_a_step_that_puts_by_a_mask_runs_guarded(tmp_path, windowed):
    """``index_put_`` with a mask (accumulating) finds its places as ``index`` does: sized by data."""
    nodes = [
        _call("mask", "gt.Scalar", _ref("w"), 0.0),
        _call("into", "zeros_like.default", _ref("w")),
        _call("value", "zeros.default", [1]),
        _call("put", "index_put_.default", _ref("into"), [_ref("mask")], _ref("value"), True),
    ]
    assert rnnify.load(_grafted(tmp_path, windowed, nodes)).guard_budget is not None


def test_a_step_split_by_values_it_reads_is_not_compiled_when_converted(tmp_path):
    """JetMoE's experts split their tokens by the router's counts: loaded, its step runs guarded and
    eagerly, so convert compiles no step ahead of time that no load would run, and says why."""
    from support import tiny_causal_lm

    from rnnify.cli.compile import compile_step

    source = tiny_causal_lm(
        "jetmoe", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        kv_channels=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    model = rnnify.convert(source, to="exact")
    note = compile_step(model, model.save(tmp_path / "jetmoe"))
    assert note.startswith("decode step: eager (this model's step makes tensors whose sizes follow"), note


@pytest.mark.parametrize(
    "nodes, written",
    [
        # a weight that adds each request's tokens: the next request reads the last one's
        (
            [
                _call("e", "embedding.default", _ref("model_model_embed_tokens_weight"), _ref("input_ids")),
                _call("s", "sum.dim_IntList", _ref("e"), [0, 1]),
                _call("leak", "add_.Tensor", _ref("w"), _ref("s")),
            ],
            "w",
        ),
        # through a view of it, the same
        ([_call("flat", "view.default", _ref("w"), [-1]), _call("drift", "mul_.Tensor", _ref("flat"), 4.0)], "flat"),
        # through a view among several (broadcast_tensors returns its inputs where shapes agree)
        (
            [
                _call("views", "broadcast_tensors.default", [_ref("w"), _ref("w")]),
                _node("first", "call_function", "operator.getitem", _ref("views"), 0),
                _call("drift", "mul_.Tensor", _ref("first"), 4.0),
            ],
            "first",
        ),
        # the caller's own ids and mask
        ([_call("shifted", "add_.Tensor", _ref("input_ids"), 7)], "input_ids"),
        ([_call("cleared", "copy_.default", _ref("attention_mask"), False)], "attention_mask"),
    ],
    ids=["weight", "view of a weight", "one of several views", "ids", "mask"],
)
def test_a_step_writes_only_into_tensors_it_made(tmp_path, windowed, nodes, written):
    with pytest.raises(RnnifyError, match=f"it writes into {written!r}, a tensor the step was given or views"):
        rnnify.load(_grafted(tmp_path, windowed, nodes))


def test_a_step_that_fails_later_is_one_line(capsys, tmp_path, windowed):
    """A graph that reads a table by position works at the dry run and fails at a later position: the
    commands print one line naming the directory, and the library raises ``RnnifyError``."""
    nodes = [
        _call("table", "slice.Tensor", _ref("w"), 0, 0, 4),
        _call("column", "unsqueeze.default", _ref("table"), 1),
        _call("picked", "embedding.default", _ref("column"), _ref("position_ids")),
    ]
    directory = _grafted(tmp_path, windowed, nodes)
    model = rnnify.load(directory)
    with pytest.raises(RnnifyError, match=r"its step failed: IndexError: index out of range"):
        model.prefill(torch.tensor([[1, 2, 3, 4, 5]]))
    assert main(["generate", str(directory), "--ids", "1,2,3", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its step failed" in err and "Traceback" not in err, err


def _squared_tokens() -> list:
    """Every token against every token: ``n * n`` floats for the batch's ``n`` tokens."""
    return [
        _call("f", "to.dtype", _ref("x"), dtype="float32"),
        _call("flat", "view.default", _ref("f"), [-1]),
        _call("column", "unsqueeze.default", _ref("flat"), 1),
        _call("row", "unsqueeze.default", _ref("flat"), 0),
        _call("square", "add.Tensor", _ref("column"), _ref("row")),
    ]


_PUMP = [  # constant ops far larger than any of a step's own: they widen no other node's bound
    _call("big", "zeros.default", [1 << 24]),
    _call("wide", "zeros.default", [1, 512, 512]),
    _call("wider", "zeros.default", [1, 512, 1024]),
    _call("work", "bmm.default", _ref("wide"), _ref("wider")),
]


@pytest.mark.filterwarnings("ignore:decoding past max_position_embeddings")
@pytest.mark.parametrize("pumped", [False, True], ids=["alone", "beside large constant ops"])
@pytest.mark.parametrize("shape", [(1, 2000), (2000, 1)], ids=["prompt", "batch"])
def test_sizes_that_grow_as_a_power_of_the_tokens_are_stopped(tmp_path, windowed, shape, pumped):
    """A tensor of the tokens squared is at most 64 bytes over the load's runs and 16 MB at 2,000
    tokens, in one prompt or a batch of them: the first call at a new shape bounds each node by its
    own growth over the load's runs, and stops it before it allocates. Shorter calls pass."""
    model = rnnify.load(_grafted(tmp_path, windowed, (_PUMP if pumped else []) + _squared_tokens()))
    assert model.guard_budget is None and aot.refusal(model) is None
    _, state = model.prefill(torch.ones(2, 32, dtype=torch.long))
    model.step(torch.ones(2, 1, dtype=torch.long), state)
    with pytest.raises(
        RnnifyError, match=r"its step was stopped: aten.add.Tensor makes a tensor of 16,000,000 bytes, more than node"
    ):
        model.prefill(torch.ones(shape, dtype=torch.long))


def test_a_batched_product_is_bounded_by_the_copies_it_makes(tmp_path, windowed):
    """``[T, 1, 1, K] @ [1, T, K, 1]`` makes T * T numbers from copies of T * T * K each: at 64 tokens
    16 KB, from copies of 1 GB, stopped at the copies."""
    nodes = [
        _call("f", "to.dtype", _ref("x"), dtype="float32"),
        _call("a1", "view.default", _ref("f"), [-1, 1, 1, 1]),
        _call("a", "expand.default", _ref("a1"), [-1, 1, 1, 1 << 16]),
        _call("b1", "view.default", _ref("f"), [1, -1, 1, 1]),
        _call("b", "expand.default", _ref("b1"), [1, -1, 1 << 16, 1]),
        _call("product", "matmul.default", _ref("a"), _ref("b")),
    ]
    model = rnnify.load(_grafted(tmp_path, windowed, nodes))
    with pytest.raises(
        RnnifyError, match=r"its step was stopped: aten.matmul.default makes a tensor of 1,073,741,824 "
    ):
        model.prefill(torch.ones(1, 64, dtype=torch.long))


def test_a_step_runs_node_by_node_once_per_shape(windowed, monkeypatch):
    """The first call at each input shape (ids' dtype included) runs node by node under the bounds;
    the next at that shape as it always runs, compiled where it is."""
    from rnnify.runtime.new_shapes import NewShapes

    ran = []
    first_call = NewShapes.first_call

    def counted(self, module, part, ids, inputs):
        out = first_call(self, module, part, ids, inputs)
        if out is not None:
            ran.append((part, tuple(ids.shape), ids.dtype))
        return out

    model = rnnify.load(windowed)
    monkeypatch.setattr(NewShapes, "first_call", counted)
    for length, dtype in ((3, torch.long), (3, torch.long), (1, torch.long), (3, torch.int32), (5, torch.long)):
        model.prefill(torch.ones(2, length, dtype=dtype))
    assert ran == [("graph", (2, 3), torch.long), ("graph", (2, 3), torch.int32), ("graph", (2, 5), torch.long)]


@pytest.mark.filterwarnings("ignore:decoding past max_position_embeddings")
def test_the_hidden_states_and_the_head_are_bounded_at_new_shapes_too(tmp_path, windowed):
    """``prefill_hidden`` runs the graph's body, ``head`` its head: each meets new shapes of its own,
    bounded by the same nodes' lines, and a refusal is one line naming the directory."""
    directory = _grafted(tmp_path, windowed, _squared_tokens())
    model = rnnify.load(directory)
    with pytest.raises(RnnifyError) as refused:
        model.prefill_hidden(torch.ones(1, 2000, dtype=torch.long), model.init_state(1))
    assert str(refused.value).startswith(f"{directory}: its step was stopped: aten.add.Tensor makes a tensor")
    assert "\n" not in str(refused.value)
    hidden, _ = model.prefill_hidden(torch.ones(2, 16, dtype=torch.long), model.init_state(2))
    torch.testing.assert_close(model.head(hidden), model.prefill(torch.ones(2, 16, dtype=torch.long))[0])


def test_a_first_call_computes_what_the_later_ones_do(windowed):
    """The first call at a shape runs node by node, the later ones through the graph's own code: the
    same logits, states, hidden states and head, step after step."""
    model = rnnify.load(windowed)
    ids = torch.arange(2 * 9).reshape(2, 9) % 50
    runs = [model.prefill(ids) for _ in range(2)]
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    steps = [model.step(ids[:, :1], state) for _, state in runs]
    for a, b in zip(steps[0][1].tensors, steps[1][1].tensors):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(steps[0][0], steps[1][0], rtol=1e-5, atol=1e-6)
    hidden = [model.prefill_hidden(ids, model.init_state(2))[0] for _ in range(2)]
    torch.testing.assert_close(hidden[0], hidden[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head(hidden[0]), model.head(hidden[0]), rtol=1e-5, atol=1e-6)


def test_a_refusal_at_load_names_the_directory(tmp_path, windowed):
    nodes = [_call("a", "zeros.default", [1 << 12, 1, 1, 16], dtype="float64")]
    nodes += [_call("b", "zeros.default", [1, 1 << 12, 16, 1], dtype="float64")]
    nodes += [_call("product", "matmul.default", _ref("a"), _ref("b"))]
    directory = _grafted(tmp_path, windowed, nodes)
    with pytest.raises(RnnifyError) as refused:
        rnnify.load(directory)
    assert str(refused.value).startswith(f"{directory}: ") and "\n" not in str(refused.value), refused.value


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int16, torch.float32])
def test_token_ids_are_int64_or_int32(windowed, dtype):
    with pytest.raises(RnnifyError, match=r"input_ids must be an int64 \(or int32\) tensor"):
        rnnify.load(windowed).prefill(torch.ones(1, 3, dtype=dtype))
