"""Split a converted model's step graph into one submodule per decoder layer (for FSDP).

Why: FSDP saves memory by gathering the full weights of one unit at a time (all-gather before
the unit's forward and backward, free after). A converted model is one flat fx graph that reads
every weight through ``get_attr``, so sharding it whole gathers the whole model at once: no
saving over DDP. ``split_layers`` rewrites the graph as a root graph that calls, in order,
``prologue`` (embeddings, rotary tables), ``layer_<i>`` for each decoder layer (its projections,
its attention cell call, its MLP) and ``epilogue`` (final norm, LM head): each piece is its own
``GraphModule`` holding exactly the weights it reads, so each can be sharded on its own
(``rnnify.distillation.fsdp``). It is not part of the conversion pipeline: only training uses it.

Nodes are assigned in graph order, never backwards, so every value flows from an earlier piece
to a later one and the split computes exactly the flat graph's function: a node that reads a
weight under layer i's module path (the cell entries give the pattern: ``model.layers.3.self_attn``
gives ``model.layers.<i>.``, which also finds layers left without a cell), or is layer i's cell
call, starts layer i; the nodes up to the next
layer's first such node belong to layer i (so a layer's residual adds and the next layer's norm
statistics may sit on either side of a boundary, which changes nothing); nodes before the first
layer are the prologue and nodes after the last layer's last such node the epilogue. A weight
read in several pieces (tied embeddings) is held by all of them.

Attributes: by default every piece holds the very objects the flat graph holds (cells,
parameters, buffers), so training the split trains the model. With ``memo`` (a dict, filled as
``copy.deepcopy``'s memo is) the pieces hold new objects that alias the same storage instead:
new ``nn.Parameter``s and buffers, and copies of the cells and of parametrized modules (LoRA),
with ``memo[id(original)]`` their copy. FSDP replaces and reshards those without touching the
original model, whose parameters the caller updates from the copies after training.
"""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.nn.utils import parametrize

from rnnify.errors import RnnifyError
from rnnify.runtime.storage import install

__all__ = ["PROLOGUE", "EPILOGUE", "layer_prefix", "split_layers"]

PROLOGUE, EPILOGUE = "prologue", "epilogue"


def layer_prefix(module_path: str, layer: int) -> str | None:
    """The decoder layer's module prefix in a cell entry's path: ``model.layers.3.self_attn`` -> ``model.layers.3.``."""
    parts = module_path.split(".")
    for i, part in enumerate(parts):
        if part == str(layer):
            return ".".join(parts[: i + 1]) + "."
    return None


