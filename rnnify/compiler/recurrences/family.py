"""What rnnify needs to know of one family of a model's own recurrent layers."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from rnnify.cells.base import Cell


@dataclass(frozen=True)
class OwnRecurrence:
    """``function``: the name of the modeling module's function the layers call (``mamba2_scan_forward``),
    or of a layer class's method (``RecurrentGemmaRglru._rnn_scan``, whose stand-in takes the layer first);
    ``stand_in``: what they call instead during capture, with that function's signature, computing
    the layer as one call of ``op``; ``cell(args)``: from that call's arguments (fx nodes, whose
    ``meta["val"]`` holds example tensors, and constants), the cell that carries the layer's state
    and the tensor arguments of its call (mask and state are added by ``thread_state``)."""

    function: str
    stand_in: Callable[..., Any]
    op: torch._ops.OpOverload
    cell: Callable[[tuple[Any, ...]], tuple[Cell, tuple[torch.fx.Node, ...]]]


def shape(node: torch.fx.Node) -> torch.Size:
    """The example shape of a captured tensor argument."""
    return node.meta["val"].shape


def from_zero_state(cell: Cell, *inputs: torch.Tensor) -> torch.Tensor:
    """``cell``'s output over whole sequences from its zero state, every token real: what a captured
    op means (its inputs are the cell's, tokens in dimension 1)."""
    first = inputs[0]
    mask = torch.ones(first.shape[:2], dtype=torch.bool, device=first.device)
    return cell(*inputs, mask, *cell.init_state(first.shape[0], first.device, torch.float32))[0]


def whole_sequence(node: torch.fx.Node) -> torch.fx.Node:
    """``x`` where ``node`` is ``tensor_split(x, [T], dim=1)[0]`` with T all of x's tokens, else ``node``.

    The mixers split off the last tokens, whose states a cache keeps one by one (none without a
    cache): the first part is the whole sequence, and reading ``x`` leaves the split dead, an op a
    saved graph need not hold."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0):
        return node
    split = node.args[0]
    if not (isinstance(split, torch.fx.Node) and split.target == torch.ops.aten.tensor_split.indices):
        return node
    x, indices, *rest = split.args
    dim = rest[0] if rest else split.kwargs.get("dim", 0)
    if dim != 1 or len(indices) != 1:
        return node
    index = indices[0].meta.get("val") if isinstance(indices[0], torch.fx.Node) else indices[0]
    return x if str(index) == str(shape(x)[1]) else node
