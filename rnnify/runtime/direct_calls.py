"""The step graph's forward with direct torch calls in place of aten overloads, for eager inference.

An exported graph calls ``torch.ops.aten.mul.Tensor(x, y)``: a Python ``OpOverload.__call__`` and
the boxed dispatcher, which ``torch.mul(x, y)``'s generated binding skips. A decode step of a small
model is mostly such calls (what that saves, measured: docs/performance.md, "Direct calls").

``direct_forward(gm)`` generates gm's forward from a copy of its graph in which each op of
``DIRECT`` calls the torch function with the same schema. It runs against gm itself, its live
modules and (LoRA-parametrised) weights, so nothing is copied and nothing goes stale. The stored
graph keeps its aten ops: saving, the passes, LoRA and ``torch.compile`` see it unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.nn import functional as F

__all__ = ["DIRECT", "direct_forward"]

aten = torch.ops.aten

# aten overload -> the torch function that binds to it with the same arguments, positional and keyword
DIRECT: dict[Any, Callable[..., Any]] = {
    aten.add.Tensor: torch.add,
    aten.sub.Tensor: torch.sub,
    aten.mul.Tensor: torch.mul,
    aten.div.Tensor: torch.div,
    aten.neg.default: torch.neg,
    aten.pow.Tensor_Scalar: torch.pow,
    aten.rsqrt.default: torch.rsqrt,
    aten.cos.default: torch.cos,
    aten.sin.default: torch.sin,
    aten.mean.dim: torch.mean,
    aten.silu.default: F.silu,
    aten.linear.default: F.linear,
    aten.embedding.default: torch.embedding,
    aten.cat.default: torch.cat,
    aten.view.default: torch.Tensor.view,
    aten.reshape.default: torch.reshape,
    aten.transpose.int: torch.transpose,
    aten.unsqueeze.default: torch.unsqueeze,
}


def _direct_target(node: torch.fx.Node) -> Callable[..., Any] | None:
    if node.op != "call_function":
        return None
    if node.target is aten.to.dtype and len(node.args) == 2 and not node.kwargs:
        return torch.Tensor.to  # x.to(dtype): other arguments would be keywords for Tensor.to
    return DIRECT.get(node.target)


def direct_forward(gm: torch.fx.GraphModule, source: torch.fx.Graph | None = None) -> Callable[..., Any]:
    """``forward(gm, *args)``: gm's graph with direct calls; equal to ``gm(*args)``, bar module hooks.

    ``source``, a graph over gm's attributes (``runtime.head``'s parts of gm's graph), runs instead."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph if source is None else source, {}))
    for node in graph.nodes:
        target = _direct_target(node)
        if target is not None:
            node.target = target
    code = graph.python_code(root_module="self")
    namespace = dict(code.globals)
    exec(compile(code.src, f"<rnnify direct calls of {type(gm).__name__}>", "exec"), namespace)  # noqa: S102
    return namespace["forward"]
