"""Write a safetensors file one tensor at a time, hashing what is written.

``safetensors.torch.save_file`` takes every tensor at once as contiguous CPU memory, so saving a
model whose weights are views, or on a GPU, first copied all of them: a second copy of the
weights at the peak of a conversion. This writer lays out the header from shapes alone, then
writes each tensor's bytes straight from its memory (a tensor that is not contiguous on the CPU,
such as a column-major weight, is copied a block of rows at a time), and returns the file's
sha256 so nothing is read back.
The file is the format ``safetensors.torch.load_file`` reads: an 8-byte little-endian header
length, a JSON header padded with spaces to a multiple of 8 bytes, then the tensors' bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Iterator, Mapping

import torch

__all__ = ["write_safetensors"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _header(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"{name}: cannot save dtype {tensor.dtype} in safetensors")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


_BLOCK_BYTES = 1 << 24  # at most this much of a tensor is copied at once to lay it out row-major


def _host_bytes(tensor: torch.Tensor) -> Iterator[memoryview]:
    """``tensor``'s bytes in row-major order: its own memory when it is contiguous on the CPU, else
    copies of blocks of its rows."""
    tensor = tensor.detach()
    if tensor.dim() == 0 or tensor.numel() == 0 or (tensor.device.type == "cpu" and tensor.is_contiguous()):
        blocks: tuple[torch.Tensor, ...] = (tensor,)
    else:
        blocks = tensor.split(max(1, _BLOCK_BYTES // (tensor[0].numel() * tensor.element_size())))
    for block in blocks:
        yield memoryview(block.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` to ``path`` in safetensors format; returns the file's sha256 (hex)."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; saving on a big-endian machine is not supported")
    header = _header(tensors, metadata)
    digest = hashlib.sha256()
    with Path(path).open("wb") as f:
        f.write(header)
        digest.update(header)
        for tensor in tensors.values():
            for data in _host_bytes(tensor):
                f.write(data)
                digest.update(data)
    return digest.hexdigest()
