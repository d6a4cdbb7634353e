"""Record how the model encodes positions, so the runtime knows how far it can decode.

Learned absolute position embeddings (GPT-2's ``wpe``) are an ``aten.embedding`` indexed by
``position_ids``: past its table the model has no representation, and the runtime refuses those
positions. Any other scheme (rotary, ALiBi, none) keeps working past
``max_position_embeddings``, which is what constant-memory decoding is for; the runtime only
warns once there.
"""

from __future__ import annotations

import functools

import torch
import torch.fx

from rnnify.compiler.passes.context import PassContext

_PASS_THROUGH = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten.to.dtype_layout,
    torch.ops.aten.clone.default,
}


def _indexed_by(node: torch.fx.Node, source: torch.fx.Node) -> bool:
    while isinstance(node, torch.fx.Node):
        if node is source:
            return True
        if node.op != "call_function" or node.target not in _PASS_THROUGH:
            return False
        node = node.args[0]
    return False


def find_positions(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    position_ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "position_ids")
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.embedding.default:
            weight, indices = node.args[0], node.args[1]
            if _indexed_by(indices, position_ids) and weight.op == "get_attr":
                table = functools.reduce(getattr, weight.target.split("."), gm)
                ctx.positions = {"kind": "learned", "limit": int(table.shape[0])}
                return gm
    limit = getattr(ctx.config, "max_position_embeddings", None)
    ctx.positions = {"kind": "relative", "limit": int(limit) if limit else None}
    return gm
