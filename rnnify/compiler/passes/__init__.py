"""The pass pipeline: small functions ``(gm, ctx) -> gm`` run in the order of ``PIPELINE``.

Each pass reads what earlier passes recorded in ``node.meta`` (``find_attention`` decides,
``rewrite_attention``, ``thread_state`` and ``fuse_kernels`` act on the decision;
``rewrite_convolutions``, ``rewrite_scans`` and ``rewrite_token_shifts`` add the cells of a model's
own short convolutions, scans and token shifts), and
``run_pipeline`` cleans up after every pass so none of them has to remember dead-code
elimination, lint and recompile.
"""

from __future__ import annotations

from typing import Callable

import torch.fx

from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.find_attention import AttentionSite, find_attention
from rnnify.compiler.passes.find_positions import find_positions
from rnnify.compiler.passes.fuse_kernels import fuse_kernels
from rnnify.compiler.passes.rewrite_attention import rewrite_attention
from rnnify.compiler.passes.rewrite_convolutions import rewrite_convolutions
from rnnify.compiler.passes.rewrite_scans import rewrite_scans
from rnnify.compiler.passes.rewrite_token_shifts import rewrite_token_shifts
from rnnify.compiler.passes.strip_export_checks import strip_export_checks
from rnnify.compiler.passes.thread_state import thread_state

__all__ = ["PIPELINE", "PassContext", "AttentionSite", "run_pipeline", "cleanup"]

Pass = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]

PIPELINE: list[Pass] = [
    strip_export_checks,
    find_positions,
    find_attention,
    rewrite_attention,
    rewrite_convolutions,
    rewrite_scans,
    rewrite_token_shifts,
    thread_state,
    fuse_kernels,
]


def cleanup(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Dead-code elimination, unused-attribute removal, lint and recompile."""
    gm.graph.eliminate_dead_code()
    used = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    modules = tuple(node.target + "." for node in gm.graph.nodes if node.op == "call_module")
    tensors = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, _ in tensors:
        if name not in used and not name.startswith(modules):
            parent, _, leaf = name.rpartition(".")
            owner = gm.get_submodule(parent) if parent else gm
            delattr(owner, leaf)
    gm.graph.lint()
    gm.recompile()
    return gm


def run_pipeline(
    gm: torch.fx.GraphModule, ctx: PassContext, passes: list[Pass] | None = None, progress=None
) -> torch.fx.GraphModule:
    """Run ``passes`` (default: ``PIPELINE``) in order; ``progress(name)`` is called before each."""
    for pass_ in PIPELINE if passes is None else passes:
        if progress is not None:
            progress(pass_.__name__)
        gm = cleanup(pass_(gm, ctx))
    return gm
