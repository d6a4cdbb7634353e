"""Bounding the tensors and the work a directory's graph asks for while it runs, before each op runs.

A graph names only allowed ops (``op_vocabulary``), but ops that make tensors take their sizes from
the graph's constants: one ``zeros([5e8])`` node is a few bytes of ``graph.json`` and 2 GB at the
load's dry run, an ``expand`` of a weight to a billion rows costs nothing until a reduction reads
every row, and a product of two such tensors runs for minutes. ``SizeGuard`` refuses an op that
reads or makes a tensor of more bytes than its budget, or a product of more multiply-adds than its
budget of work (the directory's weights, with room to spare, are what a step of one token touches
and computes), running each op that could make more than it reads first on the meta device (shapes
only, no data), so that it is refused before it allocates or computes.

A step's sizes come from its inputs' shapes (``op_vocabulary.check_size_arithmetic``), except where
they come from the data it reads: a tensor split where values read from a tensor say (a mixture of
experts' routing), or indexed by a mask. The load's dry run cannot bound those for later
tokens, so a step that has them runs every time under a guard (``guard_for``), with the budget of
one token times the tokens it reads. The others' sizes follow their input shapes alone: the first
call at each shape runs under the bounds of ``new_shapes``, each graph node's own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rnnify.errors import RnnifyError, first_line

__all__ = ["SizeError", "SizeGuard", "StepFailed", "check_step", "data_shaped", "guard_for", "running"]

aten = torch.ops.aten
# index dtypes that ``aten.index`` takes as masks (uint8 with a warning): what they select follows their data
MASKS = (torch.bool, torch.uint8)
# ops that take masks among their indices (``index_put_`` finds a mask's places as ``index`` does)
_MASKED = frozenset({aten.index.Tensor, aten.index_put_.default})
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
    """Whether ``func`` can make more bytes than its largest input holds, by its schema: it reads
    several tensors (a broadcast, a product, a concatenation), none (a factory), takes a size, or a
    dtype (a bool tensor made complex128 holds 16 times its bytes), or returns several (``sort``'s
    int64 indices are 8 times a bool's). One tensor and neither (``unsqueeze``, ``slice``, ``exp``)
    cannot, but for a float from an integer (4 times a bool's)."""
    return not _one_to_one(func) or any(a.name == "dtype" for a in func._schema.arguments)


@functools.lru_cache(maxsize=None)
def _one_to_one(func: Any) -> bool:
    """Whether ``func`` reads one tensor, returns at most one and takes no size, by its schema."""
    arguments = func._schema.arguments
    tensors = [a for a in arguments if "Tensor" in str(a.type)]
    sized = any(a.name in _SIZING for a in arguments)
    return len(tensors) == 1 and str(tensors[0].type) == "Tensor" and not sized and len(func._schema.returns) <= 1


def _broadcast_copies(func: Any, args: tuple) -> list[torch.Tensor]:
    """The operands ``matmul`` copies out to its broadcast batch shape before it multiplies, as meta
    tensors: no input or output shows them, and ``[N, 1, 1, K] @ [1, N, K, 1]`` copies N * N * K
    elements of each for an output of N * N. A second operand of one or two dimensions is folded
    into the first's rows instead: no copy."""
    if func is not aten.matmul.default or args[1].dim() < 3:
        return []
    a, b = args
    rows = a.shape[-2:] if a.dim() >= 2 else (1, *a.shape)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return [
        torch.empty((*batch, *matrix), dtype=t.dtype, device="meta") for t, matrix in ((a, rows), (b, b.shape[-2:]))
    ]


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
    """A mask as the long indices it could select at most (one per dimension it covers,
    each as long as the mask), whose result shape the meta device can tell without the mask's data."""
    if isinstance(index, torch.Tensor) and index.dtype in MASKS:
        return [torch.empty(index.numel(), dtype=torch.long, device="meta")] * max(index.dim(), 1)
    return [_on_meta(index)]


# ops whose result a few shape rules give, much faster than their meta forms (``_result``): the
# broadcast of their tensors in the promoted dtype (a true division would make integers float)
_BROADCASTS = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.where.self})


