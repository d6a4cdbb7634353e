"""Pickle-free JSON serialization of ``torch.fx`` graphs.

A compiled stepping module must be saved and loaded without pickle: pickle
executes arbitrary code on load and ties the artifact to the original model
classes. Instead we write the graph as plain JSON (this module) and the
weights separately (e.g. safetensors), then rebuild with
``torch.fx.GraphModule(root_with_weights, graph_from_json(data))``.

The graphs we handle come from ``torch.export.export(..., strict=False).module()``
followed by our own passes, so the vocabulary is small and closed: the ops of
``op_vocabulary.OPS``, each with the argument types its schema declares, and simple
constant arguments. Everything else is rejected with :class:`GraphFormatError`, on
save and on load, rather than silently degraded or run.

What is *not* stored: ``node.meta`` (fake tensors, stack traces), ``node.type``
annotations and the graph's ``_codegen``; a loaded graph always uses the plain
:class:`torch.fx.graph.CodeGen` (flat positional inputs, output returned as
stored), so swap out pytree codegen before saving if the calling convention
matters.

Loading never calls ``eval``/``importlib``: call targets are resolved only when
they are in the vocabulary, and every name that fx pastes into generated Python
source (node names, placeholder / attribute / module targets, kwarg keys) is
validated, so a hostile file cannot inject code through ``recompile()``.
"""

from __future__ import annotations

import importlib
import keyword
import math
import operator
import re
from typing import Any, Callable

import torch
import torch.fx
from torch.fx.immutable_collections import immutable_dict, immutable_list

from rnnify.errors import GraphFormatError
from rnnify.runtime.json_fields import is_attribute_path
from rnnify.runtime.op_vocabulary import (
    OPS,
    check_call,
    check_module_call,
    check_size_arithmetic,
    check_state_flow,
    check_writes,
)

__all__ = ["GRAPH_FORMAT_VERSION", "GraphFormatError", "graph_from_json", "graph_to_json"]

# graph.json's own layout version (independent of rnnify.json's MANIFEST_FORMAT_VERSION)
GRAPH_FORMAT_VERSION = 1

# Arguments nest a few levels (a tuple of slices, a list of sizes); far deeper is no graph of ours.
MAX_NESTING = 8
_OPS = ("placeholder", "get_attr", "call_function", "call_module", "output")
# Tag keys of the tagged value encoding; every JSON object in an argument is one of these.
_TAGS = (
    "node",
    "tuple",
    "dict",
    "float",
    "dtype",
    "device",
    "layout",
    "memory_format",
    "slice",
    "ellipsis",
)


# --------------------------------------------------------------------------- targets

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# the generated forward's first parameter, the module that every get_attr and call_module reads
# from: a node of that name would rebind it to its own value for every node after it
_SELF = "self"


def _build_function_table() -> dict[str, Callable[..., Any]]:
    """The plain-function call targets of the vocabulary (``op_vocabulary.OPS``: ``operator``'s), keyed by
    their stored string."""
    return {name: getattr(operator, name.partition(".")[2]) for name in sorted(OPS) if name.startswith("operator.")}


_FUNCTIONS = _build_function_table()
_FUNCTION_NAMES = {id(fn): name for name, fn in _FUNCTIONS.items()}


def _resolve_op(path: str) -> Callable[..., Any] | None:
    """Resolve "torch.ops.ns.op.overload" by attribute lookup with type checks at each step.

    Type checks (not name checks) are what keep this safe: ``torch.ops`` also exposes
    ``import_module``/``load_library``, which are never namespaces.
    """
    parts = path.split(".")
    if len(parts) != 5 or parts[:2] != ["torch", "ops"]:
        return None
    if not all(_IDENT.match(p) for p in parts[2:]):
        return None
    try:
        ns = getattr(torch.ops, parts[2])
        if not isinstance(ns, torch._ops._OpNamespace):
            return None
        packet = getattr(ns, parts[3])
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            return None
        overload = getattr(packet, parts[4])
    except (AttributeError, RuntimeError):
        return None
    return overload if isinstance(overload, torch._ops.OpOverload) else None


def _target_to_str(target: Any) -> str | None:
    """Stored name of a call_function target, or None if it is not whitelisted."""
    if not isinstance(target, torch._ops.OpOverload):
        return _FUNCTION_NAMES.get(id(target))
    name = f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    # Only accept what loads back to the very same object, so saving fails early, not loading.
    return name if _resolve_op(name) is target else None


# Op namespaces of the vocabulary that an installed library registers when one of its modules is
# imported (an MoE layer's grouped matmul): a process that loads a model has not necessarily imported it.
_OP_LIBRARIES = {"transformers": "transformers.integrations.moe"}


def _str_to_target(name: str) -> Callable[..., Any] | None:
    if name not in OPS:  # before any lookup: nothing outside the vocabulary is even resolved
        return None
    if name.startswith("torch.ops."):
        library = _OP_LIBRARIES.get(name.split(".")[2])
        if library is not None:
            importlib.import_module(library)
        return _resolve_op(name)
    return _FUNCTIONS.get(name)


# --------------------------------------------------------------------------- values


