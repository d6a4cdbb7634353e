"""Carry the state of short convolutions over the tokens (LFM2's conv layers, ZAYA's attention) through the step.

Some hybrids mix tokens in some layers with a causal convolution instead of attention. Captured
without a cache it is either ``conv1d(x [B, C, T], w [C_out, C/g, K], b, padding=K-1, groups=g)``
followed by ``[..., :T]`` (the padding puts K-1 zeros before the first token and the slice drops
the outputs past the last one: LFM2), or ``pad(x, [K-1, 0])`` followed by a chain of unpadded
convolutions whose kernels together read K tokens (ZAYA). Kept as it is, a step would read each
token as the first of its sequence. This pass replaces each with a call to a ``ShortConvCell``
(``cells.<i>``, after the attention cells), whose state is the row's last K-1 inputs
(docs/math.md §Short convolution); ``thread_state`` threads it like an attention cell's. Any other
convolution over the tokens is refused, naming its layer: a step could not carry what it reads.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from rnnify.cells import ShortConvCell, TokenWindowCell
from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.own_layers import LayerSite, cell_placer, layer_site
from rnnify.errors import UnsupportedModelError

_CONVOLUTIONS = {torch.ops.aten.conv1d.default, torch.ops.aten.convolution.default}
_PADS = {torch.ops.aten.pad.default, torch.ops.aten.constant_pad_nd.default}


def rewrite_convolutions(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    input_ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    length = str(input_ids.meta["val"].shape[1])
    place = cell_placer(gm)
    rewritten: set[torch.fx.Node] = set()
    for node in list(gm.graph.nodes):
        window = _token_window(node, length)
        if window is not None:
            x, kernel_size = window
            place(
                TokenWindowCell(TokenWindowCell.spec_for(int(x.meta["val"].shape[1])), kernel_size),
                (x,),
                node,
                layer_site(node),
            )
            gm.graph.erase_node(node)  # the pad (and slice) it read go with the pass's dead code
            continue
        if node in rewritten or node.op != "call_function" or node.target not in _CONVOLUTIONS:
            continue
        x = _arguments(node)["input"]
        if x.meta["val"].dim() != 3 or not _reads_tokens(x.meta["val"].shape[2], length):
            continue
        site = layer_site(node)
        if str(x.meta["val"].shape[2]) == length:
            source, convs, last = x, [node], _padded_by_itself(node, length, site)
        else:
            source, convs, last = _padded_before(node, length, site)
        kernel_size = 1 + sum(_kernel(conv) - 1 for conv in convs)
        if kernel_size == 1:
            continue  # each token alone: nothing to carry
        channels = int(source.meta["val"].shape[1])
        arguments = [_arguments(conv) for conv in convs]
        groups = [int(args.get("groups", 1)) for args in arguments]
        cell = ShortConvCell(ShortConvCell.spec_for(channels), kernel_size, None if groups == [channels] else groups)
        weights = [w for args in arguments for w in (args["weight"], args.get("bias"))]
        place(cell, (source, *weights), last, site)
        rewritten.update(convs)
        for dead in dict.fromkeys([last, *reversed(convs)]):  # the slice (LFM2), then the chain back to front
            if not dead.users:
                gm.graph.erase_node(dead)
    return gm


def _arguments(node: torch.fx.Node) -> dict:
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


def _kernel(conv: torch.fx.Node) -> int:
    return int(_arguments(conv)["weight"].meta["val"].shape[-1])


def _reads_tokens(size: Any, length: str) -> bool:
    """Does a dimension of ``size`` (an int, or an expression of the sequence length) follow the tokens?"""
    return re.search(rf"\b{re.escape(length)}\b", str(size)) is not None


def _refuse(site: LayerSite, reasons: list[str]) -> None:
    if reasons:
        raise UnsupportedModelError(
            f"{site.where}: a convolution over the tokens that is {', '.join(reasons)}; rnnify carries "
            "only causal convolutions from one token to the next"
        )


def _plain(args: dict) -> list[str]:
    """Why a convolution is not a plain one (``[]`` when it is): transposed, strided or dilated."""
    reasons = ["transposed"] if args.get("transposed") else []
    if list(args.get("stride", [1])) != [1] or list(args.get("dilation", [1])) != [1]:
        reasons.append("strided or dilated")
    return reasons


def _padded_by_itself(node: torch.fx.Node, length: str, site: LayerSite) -> torch.fx.Node:
    """The slice that keeps the first T outputs of a convolution padded by K-1 on both sides (LFM2);
    anything else over the tokens is refused."""
    args = _arguments(node)
    kernel_size = _kernel(node)
    if kernel_size == 1:
        return node  # each token alone: nothing to carry
    reasons = _plain(args)
    sliced = next(iter(node.users)) if len(node.users) == 1 else None
    if not (list(args.get("padding", [0])) == [kernel_size - 1] and sliced is not None and _first(sliced, length)):
        reasons.append("not causal (outputs that read later tokens are kept)")
    _refuse(site, reasons)
    return sliced


def _padded_before(
    node: torch.fx.Node, length: str, site: LayerSite
) -> tuple[torch.fx.Node, list[torch.fx.Node], torch.fx.Node]:
    """(x, the chain, its last convolution) where ``node`` reads ``pad(x, [P, 0])`` (P zeros before the
    tokens, none after) and unpadded convolutions, each the only reader of the last, read P + 1
    tokens together and end with T outputs (ZAYA); anything else over the tokens is refused."""
    padded = _arguments(node)["input"]
    source = _left_padding(padded, length)
    chain, reasons = [node], []
    while True:
        reasons += _plain(_arguments(chain[-1]))
        if list(_arguments(chain[-1]).get("padding", [0])) != [0]:
            reasons.append("padded on both sides")
        if str(chain[-1].meta["val"].shape[2]) == length or reasons:
            break
        users = list(chain[-1].users)
        if not (len(users) == 1 and users[0].op == "call_function" and users[0].target in _CONVOLUTIONS):
            reasons.append("padded for a chain of convolutions that other operations interrupt")
            break
        chain.append(users[0])
    if not reasons and (source is None or sum(_kernel(conv) - 1 for conv in chain) != source[1]):
        reasons.append("not causal (outputs that read later tokens are kept)")
    _refuse(site, reasons)
    return source[0], chain, chain[-1]


def _token_window(node: torch.fx.Node, length: str) -> tuple[torch.fx.Node, int] | None:
    """(x, K) where ``node`` is ``pad(x, [K-1, 0]).unfold(-1, K, 1)`` over x's T tokens (a slice that
    keeps every padded position may sit between: Inkling 2's), else None."""
    if node.op != "call_function" or node.target != torch.ops.aten.unfold.default:
        return None
    source, dim, size, step = node.args
    if dim not in (-1, 2) or step != 1 or not isinstance(size, int):
        return None
    if source.op == "call_function" and source.target == torch.ops.aten.slice.Tensor:
        whole = str(source.meta["val"].shape) == str(source.args[0].meta["val"].shape)
        if not (whole and source.args[1] in (-1, 2) and _arguments(source).get("step", 1) == 1):
            return None
        source = source.args[0]
    padded = _left_padding(source, length)
    if padded is None or padded[1] != size - 1 or padded[0].meta["val"].dim() != 3:
        return None
    return padded[0], size


def _left_padding(node: torch.fx.Node, length: str) -> tuple[torch.fx.Node, int] | None:
    """(x, P) where ``node`` is ``pad(x, [P, 0])`` with zeros over x's T tokens (last dimension), else None."""
    if node.op != "call_function" or node.target not in _PADS:
        return None
    args = _arguments(node)
    x, pad = args["input"], list(args["pad"])
    zeros = args.get("mode", "constant") == "constant" and args.get("value") in (None, 0, 0.0)
    if not (zeros and len(pad) == 2 and pad[1] == 0 and str(x.meta["val"].shape[-1]) == length):
        return None
    return x, int(pad[0])


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
