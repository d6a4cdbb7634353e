"""Bounding the tensors and the work a directory's graph asks for while it runs, before each op runs.

A graph names only allowed ops (``op_vocabulary``), but ops that make tensors take their sizes from
the graph's constants: one ``zeros([5e8])`` node is a few bytes of ``graph.json`` and 2 GB at the
load's dry run, an ``expand`` of a weight to a billion rows costs nothing until a reduction reads
every row, and a product of two such tensors runs for minutes. ``SizeGuard`` refuses an op that
reads or makes a tensor of more bytes than its budget, or a product of more multiply-adds than its
budget of work (the directory's weights, with room to spare, are what a step of one token touches
and computes), running each op that could make more than it reads first on the meta device (shapes
only, no data), so that it is refused before it allocates or computes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SizeGuard"]

aten = torch.ops.aten
# arguments by which an op of one tensor makes more than that tensor holds
_SIZING = frozenset({"size", "sizes", "repeats", "bins"})
# products, with the position of their first matrix: its last dimension is the one contracted
_PRODUCTS = {
    aten.mm.default: 0,
    aten.bmm.default: 0,
    aten.matmul.default: 0,
    aten.linear.default: 0,
    aten.addmm.default: 1,
    aten.baddbmm.default: 1,
}


@functools.lru_cache(maxsize=None)
def _may_grow(func: Any) -> bool:
    """Whether ``func`` can make more elements than its largest input holds, by its schema: it reads
    several tensors (a broadcast, a product, a concatenation), none (a factory), or takes a size.
    One tensor and no size (``unsqueeze``, ``to``, ``slice``, ``exp``, ``mean``) cannot."""
    arguments = func._schema.arguments
    tensors = [a for a in arguments if "Tensor" in str(a.type)]
    return len(tensors) != 1 or str(tensors[0].type) != "Tensor" or any(a.name in _SIZING for a in arguments)


def _on_meta(value: Any) -> Any:
    """``value`` with every tensor as a meta tensor of its shape and strides (lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(item) for item in value)
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def _as_long(index: Any) -> Any:
    """A boolean mask as the long indices it could select at most (one per dimension it covers,
    each as long as the mask), whose result shape the meta device can tell without the mask's data."""
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
        return [torch.empty(index.numel(), dtype=torch.long, device="meta")] * max(index.dim(), 1)
    return [_on_meta(index)]


def _meta_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on meta tensors (a factory made on the meta device); None where it has no meta form."""
    args, kwargs = list(_on_meta(args)), {k: _on_meta(v) for k, v in kwargs.items()}
    positional = [a.name for a in func._schema.arguments if not a.kwarg_only]
    if "device" in positional and positional.index("device") < len(args):
        args[positional.index("device")] = torch.device("meta")
    elif any(a.name == "device" for a in func._schema.arguments):
        kwargs["device"] = torch.device("meta")
    if func is aten.index.Tensor:  # a mask's result depends on its data: bounded by every place it covers
        args[1] = [piece for index in args[1] for piece in _as_long(index)]
    try:
        return func(*args, **kwargs)
    except (NotImplementedError, RuntimeError):  # no meta form, or one that reads data: checked after
        return None


def _tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class SizeGuard(TorchDispatchMode):
    """Refuse (``ValueError``) an op whose inputs or outputs, as shapes, hold more than ``nbytes``
    bytes, or a product of more than ``work`` multiply-adds, before it runs where the meta device can
    size it; views count every element they show (an expanded row once per row)."""

    def __init__(self, nbytes: int, work: int):
        super().__init__()
        self.nbytes, self.work = nbytes, work

    def _check(self, func: Any, values: Any, what: str) -> None:
        for value in _tensors(values):
            if value.numel() * value.element_size() > self.nbytes:
                raise ValueError(
                    f"{func} {what} a tensor of {value.numel() * value.element_size():,} bytes, more than a "
                    f"step of its weights needs ({self.nbytes:,})"
                )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._check(func, (args, kwargs), "reads")
        if _may_grow(func):
            shapes = _meta_call(func, args, kwargs)
            self._check(func, shapes, "makes")
            if func in _PRODUCTS and isinstance(shapes, torch.Tensor):
                work = shapes.numel() * args[_PRODUCTS[func]].shape[-1]
                if work > self.work:
                    raise ValueError(
                        f"{func} computes {work:,} multiply-adds, more than a step of its weights needs ({self.work:,})"
                    )
        out = func(*args, **kwargs)
        self._check(func, out, "made")
        return out
