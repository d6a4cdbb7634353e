"""Switch every cell that has a fused form to the ``rnnify.kernels`` ops, with ``ctx.kernels``.

The graph calls a cell as one ``call_module`` node for prompts (T > 1) and single tokens (T == 1)
alike, and a graph cannot branch on T, so the op each phase runs is the cell's choice
(``Cell.fused_ops``), and fusing is switching the cell (``Cell.use_kernels``): feature map,
gates and layout stay the cell's own code, the scan and the normaliser become the op's. This pass
does that for every cell call and records on its node which op each phase runs
(``node.meta["rnnify_kernels"]``, e.g. ``{"prefill": "chunk_linear_attn", "decode":
"fused_recurrent_linear_attn"}``; absent for cells without a fused form, such as ``exact``).

It runs last in ``PIPELINE``, once ``rewrite_attention`` has built the cells and the graph is final.
graph.json never holds a kernel op: the manifest records the backend and each cell's ops, and
``rnnify.load`` switches the rebuilt cells again (``RecurrentModel.use_kernels``), so the backend
can be chosen anew at load.
"""

from __future__ import annotations

import torch
import torch.fx

from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.rewrite_attention import cell_calls
from rnnify.kernels.utils import check_kernels

KERNELS_KEY = "rnnify_kernels"


def fuse_kernels(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    check_kernels(ctx.kernels)
    for call in cell_calls(gm):
        ops = gm.get_submodule(call.target).use_kernels(ctx.kernels)
        if ops:
            call.meta[KERNELS_KEY] = ops
        else:
            call.meta.pop(KERNELS_KEY, None)
    return gm
