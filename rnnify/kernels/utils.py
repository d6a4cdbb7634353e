"""Shared host-side helpers for the Triton kernels: which path to run, buffers, block sizes, launch
arguments (the in-kernel ones are ``tiles.py``).

Path selection: every op takes ``backend`` (``BACKENDS``), resolved by ``resolve_backend``.
``"auto"`` runs the PyTorch reference unless the tensors live on CUDA, or ``FORCE_TRITON`` is set
(env ``RNNIFY_FORCE_TRITON=1``, or assign ``rnnify.kernels.utils.FORCE_TRITON`` at run time);
``"triton"`` and ``"reference"`` pin the path (a benchmark, a test, a parity check). With
``TRITON_INTERPRET=1`` set before triton is imported, the Triton path runs on CPU tensors through
the interpreter: that is how the tests check the kernels without a GPU.

A converted model's ``kernels`` (``KERNELS``) is one of these backends for its cells' fused ops,
or ``"none"`` for the cells' own PyTorch forms; ``check_kernels`` is the one check of both, and
``check_runnable`` refuses a model pinned to Triton where Triton cannot run.
"""

from __future__ import annotations

import os

import torch

from rnnify.choices import BACKENDS, KERNELS
from rnnify.errors import RnnifyError

try:  # triton is optional: without it every op runs its reference implementation
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the platform
    triton = None
    tl = None

HAS_TRITON = triton is not None
# The kernels are jitted right after this module is imported, so this is the mode they were built in.
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FORCE_TRITON = os.environ.get("RNNIFY_FORCE_TRITON", "") not in ("", "0")
# tl.dot precision: "ieee" is exact fp32 (what the interpreter computes); "tf32" is faster on GPUs.
DOT_PRECISION = os.environ.get("RNNIFY_DOT_PRECISION", "ieee")


def check_kernels(kernels: str, choices: tuple[str, ...] = KERNELS) -> str:
    """``kernels`` if it is one of ``choices`` (a model's ``KERNELS``, an op's ``BACKENDS``)."""
    if not isinstance(kernels, str) or kernels not in choices:
        raise RnnifyError(f"unknown kernels {kernels!r}; choose from: {', '.join(choices)}")
    return kernels


def check_runnable(kernels: str, device: torch.device) -> None:
    """Pinned Triton kernels need triton and a CUDA device (or its interpreter, as the tests use):
    checked before a model runs, so the error names the model's setting rather than an op's."""
    if kernels != "triton":
        return
    if not HAS_TRITON:
        raise RnnifyError(
            "kernels 'triton' need triton, which cannot be imported here; use kernels 'auto' or 'reference'"
        )
    if device.type != "cuda" and not INTERPRET:
        raise RnnifyError(
            f"kernels 'triton' run on CUDA, not {device.type}; use kernels 'auto' (Triton on CUDA, the PyTorch "
            "reference elsewhere) or 'reference': a model saved with 'triton' loads with another by --kernels "
            "on a command, kernels= in rnnify.load"
        )


def resolve_backend(backend: str, x: torch.Tensor) -> bool:
    """Run the Triton implementation (True) or the PyTorch reference (False) for tensors like ``x``?

    ``"triton"`` raises rather than falling back, so a pinned path is the path that ran.
    """
    if check_kernels(backend, BACKENDS) == "reference":
        return False
    if backend == "auto":
        return HAS_TRITON and (x.is_cuda or FORCE_TRITON)
    if not HAS_TRITON:
        raise RnnifyError("backend='triton' needs triton, which cannot be imported here")
    if not x.is_cuda and not INTERPRET:
        raise RnnifyError(
            f"backend='triton' got tensors on {x.device}: Triton runs on CUDA, or on CPU only "
            "through its interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
    return True


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The ops' layout: q ``[B, T, H, K]``, k ``[B, T, H_kv, K]``, v ``[B, T, H_kv, V]``, H a multiple of H_kv."""
    B, T, H, K = q.shape
    if k.dim() != 4 or v.dim() != 4 or k.shape[:2] != (B, T) or v.shape[:3] != k.shape[:3] or k.shape[3] != K:
        raise ValueError(
            f"expected q [B, T, H, K], k [B, T, H_kv, K], v [B, T, H_kv, V]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if H % k.shape[2]:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({k.shape[2]})")


def check_shape(name: str, x: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """Refuse a state whose shape is not ``shape`` (None passes): a state comes from the step's graph,
    which a model directory holds, and the Triton paths index it by the shapes of the other inputs."""
    if x is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must be {list(shape)}, got {list(x.shape)}")


def empty(shape, device, dtype=torch.float32) -> torch.Tensor:
    """Output buffers of the Triton paths (the tests patch this to fill them with NaN)."""
    return torch.empty(shape, device=device, dtype=dtype)


def contiguous(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each tensor contiguous (None stays None): the kernels index with row-major offsets."""
    return tuple(None if x is None else x.contiguous() for x in tensors)


def next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def head_dims(H: int, Hkv: int, K: int, V: int) -> dict:
    """The head layout the kernels take: H query heads, in groups of G = H / H_kv per kv head."""
    return dict(H=H, HKV=Hkv, G=H // Hkv, K=K, V=V)


def dot_options() -> dict:
    """The launch arguments of the chunked kernels, which multiply tiles with tl.dot: its precision
    (``DOT_PRECISION``, read per launch), 4 warps, one pipeline stage (shared memory: see
    ``linear_attn/chunk.py``)."""
    return dict(PRECISION=DOT_PRECISION, num_warps=4, num_stages=1)
