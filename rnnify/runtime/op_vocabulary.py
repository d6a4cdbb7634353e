"""The closed vocabulary of a step graph: the only calls ``graph.json`` may name, and their argument types.

A converted directory is data that others share, so loading its graph must not be able to do
anything a conversion would not have done. ``torch.ops`` holds ops that read and write files
(``aten.from_file``, ``aten.save``) or reach the network of a process group; a graph that may name
any of them is a program. So a step graph may name only the ops rnnify's capture and passes emit
for the models it converts (``OPS``), and every argument must have the type the op's schema
declares: a tensor argument takes a node or a number, never a string; a string argument exists
only where its values are a small closed set (``STRING_ARGUMENTS``), so no file path or free text
reaches an op. Graph outputs, node references and targets are checked by ``serialize``; which
tensors and cells a graph may reach by ``get_attr`` and ``call_module`` is checked against the
manifest at load (``check_references``), and so is what it returns (``check_returns``).

Saving checks the same vocabulary, so a model whose graph needs an op outside it fails when it is
converted, with the op's name, instead of producing a directory that no rnnify loads.
"""

from __future__ import annotations

import numbers
import operator
import re
from typing import Any, Callable, Iterable

import torch
import torch.fx

from rnnify.errors import GraphFormatError

__all__ = [
    "OPS",
    "STRING_ARGUMENTS",
    "check_call",
    "check_module_call",
    "check_references",
    "check_returns",
    "check_size_arithmetic",
    "check_state_flow",
    "check_writes",
]

