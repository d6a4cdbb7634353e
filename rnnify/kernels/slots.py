"""How a cache slot stores one token's key or value: in a float dtype, or in int8 with a scale.

A window's ring and its sinks hold the keys and values of past tokens; the queries read them back in
fp32. By default a slot holds them in the model dtype. A smaller storage dtype holds more tokens in
the same bytes (``WindowCell(kv_dtype=...)``, docs/math.md §Storage of the cached keys and values):

- ``float16``, ``bfloat16``: the vector cast, read back with ``.float()``; float16 saturates at its
  largest value (65,504) rather than store inf.
- ``int8``: the vector's d entries rounded to integers in [-127, 127] at a scale 2^e shared by the
  vector, then e itself as one more int8 (as GGUF's Q8_0 blocks carry their scale): d + 1 bytes a
  slot instead of 4d in fp32. The scale is the power of two that puts the largest entry in [64, 128)
  (128 itself rounds to 127). A power of two makes the read-back exact in fp32, lets a product apply
  the scale to its result instead of to every entry (``levels_and_scales``), and makes the rounding
  idempotent: a vector read back and written again reads back the same. So every form of a cell,
  whichever route a token takes (written by a prompt, by a step, or rewritten from a read-back
  copy), reads the same numbers for the same key. (A model computes its keys with last-bit
  differences from one route to another, and one that crosses a rounding boundary moves the stored
  entry a whole step: a model's own checks judge such a model at half precision,
  ``runtime.agreement.rounding_dtype``.) A vector with an entry that is not finite stores e = -128
  and reads back as NaN, as a float slot would carry it on.

Every form writes through ``encode`` and reads through ``decode``, so the storage is chosen in one
place: the state's dtype (``init_state``), with the width ``slot_width`` gives.
"""

from __future__ import annotations

import torch

from rnnify.choices import KV_DTYPES as _NAMES

# the storage dtypes a cache may take instead of the model's, by the name options give
KV_DTYPES = {name: getattr(torch, name) for name in _NAMES}

_MANTISSA_BITS = 7  # 2^7 = 128: the scale puts the largest entry in [64, 128)
_FLOAT16_MAX = torch.finfo(torch.float16).max
_LEVEL = 127  # the largest int8 magnitude used (-128 is not, so that the range is symmetric)
_NOT_FINITE = -128  # the exponent of a vector with an inf or NaN: read back as NaN


def kv_dtype(name: str | None) -> torch.dtype | None:
    """The storage dtype an option names, or None (the model dtype)."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {name!r}")
    return KV_DTYPES[name]


def slot_width(dim: int, dtype: torch.dtype) -> int:
    """The width of a slot that stores a vector of ``dim`` entries in ``dtype``: ``dim + 1`` for int8
    (the exponent of its scale last), else ``dim``."""
    return dim + 1 if dtype == torch.int8 else dim


def vector_width(slots: torch.Tensor) -> int:
    """The number of entries of the vectors ``slots [..., width]`` store (``slot_width``'s inverse)."""
    return slots.shape[-1] - 1 if slots.dtype == torch.int8 else slots.shape[-1]


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., d]`` (any float dtype) as slots of ``dtype`` store it: ``[..., slot_width(d, dtype)]``;
    ``x`` already in ``dtype`` is taken as stored (a form may write what it read or encoded once)."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float16:  # a range smaller than the model's: saturate, never inf
        return x.clamp(-_FLOAT16_MAX, _FLOAT16_MAX).to(dtype)
    if dtype != torch.int8:
        return x.to(dtype)
    x = x.float()
    largest = x.abs().amax(-1, keepdim=True)
    _, exponent = torch.frexp(largest)  # largest = m 2^E, m in [0.5, 1) (0: E = 0)
    exponent = (exponent - _MANTISSA_BITS).clamp(_NOT_FINITE + 1, 127)  # its scale 2^e, e in int8's range
    finite = largest.isfinite()
    exponent = torch.where(finite, exponent, _NOT_FINITE)
    levels = torch.where(finite, torch.ldexp(x, -exponent).round().clamp(-_LEVEL, _LEVEL), 0.0)
    return torch.cat([levels, exponent.to(levels.dtype)], dim=-1).to(torch.int8)


def levels_and_scales(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``slots`` read as ``(levels [..., d] fp32, scales [..., 1] fp32 or None)``, ``decode(slots) =
    levels * scales``: a product with a vector of them may apply the scales to its few results instead
    of to every entry (``q . x = (q . levels) scale``), exactly, as a power of two scales without
    rounding. Float slots: ``(decode(slots), None)``."""
    if slots.dtype != torch.int8:
        return slots.float(), None
    exponent = slots[..., -1:]
    scales = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.int())
    return slots[..., :-1].float(), torch.where(exponent == _NOT_FINITE, torch.nan, scales)


def decode(slots: torch.Tensor) -> torch.Tensor:
    """What ``encode`` stored in ``slots``, in fp32: ``[..., d]``."""
    levels, scales = levels_and_scales(slots)
    return levels if scales is None else levels * scales
