"""Record how the model encodes positions, so the runtime knows how far it can decode, and make a
model that numbers its tokens itself read the runtime's positions instead.

Learned absolute position embeddings (GPT-2's ``wpe``) are an ``aten.embedding`` (or a table's
``index_select``) indexed by ``position_ids``: past its table the model has no representation, and
the runtime refuses those positions. A model that numbers positions from ``padding_idx + 1``
(RoBERTa's family, see ``rnnify.compiler.numbering``) indexes it with ``position_ids + padding_idx +
1``, so its table holds that many positions fewer. Any other scheme (rotary, ALiBi, none) keeps
working past ``max_position_embeddings``, which is what constant-memory decoding is for; the runtime
only warns once there.

Some decoders ignore ``position_ids`` and count the tokens they are given, ``arange(T) +
cache_length``: BART's family (bart, mbart, plbart, mvp, trocr, blenderbot, blenderbot-small,
marian, pegasus, musicgen run as decoders) to read its position table (from row 2 in BART's, a
sinusoidal table in pegasus', marian's and musicgen's), Llama 4 to scale the queries of its layers
without RoPE by the position (attention temperature tuning), Inkling to scale its global layers'
queries and relative biases (log scaling). The captured graph holds no cache, so
in a one-token step that count would say position 0. Such a count is replaced by the runtime's
``position_ids`` where it is read: as the rows of a table (the rows ``position_ids`` plus the
constant the model adds are read instead), or as float values of a pointwise function of it, laid
out ``[1, T, 1, ...]`` (or ``[1, 1, T, 1]``) to broadcast over the batch (the function is computed on
``position_ids`` and laid out ``[B, T, 1, ...]``). For a row without padding that is what the original computes at
every step; a left-padded row gets the positions it would have alone, where the original counts
the padding too. A table the original grows past its rows when it reads further (XGLM's,
musicgen's sinusoidal ones) still bounds the converted model at those rows.
"""

from __future__ import annotations

import functools

import torch
import torch.fx

from rnnify.compiler.passes.context import PassContext

_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default}
_LAYOUTS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default}
_PASS_THROUGH = _LAYOUTS | {
    torch.ops.aten.expand.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten.clone.default,
}


