"""The choice of ``--to auto``: which heads retrieve and which stream, what their state costs, and
the report of what was chosen."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rnnify.cells import CellSpec
from rnnify.errors import RnnifyError

Head = tuple[int, int]  # (layer, kv head)
Options = Mapping[str, Any] | None  # the streaming hybrids' cell options besides window, sinks and memory


def layer_specs(source: torch.nn.Module) -> list[CellSpec]:
    """The attention shape of each layer, from the model's config (enough for state sizes)."""
    config = source.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None)
    return [
        CellSpec(heads, kv_heads, dim, dim, dim**-0.5, window, config.hidden_size)  # the width: delta memories read x
        for _ in range(config.num_hidden_layers)
    ]


def retrieval_target(retrieval_window: int | None, retrieval_keep: int | None = None) -> str:
    """The target text of a retrieval head: ``exact``; a window of ``retrieval_window`` tokens; or
    with ``retrieval_keep`` a selection cache, that window and ``retrieval_keep`` tokens chosen by
    attention (``cells.select``)."""
    if retrieval_keep is not None:
        return f"select(window={retrieval_window},keep={retrieval_keep})"
    return "exact" if retrieval_window is None else f"window(window={retrieval_window})"


def layers_spec(
    specs: list[CellSpec], retrieval: set[Head], retrieval_window: int | None = None, retrieval_keep: int | None = None
) -> str | None:
    """``--layers`` rules that give the heads in ``retrieval`` their ``retrieval_target`` (the rest
    take the ``window`` target)."""
    rules, target = [], retrieval_target(retrieval_window, retrieval_keep)
    for layer, spec in enumerate(specs):
        heads = sorted(h for lay, h in retrieval if lay == layer)
        if len(heads) == spec.num_kv_heads:
            rules.append(f"{layer}:{target}")
        elif heads:
            rules.append(f"{layer}:heads({','.join(map(str, heads))}={target})")
    return ",".join(rules) or None


def plan_options(
    every_head: bool,
    window: int,
    sinks: int,
    retrieval_window: int | None,
    memory: str | None = None,
    memory_options: Options = None,
) -> tuple[str, dict[str, Any]]:
    """The ``--to`` target and options of a choice: the streaming heads' target (``window``, or
    ``hybrid`` with ``memory``) unless every head is exact."""
    if retrieval_window is None and every_head:
        return "exact", {}
    return streaming_target(window, sinks, memory, memory_options)


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
    specs: list[CellSpec],
    retrieval: set[Head],
    context: int,
    window: int,
    sinks: int,
    dtype: torch.dtype,
    retrieval_window: int | None = None,
    memory: str | None = None,
    memory_options: Options = None,
    retrieval_keep: int | None = None,
) -> int:
    """State bytes per sequence at ``context`` tokens with the heads in ``retrieval`` their
    ``retrieval_target``, the rest streaming (``streaming_target``): the cells' own
    ``state_nbytes`` (plus the positions), as ``RecurrentModel.state_nbytes`` counts."""
    from rnnify.compiler.plan import make_plan

    every_head = len(retrieval) == sum(s.num_kv_heads for s in specs)
    target, options = plan_options(every_head, window, sinks, retrieval_window, memory, memory_options)
    plan = make_plan(target, layers_spec(specs, retrieval, retrieval_window, retrieval_keep), **options)
    total = sum(plan.cell_for(layer, spec).state_nbytes(context, 1, dtype) for layer, spec in enumerate(specs))
    return total + torch.empty((), dtype=torch.long).element_size()


def kv_cache_bytes(specs: list[CellSpec], context: int, dtype: torch.dtype) -> int:
    """The original's KV cache per sequence at ``context`` tokens (keys and values of every kv head)."""
    return sum(s.num_kv_heads * (s.head_dim + s.value_dim) for s in specs) * context * dtype.itemsize


@dataclass
class HeadReport:
    """What ``--to auto`` measured and chose; saved as ``head_map.json`` beside the model."""

    score: str
    window: int
    sinks: int
    retrieval_window: int | None  # the retrieval heads' window, or None: they are exact
    context: int
    budget: int | None
    max_kl: float | None
    retrieval: list[Head]  # the heads chosen: exact, or windowed to retrieval_window
    layers: (
        str | None
    )  # the --layers spec that rebuilds the choice (with --to window, or hybrid --memory, --window --sinks)
    scores: dict[str, dict[str, float]]  # score -> "layer.head" -> value
    head_bytes: dict[str, int]  # "retrieval"/"streaming": one kv head's state at `context`
    state_bytes: int  # the chosen model's state per sequence at `context`
    kv_cache_bytes: int  # the original's KV cache at `context`
    calibration_kl: float  # measured with the choice, on the calibration rows
    calibration: dict[str, Any] = field(default_factory=dict)
    memory: str | None = None  # the streaming heads' hybrid memory, or None: they are windows
    memory_options: dict[str, Any] = field(default_factory=dict)  # those hybrids' other cell options
    retrieval_keep: int | None = None  # tokens the retrieval heads select beyond their window, or None: no selection

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(json.dumps(self.to_json(), indent=2) + "\n")


