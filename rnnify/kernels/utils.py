"""Shared helpers for the Triton kernels: which path to run, buffer allocation, block sizes.

Path selection: every op runs its PyTorch reference unless its tensors live on CUDA, or
``FORCE_TRITON`` is set (env ``RNNIFY_FORCE_TRITON=1``, or assign ``rnnify.kernels.utils.FORCE_TRITON``
at run time). With ``TRITON_INTERPRET=1`` set before triton is imported, the forced Triton path
runs on CPU tensors through the interpreter: that is how the tests check the kernels without a GPU.
"""

from __future__ import annotations

import os

import torch

try:  # triton is optional: without it every op runs its reference implementation
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

HAS_TRITON = triton is not None
FORCE_TRITON = os.environ.get("RNNIFY_FORCE_TRITON", "") not in ("", "0")
# tl.dot precision: "ieee" is exact fp32 (what the interpreter computes); "tf32" is faster on GPUs.
DOT_PRECISION = os.environ.get("RNNIFY_DOT_PRECISION", "ieee")


def use_triton(x: torch.Tensor) -> bool:
    """Run the Triton implementation for tensors like ``x``?"""
    return HAS_TRITON and (x.is_cuda or FORCE_TRITON)


def empty(shape, device, dtype=torch.float32) -> torch.Tensor:
    """Output buffers of the Triton paths (the tests patch this to fill them with NaN)."""
    return torch.empty(shape, device=device, dtype=dtype)


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())
