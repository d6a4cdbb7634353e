"""Where the bytes of a ``linear`` weight lie: a language-model head column-major on a CPU.

A decode step reads every weight once, so its time is mostly how fast each ``linear(x, W)``
streams ``W`` ([out, in]) for a few rows of ``x``. On a CPU, torch's float32 ``linear`` streams a
tall matrix such as a head over the vocabulary (50,257 x 768 for GPT-2, 49,152 x 576 for SmolLM2)
up to twice as fast at batch 1 when it is stored as the transpose of an [in, out] matrix
(strides (1, out), "column-major") than row-major, as checkpoints hold it. A height that is a
multiple of a power of two (49,152) then makes batches of 4 and more slower, which a few columns
of padding (strides (1, out + pad)) undo. The projections inside layers, about as tall as wide,
show no steady gain either way, and bfloat16 is several times slower column-major; so only float32
weights on a CPU at least ``TALL`` times taller than wide move (``benchmarks/weight_layout.py``
measures both layouts). Only strides change: values, shapes and names stay, saving writes
row-major bytes as before, and tied weights stay one tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce

import torch

__all__ = ["TALL", "lay_out_linear_weights", "laid_out", "linear_weight_names"]


TALL = 8  # a float32 weight this many times taller than wide (a head) is stored column-major on a CPU
_ALIGN = 16  # its columns lie a multiple of 16 floats, plus 16, apart


def _wants_column_major(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.shape[0] >= TALL * tensor.shape[1]


def _column_major(tensor: torch.Tensor) -> bool:
    return tensor.stride()[0] == 1 and tensor.stride()[1] >= tensor.shape[0]


def _padded_column_major(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values, its columns ``-(-out // 16) * 16 + 16`` floats apart."""
    out, width = tensor.shape
    columns = tensor.new_empty(width, -(-out // _ALIGN) * _ALIGN + _ALIGN)
    columns[:, :out] = tensor.t()
    return columns[:, :out].t()


def laid_out(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (2-D) in the layout its shape, device and dtype read fastest: itself if it already is."""
    if _wants_column_major(weight):
        return weight if _column_major(weight) else _padded_column_major(weight)
    return weight.contiguous()


def linear_weight_names(graph: torch.fx.GraphModule) -> list[str]:
    """The names of the weights the graph's ``aten.linear`` calls read, each once, in graph order."""
    return list(
        dict.fromkeys(
            node.args[1].target
            for node in graph.graph.nodes
            if node.op == "call_function"
            and node.target is torch.ops.aten.linear.default
            and isinstance(node.args[1], torch.fx.Node)
            and node.args[1].op == "get_attr"
        )
    )


def lay_out_linear_weights(
    graph: torch.fx.GraphModule, layout: Callable[[torch.Tensor], torch.Tensor] = laid_out
) -> int:
    """Re-store every 2-D weight the graph's ``aten.linear`` calls read as ``layout`` gives it
    (default ``laid_out``, the module docstring's; ``torch.Tensor.contiguous``: row-major, as
    checkpoints hold them); returns how many tensors moved. Every name a tensor is known by (a tied
    embedding and head) gets the same new tensor, so ties survive."""
    relaid: dict[tuple, torch.Tensor] = {}  # (where the old tensor lies, its shape) -> its replacement
    for name in linear_weight_names(graph):
        tensor = reduce(getattr, name.split("."), graph)
        key = (tensor.data_ptr(), tensor.shape)
        if tensor.dim() != 2 or key in relaid:
            continue
        data = layout(tensor.detach())
        if data.data_ptr() != tensor.data_ptr():
            relaid[key] = data
    for module in graph.modules() if relaid else ():
        for param in module.parameters(recurse=False):
            if (param.data_ptr(), param.shape) in relaid:
                param.data = relaid[param.data_ptr(), param.shape]
        for name, buffer in module.named_buffers(recurse=False):
            if (buffer.data_ptr(), buffer.shape) in relaid:
                setattr(module, name, relaid[buffer.data_ptr(), buffer.shape])
    return len(relaid)
