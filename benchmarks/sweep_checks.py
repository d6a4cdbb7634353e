"""The architecture sweep's comparisons, and in half precision whether a difference is rounding.

    python benchmarks/sweep_checks.py MODEL_TYPE [--seed 0] [--dtype bfloat16]

(prints the first token of ``arch_sweep``'s left-padded row that goes to other experts than alone.)

``arch_sweep`` holds a conversion to the original's forward, prefill and prefill + steps, and a
left-padded batch to each row read alone. In half precision a cached decode rounds otherwise than
one forward and a batch otherwise than one row, in the original as in its conversion, and where a
router's top experts score within that rounding of each other, a token goes to another expert and
everything after it differs. ``judge_rounding`` calls a half-precision difference over the
tolerance rounding where the conversion agrees with the original computing the same way (its
cached decode of the same rows: ``original_difference``), or, for its prompt, parts from the
original only at such a tie (``met_a_router_tie``, the check ``convert`` runs); for a mixture of
experts it records the first token of the left-padded row that goes to other experts than alone
(``first_flip``: every router's top-k, recorded), with how close their scores were.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from pathlib import Path

import torch

from rnnify.runtime.agreement import met_a_router_tie, tolerance
from rnnify.runtime.expert_choices import ExpertChoices, expert_sizes, first_difference

SEQ, STEPS, BATCH = 16, 8, 2


def relative_error(got, want) -> float | None:
    diff = float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-30)
    return diff if math.isfinite(diff) else None  # NaN/inf: reported as null, judged a mismatch


def random_ids(vocab: int, seed: int = 0) -> torch.Tensor:
    """The sweep's tokens: ``BATCH`` rows of ``SEQ + STEPS`` ids, none of the first three (often
    special)."""
    return torch.randint(3, vocab, (BATCH, SEQ + STEPS), generator=torch.Generator().manual_seed(seed))


def left_padded(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``ids`` with the second row cut short by half of its first ``SEQ`` columns and left-padded, its
    attention mask, and the column where the row starts. The padding holds the first row's tokens,
    not a padding id: a padding id's embedding is often zero, which adds nothing to a state that
    starts at zero, and so would not show a padded position leaking into one."""
    start = SEQ - SEQ // 2
    padded = ids.clone()
    padded[1, :start] = ids[0, :start]
    mask = torch.ones_like(padded)
    mask[1, :start] = 0
    return padded, mask, start


def converted_decode(
    converted, rows: torch.Tensor, prompt: int, mask: torch.Tensor | None = None, each_pass=contextlib.nullcontext
) -> torch.Tensor:
    """A conversion's logits of ``rows``: a prefill of ``prompt`` tokens (``mask``: its left padding),
    then one token a step (each within ``each_pass()``)."""
    masked = {} if mask is None else {"attention_mask": mask[:, :prompt]}
    with each_pass():
        logits, state = converted.prefill(rows[:, :prompt], **masked)
    stepped = [logits]
    for t in range(prompt, rows.shape[1]):
        with each_pass():
            logits, state = converted.step(rows[:, t : t + 1], state)
        stepped.append(logits)
    return torch.cat(stepped, 1)


