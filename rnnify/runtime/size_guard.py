"""Bounding the tensors a directory's graph makes while it runs, before each op allocates them.

A graph names only allowed ops (``op_vocabulary``), but ops that make tensors take their sizes from
the graph's constants: one ``zeros([5e8])`` node is a few bytes of ``graph.json`` and 2 GB at the
load's dry run, and an ``expand`` of a weight to a billion rows costs nothing until a reduction
reads every row, for hours. ``SizeGuard`` runs each op first on the meta device (shapes only, no
data) and refuses one that reads or makes a tensor of more elements than its budget: the
directory's weights, with room to spare, are what a step of one token touches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SizeGuard"]


def _on_meta(value: Any) -> Any:
    """``value`` with every tensor as a meta tensor of its shape and strides (lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(item) for item in value)
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


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
    """Refuse (``ValueError``) an op whose inputs or outputs, as shapes, hold more than ``budget``
    elements, before it runs; views count every element they show (an expanded row once per row)."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget = budget

    def _check(self, func: Any, values: Any, what: str) -> None:
        for value in _tensors(values):
            if value.numel() > self.budget:
                raise ValueError(
                    f"{func} {what} a tensor of {value.numel():,} elements, more than a step of its "
                    f"weights needs ({self.budget:,})"
                )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._check(func, (args, kwargs), "reads")
        meta_kwargs = {k: _on_meta(v) for k, v in kwargs.items()}
        if any(argument.name == "device" for argument in func._schema.arguments):  # a factory: on meta too
            meta_kwargs["device"] = torch.device("meta")
        try:
            shapes = func(*_on_meta(args), **meta_kwargs)
        except (NotImplementedError, RuntimeError):  # no meta form, or one that reads data: checked after
            shapes = None
        if shapes is not None:
            self._check(func, shapes, "makes")
        out = func(*args, **kwargs)
        self._check(func, out, "made")
        return out
