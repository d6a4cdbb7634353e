"""The choice of ``--to auto``: which kind each kv head gets and which heads stream, what their
state costs, the ``--layers`` rules that build it, and the report of what was chosen."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rnnify.auto.levels import Level, fill, moves, prefix, shortest_prefix
from rnnify.cells import CellSpec
from rnnify.errors import RnnifyError

Head = tuple[int, int]  # (layer, kv head)
Options = Mapping[str, Any] | None  # the streaming hybrids' cell options besides window, sinks and memory


Specs = Mapping[int, CellSpec]  # each attention layer's site (``rnnify.auto.graph_probe.attention_specs``)


def layers_spec(specs: Specs, kinds: Mapping[Head, Level]) -> str | None:
    """``--layers`` rules that give each head in ``kinds`` its kind (the heads not named take the
    ``--to`` target, the streaming one): a layer whose heads all get one kind is that kind whole,
    any other a ``heads(...)`` rule with one group per kind."""
    rules = []
    for layer, spec in specs.items():
        groups: dict[str, list[int]] = {}
        for lay, h in sorted(kinds):
            if lay == layer:
                groups.setdefault(kinds[(lay, h)].text, []).append(h)
        if len(groups) == 1 and len(next(iter(groups.values()))) == spec.num_kv_heads:
            rules.append(f"{layer}:{next(iter(groups))}")
        elif groups:
            parts = [",".join(map(str, heads)) + "=" + text for text, heads in groups.items()]
            rules.append(f"{layer}:heads({';'.join(parts)})")
    return ",".join(rules) or None


def plan_options(
    kinds: Mapping[Head, Level],
    heads: int,
    window: int,
    sinks: int,
    memory: str | None = None,
    memory_options: Options = None,
) -> tuple[str, dict[str, Any]]:
    """The ``--to`` target and options of a choice that gives ``kinds`` to some of the model's
    ``heads`` kv heads: the streaming heads' target (``window``, or ``hybrid`` with ``memory``); when
    none streams, ``exact`` if every kind is, else a window with the sinks (no memory: nothing
    would hold one)."""
    if len(kinds) < heads:
        return streaming_target(window, sinks, memory, memory_options)
    if all(level.target == "exact" for level in kinds.values()):
        return "exact", {}
    return streaming_target(window, sinks)


def streaming_target(
    window: int, sinks: int, memory: str | None = None, memory_options: Options = None
) -> tuple[str, dict[str, Any]]:
    """The target of the heads that stream: a window with sinks, or with ``memory`` a hybrid whose
    memory (gated off at first, unless ``memory_options`` open it: training-free it is that window)
    keeps what leaves the window, with ``memory_options`` its other cell options."""
    if memory is None:
        return "window", {"window": window, "sinks": sinks}
    return "hybrid", {**(memory_options or {}), "window": window, "sinks": sinks, "memory": memory}


def head_costs(
    specs: Specs,
    kinds: Mapping[Head, Level],
    context: int,
    window: int,
    sinks: int,
    dtype: torch.dtype,
    memory: str | None = None,
    memory_options: Options = None,
    sites: Mapping[int, int] | None = None,
) -> int:
    """State bytes per sequence at ``context`` tokens of the attention layers (``specs``; ``sites``: how
    many attention sites each has, one where it does not say) with the heads in ``kinds`` their kind,
    the rest streaming (``streaming_target``): the cells' own ``state_nbytes`` (plus the positions),
    as ``RecurrentModel.state_nbytes`` counts them; a hybrid's own recurrent layers keep their state
    beside it, the same whatever the choice."""
    from rnnify.compiler.plan import make_plan

    heads = sum(s.num_kv_heads for s in specs.values())
    target, options = plan_options(kinds, heads, window, sinks, memory, memory_options)
    plan = make_plan(target, layers_spec(specs, kinds), **options)
    total = sum(
        (sites or {}).get(layer, 1) * plan.cell_for(layer, spec).state_nbytes(context, 1, dtype)
        for layer, spec in specs.items()
    )
    return total + torch.empty((), dtype=torch.long).element_size()


def kv_cache_bytes(specs: Specs, context: int, dtype: torch.dtype, sites: Mapping[int, int] | None = None) -> int:
    """The original's KV cache per sequence at ``context`` tokens: keys and values of every kv head
    of every attention site (``sites`` per layer, as ``head_costs``), of the last ``window`` tokens
    where the layer has a sliding window (of its ``chunk`` where it attends in chunks)."""
    return dtype.itemsize * sum(
        (sites or {}).get(layer, 1) * s.num_kv_heads * (s.head_dim + s.value_dim) * min(context, s.keys_read or context)
        for layer, s in specs.items()
    )


@dataclass
class HeadReport:
    """What ``--to auto`` measured and chose; saved as ``head_map.json`` beside the model."""

    score: str
    window: int
    sinks: int
    retrieval_window: int | None  # --retrieval-window: the one kind's window, or None (exact, or --levels)
    context: int
    budget: int | None
    max_kl: float | None
    retrieval: list[Head]  # the heads that do not stream
    layers: (
        str | None
    )  # the --layers spec that rebuilds the choice (with --to window, or hybrid --memory, --window --sinks)
    scores: dict[str, dict[str, float]]  # score -> "layer.head" -> what the head loses streaming
    head_bytes: dict[str, int]  # one kv head's state at `context` (of a layer without a window of its own,
    # if any): "streaming", each kind, "retrieval" (the costliest)
    state_bytes: int  # the chosen attention layers' state per sequence at `context` (own recurrent layers apart)
    kv_cache_bytes: int  # the original's KV cache at `context`
    calibration_kl: float  # measured with the choice, on the calibration rows
    calibration: dict[str, Any] = field(default_factory=dict)
    memory: str | None = None  # the streaming heads' hybrid memory, or None: they are windows
    memory_options: dict[str, Any] = field(default_factory=dict)  # those hybrids' other cell options
    retrieval_keep: int | None = None  # --retrieval-keep: the one kind's selected tokens, or None
    levels: list[str] = field(default_factory=list)  # the kinds a head could get, cheapest first (--layers text)
    # score -> kind -> "layer.head" -> what the head loses as that kind (measured with --levels)
    level_scores: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # "layer.head" -> its kind, or "streaming"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(json.dumps(self.to_json(), indent=2) + "\n")

    def names(self) -> dict[str, str]:
        """Each kind's text (and ``"streaming"``) -> how the report prints it."""
        streaming = f"{'window' if self.memory is None else 'hybrid'} {self.window}"
        return {"streaming": streaming, **{text: Level.from_text(text).name for text in self.levels}}


