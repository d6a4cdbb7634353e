"""Fixtures shared by the kernel tests (imported by name, so pytest applies them per module)."""

from __future__ import annotations

import pytest
import torch

from rnnify.kernels import utils

# Tests that run the Triton path (through the interpreter on CPU): skipped where triton is not installed
# (it is an extra, "rnnify[triton]"; dev brings it). The rest of a file still runs.
needs_triton = pytest.mark.skipif(
    not utils.HAS_TRITON, reason="triton is not installed: the Triton path cannot run (pip install 'rnnify[triton]')"
)


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Output buffers of the Triton paths are NaN-filled: a kernel that leaves memory unwritten fails."""

    def empty(shape, device, dtype=torch.float32):
        return torch.full(shape, float("nan"), device=device, dtype=dtype)

    monkeypatch.setattr(utils, "empty", empty)
