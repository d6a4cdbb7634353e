"""Carry the state of short convolutions over the tokens (LFM2's conv layers) through the step.

Some hybrids mix tokens in some layers with a causal depthwise convolution instead of attention.
Captured without a cache it is ``conv1d(x [B, C, T], w [C, 1, K], b, padding=K-1, groups=C)``
followed by ``[..., :T]``: the padding puts K-1 zeros before the first token and the slice drops
the outputs past the last one. Kept as it is, a step would read each token as the first of its
sequence. This pass replaces each with a call to a ``ShortConvCell`` (``cells.<i>``, after the
attention cells), whose state is the row's last K-1 inputs (docs/math.md §Short convolution);
``thread_state`` threads it like an attention cell's. Any other convolution over the tokens is
refused, naming its layer: a step could not carry what it reads.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from rnnify.cells import ShortConvCell
from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.find_attention import SITE_KEY, _layer_index, _module_path
from rnnify.compiler.passes.rewrite_attention import CELL_KEY, cell_calls
from rnnify.errors import UnsupportedModelError

_CONVOLUTIONS = {torch.ops.aten.conv1d.default, torch.ops.aten.convolution.default}


@dataclass
class LayerSite:
    """Where a model's own recurrent layer (a short convolution, a scan) was, as ``convert`` records it
    in the manifest (as for an ``AttentionSite``)."""

    layer: int
    module_path: str

    @property
    def where(self) -> str:
        return f"layer {self.layer} ({self.module_path})"


def rewrite_convolutions(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    input_ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    length = str(input_ids.meta["val"].shape[1])
    taken = {call.target for call in cell_calls(gm)}
    names = (f"cells.{i}" for i in itertools.count() if f"cells.{i}" not in taken)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CONVOLUTIONS:
            continue
        args = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        x, weight = args["input"], args["weight"]
        if x.meta["val"].dim() != 3 or str(x.meta["val"].shape[2]) != length:
            continue  # not over the tokens
        path = _module_path(node)
        site = LayerSite(_layer_index(path, -1), path)
        kernel_size = _causal_kernel_size(node, args, length, site)
        if kernel_size == 1:
            continue  # each token alone: nothing to carry
        name = next(names)
        gm.add_submodule(name, ShortConvCell(ShortConvCell.spec_for(int(x.meta["val"].shape[1])), kernel_size))
        (sliced,) = node.users
        with gm.graph.inserting_before(sliced):
            call = gm.graph.call_module(name, (x, weight, args.get("bias")))
            out = gm.graph.call_function(operator.getitem, (call, 0))
        call.meta[SITE_KEY] = site
        call.meta[CELL_KEY] = True
        out.meta["val"] = sliced.meta.get("val")
        sliced.replace_all_uses_with(out)
        gm.graph.erase_node(sliced)
        gm.graph.erase_node(node)
    return gm


def _causal_kernel_size(node: torch.fx.Node, args: dict, length: str, site: LayerSite) -> int:
    """K of a causal depthwise convolution over the tokens (padded by K-1, its first T outputs kept);
    anything else over the tokens is refused."""
    x, weight = args["input"], args["weight"]
    channels = int(x.meta["val"].shape[1])
    out_channels, per_group, kernel_size = (int(size) for size in weight.meta["val"].shape)
    if kernel_size == 1:
        return 1
    reasons = []
    if args.get("transposed"):
        reasons.append("transposed")
    if not (args.get("groups") == channels == out_channels and per_group == 1):
        reasons.append("not depthwise (channels mix)")
    if list(args.get("stride", [1])) != [1] or list(args.get("dilation", [1])) != [1]:
        reasons.append("strided or dilated")
    sliced = next(iter(node.users)) if len(node.users) == 1 else None
    if not (list(args.get("padding", [0])) == [kernel_size - 1] and sliced is not None and _first(sliced, length)):
        reasons.append("not causal (outputs that read later tokens are kept)")
    if reasons:
        raise UnsupportedModelError(
            f"{site.where}: a convolution over the tokens that is {', '.join(reasons)}; rnnify carries "
            "only causal depthwise convolutions from one token to the next"
        )
    return kernel_size


def _first(node: torch.fx.Node, length: str) -> bool:
    """Is ``node`` ``x[:, :, :T]`` (the first T outputs along the tokens)?"""
    if node.op != "call_function" or node.target != torch.ops.aten.slice.Tensor:
        return False
    args = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
    end = args.get("end")
    end = end.meta.get("val") if isinstance(end, torch.fx.Node) else end
    return (
        args.get("dim", 0) in (2, -1)
        and args.get("start") in (0, None)
        and args.get("step", 1) == 1
        and str(end) == length
    )
