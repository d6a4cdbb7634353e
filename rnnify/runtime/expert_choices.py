"""Which experts a mixture of experts routes each token to, recorded while a model runs.

In half precision an exact conversion rounds as its original does wherever the two run the same
ops, and otherwise (an original that keeps its attention scores in float32 around its own eager
attention) only close to it. Where a router's top experts score within that rounding of each other,
the two route a token to different experts, and that token and every later one then differ by far
more than the tolerance: the draw of tokens met a tie, not a conversion that computes something
else. ``routed_apart`` finds the first token the two route otherwise and says whether the router's
scores there differ by rounding alone (each by less than the dtype's tolerance of their size, and
far enough for the two experts to have crossed: at least half the margin between them);
``check_against_original`` then draws other tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ExpertChoices", "expert_sizes", "first_difference", "routed_apart"]

_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_sizes(config: Any) -> set[int]:
    """How many experts a router of ``config`` (a text config) picks from, and how many groups of them
    where it picks groups first; empty for a model without routed experts."""
    for name in _EXPERT_COUNTS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            groups = getattr(config, "n_group", None)
            return {value, groups} if isinstance(groups, int) and groups > 1 else {value}
    return set()


class _Recorder(TorchDispatchMode):
    """Appends (scores, chosen) of each top-k over a [tokens, experts or groups] matrix to ``calls``:
    a router's choice (a top-k within each group of experts is over three dimensions)."""

    def __init__(self, sizes: set[int], calls: list):
        super().__init__()
        self.sizes, self.calls = sizes, calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.topk.default and _over_each_token(args, kwargs or {}, self.sizes):
            self.calls.append((args[0].detach().float(), out[1]))
        return out


def _over_each_token(args: tuple, kwargs: dict, sizes: set[int]) -> bool:
    """Whether a top-k call picks from each row of a [tokens, experts or groups] matrix (its last dim)."""
    scores = args[0]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    return scores.dim() == 2 and dim in (-1, 1) and scores.shape[-1] in sizes


class ExpertChoices:
    """Every ``aten.topk`` over ``sizes`` entries, pass by pass (each a forward over some tokens)."""

    def __init__(self, sizes: set[int]):
        self.sizes, self.passes = sizes, []

    @contextlib.contextmanager
    def one_pass(self) -> Iterator[None]:
        calls: list = []
        with _Recorder(self.sizes, calls):
            yield
        self.passes.append(calls)

    def choices(
        self, rows: int = 1, row: int = 0, skip: int = 0
    ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """(the pass's n-th top-k, token) -> (scores, chosen indices), for ``row`` of ``rows``, its
        tokens counted from the first pass's ``skip``-th (a left-padded row's first real token)."""
        out, first = {}, -skip
        for calls in self.passes:
            tokens = 0
            for n, (scores, chosen) in enumerate(calls):
                scores = scores.reshape(rows, -1, scores.shape[-1])[row]
                chosen = chosen.reshape(rows, -1, chosen.shape[-1])[row]
                tokens = scores.shape[0]
                for token in range(max(0, -first), tokens):
                    out[n, first + token] = scores[token], chosen[token]
            first += tokens
        return out


def first_difference(got: dict, want: dict, limit: float) -> dict | None:
    """The first token (then its first router choice) that ``got`` and ``want`` (``ExpertChoices.choices``)
    route to different experts: ``token``, ``call`` (the n-th top-k of a pass), ``margin`` (between
    ``want``'s lowest chosen and next score), ``moved`` (how far ``got``'s scores are from ``want``'s)
    and ``rounding``: the two scores can have crossed by moving that far (``margin <= 2 moved``), and
    no score moved by more than ``limit`` of their size. None where every choice agrees or the two
    record different choices (not one router read alike)."""
    if got.keys() != want.keys():
        return None
    for n, token in sorted(want, key=lambda key: (key[1], key[0])):
        (scores, chosen), (scores_want, chosen_want) = got[n, token], want[n, token]
        if set(chosen.tolist()) == set(chosen_want.tolist()):
            continue
        ranked = scores_want.sort(descending=True).values
        k = chosen_want.shape[-1]
        margin = float(ranked[k - 1] - ranked[k]) if k < ranked.shape[0] else float("inf")
        moved = float((scores - scores_want).abs().max())
        rounding = margin <= 2 * moved and moved <= limit * float(scores_want.abs().max())
        return {"token": token, "call": n, "margin": margin, "moved": moved, "rounding": rounding}
    return None


def routed_apart(
    run: Callable[[ExpertChoices], Any], reference: Callable[[ExpertChoices], Any], sizes: set[int], limit: float
) -> dict | None:
    """``first_difference`` of ``run`` and ``reference``, each a forward of one row through
    ``ExpertChoices.one_pass`` (or several, a prompt and then steps)."""
    got, want = ExpertChoices(sizes), ExpertChoices(sizes)
    run(got)
    reference(want)
    return first_difference(got.choices(), want.choices(), limit)
