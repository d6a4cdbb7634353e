"""Remove the runtime checks torch.export leaves in the graph.

They pin dtype and device (``_assert_tensor_metadata``) and the range of dynamic sizes
(``_assert_scalar``: length >= 2 would forbid single-token steps). The recurrent graph is
called with other lengths on purpose, and its own runtime checks its inputs.
"""

from __future__ import annotations

import torch
import torch.fx

from rnnify.compiler.passes.context import PassContext

_CHECKS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten._assert_async.msg,
}


def strip_export_checks(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _CHECKS and not node.users:
            gm.graph.erase_node(node)
    return gm
