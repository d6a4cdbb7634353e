"""Checks that a converted model computes what it should, on random tokens.

The recurrence is only useful if every way of feeding it agrees: one-shot prefill, token-by-token
steps, prefill split in two, and (where every cell is exact) the original model's full forward pass.
First, the directory's files are checked against its manifest's record (``runtime.integrity``):
every recorded file, not only those a load reads, and a directory without a record fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rnnify.cells.base import Cell
from rnnify.choices import SEED, VERIFY_BATCH, VERIFY_TOKENS
from rnnify.errors import RnnifyError
from rnnify.runtime import integrity
from rnnify.runtime.agreement import differences, rounding_dtype, tolerance
from rnnify.runtime.manifest import read_data
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.state import RecurrentState
from rnnify.runtime.storage import READ_AT_LOAD, READ_IF_PRESENT

__all__ = ["CHECKS", "CheckResult", "rounding_dtype", "run_checks", "tolerance"]

CHECKS = ("integrity", "step == prefill", "split prefill", "vs original")  # "vs original" needs `against`

_HALF = (torch.bfloat16, torch.float16)


@dataclass
class CheckResult:
    """One row of the report; ``passed`` is None for a difference reported but not judged."""

    name: str
    max_abs_diff: float | None
    rel_diff: float | None
    argmax_agreement: float | None
    tokens: int | None
    passed: bool | None
    note: str = ""


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, note: str = "") -> CheckResult:
    """One check's row. The difference is ``convert``'s own (``differences``: equal entries
    agree, -inf masks included; a NaN or an infinity on one side only fails), and a NaN fails even
    where both sides have it, as two of the checks compare the converted model with itself; in
    full precision the argmax must agree everywhere too."""
    got, want = got.float(), want.float()
    max_abs, rel = differences(got, want)
    agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    numbers = not bool(got.isnan().any())
    passed = numbers and rel <= tolerance(dtype) and (dtype in _HALF or agreement == 1.0)
    return CheckResult(name, max_abs, rel, agreement, got.shape[1], passed, note)


def _steps(model: RecurrentModel, ids: torch.Tensor, state: RecurrentState) -> tuple[torch.Tensor, RecurrentState]:
    """Logits of feeding ``ids`` one token at a time from ``state``."""
    logits = []
    for t in range(ids.shape[1]):
        out, state = model.step(ids[:, t : t + 1], state)
        logits.append(out)
    return torch.cat(logits, dim=1), state


def _check_integrity(model: RecurrentModel, expected_digest: str | None) -> CheckResult:
    if model.path is None:
        return CheckResult(
            "integrity", None, None, None, None, None, "model not loaded from a directory: nothing to check"
        )
    data = read_data(model.path)
    recorded = data.get("files") if isinstance(data.get("files"), dict) else {}
    try:  # every recorded file, not only those a load reads (a shipped step, head_map.json)
        integrity.check(model.path, data, [*READ_AT_LOAD, *recorded], READ_IF_PRESENT, expected_digest)
    except RnnifyError as exc:  # named in the directory the report is about
        return CheckResult("integrity", None, None, None, None, False, str(exc).replace(f"{model.path}{os.sep}", ""))
    return CheckResult("integrity", None, None, None, None, True, f"{len(recorded)} files match the manifest")


def _random_ids(model: RecurrentModel, tokens: int, batch: int, seed: int) -> tuple[torch.Tensor, str]:
    if tokens < 2:
        raise RnnifyError(f"tokens must be >= 2 (the split prefill needs two halves), got {tokens}")
    if batch < 1:
        raise RnnifyError(f"batch must be >= 1, got {batch}")
    note = ""
    limit = model.manifest.token_limit()
    if limit is not None and tokens > limit[0]:
        tokens = limit[0]
        note = f"tokens clamped to the model's {tokens} {limit[1]}"
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.manifest.vocab_size, (batch, tokens), generator=generator)
    return ids.to(model.device), note


def _spans(model: RecurrentModel) -> list[int]:
    """How many tokens each cell of ``model`` that drops some holds before it drops one: a window
    with its sinks and kept tokens (``Cell.exact_span``), a layer's own window or chunk, the keys an
    indexer keeps a query."""
    spans = []
    for cell in model.modules():
        if not isinstance(cell, Cell):
            continue
        if cell.exact_span is not None:
            spans.append(cell.exact_span)
        elif cell.grows_with_context and cell.spec.keys_read is not None:
            spans.append(cell.spec.keys_read)
        elif cell.spec.selects:
            spans.append(cell.spec.selected_keys)
    return spans


def _unfilled(model: RecurrentModel, tokens: int) -> str:
    """A note where ``tokens`` leave some window unfilled, so that passing checks say nothing of
    what it drops: none filled, or not every one; and how many tokens fill them all."""
    spans = _spans(model)
    limit = (model.manifest.token_limit() or (None,))[0]
    if not spans or tokens > max(spans) or (limit is not None and max(spans) >= limit):
        return ""
    which = "no window filled" if tokens <= min(spans) else "not every window filled"
    return f"{which}: the longest holds {max(spans)} tokens; --tokens {max(spans) + tokens} checks what they drop"


@torch.no_grad()
def run_checks(
    model: RecurrentModel,
    against: Any = None,
    tokens: int = VERIFY_TOKENS,
    batch: int = VERIFY_BATCH,
    seed: int = SEED,
    *,
    progress: Callable[[str], None] | None = None,
    expected_digest: str | None = None,
) -> list[CheckResult]:
    """Run ``CHECKS`` on ``batch`` random sequences of ``tokens`` ids; one result per check.

    ``against`` (a directory, cached hub id or ``PreTrainedModel``) adds the comparison with the
    original model, judged only where every cell is exact softmax (the ``exact`` target, or a
    per-head map whose groups are all ``exact``). ``expected_digest`` is the directory's digest as
    the user was given it (``integrity.check``). ``progress(name)`` is called as each check starts.
    """
    report = progress or (lambda name: None)
    ids, note = _random_ids(model, tokens, batch, seed)
    n, dtype = ids.shape[1], rounding_dtype(model)
    note = "; ".join(filter(None, [note, _unfilled(model, n)]))

    report("integrity")
    results = [_check_integrity(model, expected_digest)]

    report("step == prefill")
    full, _ = model.prefill(ids)
    first, state = model.prefill(ids[:, :1])
    rest, _ = _steps(model, ids[:, 1:], state)
    results.append(_compare("step == prefill", torch.cat([first, rest], dim=1), full, dtype, note))

    report("split prefill")
    head, state = model.prefill(ids[:, : n // 2])
    tail, _ = model.prefill(ids[:, n // 2 :], state)
    results.append(_compare("split prefill", torch.cat([head, tail], dim=1), full, dtype, note))

    if against is not None:
        report("vs original")
        from rnnify.compiler.capture import load_source, source_name
        from rnnify.original.teacher import check_vocabulary

        source, name = load_source(against, dtype=model.dtype), source_name(against) or type(against).__name__
        check_vocabulary(source, model, name)  # ids past the other's embeddings would index out of range
        want = source(input_ids=ids.to(next(source.parameters()).device), use_cache=False).logits.to(ids.device)
        if want.shape != full.shape:
            raise RnnifyError(
                f"{name}: its logits have shape {tuple(want.shape)}, the converted model's {tuple(full.shape)}; "
                "compare against the model this one was converted from"
            )
        head, state = model.prefill(ids[:, : n // 2])
        tail, _ = _steps(model, ids[:, n // 2 :], state)
        result = _compare("vs original", torch.cat([head, tail], dim=1), want, dtype, note)
        if not all(cell.exact for cell in model.cells):
            result.passed = None
            result.note = "; ".join(filter(None, [note, "approximate target: difference reported, not checked"]))
        results.append(result)
    return results