def split_layers(
    gm: torch.fx.GraphModule, cells: Sequence[Any], memo: dict[int, Any] | None = None
) -> torch.fx.GraphModule:
    """``gm`` as a root graph calling one ``GraphModule`` piece per decoder layer (see the module docstring).

    ``cells``: the manifest's cell entries (``module``, ``layer``, ``module_path``). The result
    takes and returns what ``gm`` does; its children, in call order, are ``prologue`` (if any
    node precedes the first layer), ``layer_<i>`` per decoder layer and ``epilogue`` (if any).
    """
    cell_layer = {entry.module: entry.layer for entry in cells}
    patterns = {  # "model.layers.3." -> "model\.layers\.(\d+)\."
        re.compile(re.escape(p[: -len(f"{entry.layer}.")]) + r"(\d+)\.")
        for entry in cells
        if (p := layer_prefix(entry.module_path, entry.layer))
    }
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]

    def layer_of(node: torch.fx.Node) -> int | None:
        if node.op == "call_module" and node.target in cell_layer:
            return cell_layer[node.target]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                for pattern in patterns:
                    if match := pattern.match(arg.target):
                        return int(match.group(1))
        return None

    hints = [layer_of(n) for n in compute]
    marked = [i for i, h in enumerate(hints) if h is not None]
    if not marked:
        raise RnnifyError("cannot split the step graph into decoder layers: no node reads a layer's weights")
    names, piece_of, current = [], {}, None
    for i, (node, hint) in enumerate(zip(compute, hints)):
        if i > marked[-1]:
            name = EPILOGUE
        elif hint is not None and f"layer_{hint}" not in names:
            name = current = f"layer_{hint}"  # the first node of a new layer starts its piece
        else:
            name = current or PROLOGUE
        if not names or names[-1] != name:
            names.append(name)
        piece_of[node] = name

    # What each piece takes (placeholders and earlier pieces' values, in first-use order) and returns.
    inputs: dict[str, dict[torch.fx.Node, None]] = {name: {} for name in names}
    outputs: dict[str, dict[torch.fx.Node, None]] = {name: {} for name in names}
    for node in compute:
        for arg in node.all_input_nodes:
            if arg.op != "get_attr" and piece_of.get(arg) != piece_of[node]:
                inputs[piece_of[node]][arg] = None
                if arg.op != "placeholder":
                    outputs[piece_of[arg]][arg] = None
    output = next(n for n in nodes if n.op == "output")
    for arg in output.all_input_nodes:
        if arg.op == "get_attr":
            raise RnnifyError(f"cannot split the step graph: its output reads {arg.target} directly")
        if arg.op != "placeholder":
            outputs[piece_of[arg]][arg] = None

    root = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        if node.op == "placeholder":
            env[node] = root.node_copy(node)
    pieces: dict[str, torch.fx.GraphModule] = {}
    for name in names:
        graph, local = torch.fx.Graph(), {}
        for arg in inputs[name]:
            local[arg] = graph.placeholder(arg.name)
            local[arg].meta = dict(arg.meta)
        attrs: list[str] = []
        modules: list[str] = []

        def lookup(arg: torch.fx.Node, graph=graph, local=local, attrs=attrs) -> torch.fx.Node:
            if arg not in local:  # a get_attr: read in this piece, from this piece's own attribute
                local[arg] = graph.get_attr(arg.target)
                local[arg].meta = dict(arg.meta)
                attrs.append(arg.target)
            return local[arg]

        for node in compute:
            if piece_of[node] == name:
                local[node] = graph.node_copy(node, lookup)
                if node.op == "call_module":
                    modules.append(node.target)
        graph.output(tuple(local[n] for n in outputs[name]))
        pieces[name] = _piece(gm, graph, attrs, modules, memo, name)
        call = root.call_module(name, tuple(env[a] for a in inputs[name]))
        for index, node in enumerate(outputs[name]):
            env[node] = root.call_function(operator.getitem, (call, index))
            env[node].meta = dict(node.meta)
    root.output(torch.fx.graph.map_arg(output.args[0], lambda n: env[n]))
    module = torch.fx.GraphModule(pieces, root, class_name="SplitStep")
    return module


def _piece(
    gm: torch.fx.GraphModule,
    graph: torch.fx.Graph,
    attrs: list[str],
    modules: list[str],
    memo: dict[int, Any] | None,
    name: str,
) -> torch.fx.GraphModule:
    """A GraphModule running ``graph`` whose attributes are ``gm``'s objects (or, with ``memo``, aliasing copies).

    Built empty and filled by hand rather than by ``GraphModule(gm, graph)``, which would copy
    each ``get_attr`` leaf's value: a parametrized weight (LoRA) must stay a live
    parametrization, so its owning module is installed whole.
    """
    piece = torch.fx.GraphModule(nn.Module(), torch.fx.Graph(), class_name=f"Step_{name}")
    for target in modules:
        install(piece, target, _take(gm.get_submodule(target), memo))
    for target in attrs:
        owner_path, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if parametrize.is_parametrized(owner, leaf):
            if not owner_path:
                raise RnnifyError(f"cannot split the step graph: {target} is parametrized on the graph itself")
            install(piece, owner_path, _take(owner, memo))
        else:
            install(piece, target, _take(getattr(owner, leaf), memo))
    piece.graph = graph  # recompiles
    return piece


def _take(obj: Any, memo: dict[int, Any] | None) -> Any:
    """``obj`` itself, or (with ``memo``) its copy: modules deep-copied, tensors aliased."""
    if memo is None:
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, nn.Module):
        for tensor in [*obj.parameters(), *obj.buffers()]:
            _take(tensor, memo)
        copied = copy.deepcopy(obj, memo)  # parameters and buffers come from memo: aliases
    elif isinstance(obj, nn.Parameter):
        copied = nn.Parameter(obj.detach(), requires_grad=obj.requires_grad)
    elif isinstance(obj, torch.Tensor):
        copied = obj.detach()
    else:
        copied = copy.deepcopy(obj, memo)
    memo[id(obj)] = copied
    return copied