def original_decode(model, rows: torch.Tensor, prompt: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The original's logits of ``rows`` read as a conversion reads them: a prompt of ``prompt`` tokens,
    then one token a step through its cache; ``mask`` marks left padding (positions counted past it)."""
    masked = {}
    if mask is not None:
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        masked = {"attention_mask": mask[:, :prompt], "position_ids": positions[:, :prompt]}
    out = model(input_ids=rows[:, :prompt], use_cache=True, **masked)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(prompt, rows.shape[1]):
        if mask is not None:
            masked = {"attention_mask": mask[:, : t + 1], "position_ids": positions[:, t : t + 1]}
        out = model(input_ids=rows[:, t : t + 1], past_key_values=cache, use_cache=True, **masked)
        cache = out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, 1)


def _rows_differ(batch: torch.Tensor, first: torch.Tensor, second: torch.Tensor, start: int) -> float | None:
    """How far the rows of ``left_padded``'s ``batch`` are from ``first`` and ``second`` (the second
    row's tokens from ``start`` on)."""
    errors = [relative_error(batch[:1], first), relative_error(batch[1:, start:], second)]
    return None if None in errors else max(errors)


@torch.no_grad()
def left_padded_error(converted, ids) -> float | None:
    """How far the rows of ``left_padded(ids)`` (a prefill of the first ``SEQ`` columns, then steps)
    are from each row read alone."""
    padded, mask, start = left_padded(ids)
    batch = converted_decode(converted, padded, SEQ, mask)
    first, second = converted_decode(converted, ids[:1], SEQ), converted_decode(converted, ids[1:, start:], SEQ - start)
    return _rows_differ(batch, first, second, start)


@torch.no_grad()
def original_difference(model, converted, ids, comparison: str) -> float | None:
    """How far a conversion is from the original computing the same way: ``prefill+steps`` both
    decoding ``ids`` through their caches, ``left-padded`` both decoding ``left_padded(ids)``. None
    where the original does not run so."""
    try:
        if comparison == "prefill+steps":
            return relative_error(converted_decode(converted, ids, SEQ), original_decode(model, ids, SEQ))
        padded, mask, start = left_padded(ids)
        batch, want = converted_decode(converted, padded, SEQ, mask), original_decode(model, padded, SEQ, mask)
        return _rows_differ(batch, want[:1], want[1:, start:], start)
    except Exception:  # noqa: BLE001  (an original that does not run so leaves the check as it is)
        return None


@torch.no_grad()
def first_flip(converted, ids: torch.Tensor, sizes: set[int], tol: float) -> dict | None:
    """``first_difference`` of ``left_padded(ids)``'s second row, prefilled and then stepped as
    ``left_padded_error`` runs it, and the row alone: the first token the batch sends to other experts."""
    padded, mask, start = left_padded(ids)
    batch, alone = ExpertChoices(sizes), ExpertChoices(sizes)
    converted_decode(converted, padded, SEQ, mask, batch.one_pass)
    converted_decode(converted, ids[1:, start:], SEQ - start, None, alone.one_pass)
    return first_difference(batch.choices(rows=2, row=1, skip=start), alone.choices(), tol)


@torch.no_grad()
def _agrees_or_ties(model, converted, row: torch.Tensor, tol: float) -> bool:
    """Whether the conversion's prompt of one ``row`` gives the original's logits within ``tol``, or
    parts from them only at a router's tie (``met_a_router_tie``)."""
    want = model(input_ids=row, use_cache=False).logits
    got = converted.prefill(row)[0]
    error = relative_error(got, want)
    return (error is not None and error <= tol) or met_a_router_tie(converted, model, row, tol, got=got, want=want)


def judge_rounding(model, converted, ids, errors: dict, tol: float) -> dict:
    """For a half-precision mismatch: ``status: rounding`` where, in each comparison over ``tol``, the
    conversion agrees within ``tol`` with the original computing the same way (``original``: how far
    apart), or, in the prefill and its steps, where each row's prompt agrees with the original's but
    where a router met a tie (``tie``, rnnify.runtime.expert_choices): the conversion passed
    ``convert``'s own check, on a draw of tokens that agrees whole, before the sweep compared it.
    For a mixture of experts with the left-padded batch over ``tol``, ``flip`` records why the
    original differs from itself there: the first token routed otherwise (``first_flip``)."""
    over = [k for k, e in errors.items() if e is None or e > tol]
    judged = {"original": {k: original_difference(model, converted, ids, k) for k in over if k != "prefill"}}
    sizes = expert_sizes(model.config.get_text_config())
    if "left-padded" in over and sizes:
        try:
            judged["flip"] = first_flip(converted, ids, sizes, tol)
        except Exception:  # noqa: BLE001  (a router this reading does not follow: no explanation, same verdict)
            judged["flip"] = None
    if "prefill" in over:  # the conversion and the original, both one forward: a router's tie alone
        judged["tie"] = all(_agrees_or_ties(model, converted, row[None, :SEQ], tol) for row in ids)
    agree = [
        (k in judged["original"] and judged["original"][k] is not None and judged["original"][k] <= tol)
        or (k != "left-padded" and judged.get("tie", False))
        for k in over
    ]
    return {**judged, "status": "rounding"} if all(agree) else judged


def main() -> None:
    parser = argparse.ArgumentParser(description="Where a left-padded row's tokens go to other experts than alone.")
    parser.add_argument("model_type", help="a job of benchmarks/arch_sweep.py (a model type with routed experts)")
    parser.add_argument("--seed", type=int, default=0, help="the random tokens' seed (arch_sweep's: 0)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import arch_sweep

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, convert, _ = arch_sweep._convert(args.model_type, getattr(torch, args.dtype))
    config = model.config.get_text_config()
    sizes = expert_sizes(config)
    if not sizes:
        parser.error(f"{args.model_type} names no routed experts")
    ids = random_ids(config.vocab_size, args.seed)
    print(
        first_flip(convert(), ids, sizes, tolerance(getattr(torch, args.dtype)))
        or "every token routes as the row alone does"
    )


if __name__ == "__main__":
    main()
