"""``type=`` functions for the command line's flags whose allowed values are narrower than their
Python type. A value outside them fails while the command line is parsed, before a model is
loaded, as an ``RnnifyError`` (``cli.main`` prints it as one ``error:`` line, exit 2) that says what
is allowed, rather than as a traceback or a crash halfway through the command.
"""

from __future__ import annotations

from collections.abc import Callable

from rnnify.errors import RnnifyError

__all__ = ["SEEDS", "seed", "temperature", "utf8"]

SEEDS = range(-(2**63), 2**64)  # what torch.Generator.manual_seed takes (a negative one as its two's complement)


def seed(flag: str) -> Callable[[str], int]:
    """An integer torch can seed a generator with."""

    def parse(text: str) -> int:
        value = _number(int, flag, text, "an integer")
        if value not in SEEDS:
            raise RnnifyError(f"{flag} {text}: a seed must be an integer from -2**63 to 2**64 - 1")
        return value

    return parse


def temperature(flag: str) -> Callable[[str], float]:
    """A sampling temperature as ``runtime.sampling.check_temperature`` allows it."""

    def parse(text: str) -> float:
        from rnnify.runtime.sampling import check_temperature  # imports torch: only once a value is given

        return check_temperature(_number(float, flag, text, "a number"), flag)

    return parse


def utf8(flag: str) -> Callable[[str], str]:
    """Text that is UTF-8: bytes that are not arrive in ``sys.argv`` as lone surrogates, which a
    tokenizer refuses with a traceback."""

    def parse(text: str) -> str:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = text[exc.start : exc.end]
            try:
                shown = ("bytes " if len(bad) > 1 else "byte ") + bad.encode("utf-8", "surrogateescape").hex(" ")
            except UnicodeEncodeError:  # a surrogate that stands for no byte (given in-process)
                shown = ascii(bad)
            where = f"{shown} at character {exc.start + 1}"
            raise RnnifyError(f"{flag} is not UTF-8 text ({where}); give it in UTF-8") from None
        return text

    return parse


def _number(kind: type, flag: str, text: str, what: str):
    try:
        return kind(text)
    except ValueError:
        raise RnnifyError(f"{flag} {text!r}: expected {what}") from None
