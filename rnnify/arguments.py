"""Parsing the command line: its parsers, and ``type=`` functions for flags whose allowed values are
narrower than their Python type.

A mistake on the command line is one ``error:`` line and exit 2, as every other mistake of the user
is (``cli.main``), whether argparse finds it (``Parser``: an unknown flag, a missing argument, a
choice that is not one) or a ``type=`` function here does (an ``RnnifyError`` that says what is
allowed), before a model is loaded rather than as a traceback or a crash halfway through the command.
Both answer without importing torch: ``Command`` adds a command's arguments only when it parses, and
their choices and defaults come from ``rnnify.choices``. A command's help shows each flag's default
as the flag holds it (``DefaultsFormatter``), so that no help text repeats a value by hand.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from rnnify.errors import RnnifyError, check_positive_finite

__all__ = [
    "SEEDS",
    "Command",
    "DefaultsFormatter",
    "Parser",
    "at_least",
    "digest",
    "integers",
    "layer_list",
    "probability",
    "seed",
    "temperature",
    "text_path",
    "threads",
    "utf8",
]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one ``error:`` line and exit 2, without the usage
    block argparse prints first (``--help`` still shows it): the line says what is wrong, and a
    command's usage runs to tens of lines that would push it out of sight."""

    def error(self, message: str) -> None:
        hint = f"; {self.prog} --help lists them" if "required: COMMAND" in message else ""
        self.exit(2, f"error: {' '.join(message.split())}{hint}\n")


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends a flag's text with ``(default: VALUE)``, read from the flag itself. Not for a
    flag without a value of its own (None, or a switch), whose text says in words what happens
    without it, nor for one whose text states its default already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or action.nargs == 0
            or default is None
            or default is argparse.SUPPRESS
            or "%(default)" in help
            or "(default:" in help
        ):
            return help
        return help + " (default: %(default)s)"


class Command(Parser):
    """A command's parser whose arguments are added by ``arguments`` when it first parses, so that
    ``rnnify --help`` and the other commands do not build them; its help shows the flags' defaults."""

    def __init__(self, *args: Any, arguments: Callable[[argparse.ArgumentParser], None], **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)
        self._arguments: Callable[[argparse.ArgumentParser], None] | None = arguments

    def parse_known_args(self, args=None, namespace=None):
        if self._arguments is not None:
            add, self._arguments = self._arguments, None
            add(self)
        return super().parse_known_args(args, namespace)


SEEDS = range(-(2**63), 2**64)  # what torch.Generator.manual_seed takes (a negative one as its two's complement)


def integers(text: str) -> list[int] | None:
    """``text``'s comma-separated integers, each once; None if an item is empty (``1,,2``), not an
    integer, or repeated (a typo, not a request to do it twice)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        return None
    return values if len(set(values)) == len(values) else None


def digest(flag: str) -> Callable[[str], str]:
    """A sha256 as ``rnnify info`` prints it: 64 hexadecimal digits (a typo is not a directory that changed)."""

    def parse(text: str) -> str:
        if len(text) != 64 or any(c not in "0123456789abcdefABCDEF" for c in text):
            raise RnnifyError(f"{flag} {text!r:.80}: expected a sha256, 64 hexadecimal digits (rnnify info prints it)")
        return text.lower()

    return parse


def text_path(flag: str) -> Callable[[str], str]:
    """A path to text (a file, a folder or a .jsonl file) that exists now, not after the model loads."""

    def parse(text: str) -> str:
        if not os.path.exists(os.path.expanduser(text)):
            raise RnnifyError(
                f"{flag} {text} does not exist; pass a text file, a folder of text files or a .jsonl file"
            )
        return text

    return parse


def layer_list(flag: str) -> Callable[[str], list[int]]:
    """Comma-separated layer indices (``rnnify.convert``'s ``keep_softmax``)."""

    def parse(text: str) -> list[int]:
        layers = integers(text)
        if not layers or min(layers) < 0:  # not integers, none, or a negative index
            raise RnnifyError(f"{flag} {text!r}: expected comma-separated layer indices, each once, e.g. 0,3")
        return layers

    return parse


def probability(flag: str) -> Callable[[str], float]:
    """A number in (0, 1] (``--top-p``), as ``runtime.sampling.check_sampling`` allows it."""
    return _bounded(float, flag, "a number", lambda value: 0 < value <= 1, "must be in (0, 1]")


def at_least(minimum: int, flag: str) -> Callable[[str], int]:
    """An integer no smaller than ``minimum`` (a window's tokens, a count of sinks)."""
    return _bounded(int, flag, "an integer", lambda value: value >= minimum, f"must be at least {minimum}")


def _bounded(kind: type, flag: str, what: str, allowed: Callable[[Any], bool], why: str) -> Callable[[str], Any]:
    """A ``kind`` number (``what``, in words) that ``allowed`` accepts; else ``why``, naming ``flag``."""

    def parse(text: str):
        value = _number(kind, flag, text, what)
        if not allowed(value):
            raise RnnifyError(f"{flag} {text}: {why}")
        return value

    return parse


def seed(flag: str) -> Callable[[str], int]:
    """An integer torch can seed a generator with."""

    def parse(text: str) -> int:
        value = _number(int, flag, text, "an integer")
        if value not in SEEDS:
            raise RnnifyError(f"{flag} {text}: a seed must be an integer from -2**63 to 2**64 - 1")
        return value

    return parse


def temperature(flag: str) -> Callable[[str], float]:
    """A sampling temperature as ``runtime.sampling.check_temperature`` allows it (the same torch-free
    check, here before that module, which imports torch, is loaded)."""

    def parse(text: str) -> float:
        return check_positive_finite(flag, _number(float, flag, text, "a number"))

    return parse


def threads(flag: str) -> Callable[[str], int]:
    """A thread count as ``runtime.threads.choose_threads`` allows it (that module imports no torch)."""

    def parse(text: str) -> int:
        from rnnify.runtime.threads import choose_threads

        return choose_threads(_number(int, flag, text, "an integer"))[0]

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