def _enum_name(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _encode(value: Any, where: str, path: str) -> Any:
    """Encode one argument value; JSON objects are always single-key tags."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if type(value) in (list, immutable_list):
        return [_encode(v, where, f"{path}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return {"tuple": [_encode(v, where, f"{path}[{i}]") for i, v in enumerate(value)]}
    if type(value) in (dict, immutable_dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise GraphFormatError(f"{where}: dict key {k!r} at {path} is not a str")
            out[k] = _encode(v, where, f"{path}[{k!r}]")
        return {"dict": out}
    if isinstance(value, torch.dtype):
        return {"dtype": _enum_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": _enum_name(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": _enum_name(value)}
    if isinstance(value, slice):
        return {"slice": [_encode(getattr(value, a), where, f"{path}.{a}") for a in ("start", "stop", "step")]}
    if value is Ellipsis:
        return {"ellipsis": True}
    raise GraphFormatError(f"{where}: unsupported argument of type {type(value).__qualname__} at {path}")


# torch's dtypes, layouts and memory formats by name, read from the module's own namespace: a name
# looked up with getattr could make torch import one of its submodules lazily (``torch._inductor``)
_TORCH_ENUMS = {
    name: value
    for name, value in vars(torch).items()
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
}


def _torch_enum(kind: str, name: Any, cls: type, where: str) -> Any:
    value = _TORCH_ENUMS.get(name) if isinstance(name, str) else None
    if not isinstance(value, cls):
        raise GraphFormatError(f"{where}: unknown {kind} {name!r}")
    return value


class _Decoder:
    def __init__(self, nodes: dict[str, torch.fx.Node], device: torch.device | None):
        self.nodes = nodes
        self.device = device

    def decode(self, value: Any, where: str, depth: int = 0) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if depth > MAX_NESTING:
            raise GraphFormatError(f"{where}: argument nested deeper than {MAX_NESTING} levels")
        depth += 1
        if isinstance(value, list):
            return [self.decode(v, where, depth) for v in value]
        if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in _TAGS:
            raise GraphFormatError(f"{where}: malformed argument value {value!r:.200}")
        ((tag, payload),) = value.items()
        if tag == "node":
            if not isinstance(payload, str) or payload not in self.nodes:
                raise GraphFormatError(
                    f"{where}: reference to unknown node {payload!r} (nodes must be defined before use)"
                )
            return self.nodes[payload]
        if tag in ("tuple", "slice"):
            if not isinstance(payload, list) or (tag == "slice" and len(payload) != 3):
                raise GraphFormatError(f"{where}: malformed {tag} {payload!r:.200}")
            items = [self.decode(v, where, depth) for v in payload]
            return tuple(items) if tag == "tuple" else slice(*items)
        if tag == "dict":
            if not isinstance(payload, dict):
                raise GraphFormatError(f"{where}: malformed dict {payload!r:.200}")
            return {k: self.decode(v, where, depth) for k, v in payload.items()}
        if tag == "float":
            special = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
            if not isinstance(payload, str) or payload not in special:
                raise GraphFormatError(f"{where}: unknown float constant {payload!r}")
            return special[payload]
        if tag == "dtype":
            return _torch_enum("dtype", payload, torch.dtype, where)
        if tag == "layout":
            return _torch_enum("layout", payload, torch.layout, where)
        if tag == "memory_format":
            return _torch_enum("memory_format", payload, torch.memory_format, where)
        if tag == "device":
            if not isinstance(payload, str):
                raise GraphFormatError(f"{where}: malformed device {payload!r}")
            try:
                device = torch.device(payload)
            except (RuntimeError, ValueError) as e:
                raise GraphFormatError(f"{where}: invalid device {payload!r}: {e}") from None
            return self.device if self.device is not None else device
        if tag == "ellipsis":
            if payload is not True:
                raise GraphFormatError(f"{where}: malformed ellipsis {payload!r}")
            return Ellipsis
        raise AssertionError(tag)  # unreachable: tags are checked above


# --------------------------------------------------------------------------- graph


def _check_target(op: str, target: Any, where: str) -> None:
    """Reject strings that fx would paste into generated source unsafely."""
    if not isinstance(target, str):
        raise GraphFormatError(f"{where}: target must be a string, got {type(target).__qualname__}")
    if op == "placeholder":
        # a plain name: a step's inputs are positional, and a starred one would make fx's source invalid
        ok = _IDENT.match(target) is not None and not keyword.iskeyword(target) and target != _SELF
    elif op == "output":
        ok = target == "output"
    else:
        ok = is_attribute_path(target)
    if not ok:
        raise GraphFormatError(f"{where}: invalid {op} target {target!r}")


def graph_to_json(graph: torch.fx.Graph) -> dict:
    """Describe ``graph`` as a JSON-compatible dict so it can be stored without pickle.

    Raises GraphFormatError naming the node if a call target is not in the whitelist or an
    argument has a type the format cannot represent, so a bad graph fails at save time
    instead of producing a file that cannot be loaded.
    """
    check_size_arithmetic(graph)
    check_state_flow(graph)
    check_writes(graph)
    nodes = []
    for node in graph.nodes:
        where = f"node {node.name!r} ({node.op})"
        if node.op not in _OPS:
            raise GraphFormatError(f"{where}: unsupported op")
        if node.op == "call_function":
            target = _target_to_str(node.target)
            if target is None:
                raise GraphFormatError(
                    f"{where}: {node.target!r} is outside rnnify's op vocabulary (rnnify.runtime.op_vocabulary)"
                )
            check_call(target, node.target, node.args, node.kwargs, where)
        else:
            target = node.target
            _check_target(node.op, target, where)
        for a in node.all_input_nodes:
            if a.graph is not graph:
                raise GraphFormatError(f"{where}: argument {a.name!r} belongs to a different graph")
        for k in node.kwargs:
            if not isinstance(k, str) or not k.isidentifier() or keyword.iskeyword(k):
                raise GraphFormatError(f"{where}: kwarg name {k!r} is not an identifier")
        nodes.append(
            {
                "name": node.name,
                "op": node.op,
                "target": target,
                "args": [_encode(a, where, f"args[{i}]") for i, a in enumerate(node.args)],
                "kwargs": {k: _encode(v, where, f"kwargs[{k!r}]") for k, v in node.kwargs.items()},
            }
        )
    return {"format": GRAPH_FORMAT_VERSION, "nodes": nodes}


def graph_from_json(data: dict, device: torch.device | str | None = None) -> torch.fx.Graph:
    """Rebuild a graph written by :func:`graph_to_json`, without running any stored code.

    ``device``, if given, replaces every ``torch.device`` constant in the graph (``arange(...,
    device=cpu)``, ``to(device=cpu)``, metadata asserts), so a graph captured on CPU runs on
    CUDA. Wrap the result with ``torch.fx.GraphModule(root, graph)`` where ``root`` holds the
    attributes and submodules the get_attr / call_module nodes name.

    Raises GraphFormatError (naming the node) for an unknown format version, an unknown
    call target, a malformed value, or a reference to a node not defined earlier.
    """
    if not isinstance(data, dict):
        raise GraphFormatError(f"graph data must be a dict, got {type(data).__qualname__}")
    if data.get("format") != GRAPH_FORMAT_VERSION:
        raise GraphFormatError(
            f"unsupported graph format {data.get('format')!r} (this version reads format {GRAPH_FORMAT_VERSION})"
        )
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list):
        raise GraphFormatError("graph data has no 'nodes' list")
    if device is not None:
        device = torch.device(device)

    graph = torch.fx.Graph()
    nodes: dict[str, torch.fx.Node] = {}
    inputs: set[str] = set()
    decoder = _Decoder(nodes, device)
    for index, raw in enumerate(raw_nodes):
        if not isinstance(raw, dict):
            raise GraphFormatError(f"node #{index}: expected an object, got {type(raw).__qualname__}")
        name, op = raw.get("name"), raw.get("op")
        where = f"node {name!r} ({op})"
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name == _SELF:
            raise GraphFormatError(f"node #{index}: invalid node name {name!r}")
        if name in nodes:
            raise GraphFormatError(f"{where}: duplicate node name")
        if op not in _OPS:
            raise GraphFormatError(f"{where}: unknown op")
        args, kwargs = raw.get("args", []), raw.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise GraphFormatError(f"{where}: 'args' must be a list and 'kwargs' an object")
        for k in kwargs:
            if not k.isidentifier() or keyword.iskeyword(k):
                raise GraphFormatError(f"{where}: kwarg name {k!r} is not an identifier")

        target: Any = raw.get("target")
        if op == "call_function":
            resolved = _str_to_target(target) if isinstance(target, str) else None
            if resolved is None:
                raise GraphFormatError(f"{where}: {target!r} is outside rnnify's op vocabulary; nothing was run")
            target = resolved
        else:
            _check_target(op, target, where)
        if op == "placeholder":  # the generated forward's parameters: a name twice is invalid Python
            if target in inputs:
                raise GraphFormatError(f"{where}: input {target!r} appears twice")
            inputs.add(target)
        if op == "output" and (index != len(raw_nodes) - 1 or len(args) != 1 or kwargs):
            raise GraphFormatError(f"{where}: output must be the last node, with one value")

        args = tuple(decoder.decode(a, where) for a in args)
        kwargs = {k: decoder.decode(v, where) for k, v in kwargs.items()}
        if op == "call_function":
            check_call(raw["target"], target, args, kwargs, where)
        elif op == "call_module":
            check_module_call(args, kwargs, where)
        elif op in ("placeholder", "get_attr") and (args or kwargs):  # a default value would be a node's value
            raise GraphFormatError(f"{where}: a {op} takes no arguments")
        node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            # fx renames clashes with builtins/reserved names; a renamed node would break references.
            raise GraphFormatError(f"{where}: name is not usable in an fx graph (fx renamed it to {node.name!r})")
        nodes[name] = node

    check_size_arithmetic(graph)
    check_state_flow(graph)
    check_writes(graph)
    try:
        graph.lint()
    except Exception as e:  # lint raises RuntimeError/AssertionError on structural problems
        raise GraphFormatError(f"graph failed validation: {e}") from None
    return graph