# Every call target a step graph may name, as ``graph.json`` stores it: exactly the ops that
# ``benchmarks/arch_sweep.py`` found in the step graphs of every architecture that converts and of
# every target, in float32 and in bfloat16 (its JSONs in benchmarks/results; tests/test_graph_vocabulary.py
# holds them equal). A mixture of experts multiplies with transformers' fallback op, not torch's
# grouped matmul, which trusts its offsets (rnnify/compiler/routing.py).
# A new entry is a decision, reviewed as such, that the op only computes on tensors it is given:
# no file, process, device or library beyond torch and transformers.
OPS = frozenset(
    {
        "operator.getitem",
        "operator.mul",
        "operator.neg",
        "torch.ops.aten.abs.default",
        "torch.ops.aten.add.Tensor",
        "torch.ops.aten.add_.Tensor",
        "torch.ops.aten.addmm.default",
        "torch.ops.aten.alias.default",
        "torch.ops.aten.arange.default",
        "torch.ops.aten.arange.start_step",
        "torch.ops.aten.baddbmm.default",
        "torch.ops.aten.bitwise_not.default",
        "torch.ops.aten.bmm.default",
        "torch.ops.aten.broadcast_tensors.default",
        "torch.ops.aten.cat.default",
        "torch.ops.aten.chunk.default",
        "torch.ops.aten.clamp.Tensor",
        "torch.ops.aten.clamp.default",
        "torch.ops.aten.clamp_max.default",
        "torch.ops.aten.clamp_min.default",
        "torch.ops.aten.clone.default",
        "torch.ops.aten.concat.default",
        "torch.ops.aten.concatenate.default",
        "torch.ops.aten.contiguous.default",
        "torch.ops.aten.copy_.default",
        "torch.ops.aten.cos.default",
        "torch.ops.aten.cumsum.default",
        "torch.ops.aten.detach.default",
        "torch.ops.aten.detach_.default",
        "torch.ops.aten.div.Tensor",
        "torch.ops.aten.div.Tensor_mode",
        "torch.ops.aten.div_.Tensor",
        "torch.ops.aten.dropout.default",
        "torch.ops.aten.embedding.default",
        "torch.ops.aten.empty_like.default",
        "torch.ops.aten.eq.Scalar",
        "torch.ops.aten.erfinv.default",
        "torch.ops.aten.exp.default",
        "torch.ops.aten.expand.default",
        "torch.ops.aten.expand_as.default",
        "torch.ops.aten.expm1.default",
        "torch.ops.aten.flatten.using_ints",
        "torch.ops.aten.flip.default",
        "torch.ops.aten.floor.default",
        "torch.ops.aten.floor_divide.default",
        "torch.ops.aten.full_like.default",
        "torch.ops.aten.gather.default",
        "torch.ops.aten.ge.Scalar",
        "torch.ops.aten.gelu.default",
        "torch.ops.aten.gt.Scalar",
        "torch.ops.aten.histc.default",
        "torch.ops.aten.index.Tensor",
        "torch.ops.aten.index_add.default",
        "torch.ops.aten.index_put_.default",
        "torch.ops.aten.index_select.default",
        "torch.ops.aten.item.default",
        "torch.ops.aten.layer_norm.default",
        "torch.ops.aten.lift_fresh_copy.default",
        "torch.ops.aten.linalg_vector_norm.default",
        "torch.ops.aten.linear.default",
        "torch.ops.aten.log.default",
        "torch.ops.aten.log1p.default",
        "torch.ops.aten.log_sigmoid.default",
        "torch.ops.aten.logical_and.default",
        "torch.ops.aten.logsumexp.default",
        "torch.ops.aten.lt.Scalar",
        "torch.ops.aten.lt.Tensor",
        "torch.ops.aten.masked_fill.Scalar",
        "torch.ops.aten.matmul.default",
        "torch.ops.aten.max.dim",
        "torch.ops.aten.mean.dim",
        "torch.ops.aten.min.other",
        "torch.ops.aten.mul.Tensor",
        "torch.ops.aten.mul_.Tensor",
        "torch.ops.aten.multiply.Tensor",
        "torch.ops.aten.neg.default",
        "torch.ops.aten.new_empty.default",
        "torch.ops.aten.new_ones.default",
        "torch.ops.aten.new_zeros.default",
        "torch.ops.aten.numpy_T.default",
        "torch.ops.aten.ones.default",
        "torch.ops.aten.ones_like.default",
        "torch.ops.aten.permute.default",
        "torch.ops.aten.polar.default",
        "torch.ops.aten.pow.Scalar",
        "torch.ops.aten.pow.Tensor_Scalar",
        "torch.ops.aten.reciprocal.default",
        "torch.ops.aten.relu.default",
        "torch.ops.aten.repeat.default",
        "torch.ops.aten.repeat_interleave.self_int",
        "torch.ops.aten.reshape.default",
        "torch.ops.aten.reshape_as.default",
        "torch.ops.aten.rms_norm.default",
        "torch.ops.aten.rsqrt.default",
        "torch.ops.aten.rsub.Scalar",
        "torch.ops.aten.scatter.value",
        "torch.ops.aten.scatter_.src",
        "torch.ops.aten.scatter_.value",
        "torch.ops.aten.select.int",
        "torch.ops.aten.sigmoid.default",
        "torch.ops.aten.silu.default",
        "torch.ops.aten.sin.default",
        "torch.ops.aten.slice.Tensor",
        "torch.ops.aten.softmax.int",
        "torch.ops.aten.softplus.default",
        "torch.ops.aten.sort.default",
        "torch.ops.aten.split.Tensor",
        "torch.ops.aten.split_with_sizes.default",
        "torch.ops.aten.sqrt.default",
        "torch.ops.aten.square.default",
        "torch.ops.aten.squeeze.default",
        "torch.ops.aten.squeeze.dim",
        "torch.ops.aten.stack.default",
        "torch.ops.aten.std.dim",
        "torch.ops.aten.sub.Tensor",
        "torch.ops.aten.sum.dim_IntList",
        "torch.ops.aten.sym_size.int",
        "torch.ops.aten.tanh.default",
        "torch.ops.aten.to.device",
        "torch.ops.aten.to.dtype",
        "torch.ops.aten.to.dtype_layout",
        "torch.ops.aten.topk.default",
        "torch.ops.aten.transpose.int",
        "torch.ops.aten.type_as.default",
        "torch.ops.aten.unbind.int",
        "torch.ops.aten.unflatten.int",
        "torch.ops.aten.unsqueeze.default",
        "torch.ops.aten.view.default",
        "torch.ops.aten.view_as.default",
        "torch.ops.aten.view_as_complex.default",
        "torch.ops.aten.view_as_real.default",
        "torch.ops.aten.where.ScalarOther",
        "torch.ops.aten.where.self",
        "torch.ops.aten.zeros.default",
        "torch.ops.aten.zeros_like.default",
        "torch.ops.transformers.grouped_mm_fallback.default",
    }
)

