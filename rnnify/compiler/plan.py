"""Which cell each layer becomes: one target for all layers, a target per layer range, or a
target per group of kv heads.

    plan = make_plan("hybrid", layers="0-1:exact,4-:linear,2:heads(0=exact)", keep_softmax=[3], window=64)
    plan.target_for(layer)   # "exact" for 0, 1 and 3, "linear" from 4 on, "heads" for 2, "hybrid" elsewhere
    plan.options_for(target) # the options that target's cell accepts
    plan.cell_for(layer, spec)  # the cell itself; layer 2's kv head 0 is exact, its others hybrid

A rule's target may carry options of its own, ``TARGET(KEY=VALUE,...)``, over the plan's:
``"0-:heads(1=window(window=1024);*=window)"`` with ``window=64`` gives kv head 1 of every layer a
1,024-token window and the others 64 tokens. ``RANGE:heads(HEADS=TARGET;...)`` splits a layer's kv heads (with their query heads) into groups,
each its own cell (``rnnify.cells.heads``): ``HEADS`` is a comma list of kv heads and ranges
(``0,2-3``) or ``*`` (the heads not named); heads not named, without ``*``, take the ``--to``
target. Later rules win over earlier ones; ``keep_softmax`` wins over all. Options go to every cell
whose constructor accepts them; an option no chosen cell accepts is an error, not silently dropped.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from rnnify.cells import CELLS, Cell, CellSpec, build_cell
from rnnify.cells.heads import TARGET as HEADS
from rnnify.cells.registry import check_target
from rnnify.errors import RnnifyError

__all__ = ["LayerRule", "ConversionPlan", "make_plan", "parse_layers", "parse_options"]


Options = tuple[tuple[str, Any], ...]  # a rule's own cell options, as sorted (key, value) pairs
# a head group: its kv heads (None: those no other group names), their target and its own options
HeadGroup = tuple[tuple[int, ...] | None, str, Options]


@dataclass(frozen=True)
class LayerRule:
    """Layers ``start`` .. ``stop`` (inclusive; ``stop=None``: to the last layer) become ``target``
    with ``options`` over the plan's; for target ``"heads"``, ``heads`` gives each group of kv heads
    its own target and options."""

    start: int
    stop: int | None
    target: str
    heads: tuple[HeadGroup, ...] | None = None
    options: Options = ()

    def matches(self, layer: int) -> bool:
        return self.start <= layer and (self.stop is None or layer <= self.stop)

    @property
    def targets(self) -> set[str]:
        """The cell targets this rule uses."""
        return {target for _, target, _ in self.heads} if self.heads else {self.target}

    def __str__(self) -> str:
        target = _target_text(self.target, self.options)
        if self.heads is not None:
            target = f"{HEADS}(" + ";".join(f"{_heads_text(kv)}={_target_text(t, o)}" for kv, t, o in self.heads) + ")"
        if self.stop == self.start:
            return f"{self.start}:{target}"
        return f"{self.start}-{'' if self.stop is None else self.stop}:{target}"


def _heads_text(kv: tuple[int, ...] | None) -> str:
    return "*" if kv is None else ",".join(map(str, kv))


def _target_text(target: str, options: Options) -> str:
    return target + (f"({','.join(f'{k}={json.dumps(v)}' for k, v in options)})" if options else "")


def _parse_target(text: str, where: str) -> tuple[str, Options]:
    """``"window(window=1024,sinks=4)"`` -> ("window", (("sinks", 4), ("window", 1024))); values are
    JSON where they parse as JSON, else text."""
    name, paren, rest = text.strip().partition("(")
    target = check_target(name.strip())
    if not paren:
        return target, ()
    if not rest.endswith(")"):
        raise RnnifyError(f"{where}: expected {target}(KEY=VALUE,...), e.g. 'window(window=1024)'")
    options = parse_options(
        filter(None, (p.strip() for p in rest[:-1].split(","))),
        lambda pair: f"{where}: option {pair!r} of {target}: expected KEY=VALUE, e.g. 'window(window=1024)'",
    )
    unknown = sorted(set(options) - _accepted(target))
    if unknown:
        raise RnnifyError(
            f"{where}: {target} takes no option {', '.join(unknown)}; it takes: "
            f"{', '.join(sorted(_accepted(target))) or 'none'}"
        )
    return target, tuple(sorted(options.items()))


def parse_options(pairs: Iterable[str], bad: Callable[[str], str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs -> options; values are JSON when they parse as JSON (numbers, true, lists),
    else text. A pair that is not ``KEY=VALUE`` is an error with the message ``bad(pair)``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise RnnifyError(bad(pair))
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value.strip()
    return options


def _split_outside_parentheses(text: str, sep: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if char == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


_HEADS_EXAMPLE = "e.g. '0-:heads(0,2=exact;*=window)'"


def _parse_head_list(text: str, where: str) -> tuple[int, ...] | None:
    if text == "*":
        return None
    heads: list[int] = []
    try:
        for item in text.split(","):
            first, dash, last = item.partition("-")
            heads += range(int(first), int(last) + 1) if dash else [int(first)]
    except ValueError:
        raise RnnifyError(
            f"{where}: kv heads {text!r} must be numbers, ranges (2-3) or '*', {_HEADS_EXAMPLE}"
        ) from None
    if not heads or min(heads) < 0:
        raise RnnifyError(f"{where}: kv heads {text!r} name no head")
    return tuple(heads)


def _parse_heads(text: str, where: str) -> tuple[HeadGroup, ...]:
    """``"0,2=exact;*=window(window=8)"`` -> ((0, 2), "exact", ()), (None, "window", (("window", 8),))."""
    groups: list[HeadGroup] = []
    for item in filter(None, (i.strip() for i in text.split(";"))):
        heads, sep, target = item.partition("=")
        if not sep:
            raise RnnifyError(f"{where}: expected HEADS=TARGET entries separated by ';', {_HEADS_EXAMPLE}")
        groups.append((_parse_head_list(heads.replace(" ", ""), where), *_parse_target(target, where)))
    named = [h for kv, _, _ in groups if kv is not None for h in kv]
    if not groups:
        raise RnnifyError(f"{where}: names no head group, {_HEADS_EXAMPLE}")
    if len(set(named)) != len(named) or sum(kv is None for kv, _, _ in groups) > 1:
        raise RnnifyError(f"{where}: a kv head (or '*') is named twice")
    return tuple(groups)


def parse_layers(spec: str) -> list[LayerRule]:
    """``"0-1:exact,2-:hybrid(window=128),3:heads(0=exact;*=window)"`` -> rules; ranges are
    inclusive, ``N-`` runs to the last layer."""
    rules = []
    for part in filter(None, (p.strip() for p in _split_outside_parentheses(spec, ","))):
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
        target = target.strip()
        if target.startswith(f"{HEADS}(") and target.endswith(")"):
            rules.append(
                LayerRule(first, last, HEADS, _parse_heads(target[len(HEADS) + 1 : -1], f"layer spec {part!r}"))
            )
        elif target.startswith(HEADS):
            raise RnnifyError(f"layer spec {part!r}: expected {HEADS}(HEADS=TARGET;...), {_HEADS_EXAMPLE}")
        else:
            name, options = _parse_target(target, f"layer spec {part!r}")
            rules.append(LayerRule(first, last, name, options=options))
    if not rules:
        raise RnnifyError(f"layer spec {spec!r} names no layers")
    return rules


def _parameters(target: str) -> Mapping[str, inspect.Parameter]:
    """The options ``target``'s cell takes, with their defaults."""
    return _init_parameters(CELLS[target])


