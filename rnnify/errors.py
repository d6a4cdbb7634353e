"""Errors that name a user's mistake and what to do about it, and warnings meant for the user.

The CLI prints these errors as one line and exits with code 2; anything else is a bug and keeps
its traceback. It prints an ``RnnifyWarning`` as one ``warning:`` line, without the source line
Python's default format adds.
"""

import os
import sys
import warnings
from pathlib import Path

_PACKAGE = str(Path(__file__).resolve().parent) + os.sep
# torch's no_grad/inference_mode decorators, which wrap rnnify's functions between them and the user
_DECORATOR = str(Path("torch", "utils", "_contextlib.py"))


class RnnifyError(Exception):
    """A problem with the user's input: a path, a model, a state, an option."""


class UnsupportedModelError(RnnifyError):
    """The model cannot be compiled into a recurrent form (no attention, not causal, ...)."""


class PositionError(RnnifyError):
    """A token position the model cannot represent (e.g. past GPT-2's learned positions)."""


class GraphFormatError(RnnifyError):
    """A step graph that cannot be saved (an op or argument outside the format) or loaded (malformed
    or unknown data in ``graph.json``)."""


class StateError(RnnifyError):
    """A recurrent state that does not belong to this model or batch."""


def first_line(exc: BaseException, with_type: bool = False) -> str:
    """The first line of ``exc``'s message, to quote inside a one-line error or warning (its type
    name when it has no message; prefixed with it when ``with_type``)."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if with_type else text.splitlines()[0]


def check_int(name: str, value: object, minimum: int = 1, error: type[Exception] = ValueError, why: str = "") -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``; else ``error`` naming ``name`` (and ``why``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise error(f"{name} must be {bound}{why}, got {value!r}")
    return value


def is_number(value: object) -> bool:
    """Whether ``value`` is an int or a float, not a bool (a config field's number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_positive_finite(value: object) -> bool:
    """Whether ``value`` is a number (``is_number``) > 0 and finite; NaN is not."""
    return is_number(value) and 0 < value < float("inf")


def check_positive_finite(name: str, value: float) -> float:
    """``value`` if it is a finite number > 0; else ``RnnifyError`` naming ``name``."""
    if not (value > 0 and value != float("inf")):  # nan fails the first test
        raise RnnifyError(f"{name} must be a finite number > 0, got {value}")
    return value


class RnnifyWarning(UserWarning):
    """Something the user should know that does not stop the work (e.g. decoding past trained positions)."""


def warn_caller(message: str) -> None:
    """Warn (``RnnifyWarning``) at the first caller outside rnnify: the user's own line, which they can
    find and filter, however deep inside rnnify the reason was found."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: this function's caller
    while frame is not None and _inside(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RnnifyWarning, stacklevel=level)


def _inside(filename: str) -> bool:
    return filename.endswith(_DECORATOR) or str(Path(filename).resolve()).startswith(_PACKAGE)
