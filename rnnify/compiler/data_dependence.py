"""A forward pass whose control flow depends on the token values, told as one line.

torch.export traces one graph for every input of the declared shapes. A model that turns tensor
values into Python control flow (a loop over the experts some token picked, patch boundaries chosen
by an entropy, a Python list of selected positions) has no such graph: export stops with a guard on
a data-dependent size (``GuardOnDataDependentSymNode``). That is the model's design, not a length
export failed to keep dynamic, so the refusal says so and names the model's line that does it.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from rnnify.errors import UnsupportedModelError

__all__ = ["data_dependence"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_RNNIFY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def data_dependence(name: str, exc: BaseException) -> UnsupportedModelError | None:
    """The refusal for model ``name`` whose export failed with ``exc``, if ``exc`` (or what it wraps) is
    a guard on data; else None."""
    cause = exc
    while cause is not None and not isinstance(cause, GuardOnDataDependentSymNode):
        cause = cause.__cause__
    if cause is None:
        return None
    where = _model_line(cause)
    return UnsupportedModelError(
        f"{name}: its forward pass branches on the values of its tensors{where}: data-dependent control flow, "
        "which no single captured graph computes for every input"
    )


def _model_line(exc: BaseException) -> str:
    """`` (file.py:LINE in FUNCTION: `code`)`` for the innermost frame of ``exc`` outside torch and
    rnnify, the model's code that asked for the value; empty when there is none."""
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith((_TORCH_DIR, _RNNIFY_DIR)) and frame.line
    ]
    if not frames:
        return ""
    frame = frames[-1]
    return f" ({os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}: `{frame.line.strip()}`)"
