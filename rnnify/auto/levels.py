"""The kinds ``--to auto`` may give a kv head (``--levels``), and the choice among them.

Each head (or, with ``--per-layer``, each layer's heads together: a unit) has a ladder: the
streaming target at the bottom, then the kinds listed, ordered by the state they hold at
``--at-context`` tokens. Each rung has its extra bytes over the bottom and its benefit over it
(what the head loses at the bottom minus what it loses there, by the chosen score). Choosing one
rung per unit under a byte budget is the multiple-choice knapsack problem; its classic greedy
(Sinha & Zoltners 1979) walks each ladder's upper convex hull from the bottom: the moves up the
hulls, sorted by marginal benefit per marginal byte, are taken in that order while the state fits.
Along one hull those ratios fall, so a unit's moves come in ladder order; a move that no longer
fits is skipped with the rest of its unit's. Taken as a prefix, the moves are the optimum of the
problem's linear relaxation, so the greedy is optimal whenever the budget ends at a move (and
never further below the optimum than one move's benefit). With ``--max-kl`` the same moves, in the
same order, are taken as the shortest prefix whose measured KL fits (a bisection on its length).

The hull keeps the moves of benefit >= 0 only: past the rung of highest benefit (ties: the
costlier) nothing is gained. Moves of zero benefit are taken last, while bytes remain, as a head
whose score is zero was kept exact by the one-kind choice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rnnify.choices import AUTO_KINDS
from rnnify.errors import RnnifyError

LEVEL_EXAMPLE = "e.g. 'window(window=1024),select(window=512,keep=512),exact'"
KEPT_KINDS = ("select", "lola")  # kinds that keep chosen older tokens beside their window
Move = tuple[int, int, int]  # (unit, from rung, to rung)


@dataclass(frozen=True)
class Level:
    """One kind a head may get: ``exact``, ``window`` (``window=N``), ``select`` (``window=N,
    keep=K`` and the select cell's other options) or ``lola`` (the same, and a memory of the tokens
    it does not keep: ``feature_map=...``); the sinks are always ``--sinks``."""

    target: str
    options: tuple[tuple[str, Any], ...] = ()  # in the order given, for the text

    @property
    def text(self) -> str:
        """The target as ``--layers`` writes it, e.g. ``select(window=512,keep=512)``."""
        if not self.options:
            return self.target
        return f"{self.target}({','.join(f'{k}={json.dumps(v)}' for k, v in self.options)})"

    @property
    def window(self) -> int | None:
        """Recent tokens kept; None: every token (exact)."""
        return dict(self.options).get("window")

    @property
    def keep(self) -> int:
        """Older tokens selected besides the window (0: none)."""
        return dict(self.options).get("keep", 0)

    @property
    def name(self) -> str:
        """How the report prints it: ``exact``, ``window 1024``, ``window 512 + 512 selected`` or
        ``window 512 + 512 kept + memory``."""
        if self.target == "exact":
            return "exact"
        kept = {"select": f" + {self.keep} selected", "lola": f" + {self.keep} kept + memory"}
        return f"window {self.window}" + kept.get(self.target, "")

    @classmethod
    def from_text(cls, text: str, where: str = "kind") -> Level:
        """``"select(window=512,keep=512)"`` -> that kind (values read as JSON where they parse);
        a kind that is not exact, window, select or lola, or text that is not ``NAME(KEY=VALUE,...)``, is
        an error that starts with ``where``."""
        from rnnify.compiler.plan import parse_options

        name, paren, rest = text.strip().partition("(")
        name = name.strip()
        if name not in AUTO_KINDS:
            raise RnnifyError(
                f"{where}: {text.strip()!r} is not a kind; a kind is exact, window(window=N), "
                f"select(window=N,keep=K) or lola(window=N,keep=K), {LEVEL_EXAMPLE}"
            )
        if paren and not rest.endswith(")"):
            raise RnnifyError(f"{where}: expected {name}(KEY=VALUE,...), {LEVEL_EXAMPLE}")
        pairs = [p.strip() for p in rest[:-1].split(",") if p.strip()] if paren else []
        options = parse_options(pairs, lambda pair: f"{where}: option {pair!r} of {name}: expected KEY=VALUE")
        return cls(name, tuple(options.items()))

    def cell_options(self, sinks: int) -> dict[str, Any]:
        """The options of this kind's cell with ``sinks`` sinks (none for ``exact``)."""
        return {} if self.target == "exact" else {"sinks": sinks, **dict(self.options)}


