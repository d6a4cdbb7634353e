"""Which cell each layer becomes: one target for all layers, or a target per layer range.

    plan = make_plan("hybrid", layers="0-1:exact,4-:linear", keep_softmax=[3], window=64)
    plan.target_for(layer)   # "exact" for 0, 1 and 3, "linear" from 4 on, "hybrid" elsewhere
    plan.options_for(target) # the options that target's cell accepts

Later rules win over earlier ones; ``keep_softmax`` wins over all. Options go to every cell whose
constructor accepts them; an option no chosen cell accepts is an error, not silently dropped.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Iterable

from rnnify.cells import CELLS
from rnnify.errors import RnnifyError

__all__ = ["LayerRule", "ConversionPlan", "make_plan", "parse_layers"]


@dataclass(frozen=True)
class LayerRule:
    """Layers ``start`` .. ``stop`` (inclusive; ``stop=None``: to the last layer) become ``target``."""

    start: int
    stop: int | None
    target: str

    def matches(self, layer: int) -> bool:
        return self.start <= layer and (self.stop is None or layer <= self.stop)

    def __str__(self) -> str:
        if self.stop == self.start:
            return f"{self.start}:{self.target}"
        return f"{self.start}-{'' if self.stop is None else self.stop}:{self.target}"


def _check_target(target: str) -> str:
    if target not in CELLS:
        raise RnnifyError(f"unknown target {target!r}; choose from: {', '.join(CELLS)}")
    return target


def parse_layers(spec: str) -> list[LayerRule]:
    """``"0-1:exact,2-:hybrid"`` -> rules; ranges are inclusive, ``N-`` runs to the last layer."""
    rules = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        where, sep, target = part.partition(":")
        start, dash, stop = where.partition("-")
        try:
            if not sep:
                raise ValueError
            first = int(start)
            last = None if dash and not stop.strip() else int(stop) if dash else first
        except ValueError:
            raise RnnifyError(f"layer spec {part!r}: expected RANGE:TARGET, e.g. '0-1:exact' or '2-:linear'") from None
        if first < 0 or (last is not None and last < first):
            raise RnnifyError(f"layer spec {part!r}: empty or negative layer range")
        rules.append(LayerRule(first, last, _check_target(target.strip())))
    if not rules:
        raise RnnifyError(f"layer spec {spec!r} names no layers")
    return rules


def _accepted(target: str) -> set[str]:
    parameters = inspect.signature(CELLS[target].__init__).parameters
    return {name for name in parameters if name not in ("self", "spec")}


@dataclass
class ConversionPlan:
    default: str
    rules: list[LayerRule] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    def target_for(self, layer: int) -> str:
        target = self.default
        for rule in self.rules:
            if rule.matches(layer):
                target = rule.target
        return target

    def options_for(self, target: str) -> dict[str, Any]:
        accepted = _accepted(target)
        return {k: v for k, v in self.options.items() if k in accepted}

    def check(self, layers: Iterable[int]) -> None:
        """Every rule and option must be used by some layer of the model."""
        layers = sorted(set(layers))
        for rule in self.rules:
            if not any(rule.matches(layer) for layer in layers):
                raise RnnifyError(f"layer rule '{rule}' matches no layer (the model has layers {layers[0]}-{layers[-1]})")
        self.check_options({self.target_for(layer) for layer in layers})

    def check_options(self, targets: set[str]) -> None:
        unused = set(self.options) - set().union(*(_accepted(t) for t in targets))
        if unused:
            raise RnnifyError(
                f"option(s) {', '.join(sorted(unused))} apply to none of the targets used ({', '.join(sorted(targets))})"
            )

    def describe(self) -> str:
        return ",".join([f"*:{self.default}", *map(str, self.rules)])


def make_plan(
    to: str, layers: str | None = None, keep_softmax: Iterable[int] | None = None, **options: Any
) -> ConversionPlan:
    rules = parse_layers(layers) if layers else []
    rules += [LayerRule(int(layer), int(layer), "exact") for layer in keep_softmax or ()]
    plan = ConversionPlan(_check_target(to), rules, options)
    plan.check_options({to, *(rule.target for rule in rules)})  # before any model is loaded
    return plan
