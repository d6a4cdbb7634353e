"""Carry token shifts (ZAYA's delayed values: each token reads the one before it) through the step.

Captured without a cache, a shift by one token is ``cat([first, x[:, :T-1]], dim=1)``: token t
reads token t-1's x and the first token reads ``first`` ``[B, 1, C]``, which the graph computes.
Kept as it is, every step would read ``first``. This pass replaces each with a call to a
``TokenShiftCell`` (``cells.<i>``, after the cells already there), whose state is the row's last
real x (docs/math.md §Token shift); ``thread_state`` threads it like an attention cell's. The cell
reads ``first`` before a row's first token, so a ``first`` computed from the graph's inputs (the
first token itself, or the last one: a rotation) is refused, naming its layer.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from rnnify.cells.token_shift import TokenShiftCell
from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.own_layers import cell_placer, layer_site
from rnnify.errors import UnsupportedModelError


def rewrite_token_shifts(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    input_ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    length = str(input_ids.meta["val"].shape[1])
    place = cell_placer(gm)
    for node in list(gm.graph.nodes):
        shift = _token_shift(node, length)
        if shift is not None:
            first, x = shift
            place(
                TokenShiftCell(TokenShiftCell.spec_for(int(x.meta["val"].shape[2]))), (x, first), node, layer_site(node)
            )
            gm.graph.erase_node(node)
    return gm


def _token_shift(node: torch.fx.Node, length: str) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(first, x) where ``node`` is ``cat([first, x[:, :T-1]], dim=1)`` with x ``[B, T, C]`` over the
    T tokens and first ``[B, 1, C]``; else None."""
    if node.op != "call_function" or node.target != torch.ops.aten.cat.default:
        return None
    args = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    parts, dim = args["tensors"], args.get("dim", 0)
    if len(parts) != 2 or not all(isinstance(part, torch.fx.Node) for part in parts):
        return None
    first, sliced = parts
    if first.meta["val"].dim() != 3 or dim not in (1, -2) or str(first.meta["val"].shape[1]) != "1":
        return None
    if sliced.op != "call_function" or sliced.target != torch.ops.aten.slice.Tensor:
        return None
    cut = normalize_function(sliced.target, sliced.args, sliced.kwargs, normalize_to_only_use_kwargs=True).kwargs
    x, end = cut["input"], cut.get("end")
    end = end.meta.get("val") if isinstance(end, torch.fx.Node) else end
    drops_last = end == -1 or str(end) == f"{length} - 1"
    if not (
        cut.get("dim", 0) == 1
        and cut.get("start") in (0, None)
        and cut.get("step", 1) == 1
        and drops_last
        and x.meta["val"].dim() == 3
        and str(x.meta["val"].shape[1]) == length
        and isinstance(x.meta["val"].shape[2], int)  # channels, not a second axis over the tokens
    ):
        return None
    if _reads_inputs(first):
        raise UnsupportedModelError(
            f"{layer_site(node).where}: a token shift whose first value is computed from the tokens; rnnify "
            "carries shifts whose first token reads a value of the weights alone"
        )
    return first, x


# ops that read only their tensor argument's shape, dtype or device
_METADATA_ONLY = {
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_full.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.full_like.default,
    torch.ops.aten.sym_size.int,
}


def _reads_inputs(node: torch.fx.Node) -> bool:
    """Does ``node``'s value depend on the graph's inputs (tokens, positions, mask), not only on weights
    and shapes? ZAYA's first value is its projection of ``x.new_zeros(...)``: weights alone."""
    stack, visited = [node], set()
    while stack:
        current = stack.pop()
        if current in visited or (current.op == "call_function" and current.target in _METADATA_ONLY):
            continue
        visited.add(current)
        if current.op == "placeholder":
            return True
        stack.extend(current.all_input_nodes)
    return False
