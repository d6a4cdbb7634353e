"""The device a model is loaded onto or trained on, checked where the user names it."""

from __future__ import annotations

import torch

from rnnify.errors import RnnifyError


def usable_device(device: torch.device | str, named: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` this process can use: a name torch does not know, or CUDA where
    none is available, is one line saying so (``named``: how the user gave it, e.g. ``--device``),
    not torch's error from deep inside the first tensor moved there."""
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise RnnifyError(f"{named} {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise RnnifyError(f"{named} {str(device)!r}: no CUDA device is available; use cpu")
    return chosen
