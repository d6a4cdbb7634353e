"""When torch.export will not keep the length dynamic: the lengths its graph holds for, or one line why not.

Declared dynamic over a range, the length fails export ("Constraints violated") whenever the trace
adds a guard export cannot prove over the whole range. Some such guards are facts about the model:
a length the forward turns into a Python number (CPM-Ant's ``range(seqlen)``), a limit past which a
slice comes up short. Others are only what export's reasoning cannot simplify: ``min(2048, T) <= T``,
``T * min(64, 64 * T) == 64 * T``, a contiguity test on a slice of ``T - 1`` tokens (``T - 1 != 1``),
``T >= 4`` from unfolding a left-padded window. Exported with the length left to export
(``Dim.AUTO``), it returns the graph with the guards it assumed, and ``check_lengths`` judges them: it
runs the guards over a range of lengths (on meta tensors, which compute nothing). A graph whose guards
hold at every length tried holds for every length. Lengths shorter than the example that a guard
refuses are run through the graph and compared with the source, since such a guard may also be a
branch the source takes differently there; a longer length refused is a limit nothing checks past,
and the model is refused with the guard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rnnify.errors import UnsupportedModelError
from rnnify.runtime.agreement import relative_difference, tolerance

__all__ = ["agreement", "check_lengths", "probed_lengths", "refused_lengths"]

_BATCHES = (1, 2)  # batch sizes the guards are run at; the batch is declared dynamic and export keeps it so


def probed_lengths(max_length: int) -> list[int]:
    """Every length up to 64, then each power of two from 128 and its neighbours, up to ``max_length``."""
    lengths = set(range(2, 65))
    for power in range(7, max_length.bit_length() + 1):
        lengths.update((2**power - 1, 2**power, 2**power + 1))
    return sorted(length for length in lengths if length <= max_length)


def refused_lengths(guards: torch.nn.Module, lengths: list[int]) -> dict[int, str]:
    """{length: the guard's message} for each of ``lengths`` at which ``guards`` (an exported module's
    ``_guards_fn``, called with ``(input_ids, position_ids)``) fail for some batch size."""
    refused = {}
    for length in lengths:
        for batch in _BATCHES:
            tokens = torch.empty(batch, length, dtype=torch.long, device="meta")
            try:
                guards(tokens, tokens)
            except AssertionError as exc:  # GuardsFn's way of saying no
                refused[length] = str(exc).removeprefix("Guard failed: ").strip()
                break
    return refused


def check_lengths(
    name: str,
    refused: dict[int, str],
    probed: list[int],
    example_length: int,
    agrees_at: Callable[[int], bool],
) -> None:
    """Raise ``UnsupportedModelError`` unless the graph holds for every length of ``probed`` its guards
    ``refused`` (module docstring): those shorter than ``example_length`` are checked with ``agrees_at``."""
    longer = sorted(length for length in refused if length > example_length)
    if longer and set(probed) - {example_length} <= set(refused):
        guards = ", ".join(f"`{guard}`" for guard in dict.fromkeys(refused[length] for length in sorted(refused)))
        raise UnsupportedModelError(
            f"{name}: its forward pass makes the sequence length a constant: torch.export's graph holds at "
            f"{example_length} tokens alone (it keeps {guards}), so no captured graph computes other lengths"
        )
    if longer:
        raise UnsupportedModelError(
            f"{name}: torch.export captures its forward pass only for some lengths: at {longer[0]} tokens "
            f"its graph fails the guard `{refused[longer[0]]}`"
        )
    for length in sorted(refused):
        if not agrees_at(length):
            raise UnsupportedModelError(
                f"{name}: torch.export captures its forward pass only from {max(refused) + 1} tokens on, and "
                f"at {length} tokens (refused by the guard `{refused[length]}`) the graph differs from the model"
            )


def agreement(graph: torch.fx.GraphModule, source: torch.nn.Module, vocab: int, device: torch.device):
    """``agrees_at(length)``: whether ``graph`` and ``source`` (both ``(input_ids, position_ids) ->
    logits``) give the same logits on random tokens of that length, within ``tolerance``."""

    @torch.no_grad()
    def agrees_at(length: int) -> bool:
        generator = torch.Generator().manual_seed(length)
        input_ids = torch.randint(0, vocab, (_BATCHES[-1], length), generator=generator).to(device)
        position_ids = torch.arange(length, device=device).expand(_BATCHES[-1], -1)
        want = source(input_ids, position_ids)
        try:
            (got,) = graph(input_ids, position_ids)
        except Exception:  # noqa: BLE001  (a graph that cannot run at this length does not hold for it)
            return False
        return relative_difference(got, want) <= tolerance(want.dtype)

    return agrees_at
