"""The streaming safetensors writer: what safetensors itself reads back, and the sha256 of the file."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rnnify.runtime.weights_file import write_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    return {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "f64": base.double(),
        "transposed": base.t(),  # not contiguous
        "row": base[2],  # a view at a storage offset
        "expanded": torch.arange(3.0).expand(4, 3),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "i64": torch.arange(-5, 5),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "parameter": torch.nn.Parameter(torch.ones(2, 2)),
    }


def test_safetensors_reads_back_every_tensor(tmp_path):
    tensors = _tensors()
    write_safetensors(tmp_path / "w.safetensors", tensors, metadata={"format": "pt"})
    loaded = load_file(tmp_path / "w.safetensors")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor.detach()), name
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_returns_the_sha256_of_the_file(tmp_path):
    digest = write_safetensors(tmp_path / "w.safetensors", _tensors())
    assert digest == hashlib.sha256((tmp_path / "w.safetensors").read_bytes()).hexdigest()


def test_no_tensors_is_a_valid_file(tmp_path):
    write_safetensors(tmp_path / "w.safetensors", {})
    assert load_file(tmp_path / "w.safetensors") == {}


def test_an_unsupported_dtype_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(tmp_path / "w.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
    assert not (tmp_path / "w.safetensors").exists()