def retrieval_level(retrieval_window: int | None, retrieval_keep: int | None = None) -> Level:
    """The one kind of ``--retrieval-window`` / ``--retrieval-keep``: ``exact``, a window of
    ``retrieval_window`` tokens, or with ``retrieval_keep`` a selection cache."""
    if retrieval_keep is not None:
        return Level("select", (("window", retrieval_window), ("keep", retrieval_keep)))
    return Level("exact") if retrieval_window is None else Level("window", (("window", retrieval_window),))


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def parse_levels(text: str, window: int) -> list[Level]:
    """``--levels`` text -> its kinds, in the order given; ``window`` is the streaming heads' window,
    which a ``window`` kind must exceed. Any mistake is one ``RnnifyError`` line."""
    from rnnify.cells import CellSpec, build_cell

    def bad(why: str) -> RnnifyError:
        return RnnifyError(f"--levels {text!r}: {why}")

    levels: list[Level] = []
    for part in _split_top_level(text):
        level = Level.from_text(part, f"--levels {text!r}")
        options = dict(level.options)
        if "sinks" in options:
            raise bad("every kind keeps the --sinks sinks: give them there, not as an option")
        if "kv_dtype" in options:
            raise bad("--to auto scores and counts its kinds in the model's dtype: a kind takes no kv_dtype")
        if level.target == "exact" and options:
            raise bad(f"exact takes no options, got {', '.join(options)}")
        if level.target == "window" and set(options) != {"window"}:
            raise bad("a window kind takes one option, its length: window(window=N)")
        if level.target in KEPT_KINDS and not {"window", "keep"} <= set(options):
            raise bad(
                f"a {level.target} kind needs its window and the tokens it keeps: {level.target}(window=N,keep=K)"
            )
        if level.target != "exact":
            try:  # the values, on a stand-in head
                build_cell(level.target, CellSpec(2, 1, 8, 8, 8**-0.5), level.cell_options(0))
            except RnnifyError as exc:
                raise bad(str(exc)) from None
        if level.target == "window" and level.window <= window:
            raise bad(f"window(window={level.window}) is not longer than the streaming heads' {window}-token window")
        if level in levels:
            raise bad(f"{level.text} is listed twice")
        levels.append(level)
    return levels


def hull(ladder: Sequence[tuple[float, float]]) -> list[int]:
    """The rungs of ``ladder`` (per rung: extra bytes, benefit; rung 0 the bottom at (0, 0)) along
    its upper convex hull from the bottom, bottom left out: from each rung on, the rung of highest
    benefit per byte above it (ties: the nearer), while that is >= 0. Bytes count at least 1, so a
    rung no costlier than the last is taken by its benefit alone."""
    order = sorted(range(1, len(ladder)), key=lambda r: ladder[r][0])
    path, at, start = [], 0, 0
    while start < len(order):
        best = max(range(start, len(order)), key=lambda i: (_slope(ladder, at, order[i]), -i))
        if _slope(ladder, at, order[best]) < 0:
            break
        path.append(at := order[best])
        start = best + 1
    return path


def _slope(ladder: Sequence[tuple[float, float]], low: int, high: int) -> float:
    return (ladder[high][1] - ladder[low][1]) / max(ladder[high][0] - ladder[low][0], 1)


def moves(ladders: Sequence[Sequence[tuple[float, float]]]) -> list[Move]:
    """Every unit's moves up its ``hull``, by benefit per byte, highest first (ties: unit order,
    then ladder order)."""
    steps = []
    for unit, ladder in enumerate(ladders):
        low = 0
        for high in hull(ladder):
            steps.append((unit, low, high))
            low = high
    return sorted(steps, key=lambda m: -_slope(ladders[m[0]], m[1], m[2]))


def fill(order: Sequence[Move], units: int, fits: Callable[[list[int]], bool]) -> list[int]:
    """The rung per unit: each move of ``order`` taken when its unit stands where it starts and the
    rungs with it taken still ``fits``."""
    rungs = [0] * units
    for unit, low, high in order:
        if rungs[unit] == low:
            trial = [*rungs[:unit], high, *rungs[unit + 1 :]]
            if fits(trial):
                rungs = trial
    return rungs


def prefix(order: Sequence[Move], units: int, count: int) -> list[int]:
    """The rung per unit after the first ``count`` moves of ``order``."""
    rungs = [0] * units
    for unit, _, high in order[:count]:
        rungs[unit] = high
    return rungs


def shortest_prefix(order: Sequence[Move], units: int, fits: Callable[[list[int]], bool]) -> list[int]:
    """The rungs of the shortest prefix of ``order`` that ``fits``, by bisection on its length: no
    move is known not to fit, every move is assumed to."""
    low, high = 0, len(order)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(prefix(order, units, middle)):
            high = middle
        else:
            low = middle
    return prefix(order, units, high)