def one_head_bytes(
    spec: CellSpec,
    level: Level | None,
    context: int,
    dtype: torch.dtype,
    window: int,
    sinks: int,
    memory: str | None = None,
    memory_options: Options = None,
) -> int:
    """One kv head's state (with its query group) at ``context`` tokens as ``level``, or None:
    streaming (``streaming_target``)."""
    from rnnify.cells import build_cell
    from rnnify.cells.heads import part_spec

    if level is None:
        target, options = streaming_target(window, sinks, memory, memory_options)
    else:
        target, options = level.target, level.cell_options(sinks)
    return build_cell(target, part_spec(spec, [0]), options).state_nbytes(context, 1, dtype)


def choose(
    benefits: Mapping[Head, Sequence[float]],
    levels: Sequence[Level],
    specs: Specs,
    *,
    context: int,
    window: int,
    sinks: int,
    dtype: torch.dtype,
    budget: int | None = None,
    kl_of: Callable[[dict[Head, Level]], float] | None = None,
    max_kl: float | None = None,
    units: list[list[Head]] | None = None,
    memory: str | None = None,
    memory_options: Options = None,
    given: str = "",
    sites: Mapping[int, int] | None = None,
) -> dict[Head, Level]:
    """The kind of each head that does not stream (rnnify.auto.levels: the greedy up each unit's
    ladder). ``benefits[head][i]`` is what ``levels[i]`` gains the head over streaming. ``units``
    (default: each head alone) are chosen whole, e.g. all heads of a layer for a per-layer choice;
    a unit's benefit is the sum of its heads'.

    With ``budget``: the moves by benefit per byte while the state at ``context`` tokens fits; a
    budget below the all-streaming state is an error naming that state. With ``max_kl`` (and
    ``kl_of``, the measured KL of a choice): the shortest prefix of those moves whose KL is at most
    ``max_kl``; if every unit at the top of its ladder misses it too (it cannot when that top is
    exact: the original), an error that names ``given``, the flags that set the kinds. ``sites``: as
    ``head_costs`` counts them."""
    units = units or [[h] for h in sorted(benefits)]

    def kinds_of(rungs: list[int]) -> dict[Head, Level]:
        return {h: levels[rung - 1] for unit, rung in zip(units, rungs) if rung for h in unit}

    def cost(kinds: dict[Head, Level]) -> int:
        return head_costs(specs, kinds, context, window, sinks, dtype, memory, memory_options, sites)

    smallest = cost({})
    ladders = [
        [(0, 0.0)]
        + [
            (cost({h: level for h in unit}) - smallest, sum(benefits[h][i] for h in unit))
            for i, level in enumerate(levels)
        ]
        for unit in units
    ]
    order = moves(ladders)
    if budget is not None:
        if budget < smallest:
            raise RnnifyError(
                f"--state-budget {budget:,} bytes cannot be met at {context:,} tokens: the smallest state "
                f"(every head a {window}-token {'window' if memory is None else memory + ' hybrid'} "
                f"with {sinks} sinks, or its layer's own shorter window or chunk) is {smallest:,} "
                "bytes; give at least that"
            )
        return kinds_of(fill(order, len(units), lambda rungs: cost(kinds_of(rungs)) <= budget))
    if max_kl is None or kl_of is None:
        raise RnnifyError("--to auto needs --state-budget BYTES (with --at-context N) or --max-kl X")
    if kl_of({}) <= max_kl:
        return {}
    top = kinds_of(prefix(order, len(units), len(order)))
    if any(level.target != "exact" for level in top.values()) and (best := kl_of(top)) > max_kl:
        raise RnnifyError(
            f"--max-kl {max_kl:g} cannot be met with {given}: with every head at its best kind the "
            f"calibration KL is {best:.4g}; give longer windows or a higher --max-kl"
        )
    return kinds_of(shortest_prefix(order, len(units), lambda rungs: kl_of(kinds_of(rungs)) <= max_kl))


def parse_bytes(text: str, kv_cache: Callable[[], int]) -> int:
    """``"250000"``, ``"1.5MB"``, ``"2MiB"`` or ``"30%"`` (of the original's KV cache) -> bytes."""
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    clean = text.strip().upper().replace(" ", "")
    try:
        if clean.endswith("%"):
            share = float(clean[:-1])
            value = share / 100 * kv_cache() if math.isfinite(share) and share > 0 else share
        else:
            number = clean.rstrip("KMGIB")
            value = float(number) * units[clean[len(number) :]]
    except (ValueError, KeyError):
        raise RnnifyError(
            f"--state-budget {text!r}: expected bytes, e.g. 2000000, 2MB, 1.5MiB or 30% (of the "
            "original's KV cache at --at-context)"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise RnnifyError(f"--state-budget {text!r} must be a positive size")
    return int(value)
