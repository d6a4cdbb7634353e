"""Reading a GGUF file (llama.cpp's format) as an ordinary Hugging Face causal LM.

transformers dequantises every GGUF tensor to the requested dtype (it needs the ``gguf`` and
``accelerate`` packages: ``pip install "rnnify[gguf]"``). rnnify asks for that explicitly
(``GgufConfig(dequantize=True)``); a model that still comes back with transformers' GGUF quantizer
(a ``quantization_config``; it refuses ``save_pretrained``) is rebuilt as a plain model of the
same class from its config without it, with the dequantised weights loaded. Either way the rest of
rnnify sees the model it would have loaded from a Hugging Face directory.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from rnnify.errors import RnnifyError, UnsupportedModelError, first_line

__all__ = ["is_gguf", "load_gguf", "tokenizer_files"]

_MAGIC = b"GGUF"
_PACKAGES = ("gguf", "accelerate")


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a file named ``*.gguf`` or starting with GGUF's magic bytes."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(len(_MAGIC)) == _MAGIC


def _require_packages(path: Path) -> None:
    missing = []
    for name in _PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise RnnifyError(
            f"{path}: reading GGUF files needs the {' and '.join(missing)} package{'s' * (len(missing) > 1)}; "
            'install them with: pip install "rnnify[gguf]"'
        )


def _architecture(path: Path) -> str:
    """The file's ``general.architecture``, reading the header and tensor index (not the weights)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        architecture = bytes(field.parts[field.data[0]]).decode()
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as exc:  # the reader fails in many ways on a damaged file; report them as one
        raise RnnifyError(
            f"{path}: not a readable GGUF file ({first_line(exc, with_type=True)}); it may be truncated or corrupt, download it again"
        ) from exc
    if end > path.stat().st_size:
        raise RnnifyError(
            f"{path}: truncated GGUF file ({path.stat().st_size} bytes, its tensors need {end}); download it again"
        )
    return architecture


def _dequantize_options() -> dict:
    """``from_pretrained`` options that unpack every GGUF weight (else, with the ``kernels`` package
    installed, transformers keeps quantised weights packed in their blocks)."""
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers before GgufConfig always dequantises
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The causal LM in GGUF file ``path``, dequantised to ``dtype``, as a plain ``PreTrainedModel``."""
    path = Path(path).expanduser().resolve()
    _require_packages(path)
    architecture = _architecture(path)
    from transformers import AutoModelForCausalLM

    try:
        with alone(path) as file:
            model = AutoModelForCausalLM.from_pretrained(
                str(file.parent),
                gguf_file=file.name,
                dtype=dtype,
                attn_implementation="sdpa",
                local_files_only=True,
                trust_remote_code=False,
                **_dequantize_options(),
            )
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise UnsupportedModelError(
            f"{path}: transformers cannot read a {architecture} GGUF file as a causal LM ({first_line(exc, with_type=True)}); "
            "rnnify reads the GGUF architectures transformers supports (llama, mistral, qwen2, ...)"
        ) from exc
    model.config._name_or_path = str(path)
    if getattr(model, "hf_quantizer", None) is None and getattr(model.config, "quantization_config", None) is None:
        return model
    return _plain(model, dtype)


def _plain(model, dtype: torch.dtype) -> torch.nn.Module:
    """The same model without the GGUF quantizer transformers attaches when it does not dequantise on
    request (it keeps a ``quantization_config`` and refuses ``save_pretrained``)."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    plain.load_state_dict(model.state_dict(), strict=True)
    return plain


@contextmanager
def alone(path: Path) -> Iterator[Path]:
    """GGUF file ``path`` as a link in a folder that holds nothing else: transformers reads the folder
    a GGUF file is in too (a tokenizer_config.json there could name code or files elsewhere, a peft
    adapter_config.json another model), and a GGUF file is all rnnify reads."""
    with tempfile.TemporaryDirectory() as directory:
        file = Path(directory) / path.name
        file.symlink_to(path)
        yield file


def tokenizer_files(path: str | os.PathLike) -> dict[str, bytes]:
    """The tokenizer (and chat template) stored in GGUF file ``path`` as Hugging Face tokenizer files,
    or none when the file holds no tokenizer transformers can build."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser().resolve()
    try:
        with alone(path) as file:
            tokenizer = AutoTokenizer.from_pretrained(
                str(file.parent), gguf_file=file.name, local_files_only=True, trust_remote_code=False
            )
    except (ValueError, KeyError, TypeError, OSError):
        return {}
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        return {f.name: f.read_bytes() for f in Path(directory).iterdir() if f.is_file()}