def _result(func: Any, args: tuple, kwargs: dict) -> Any:
    """What ``func`` makes, as a meta tensor of its shape and dtype: by ``_BROADCASTS``' rule, a
    linear map's or a cast's; None for a reduction of floats in their dtype (no larger than what it
    reads: checked after); else ``_meta_call``'s."""
    if func in _BROADCASTS and not kwargs and all(isinstance(a, (torch.Tensor, int, float)) for a in args):
        shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, torch.Tensor)))
        dtype = torch.result_type(*(args[1:] if func is aten.where.self else args))
        return torch.empty(shape, dtype=dtype, device="meta")
    if func is aten.linear.default and not kwargs and args[0].dim() >= 1 and args[1].dim() == 2:
        shape = (*args[0].shape[:-1], args[1].shape[0])
        return torch.empty(shape, dtype=torch.result_type(args[0], args[1]), device="meta")
    if func is aten.to.dtype and not kwargs and len(args) >= 2 and isinstance(args[1], torch.dtype):
        return torch.empty(args[0].shape, dtype=args[1], device="meta")
    place = _dtype_place(func)
    given = kwargs.get("dtype", args[place] if place is not None and place < len(args) else None)
    if place is not None and given is None and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        return None
    return _meta_call(func, args, kwargs)


@functools.lru_cache(maxsize=None)
def _dtype_place(func: Any) -> int | None:
    """Where ``func`` takes the dtype that alone lets it make more than it reads (a reduction's
    ``dtype``: ``_one_to_one``), as a position; None for other ops."""
    if not _one_to_one(func):
        return None
    return next((i for i, a in enumerate(func._schema.arguments) if a.name == "dtype"), None)


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


class StepFailed(RnnifyError):
    """A loaded directory's step failed on an input its load's dry run passed; the error it raised
    is its ``__cause__``."""


class SizeError(ValueError):
    """An op asked for more than its budget; raised before it ran, where the meta device could tell."""


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
    """Refuse (``SizeError``) an op whose inputs or outputs, as shapes, hold more than ``nbytes``
    bytes, or a product of more than ``work`` multiply-adds, before it runs where the meta device can
    size it; views count every element they show (an expanded row once per row).

    ``why`` names the bound in a refusal. Where a caller runs a graph node by node it sets ``node``
    (None for anything but a call of an op, a cell's included) and ``shape``: what each node's ops
    make and compute outside the cells is then recorded, summed per node and shape (``made``);
    ``cells_too`` False leaves what the cells do, and what any op reads, unbounded."""

    def __init__(self, nbytes: int, work: int, why: str = "a step of its weights needs", cells_too: bool = True):
        super().__init__()
        self.nbytes, self.work, self.why, self.cells_too = nbytes, work, why, cells_too
        self.in_cells = 0  # cells are rnnify's code: a mask they index with is theirs (set by ``new_shapes``)
        self.masked = False  # whether an op outside the cells indexed with a mask (``MASKS``)
        self.node: str | None = None
        self.shape: tuple[int, int] | None = None
        self.made: dict[str, dict[tuple[int, int], tuple[int, int]]] = {}

    def _record(self, values: Any = (), work: int = 0) -> None:
        """Add what an op made (or copies first) and computed to its node's sums at this shape: a
        sum grows with the tokens wherever one of its terms does, however small beside the rest."""
        if self.node is not None and not self.in_cells:
            shapes = self.made.setdefault(self.node, {})
            nbytes, old_work = shapes.get(self.shape, (0, 0))
            nbytes += sum(value.numel() * value.element_size() for value in _tensors(values))
            shapes[self.shape] = (nbytes, old_work + work)

    def _check(self, func: Any, values: Any, what: str) -> None:
        for value in _tensors(values):
            nbytes = value.numel() * value.element_size()
            if nbytes > self.nbytes:
                raise SizeError(f"{func} {what} a tensor of {nbytes:,} bytes, more than {self.why} ({self.nbytes:,})")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_cells and not self.cells_too:
            return func(*args, **kwargs)
        if self.cells_too:
            self._check(func, (args, kwargs), "reads")
        if func in _MASKED:
            masks = [i for i in args[1] if isinstance(i, torch.Tensor) and i.dtype in MASKS]
            self.masked |= bool(masks) and not self.in_cells
            for mask in masks:  # the op finds the places a mask selects first: a long index per dimension
                places = torch.empty(mask.numel(), mask.dim(), dtype=torch.long, device="meta")
                self._check(func, places, "makes")
                self._record(places)
        if _may_grow(func):
            shapes, copies = _result(func, args, kwargs), _broadcast_copies(func, args)
            self._check(func, (shapes, copies), "makes")
            self._record(copies)
            if func in _PRODUCTS and isinstance(shapes, torch.Tensor):
                work = shapes.numel() * args[_PRODUCTS[func]].shape[-1]
                self._record(work=work)
                if work > self.work:
                    raise SizeError(f"{func} computes {work:,} multiply-adds, more than {self.why} ({self.work:,})")
        out = func(*args, **kwargs)
        self._check(func, out, "made")
        self._record(out)
        return out


