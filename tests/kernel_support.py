"""Fixtures shared by the kernel tests (imported by name, so pytest applies them per module)."""

from __future__ import annotations

import pytest
import torch

from rnnify.kernels import utils


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Output buffers of the Triton paths are NaN-filled: a kernel that leaves memory unwritten fails."""

    def empty(shape, device, dtype=torch.float32):
        return torch.full(shape, float("nan"), device=device, dtype=dtype)

    monkeypatch.setattr(utils, "empty", empty)