@functools.cache
def _init_parameters(cls: type[Cell]) -> Mapping[str, inspect.Parameter]:
    """Read once per cell class: ``--to auto``'s probe asks for every head of every pass."""
    parameters = inspect.signature(cls.__init__).parameters
    return MappingProxyType({name: p for name, p in parameters.items() if name not in ("self", "spec")})


def _accepted(target: str) -> set[str]:
    return set(_parameters(target))


def within_own_window(own_window: int | None, target: str, options: dict[str, Any]) -> bool:
    """Whether ``target`` with ``options`` reads further back than the layer's own sliding window
    ``own_window`` (its window, or its constructor's default, no shorter; sinks or selected and
    remembered tokens besides): keys the original never reads, where the original's own window is a
    constant state already. A ``window`` of exactly the layer's own and no sinks is the original itself."""
    parameters = _parameters(target)
    if own_window is None or target == "exact" or "window" not in parameters:
        return False
    window = options.get("window", parameters["window"].default)
    window = own_window if window is None else window
    if isinstance(window, bool) or not isinstance(window, int):
        return False  # the cell refuses it, in its own words
    return window > own_window or (window == own_window and (target != "window" or bool(options.get("sinks"))))


@dataclass
class ConversionPlan:
    default: str
    rules: list[LayerRule] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    keep_softmax: tuple[int, ...] = ()  # the layers its last rules keep exact, as the user named them

    def rule_for(self, layer: int) -> LayerRule | None:
        """The rule that decides ``layer`` (the last that matches), or None: the default target."""
        return next((rule for rule in reversed(self.rules) if rule.matches(layer)), None)

    def target_for(self, layer: int) -> str:
        rule = self.rule_for(layer)
        return self.default if rule is None else rule.target

    def cell_for(self, layer: int, spec: CellSpec) -> Cell:
        """The cell of ``layer``'s attention, whose shape is ``spec``. A chunked layer (Llama 4's) that
        no rule names is ``exact`` whatever the default target: its state is bounded by the chunk,
        and only ``exact`` computes a chunk (a rule naming another target is refused by the cell).
        Heads whose target would read further back than the layer's own sliding window
        (``within_own_window``) get that window instead, as ``window`` without sinks: the original."""
        if self.rule_for(layer) is None and spec.chunk is not None:
            return build_cell("exact", spec, self.options_for("exact"))
        groups = self._groups(layer, spec)
        parts = [(kv, *self._faithful(spec, target, options)) for kv, target, options in groups]
        if len(parts) == 1 or all(within_own_window(spec.window, target, options) for _, target, options in groups):
            return build_cell(parts[0][1], spec, parts[0][2])  # one kind for every head: the plain cell
        return build_cell(
            HEADS,
            spec,
            {"groups": [{"kv_heads": kv, "target": target, "options": options} for kv, target, options in parts]},
        )

    def keeps_own_window(self, layer: int, spec: CellSpec) -> bool:
        """Whether ``cell_for`` gives some of ``layer``'s heads their own sliding window in place of
        the target the plan names for them."""
        if self.rule_for(layer) is None and spec.chunk is not None:
            return False
        return any(within_own_window(spec.window, target, options) for _, target, options in self._groups(layer, spec))

    def _groups(self, layer: int, spec: CellSpec) -> list[tuple[list[int] | None, str, dict[str, Any]]]:
        """``(kv heads, target, options)`` of each group of ``layer``'s heads (None: all of them)."""
        rule = self.rule_for(layer)
        if rule is None or rule.heads is None:
            target = self.target_for(layer)
            return [(None, target, self.options_for(target, rule.options if rule else ()))]
        groups = self.head_groups(rule, spec.num_kv_heads, layer)
        return [(kv, target, self.options_for(target, options)) for kv, target, options in groups]

    def _faithful(self, spec: CellSpec, target: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """``(target, options)``, or the layer's own window where ``within_own_window``."""
        if within_own_window(spec.window, target, options):
            return "window", {**self.options_for("window"), "window": spec.window, "sinks": 0}
        return target, options

    def head_groups(self, rule: LayerRule, num_kv_heads: int, layer: int) -> list[tuple[list[int], str, Options]]:
        """``rule``'s groups for a layer of ``num_kv_heads`` kv heads: ``*`` (or, without it, the
        default target) takes the heads no group names."""
        named = {h for kv, _, _ in rule.heads if kv is not None for h in kv}
        if max(named, default=-1) >= num_kv_heads:
            raise RnnifyError(f"layer rule '{rule}': layer {layer} has kv heads 0-{num_kv_heads - 1}, not {max(named)}")
        rest = [h for h in range(num_kv_heads) if h not in named]
        groups = [(list(kv) if kv is not None else rest, target, options) for kv, target, options in rule.heads]
        if not any(kv is None for kv, _, _ in rule.heads):
            groups.append((rest, self.default, ()))
        return [group for group in groups if group[0]]

    def options_for(self, target: str, own: Options = ()) -> dict[str, Any]:
        """The plan's options that ``target`` accepts, with a rule's ``own`` over them."""
        accepted = _accepted(target)
        return {**{k: v for k, v in self.options.items() if k in accepted}, **dict(own)}

    def check(self, kv_heads: Mapping[int, int], chunked: Iterable[int] = (), depth: int | None = None) -> None:
        """Every rule and option must be used by some head of the model, whose attention layers have
        ``kv_heads[layer]`` kv heads each (``chunked`` layers that no rule names are exact:
        ``cell_for``), and no rule's range may run past its ``depth`` decoder layers (where known; a
        hybrid's last layers need not be attention)."""
        layers, chunked = sorted(kv_heads), set(chunked)
        for layer in self.keep_softmax:
            if layer not in layers:
                shown = ", ".join(map(str, layers)) if len(layers) <= 8 else f"{layers[0]}-{layers[-1]}"
                raise RnnifyError(
                    f"keep_softmax (--keep-softmax) {layer}: layer {layer} computes no attention (the model's "
                    f"attention layers: {shown})"
                )
        for rule in self.rules:
            if not any(rule.matches(layer) for layer in layers):
                raise RnnifyError(
                    f"layer rule '{rule}' matches no layer (the model has layers {layers[0]}-{layers[-1]})"
                )
            if depth is not None and rule.stop is not None and rule.stop >= depth:  # written for another model
                raise RnnifyError(
                    f"layer rule '{rule}' runs to layer {rule.stop}, past the model's last layer {depth - 1}; "
                    f"'{replace(rule, stop=None)}' runs to the last layer"
                )
        used: set[str] = set()
        for layer in layers:
            rule = self.rule_for(layer)
            if rule is None:
                used.add("exact" if layer in chunked else self.default)
            elif rule.heads is None:
                used.add(rule.target)
            else:  # the default takes the heads a rule without '*' does not name, if any are left
                used |= {target for _, target, _ in self.head_groups(rule, kv_heads[layer], layer)}
        self.check_options(used)

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
    kept = tuple(int(layer) for layer in keep_softmax or ())
    rules += [LayerRule(layer, layer, "exact") for layer in kept]
    plan = ConversionPlan(check_target(to), rules, options, kept)
    plan.check_options({to}.union(*(rule.targets for rule in rules)))  # before any model is loaded
    return plan
