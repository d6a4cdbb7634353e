"""Targets per kv head inside one attention site: retrieval heads keep softmax, the rest stream.

The math: docs/math.md §Retrieval and streaming heads.

Attention heads differ more than layers do: a few "retrieval" heads read tokens far back, most
("streaming" heads) attend to the first tokens and a recent window. ``HeadSplitCell`` gives each
group of kv heads, with the query heads that share them (GQA: query head h reads kv head
``h // (num_heads / num_kv_heads)``), its own cell of any target and its own state, and puts the
outputs back in head order. Heads are independent in attention, so the split computes exactly
what the parts would compute inside one cell each: with every group ``exact`` it is the original
attention. The score terms a model adds (``CellSpec.score_terms``) travel with the heads: each
part's spec holds the ALiBi slopes and sink logits of its own query heads, and the layer's softcap;
a part whose target cannot compute them refuses, naming that target.

The state is the parts' states one after the other (``p<i>_<name>``); its size is their sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from rnnify.cells.base import PER_QUERY_TERMS, Cell, CellSpec
from rnnify.cells.registry import build_target_cell

TARGET = "heads"


def query_heads(spec: CellSpec, kv_heads: Sequence[int]) -> list[int]:
    """The query heads that read ``kv_heads`` (GQA: head h reads kv head ``h // group_size``), in the order
    a part holds them."""
    return [h * spec.group_size + g for h in kv_heads for g in range(spec.group_size)]


def part_spec(spec: CellSpec, kv_heads: Sequence[int]) -> CellSpec:
    """The spec of a part that holds ``kv_heads`` and their query groups, with those query heads' score
    terms (per-head ALiBi slopes and sink logits; the softcap is the layer's)."""
    heads = query_heads(spec, kv_heads)

    def of_heads(values: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return None if values is None else tuple(values[h] for h in heads)

    return dataclasses.replace(
        spec,
        num_heads=len(heads),
        num_kv_heads=len(kv_heads),
        alibi_slopes=of_heads(spec.alibi_slopes),
        sink_logits=of_heads(spec.sink_logits),
    )


def _check_groups(groups: list[dict[str, Any]], num_kv_heads: int) -> list[list[int]]:
    if not isinstance(groups, list) or len(groups) < 1:
        raise ValueError("groups must be a non-empty list of {kv_heads, target, options}")
    heads = [list(g.get("kv_heads", [])) for g in groups]
    named = sorted(h for hs in heads for h in hs)
    if any(not hs for hs in heads) or named != list(range(num_kv_heads)):
        raise ValueError(
            f"groups must split kv heads 0-{num_kv_heads - 1} so each is in exactly one group, got {heads}"
        )
    return heads


class HeadSplitCell(Cell):
    """Each group of kv heads (with its query heads) runs its own cell: e.g. a few exact, the rest windowed."""

    target = TARGET

    def __init__(self, spec: CellSpec, groups: list[dict[str, Any]]):
        heads = _check_groups(groups, spec.num_kv_heads)
        parts = []
        for kv, group in zip(heads, groups):
            if group.get("target") == TARGET:
                raise ValueError("a head group cannot itself be split by heads")
            parts.append(build_target_cell(group["target"], part_spec(spec, kv), group.get("options") or {}))
        # the split computes the terms its parts compute (each part has refused, by its target's name,
        # a term its target cannot compute): set before Cell's own check of the spec reads it. Not what
        # queries bring (a relative bias, sink logits): inputs no part is handed.
        self.score_terms = frozenset.intersection(*(part.score_terms for part in parts)) - PER_QUERY_TERMS
        self.computes_chunks = all(part.computes_chunks for part in parts)
        super().__init__(spec)
        self.parts = torch.nn.ModuleList(parts)
        self.kv_heads = heads
        q_heads = [query_heads(spec, kv) for kv in heads]
        order = torch.tensor([h for hs in q_heads for h in hs]).argsort()
        for i, (kv, q) in enumerate(zip(heads, q_heads)):  # not saved: rebuilt from the options
            self.register_buffer(f"kv_index_{i}", torch.tensor(kv), persistent=False)
            self.register_buffer(f"q_index_{i}", torch.tensor(q), persistent=False)
        self.register_buffer("order", order, persistent=False)
        self.state_names = tuple(f"p{i}_{name}" for i, part in enumerate(parts) for name in part.state_names)
        self.grows_with_context = any(part.grows_with_context for part in parts)
        self.uses_query = any(part.uses_query for part in parts)
        self.calibrates = any(part.calibrates for part in parts)
        self.needs_input = any(part.needs_input for part in parts)

    @property
    def exact(self) -> bool:
        return all(part.exact for part in self.parts)

    @property
    def exact_span(self) -> int | None:
        spans = [part.exact_span for part in self.parts if not part.exact]
        return None if not spans or None in spans else min(spans)

    def overwrites_state(self, x: torch.Tensor) -> bool:
        return any(part.overwrites_state(x) for part in self.parts)

    def options(self) -> dict[str, Any]:
        return {
            "groups": [
                {"kv_heads": kv, "target": part.target, "options": part.options()}
                for kv, part in zip(self.kv_heads, self.parts)
            ]
        }

    def _indices(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"q_index_{i}"), getattr(self, f"kv_index_{i}")

    def init_state(self, batch_size, device, dtype):
        return tuple(t for part in self.parts for t in part.init_state(batch_size, device, dtype))

    def state_nbytes(self, length, batch_size=1, dtype=torch.float32):
        return sum(part.state_nbytes(length, batch_size, dtype) for part in self.parts)

    def forward(self, q, k, v, mask, *state, x=None):
        outs, new_state, start = [], [], 0
        for i, part in enumerate(self.parts):
            q_index, kv_index = self._indices(i)
            count = len(part.state_names)
            kwargs = {"x": x} if part.needs_input else {}
            out, *part_state = part(
                q.index_select(1, q_index),
                k.index_select(1, kv_index),
                v.index_select(1, kv_index),
                mask,
                *state[start : start + count],
                **kwargs,
            )
            outs.append(out)
            new_state += part_state
            start += count
        return torch.cat(outs, dim=1).index_select(1, self.order), *new_state

    def fused_ops(self) -> dict[str, str]:
        return _merge([part.fused_ops() for part in self.parts])

    def use_kernels(self, kernels: str) -> dict[str, str]:
        ops = _merge([part.use_kernels(kernels) for part in self.parts])
        self.kernels = kernels if ops else None
        return ops

    def calibrate(self, q, mask=None):
        for i, part in enumerate(self.parts):
            if part.calibrates:
                part.calibrate(q.index_select(1, self._indices(i)[0]), mask)
        return self

    def describe(self) -> str:
        return "; ".join(
            f"kv {','.join(map(str, kv))}: {_summary(part)}" for kv, part in zip(self.kv_heads, self.parts)
        )

    def extra_repr(self) -> str:
        return ", ".join(f"kv {kv}: {part.target}" for kv, part in zip(self.kv_heads, self.parts))


_SHOWN = ("window", "sinks", "feature_map", "gate", "memory")  # the options worth a word in `rnnify info`


def _summary(part: Cell) -> str:
    options = part.options()
    shown = [f"{k}={options[k]}" for k in _SHOWN if options.get(k) not in (None, 0)]
    return part.target + (f" ({', '.join(shown)})" if shown else "")


def _merge(ops: list[dict[str, str]]) -> dict[str, str]:
    """The parts' fused ops per phase, each named once (``a+b`` where parts differ)."""
    merged: dict[str, list[str]] = {}
    for part_ops in ops:
        for phase, op in part_ops.items():
            merged.setdefault(phase, [])
            if op not in merged[phase]:
                merged[phase].append(op)
    return {phase: "+".join(names) for phase, names in merged.items()}