def one_head_bytes(
    spec: CellSpec,
    window: int | None,
    sinks: int,
    context: int,
    dtype: torch.dtype,
    memory: str | None = None,
    memory_options: Options = None,
    keep: int | None = None,
) -> int:
    """One kv head's state (with its query group) at ``context`` tokens: exact (``window`` None), a
    selection cache of ``window`` tokens and ``keep`` selected, or ``streaming_target``."""
    from rnnify.cells import build_cell
    from rnnify.cells.heads import part_spec

    if keep is not None:
        target, options = "select", {"window": window, "sinks": sinks, "keep": keep}
    elif window is None:
        target, options = "exact", {}
    else:
        target, options = streaming_target(window, sinks, memory, memory_options)
    return build_cell(target, part_spec(spec, 1), options).state_nbytes(context, 1, dtype)


def choose(
    scores: dict[Head, float],
    specs: list[CellSpec],
    *,
    context: int,
    window: int,
    sinks: int,
    dtype: torch.dtype,
    budget: int | None = None,
    kl_of: Callable[[set[Head]], float] | None = None,
    max_kl: float | None = None,
    units: list[list[Head]] | None = None,
    retrieval_window: int | None = None,
    memory: str | None = None,
    memory_options: Options = None,
    retrieval_keep: int | None = None,
) -> set[Head]:
    """The retrieval heads (their ``retrieval_target``: exact, a window of ``retrieval_window``
    tokens, or that window and ``retrieval_keep`` selected tokens); the rest stream. ``units``
    (default: each head alone) are chosen whole, e.g. all heads of a layer for a per-layer choice;
    a unit's score is the sum of its heads'.

    With ``budget``: greedily by score per byte, every unit that still fits; a budget below the
    all-windowed state is an error naming that state. With ``max_kl`` (and ``kl_of``, the measured
    KL of an assignment): the fewest best-scored units whose KL is at most ``max_kl``."""
    units = units or [[h] for h in sorted(scores)]
    unit_score = [sum(scores[h] for h in unit) for unit in units]
    if budget is not None:

        def cost(heads: set[Head]) -> int:
            return head_costs(
                specs, heads, context, window, sinks, dtype, retrieval_window, memory, memory_options, retrieval_keep
            )

        smallest = cost(set())
        if budget < smallest:
            raise RnnifyError(
                f"--state-budget {budget:,} bytes cannot be met at {context:,} tokens: the smallest state "
                f"(every head a {window}-token {'window' if memory is None else memory + ' hybrid'} "
                f"with {sinks} sinks) is {smallest:,} bytes; give at least that"
            )
        extra = [cost(set(u)) - smallest for u in units]
        order = sorted(range(len(units)), key=lambda i: -unit_score[i] / max(extra[i], 1))
        chosen: set[Head] = set()
        for i in order:
            if cost(chosen | set(units[i])) <= budget:
                chosen |= set(units[i])
        return chosen
    if max_kl is None or kl_of is None:
        raise RnnifyError("--to auto needs --state-budget BYTES (with --at-context N) or --max-kl X")
    order = sorted(range(len(units)), key=lambda i: -unit_score[i])

    def first(k: int) -> set[Head]:
        return {h for i in order[:k] for h in units[i]}

    low, high = 0, len(units)  # KL(first(high)) <= max_kl: every head exact is the original
    if kl_of(first(0)) <= max_kl:
        return set()
    if retrieval_window is not None and (best := kl_of(first(high))) > max_kl:
        cells = f"--retrieval-window {retrieval_window}" + (
            f" --retrieval-keep {retrieval_keep}" if retrieval_keep else ""
        )
        raise RnnifyError(
            f"--max-kl {max_kl:g} cannot be met with {cells}: with every head a retrieval head the "
            f"calibration KL is {best:.4g}; give a longer window or a higher --max-kl"
        )
    while high - low > 1:
        middle = (low + high) // 2
        if kl_of(first(middle)) <= max_kl:
            high = middle
        else:
            low = middle
    return first(high)


def parse_bytes(text: str, kv_cache: Callable[[], int]) -> int:
    """``"250000"``, ``"1.5MB"``, ``"2MiB"`` or ``"30%"`` (of the original's KV cache) -> bytes."""
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    clean = text.strip().upper().replace(" ", "")
    try:
        if clean.endswith("%"):
            return int(float(clean[:-1]) / 100 * kv_cache())
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