def data_shaped(graph: torch.fx.Graph, guard: SizeGuard) -> bool:
    """Whether ``graph``'s sizes depend on values it reads: a number read from a tensor (``item``), or
    a mask (``MASKS``) its ops indexed with in the load's runs under ``guard``."""
    return guard.masked or any(n.op == "call_function" and n.target is aten.item.default for n in graph.nodes)


def guard_for(budget: tuple[int, int] | None, tokens: int, where: str) -> contextlib.AbstractContextManager:
    """The guard of a step (or head) over ``tokens`` tokens whose one-token ``budget`` is (bytes,
    work), an op past it one ``RnnifyError`` line naming ``where``; nothing without a budget."""
    return contextlib.nullcontext() if budget is None else _guarded(budget[0] * tokens, budget[1] * tokens, where)


@contextlib.contextmanager
def _guarded(nbytes: int, work: int, where: str) -> Iterator[None]:
    try:
        with SizeGuard(nbytes, work):
            yield
    except SizeError as exc:
        raise RnnifyError(f"{where}: its step was stopped: {exc}") from exc


@contextlib.contextmanager
def running(model: Any, tokens: int) -> Iterator[None]:
    """A step (or head) of ``tokens`` tokens of ``model`` (a ``RecurrentModel``): where its sizes
    follow data, under ``guard_for`` its ``guard_budget``; a refusal by ``new_shapes``' bounds is one
    line too. Where the model was loaded from a directory (``growth`` set), a failure on an input
    its load's runs passed (a table read by position, shapes that stop agreeing) is one
    ``StepFailed`` line naming the directory, the error chained; a model built in this process
    keeps the traceback of what is then a bug, and running out of memory is the batch's."""
    where, budget, loaded = str(model.path or "the model"), model.guard_budget, model.growth is not None
    try:
        with guard_for(budget, tokens, where):
            yield
    except SizeError as exc:  # (``new_shapes``' bounds)
        raise RnnifyError(f"{where}: its step was stopped: {first_line(exc)}") from exc
    except (RuntimeError, IndexError, ValueError) as exc:
        if not loaded or isinstance(exc, torch.OutOfMemoryError):  # (the batch, not the directory)
            raise
        raise StepFailed(f"{where}: its step failed: {first_line(exc, with_type=True)}") from exc


def check_step(where: str, input_ids: torch.Tensor, out: Any, old: tuple, new: tuple, growth: int) -> None:
    """Refuse a step of a loaded directory that returned other rows than the tokens it read, or grew
    its state more than ``growth`` bytes a token (a cache's keys and values): a graph that widens what
    a cell appends (its mask, its keys) would grow the cache by gigabytes a token, from a load that
    passed, and a body's hidden states of a length it chose would size the head's guard."""
    if isinstance(out, torch.Tensor) and out.shape[:2] != input_ids.shape:  # (distillation's steps return more)
        raise RnnifyError(f"{where}: its step returned {tuple(out.shape)} for {tuple(input_ids.shape)} tokens")
    added = sum(t.numel() * t.element_size() for t in new) - sum(t.numel() * t.element_size() for t in old)
    if added > growth * input_ids.numel():
        raise RnnifyError(
            f"{where}: its step grew the state by {added:,} bytes for {input_ids.numel()} tokens, where its "
            f"cells add {growth:,} a token"
        )
