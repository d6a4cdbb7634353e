"""Fixtures and helpers shared by the kernel tests (fixtures are imported by name, so pytest applies
them per module)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setattr(utils, "FORCE_TRITON", True)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, **TOL)


def make_attn(B, T, H, Hkv, Kd, V, gates, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, Kd), r(B, T, Hkv, Kd) / Kd**0.5, r(B, T, Hkv, V)
    gates = gates.split("+")
    g = -torch.rand(B, T, Hkv, generator=gen) if "g" in gates else None
    gk = F.logsigmoid(r(B, T, Hkv, Kd) + 2) if "gk" in gates else None
    h0 = r(B, Hkv, Kd, V) if state else None
    return q, k, v, g, gk, h0


def close_grad(actual, expected):
    # gate gradients are reverse cumulative sums whose terms cancel: entries near 0 keep the
    # rounding of the large terms, so the tolerance is relative to the tensor's largest entry
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * max(1.0, expected.abs().max().item()))


@pytest.fixture
def no_reference(monkeypatch):
    """The Triton path, forward and backward, must not fall back on the PyTorch reference."""

    def fail(*args, **kwargs):
        raise AssertionError("the PyTorch reference ran on the Triton path")

    from rnnify.kernels.linear_attn import common

    monkeypatch.setattr(common, "reference", fail)


def left_padding(B, T):
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False  # row 0 left-padded; a padding token in the middle of row 1 too
    if B > 1:
        mask[1, T // 2] = False
    return mask
