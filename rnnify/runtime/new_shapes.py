"""A loaded step's first call at each new input shape, each graph op bounded by its own growth.

Outside its cells, a step takes every size from its inputs' shapes, the batch B and the tokens T
(``op_vocabulary.check_size_arithmetic``; its states go to its cells alone, ``check_state_flow``):
what an op makes at one shape it makes at every call of that shape. A graph can still make an op
grow as a power of them (a token-long tensor broadcast against itself), small at the load's dry
run and gigabytes at the first long prompt or large batch. So the load runs the step at four shapes
(``PROBES``: B and T each 1 or 2), recording what each fx node's ops make (bytes) and compute
(multiply-adds), and fits each node ``c + b (B - 1) + t (T - 1) + m (B - 1)(T - 1)``: the sizes of
a step whose ops grow with the batch, the tokens and both. The first call at each later shape runs
node by node (``torch.fx.Interpreter``) under a ``SizeGuard`` bounded, for each node, by ``SLACK``
times that fit (coefficients taken positive) plus ``FLOOR``: an op that grows faster is refused in
one line before it allocates, at the first shape where it outgrows its own line. Each node has its
own line, so a large constant op elsewhere raises no other's. The cells run unbounded: they are
rnnify's code, sized by their own options and state. Later calls at a shape seen run as usual,
compiled where they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from rnnify.runtime.head import split_head
from rnnify.runtime.size_guard import SizeGuard

__all__ = ["FLOOR", "PROBES", "SLACK", "NewShapes"]

PROBES = ((1, 1), (1, 2), (2, 1), (2, 2))  # (batch, tokens) of the load's runs
SLACK = 4  # what a node may make at a new shape, times its fitted line
FLOOR = 1 << 20  # and bytes (or multiply-adds) beside it, whatever the fit


class _Nodes(torch.fx.Interpreter):
    """``graph`` of ``module``'s weights run node by node, ``guard`` told which op node runs and,
    with ``bound``, bounded for each. The cells (``call_module`` nodes) run counted in
    ``guard.in_cells`` where it bounds them too (``cells_too``: the load's runs), else outside it."""

    extra_traceback = False  # a refusal is one line; the node is in its words

    def __init__(self, module: nn.Module, graph: torch.fx.Graph, guard: SizeGuard, bound: Any = None):
        super().__init__(module, garbage_collect_values=True, graph=graph)
        self.guard, self.bound = guard, bound

    def run_node(self, n: torch.fx.Node) -> Any:
        guard = self.guard
        guard.node = n.name if n.op == "call_function" else None
        if guard.node is not None and self.bound is not None:
            guard.nbytes, guard.work = self.bound(n.name)
            guard.why = f"node {n.name!r} may at this shape, {SLACK} times its growth at the load's runs"
        if n.op != "call_module":
            return super().run_node(n)
        if not guard.cells_too:
            with _disable_current_modes():
                return super().run_node(n)
        guard.in_cells += 1
        try:
            return super().run_node(n)
        finally:
            guard.in_cells -= 1


class NewShapes:
    """The shapes a loaded step has run at and each node's fitted growth (module docstring).

    Built by the load, which runs ``PROBES`` through ``first_call`` while ``recording`` (its own
    guard, whose records ``fit`` reads)."""

    def __init__(self, recording: SizeGuard):
        self.recording: SizeGuard | None = recording
        self.lines: dict[str, tuple[tuple[int, int, int, int], ...]] = {}
        self.seen: set[tuple] = set()

    def fit(self) -> None:
        """Each node's lines (bytes, work) through what it made and computed at ``PROBES``."""
        for name, made in self.recording.made.items():
            points = [made.get(shape, (0, 0)) for shape in PROBES]
            self.lines[name] = tuple(
                (s11, s21 - s11, s12 - s11, s22 - s21 - s12 + s11)
                for s11, s12, s21, s22 in ([p[i] for p in points] for i in range(2))
            )
        self.recording = None

    def _bound(self, batch: int, tokens: int):
        def bound(name: str) -> tuple[int, ...]:
            # a node no probe ran (none where the load ran the whole graph) gets the floor alone
            lines = self.lines.get(name, ((0, 0, 0, 0),) * 2)
            return tuple(
                SLACK * (abs(c) + abs(b) * (batch - 1) + abs(t) * (tokens - 1) + abs(m) * (batch - 1) * (tokens - 1))
                + FLOOR
                for c, b, t, m in lines
            )

        return bound

    def first_call(self, module: nn.Module, part: str, ids: torch.Tensor, inputs: tuple) -> Any:
        """What ``part`` ("graph", its "body" or "head": ``runtime.head``) of ``module`` computes of
        ``inputs`` (``ids`` the token ids, or the head's hidden states), run node by node where the
        part meets their shape (and the ids' dtype) first: recorded while probing, bounded after;
        None where the shape was seen (the caller runs the part as it always does)."""
        key = (part, tuple(ids.shape), ids.dtype)
        if key in self.seen:
            return None
        graph = module.graph if part == "graph" else split_head(module.graph)[part == "head"]
        if self.recording is not None:
            guard, bound = self.recording, None
            guard.shape = (ids.shape[0], ids.shape[1])
        else:  # the head's rows are tokens of one row
            shape = (1, ids.shape[:-1].numel()) if part == "head" else (ids.shape[0], ids.shape[1])
            guard, bound = SizeGuard(FLOOR, FLOOR, cells_too=False), self._bound(*shape)
        with guard:
            out = _Nodes(module, graph, guard, bound).run(*inputs)
        self.seen.add(key)
        return out
