"""Choosing the next token from logits, with transformers' meaning of each option.

Order as in transformers' ``generate``: temperature, then top-k, then top-p (nucleus).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from rnnify.choices import TEMPERATURE, TOP_K
from rnnify.errors import RnnifyError, check_positive_finite, warn_caller

# the sampling options and their unset values: greedy decoding reads none of them
SAMPLING_DEFAULTS = {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": None, "seed": None}


def token_ids(ids: int | Iterable[int] | None) -> list[int]:
    """The ids an ``eos_token_id`` names: none, one or several (configs and tokenizers give any of the three)."""
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def check_temperature(temperature: float, name: str = "temperature") -> float:
    """``temperature`` if it is a finite number > 0. However small, it cannot overflow (``next_token``);
    infinity would turn a logit of -inf into nan."""
    return check_positive_finite(name, temperature)


def check_sampling(
    do_sample: bool, temperature: float, top_k: int | None, top_p: float | None, seed: int | None
) -> None:
    """The sampling options as ``generate`` and ``Chat`` take them: each in range, and set only where
    they are read (``warn_if_greedy``)."""
    check_temperature(temperature)
    if top_k is not None and top_k < 0:
        raise RnnifyError(f"top_k must be >= 0 (0: every token), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise RnnifyError(f"top_p must be in (0, 1], got {top_p}")
    warn_if_greedy(do_sample, dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))


def warn_if_greedy(
    do_sample: bool,
    options: dict[str, object],
    *,
    named: Callable[[str], str] = str,
    switch: str = "do_sample=True",
) -> None:
    """Warn, as transformers does, when sampling ``options`` were set (other than ``SAMPLING_DEFAULTS``)
    but decoding is greedy: a temperature without ``do_sample`` is otherwise silently ignored.
    ``named`` and ``switch`` name the options as the caller's user wrote them (the CLI's flags)."""
    given = [named(name) for name, value in options.items() if value != SAMPLING_DEFAULTS[name]]
    if given and not do_sample:
        verb = "applies" if len(given) == 1 else "apply"
        warn_caller(f"{', '.join(given)} {verb} only with {switch}: decoding greedily")


def next_token(
    logits: torch.Tensor,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``logits [B, V]`` -> token ids ``[B]``: argmax, or a sample from the filtered distribution
    (``top_k`` 0 or None: no top-k filter, as in transformers)."""
    if not do_sample:
        return logits.argmax(-1)
    # Shifted so that the largest is 0 before dividing: a temperature near 0 then sends the others to
    # -inf, where dividing first overflows to inf and the softmax to nan. Softmax, top-k and top-p
    # ignore the shift.
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - top_p
        remove[..., -1] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