# String arguments, by argument name, and the values they may take (a full match). Any other
# string argument, or another value, is refused: that is what keeps paths out of the graph.
STRING_ARGUMENTS: dict[str, re.Pattern[str]] = {
    "approximate": re.compile(r"none|tanh"),  # gelu
    "rounding_mode": re.compile(r"trunc|floor"),  # div
}

_MAX_LIST = 1 << 16  # longer constant lists than any shape or index list a conversion writes


def _fail(where: str, message: str) -> GraphFormatError:
    return GraphFormatError(f"{where}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _constant_fits(value: Any, kind: str, arg: Any) -> bool:
    """Does the constant ``value`` fit a schema type of kind ``kind`` (``arg``: the schema type)?"""
    if kind == "OptionalType":
        return value is None or _fits(value, arg.getElementType())
    if kind == "ListType":
        if not isinstance(value, (list, tuple)) or len(value) > _MAX_LIST:
            return False
        return all(_fits(item, arg.getElementType()) for item in value)
    if kind in ("IntType", "SymIntType"):
        return _is_int(value)
    if kind in ("FloatType", "SymFloatType"):
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind in ("BoolType", "SymBoolType"):
        return isinstance(value, bool)
    if kind == "NumberType":  # a Scalar: int, float or bool
        return isinstance(value, (int, float))
    if kind == "ScalarTypeType":
        return isinstance(value, torch.dtype)
    if kind == "LayoutType":
        return isinstance(value, torch.layout)
    if kind == "MemoryFormatType":
        return isinstance(value, torch.memory_format)
    if kind == "DeviceObjType":
        return isinstance(value, torch.device)
    return False  # strings (checked by name), generators, storages, ...: never a constant


def _fits(value: Any, arg_type: Any) -> bool:
    kind = arg_type.kind()
    if isinstance(value, torch.fx.Node):  # nodes hold tensors and sizes, never text
        while kind in ("OptionalType", "ListType"):
            arg_type = arg_type.getElementType()
            kind = arg_type.kind()
        return kind != "StringType"
    if kind == "TensorType":  # a Python number stands for a 0-d tensor (``add.Tensor(x, 1.0)``)
        return isinstance(value, (int, float))
    return _constant_fits(value, kind, arg_type)


def _check_strings(value: Any, name: str, where: str) -> None:
    """A string anywhere in ``value`` must be one of ``STRING_ARGUMENTS[name]``'s values."""
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(item, str):
            pattern = STRING_ARGUMENTS.get(name)
            if pattern is None or pattern.fullmatch(item) is None:
                raise _fail(where, f"argument {name!r} may not be the string {item[:64]!r}")


def _check_schema(op: torch._ops.OpOverload, args: tuple, kwargs: dict, where: str) -> None:
    """Bind ``args``/``kwargs`` to ``op``'s schema as the dispatcher would, and check each type."""
    schema = op._schema.arguments
    positional = [a for a in schema if not a.kwarg_only]
    if len(args) > len(positional):
        raise _fail(where, f"{op} takes at most {len(positional)} positional arguments, got {len(args)}")
    bound = dict(zip((a.name for a in positional), args))
    for name, value in kwargs.items():
        if name in bound:
            raise _fail(where, f"argument {name!r} given twice")
        bound[name] = value
    known = {a.name for a in schema}
    unknown = sorted(set(bound) - known)
    if unknown:
        raise _fail(where, f"{op} has no argument {unknown[0]!r}")
    for arg in schema:
        if arg.name not in bound:
            if not arg.has_default_value():
                raise _fail(where, f"{op} needs argument {arg.name!r}")
            continue
        value = bound[arg.name]
        kind = arg.real_type.kind()
        element = arg.real_type.getElementType() if kind in ("OptionalType", "ListType") else None
        if kind == "StringType" or (element is not None and element.kind() == "StringType"):
            _check_strings(value, arg.name, where)
            if isinstance(value, str) or value is None:
                continue
        if not _fits(value, arg.real_type):
            raise _fail(where, f"argument {arg.name!r} of {op} must be {arg.real_type}, got {_describe(value)}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        return f"node {value.name!r}"
    return f"{type(value).__name__} {value!r:.64}"


def _check_plain(name: str, args: tuple, kwargs: dict, where: str) -> None:
    """Arguments of a Python function target: ``operator.getitem`` takes a node and an index, the
    others (size arithmetic such as ``operator.mul``) nodes and numbers."""
    if kwargs:
        raise _fail(where, f"{name} takes no keyword arguments")
    if name == "operator.getitem":
        if len(args) != 2 or not isinstance(args[0], torch.fx.Node):
            raise _fail(where, "operator.getitem takes a node and an index")
        _check_index(args[1], where)
        return
    for value in args:
        if not isinstance(value, (torch.fx.Node, int, float)):
            raise _fail(where, f"{name} takes nodes and numbers, got {_describe(value)}")


def _check_index(value: Any, where: str) -> None:
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        if isinstance(item, slice):
            parts = (item.start, item.stop, item.step)
            if all(p is None or _is_int(p) or isinstance(p, torch.fx.Node) for p in parts):
                continue
        elif item is None or item is Ellipsis or _is_int(item) or isinstance(item, torch.fx.Node):
            continue
        raise _fail(where, f"index {_describe(item)} is not an int, slice, None, ... or node")


def check_call(name: str, target: Callable[..., Any], args: tuple, kwargs: dict, where: str) -> None:
    """Refuse a call_function node unless ``name`` is in ``OPS`` and its arguments fit its schema.

    ``name`` is the target as ``graph.json`` stores it, ``target`` what it resolved to."""
    if name not in OPS:
        raise _fail(where, f"{name!r} is outside rnnify's op vocabulary")
    if isinstance(target, torch._ops.OpOverload):
        _check_schema(target, args, kwargs, where)
    else:
        _check_plain(name, args, kwargs, where)


# The numbers a step computes size what its ops make, and a graph that could read them from the values
# of its tensors (a position, through ``item``) would stay small at the load's dry run and ask for
# gigabytes at some later token. So a number comes from the shapes of the step's token inputs alone
# (``sym_size`` of ids, positions or mask: the batch and the prompt's length), or from products of
# such numbers; the one number read from a tensor (``item``) may only say where a tensor splits
# (a mixture of experts' tokens per expert), which cannot make more than the tensor split.
# ``operator.mul`` and ``operator.neg`` are Python's: on a list or tuple ``mul`` repeats it, and
# integers have no width, so a chain of ``mul`` squaring its own result doubles its digits every
# time; a product that could pass PRODUCT_BITS (a size counts SIZE_BITS) is refused. The products a
# step computes multiply a few sizes (a batch by heads by a length), far below PRODUCT_BITS.
TOKEN_INPUTS = 3  # ids, positions, mask: what ``RecurrentModel`` passes a step before the state
SIZE_BITS = 64
PRODUCT_BITS = 1024
_SIZE = torch.ops.aten.sym_size.int
_READ = torch.ops.aten.item.default
_SPLITS = {(torch.ops.aten.split_with_sizes.default, "split_sizes")}  # where a number read may go
_SIZING_SCALARS = {torch.ops.aten.arange.default, torch.ops.aten.arange.start_step}  # Scalars that size


def _takes_ints(arg: Any) -> bool:
    kind = arg.real_type
    while kind.kind() in ("OptionalType", "ListType"):
        kind = kind.getElementType()
    return kind.kind() in ("IntType", "SymIntType")


def _bound(node: torch.fx.Node) -> Iterable[tuple[Any, Any]]:
    """(schema argument, value) of ``node``'s arguments given, for an aten op."""
    arguments = node.target._schema.arguments
    positional = [a for a in arguments if not a.kwarg_only]
    yield from zip(positional, node.args)
    yield from ((a, node.kwargs[a.name]) for a in arguments if a.name in node.kwargs)


def _number_arguments(node: torch.fx.Node) -> Iterable[tuple[str, Any]]:
    """(name, value) of ``node``'s arguments that take numbers a step may compute: ints and lists
    of ints, the Scalars that size a factory (``arange``'s), and ``operator.getitem``'s index."""
    if node.target is operator.getitem:  # an index: a slice's bounds cut a tensor to a length
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        yield "index", [p for i in index for p in ((i.start, i.stop, i.step) if isinstance(i, slice) else (i,))]
    if not isinstance(node.target, torch._ops.OpOverload):
        return
    for arg, value in _bound(node):
        if _takes_ints(arg) or node.target in _SIZING_SCALARS:
            yield arg.name, value


def _bits(value: Any, bound: dict[torch.fx.Node, int], where: str) -> int:
    if isinstance(value, torch.fx.Node):
        if value in bound:
            return bound[value]
        if value.op == "call_function" and value.target is _SIZE:
            return SIZE_BITS
        raise _fail(where, f"integer arithmetic takes numbers and sizes, not node {value.name!r} ({value.op})")
    return abs(value).bit_length() if _is_int(value) else 0  # a float overflows to inf, in no time


def _check_number(value: Any, node: torch.fx.Node, name: str, bound: dict[torch.fx.Node, int]) -> None:
    """A node in argument ``name`` of ``node`` must be a size, a product of sizes, or where a tensor
    splits, a number read from a tensor."""
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if not isinstance(item, torch.fx.Node) or item in bound or item.target is _SIZE:
            continue
        if item.target is _READ and (node.target, name) in _SPLITS:
            continue
        raise _fail(
            f"node {node.name!r} (call_function)",
            f"argument {name!r} takes node {item.name!r}: a step's sizes come from its inputs' shapes",
        )


def check_size_arithmetic(graph: torch.fx.Graph) -> None:
    """Refuse numbers a step computes from anything but its token inputs' shapes (``sym_size`` of one
    of the first ``TOKEN_INPUTS`` placeholders) and their products, a number read from a tensor
    anywhere but where a tensor splits, ``operator.mul``/``operator.neg`` on anything but numbers,
    sizes and earlier products, and products that could grow past ``PRODUCT_BITS`` bits (a ``mul`` is
    bounded by the sum of its operands' bit lengths, a ``neg`` by its operand's)."""
    inputs = [node for node in graph.nodes if node.op == "placeholder"][:TOKEN_INPUTS]
    bound: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        where = f"node {node.name!r} (call_function)"
        if node.target in (operator.mul, operator.neg):
            bits = sum(_bits(arg, bound, where) for arg in node.args)
            if bits > PRODUCT_BITS:
                raise _fail(
                    where, f"its integer arithmetic may reach {bits} bits; a step's sizes need at most {PRODUCT_BITS}"
                )
            bound[node] = bits
        elif node.target is _SIZE and (node.args or (node.kwargs.get("self"),))[0] not in inputs:
            raise _fail(where, "a step reads the sizes of its token inputs (ids, positions, mask) alone")
        for name, value in _number_arguments(node):
            _check_number(value, node, name, bound)


def _state_slot(node: Any) -> tuple[torch.fx.Node, int] | None:
    """(cell call, index) where ``node`` is ``getitem`` of a cell's returns after its output."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    cell, index = node.args
    ok = isinstance(cell, torch.fx.Node) and cell.op == "call_module" and _is_int(index) and index >= 1
    return (cell, index) if ok else None


def check_state_flow(graph: torch.fx.Graph) -> None:
    """Refuse a graph whose state does not go from each cell to itself: the i-th state a step is given
    (the placeholders after the first ``TOKEN_INPUTS``) is one of the last arguments of one cell
    call, and nothing else's, and the i-th state the step returns is what that cell returns for it
    (``getitem`` 1 on, in the order it takes them), read by nothing else. A cache that grows with
    every token (the exact cells') then grows as its cell grows it: no op of the directory's reads
    it, and no cell is handed another's state, or its own in another place, to grow it faster."""
    states = [node for node in graph.nodes if node.op == "placeholder"][TOKEN_INPUTS:]
    output = next((node for node in graph.nodes if node.op == "output"), None)
    returned = output.args[0] if output is not None and output.args else ()
    returned = list(returned[1:]) if isinstance(returned, (tuple, list)) else []
    for cell in (node for node in graph.nodes if node.op == "call_module"):
        for user in cell.users:
            index = user.args[1] if user.target is operator.getitem else None
            if not (_is_int(index) and index >= 0):
                raise _fail(
                    f"node {user.name!r} ({user.op})",
                    f"cell {cell.target!r} returns a tuple, which a step reads by getitem of an index 0 or more",
                )
            if index and any(reader is not output for reader in user.users):
                raise _fail(
                    f"node {user.name!r} (call_function)",
                    f"the new state of cell {cell.target!r} goes to the output alone",
                )
    if len(returned) != len(states):  # refused at load: ``check_returns``, or the dry run's call
        return
    for state, value in zip(states, returned):
        where = f"node {state.name!r} (placeholder)"
        slot = _state_slot(value)
        if slot is None:
            raise _fail(where, "the step must return, for this state, what the cell it goes to returns for it")
        cell, index = slot
        taken = [a for a in cell.args if a in states]
        if len(set(taken)) != len(taken):
            raise _fail(where, f"cell {cell.target!r} takes a state twice")
        offset = len(cell.args) - len(taken) + index - 1
        if (
            list(state.users) != [cell]
            or state in cell.kwargs.values()
            or cell.args[-len(taken) :] != tuple(taken)
            or cell.args[offset : offset + 1] != (state,)
        ):
            raise _fail(
                where,
                f"the step returns for it a state of cell {cell.target!r}: it goes to that cell alone, in that place",
            )


# ops whose schema marks no alias but whose result may be an input itself or a view of it: a
# broadcast's expanded inputs, a dropout off (its input), a ``type_as`` to the same dtype (itself)
_UNMARKED_VIEWS = frozenset(
    {torch.ops.aten.broadcast_tensors.default, torch.ops.aten.dropout.default, torch.ops.aten.type_as.default}
)


def check_writes(graph: torch.fx.Graph) -> None:
    """Refuse an op that writes in place (``add_``, ``copy_``, ``index_put_``) into a tensor the step
    was given or holds, or a view of one: the caller's ids or mask, a state, a weight. A weight
    written at each step would carry one request's tokens into the next (state outside the state
    a caller holds), or drift a little every step until the logits are NaN; ids written would hand
    the caller back another prompt. The step writes only into tensors it made."""
    given: set[torch.fx.Node] = set()  # placeholders, weights, and what views them
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            given.add(node)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in given:
            given.add(node)  # a piece of a view that returns several (split, unbind)
        elif node.target in _UNMARKED_VIEWS and given.intersection(node.all_input_nodes):
            given.add(node)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            for arg, value in _bound(node):
                values = value if isinstance(value, (list, tuple)) else (value,)  # broadcast_tensors: a list
                seen = [v for v in values if isinstance(v, torch.fx.Node) and v in given]
                if arg.alias_info is None or not seen:
                    continue
                if arg.alias_info.is_write:
                    raise _fail(
                        f"node {node.name!r} (call_function)",
                        f"it writes into {seen[0].name!r}, a tensor the step was given or views: it writes only what it made",
                    )
                given.add(node)  # a view of a tensor the step was given


def check_module_call(args: tuple, kwargs: dict, where: str) -> None:
    """A cell is called with nodes (q, k, v, the mask, its state, the layer input): no constant but a
    number or None reaches its Python code."""
    for value in (*args, *kwargs.values()):
        if not (value is None or isinstance(value, (torch.fx.Node, int, float))):
            raise _fail(where, f"a cell takes nodes, numbers and None, got {_describe(value)}")


def check_returns(graph: torch.fx.Graph, outputs: int) -> None:
    """A step graph returns ``(logits, *state)``: one tuple of ``outputs`` nodes."""
    node = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    value = node.args[0] if node is not None and len(node.args) == 1 else None
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, torch.fx.Node) for v in value):
        raise GraphFormatError("the graph must return a tuple of nodes: (logits, *state)")
    if len(value) != outputs:
        raise GraphFormatError(
            f"the graph returns {len(value)} values, the manifest's cells need {outputs}: (logits, *state)"
        )


def check_references(graph: torch.fx.Graph, tensors: Iterable[str], cells: Iterable[str]) -> None:
    """Every ``get_attr`` must name a stored tensor and every ``call_module`` a cell of the manifest,
    so a graph reaches nothing but the weights and cells it was saved with; and every cell must be
    called (one that is not would be built for nothing, as large as its spec says)."""
    tensors, cells = set(tensors), set(cells)
    uncalled = cells - {node.target for node in graph.nodes if node.op == "call_module"}
    if uncalled:
        raise GraphFormatError(f"cell {sorted(uncalled)[0]!r} of the manifest is never called by the graph")
    for node in graph.nodes:
        if node.op == "get_attr" and node.target not in tensors:
            raise GraphFormatError(
                f"node {node.name!r} (get_attr): {node.target!r} is not a tensor of the weights file"
            )
        if node.op == "call_module" and node.target not in cells:
            raise GraphFormatError(f"node {node.name!r} (call_module): {node.target!r} is not a cell of the manifest")
