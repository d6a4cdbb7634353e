"""Errors that name a user's mistake and what to do about it, and warnings meant for the user.

The CLI prints these errors as one line and exits with code 2; anything else is a bug and keeps
its traceback. It prints an ``RnnifyWarning`` as one ``warning:`` line, without the source line
Python's default format adds.
"""


class RnnifyError(Exception):
    """A problem with the user's input: a path, a model, a state, an option."""


class UnsupportedModelError(RnnifyError):
    """The model cannot be compiled into a recurrent form (no attention, not causal, ...)."""


class PositionError(RnnifyError):
    """A token position the model cannot represent (e.g. past GPT-2's learned positions)."""


class StateError(RnnifyError):
    """A recurrent state that does not belong to this model or batch."""


class RnnifyWarning(UserWarning):
    """Something the user should know that does not stop the work (e.g. decoding past trained positions)."""
