"""Calibration rows for ``--to auto``: real text, and pass-key prompts with their answers appended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rnnify.errors import RnnifyError

ANSWER_ROOM = 8  # tokens of a calibration row left after its pass-key prompt for the answer


@dataclass
class Calibration:
    """Rows ``[1, T]`` and, per row, the float weights ``[T]`` of the positions whose prediction counts."""

    rows: list[torch.Tensor]
    weights: list[torch.Tensor]
    kinds: list[str]  # "text" or "passkey": the two means a score adds


def calibration_rows(
    tokenizer: Any, data: Any, seq_len: int, rows: int, passkey: int, seed: int = 0, *, limit: int | None = None
) -> Calibration:
    """``rows`` rows of ``seq_len`` tokens of ``data`` (``rnnify.data.token_batches``) and ``passkey``
    pass-key prompts of at most ``seq_len`` tokens, each with its answer appended. ``limit``: the
    model's positions, to say whether a longer ``--calib-len`` would make room for the prompts."""
    from rnnify.data import token_batches

    out = Calibration([], [], [])
    if rows:
        for batch in token_batches(
            data, tokenizer, seq_len=seq_len, batch_size=1, max_tokens=rows * seq_len, seed=seed
        ):
            if bool(batch["attention_mask"].all()):  # the last, padded row is left out
                out.rows.append(batch["input_ids"])
                out.weights.append(torch.ones(seq_len))
                out.kinds.append("text")
        if not out.rows:
            raise RnnifyError(
                f"the calibration data holds fewer than {seq_len} tokens: give more text or a lower --calib-len"
            )
    if passkey:
        for prompt in _passkey_prompts(tokenizer, seq_len, passkey, seed, rows, limit):
            answer = tokenizer(f" {prompt.key}.", add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt.ids + answer])
            weights = torch.zeros(ids.shape[1])
            weights[len(prompt.ids) - 1 : ids.shape[1] - 1] = 1.0  # the positions that predict the answer
            out.rows.append(ids)
            out.weights.append(weights)
            out.kinds.append("passkey")
    return out


def _passkey_prompts(tokenizer: Any, seq_len: int, passkey: int, seed: int, rows: int, limit: int | None) -> list:
    """The calibration probe's ``passkey`` prompts in rows of ``seq_len`` tokens, room left for the
    answer; rows too short for them are refused naming ``--calib-len`` (the probes' own error names
    no flag) and what would do instead."""
    from rnnify.probes import PromptTooLong

    try:
        return _prompts(tokenizer, seq_len - ANSWER_ROOM, passkey, seed)
    except PromptTooLong as exc:
        needed = _fewest_tokens(tokenizer, exc.needed, passkey, seed) + ANSWER_ROOM
        raise RnnifyError(_too_short(seq_len, needed, rows, limit)) from exc


def _too_short(seq_len: int, needed: int, rows: int, limit: int | None) -> str:
    """Why rows of ``seq_len`` tokens hold no pass-key prompt, and the fix: ``--calib-len`` of the
    ``needed`` tokens where the model's ``limit`` allows that many, or calibrating on text alone."""
    from rnnify.choices import CALIB_ROWS

    text = "--calib-passkey 0" if rows else f"--calib-rows {CALIB_ROWS} --calib-passkey 0"
    alone = f"{text} to calibrate on text alone"
    said = f"--calib-len {seq_len} is too short for the pass-key calibration prompts, which need {needed} tokens"
    if limit is not None and needed > limit:
        return f"{said} with this tokenizer, more than the model's {limit} positions: give {alone}"
    return f"{said} with this tokenizer: give --calib-len {needed} or more, or {alone}"


def _fewest_tokens(tokenizer: Any, needed: int, passkey: int, seed: int) -> int:
    """The fewest tokens all the prompts fit in, from the ``needed`` of the first that did not fit:
    another key or depth may need more, and each try names the need of the next that does not fit."""
    from rnnify.probes import PromptTooLong

    while True:
        try:
            _prompts(tokenizer, needed, passkey, seed)
            return needed
        except PromptTooLong as exc:
            needed = exc.needed


def _prompts(tokenizer: Any, length: int, passkey: int, seed: int) -> list:
    from rnnify.probes import CALIBRATION, prompts

    return [prompt for _, prompt in prompts(tokenizer, [length], passkey, seed, [CALIBRATION])]
