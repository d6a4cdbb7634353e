"""Calibration rows for ``--to auto``: real text, and pass-key prompts with their answers appended."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rnnify.errors import RnnifyError


@dataclass
class Calibration:
    """Rows ``[1, T]`` and, per row, the float weights ``[T]`` of the positions whose prediction counts."""

    rows: list[torch.Tensor]
    weights: list[torch.Tensor]
    kinds: list[str]  # "text" or "passkey": the two means a score adds


def calibration_rows(tokenizer: Any, data: Any, seq_len: int, rows: int, passkey: int, seed: int = 0) -> Calibration:
    """``rows`` rows of ``seq_len`` tokens of ``data`` (``rnnify.data.token_batches``) and ``passkey``
    pass-key prompts of at most ``seq_len`` tokens, each with its answer appended."""
    from rnnify.data import token_batches
    from rnnify.probes import CALIBRATION, prompts

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
        for _, prompt in prompts(tokenizer, [seq_len - 8], passkey, seed, [CALIBRATION]):
            answer = tokenizer(f" {prompt.key}.", add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt.ids + answer])
            weights = torch.zeros(ids.shape[1])
            weights[len(prompt.ids) - 1 : ids.shape[1] - 1] = 1.0  # the positions that predict the answer
            out.rows.append(ids)
            out.weights.append(weights)
            out.kinds.append("passkey")
    return out