def _origin(node: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """The node ``node`` comes from through ops that keep each value (views, casts) or add a
    constant, and the constant they add in all."""
    offset = 0
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        if node.target in _PASS_THROUGH:
            node = node.args[0]
        elif node.target == torch.ops.aten.add.Tensor and isinstance(node.args[1], int):
            node, offset = node.args[0], offset + node.args[1]
        else:
            break
    return node, offset


def _table_read(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(table, row indices) when ``node`` reads rows of a table: an embedding or ``index_select`` on dim 0."""
    if node.op != "call_function":
        return None
    if node.target == torch.ops.aten.embedding.default:
        return node.args[0], node.args[1]
    if node.target == torch.ops.aten.index_select.default and node.args[1] == 0:
        return node.args[0], node.args[2]
    return None


def _counts_tokens(node: torch.fx.Node, length: str) -> bool:
    """Whether ``node`` is ``arange(T)`` (or ``arange(0, T)``) over the T tokens the graph is given."""
    if node.op != "call_function" or node.target not in (torch.ops.aten.arange.default, torch.ops.aten.arange.start):
        return False
    *start, end = node.args[:2] if node.target == torch.ops.aten.arange.start else node.args[:1]
    return start in ([], [0]) and isinstance(end, torch.fx.Node) and str(end.meta.get("val")) == length


def _recorded(arg):
    """``arg`` with each node in it replaced by the value export recorded for it."""
    return torch.fx.node.map_arg(arg, lambda node: node.meta["val"])


def _call(gm: torch.fx.GraphModule, target, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """A new call of ``target`` (inserted where the graph's insertion point is), with the value
    export would have recorded for it."""
    node = gm.graph.call_function(target, args, kwargs or {})
    node.meta["val"] = target(*_recorded(args), **_recorded(kwargs or {}))
    return node


def _read_position_ids(
    gm: torch.fx.GraphModule, read: torch.fx.Node, table: torch.fx.Node, position_ids: torch.fx.Node, offset: int
):
    """Read the rows ``position_ids + offset`` of ``table`` in place of ``read``: [B, T, width] where
    the model read [T, width] (or [1, T, width]) for every batch row, which what it is added to
    broadcasts either way. Where the model lays the [T, width] out as [1, T, width] first (RoFormer's
    ``[None, None]`` before its heads), the rows replace that [1, T, width]."""
    with gm.graph.inserting_before(read):
        indices = _call(gm, torch.ops.aten.add.Tensor, (position_ids, offset)) if offset else position_ids
        rows = gm.graph.call_function(torch.ops.aten.embedding.default, (table, indices))
    width = read.meta["val"].shape[-1]
    rows.meta["val"] = read.meta["val"].new_empty((*position_ids.meta["val"].shape, width))
    laid_out = [u for u in read.users if u.target == torch.ops.aten.unsqueeze.default and u.args[1] == 0]
    for replaced in laid_out if laid_out and len(laid_out) == len(read.users) else [read]:
        replaced.replace_all_uses_with(rows)


def _pointwise_of_count(layout: torch.fx.Node, length: str) -> list[torch.fx.Node] | None:
    """The ops from ``arange(T)`` to what ``layout`` lays out, first op first, when ``layout`` is a
    view of float values, each a pointwise function of its token's count (constants aside), as
    ``[1, T, 1, ...]`` or with T on a later axis (``[1, 1, T, 1]``: Inkling's, a factor per query of
    its heads' scores); None otherwise (a mask compares counts: no float values)."""
    value = layout.meta.get("val")
    if (
        layout.op != "call_function"
        or layout.target not in _LAYOUTS
        or not isinstance(value, torch.Tensor)
        or not value.is_floating_point()
    ):
        return None
    sizes = [str(size) for size in value.shape]
    if len(sizes) < 2 or sizes[0] != "1" or sizes[1:].count(length) != 1 or set(sizes[1:]) != {length, "1"}:
        return None
    chain, node = [], layout.args[0]
    while node.op == "call_function" and (
        node.target in _CASTS or torch.Tag.pointwise in getattr(node.target, "tags", ())
    ):
        if node.all_input_nodes != [node.args[0]]:  # another tensor: not a function of the count alone
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1] if chain and _counts_tokens(node, length) else None


def _lay_out_by_position_ids(
    gm: torch.fx.GraphModule, layout: torch.fx.Node, chain: list[torch.fx.Node], position_ids: torch.fx.Node
):
    """Compute ``chain`` on ``position_ids`` [B, T] and lay it out as ``layout`` does, with B in place
    of its leading 1 (``[B, T, 1, ...]``, ``[B, 1, T, 1]``), in place of ``layout``."""
    with gm.graph.inserting_before(layout):
        value = position_ids
        for node in chain:
            value = _call(gm, node.target, (value, *node.args[1:]), node.kwargs)
        batch = _call(gm, torch.ops.aten.sym_size.int, (position_ids, 0))
        new = _call(gm, layout.target, (value, [batch, *layout.args[1][1:]]))
    layout.replace_all_uses_with(new)


def find_positions(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    placeholders = {node.name: node for node in gm.graph.nodes if node.op == "placeholder"}
    position_ids = placeholders["position_ids"]
    length = str(placeholders["input_ids"].meta["val"].shape[1])
    limit = None
    for node in list(gm.graph.nodes):
        chain = _pointwise_of_count(node, length)
        if chain is not None:
            _lay_out_by_position_ids(gm, node, chain, position_ids)
            continue
        read = _table_read(node)
        if read is None or read[0].op != "get_attr":
            continue
        table, indices = read
        origin, offset = _origin(indices)
        if origin is not position_ids:
            if not _counts_tokens(origin, length):
                continue
            _read_position_ids(gm, node, table, position_ids, offset)
        rows = int(functools.reduce(getattr, table.target.split("."), gm).shape[0])
        limit = rows - offset if limit is None else min(limit, rows - offset)
    if limit is not None:
        ctx.positions = {"kind": "learned", "limit": limit}
    else:
        limit = getattr(ctx.config, "max_position_embeddings", None)
        ctx.positions = {"kind": "relative", "limit": int(limit) if limit else None}
    return gm
