"""Distillations that would run and teach nothing, refused before the teacher loads or the data is read."""

from __future__ import annotations

from collections.abc import Sequence

from rnnify.errors import RnnifyError
from rnnify.runtime.model import RecurrentModel

EXACT_ALREADY = (
    "every attention of this model is exact softmax: it computes its original already, and "
    "distilling would only move it away; to train on your data, finetune the original, then convert it"
)


def check_worth_training(model: RecurrentModel, stages: Sequence[str], seq_len: int) -> None:
    """Refuse an exact model (it computes its original already: training only moves it away, and it
    would still be called exact), rows longer than the original was trained on, and attention
    transfer on rows that every trained cell's window holds whole (the cells then compute the
    original's softmax exactly: their loss is 0 and their memories learn nothing)."""
    if all(cell.exact for cell in model.cells):
        raise RnnifyError(EXACT_ALREADY)
    trained_on = model.manifest.positions.get("limit")
    if trained_on and seq_len > trained_on:  # and the teacher's seq_len x seq_len attention fills the memory
        raise RnnifyError(
            f"seq_len (--seq-len) {seq_len} is past the {trained_on} positions the original was trained on: "
            f"its outputs there are no target to learn; use at most {trained_on}"
        )
    trained = [cell for cell in model.cells if any(p.requires_grad for p in cell.parameters())]
    spans = [cell.exact_span for cell in trained]
    if "transfer" in stages and trained and None not in spans and seq_len <= min(spans):
        every = "" if min(spans) == max(spans) else f" ({max(spans)} for every cell's)"
        raise RnnifyError(
            f"rows of {seq_len} tokens fit in the window and sinks of every cell that attention transfer "
            f"trains ({min(spans)} tokens or more): their loss is 0 and their memories learn nothing; give a "
            f"seq_len (--seq-len) above {min(spans)}{every}"
        )
