"""The original model's outputs, kept on disk by content hash: a sweep over converted models runs it once.

Comparing many converted models with one original on the same long rows recomputes the same
original logits each time; at 8,192 tokens that is most of a row's cost on a CPU. So the
original's logits (and its greedy pass-key answers) are stored in this user's rnnify cache
(``rnnify.runtime.step_cache.cache_root``, folder ``original``) under the SHA-256 of what
determines them: the bytes of the original's config and weight files, the dtype, and the token ids
(or prompt and answer length). A changed weight file is a different key, never a stale hit. The
entries are plain tensors (safetensors) and JSON: reading one runs no code. Only an original
given as a local directory is cached; a model passed in memory has no content to name it by.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from rnnify.runtime.integrity import sha256_file
from rnnify.runtime.output_dir import replace_file
from rnnify.runtime.step_cache import cache_root

__all__ = ["OriginalOutputs", "content_digest"]

# the files of a Hugging Face directory (or a GGUF file) that determine its outputs (an index maps
# tensors to the shards that hold them)
DETERMINING = ("config.json", "*.index.json", "*.safetensors", "*.bin", "*.gguf", "*.pt", "*.pth")


def content_digest(source: str | os.PathLike) -> str | None:
    """SHA-256 over the names and contents of the files that make ``source``'s outputs; None if it is
    neither a directory nor a file."""
    path = Path(source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted({f for pattern in DETERMINING for f in path.glob(pattern) if f.is_file()})
    else:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0{sha256_file(file)}\0".encode())
    return digest.hexdigest()


class OriginalOutputs:
    """Logits and greedy answers of one original model, from the cache when it has them.

    ``compute_logits(ids [1, T]) -> [1, T, V]`` and ``compute_answer(ids, new) -> token ids`` run the
    model (loading it on first use is the caller's affair); ``digest`` (``content_digest``, with the
    dtype) names its content, or None to cache nothing.
    """

    def __init__(
        self,
        digest: str | None,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        compute_answer: Callable[[list[int], int], list[int]] | None = None,
    ):
        self.digest = digest
        self.compute_logits = compute_logits
        self.compute_answer = compute_answer
        self.hits = self.misses = 0

    def _entry(self, kind: str, *parts: bytes) -> Path | None:
        if self.digest is None:
            return None
        key = hashlib.sha256(b"\0".join([self.digest.encode(), kind.encode(), *parts])).hexdigest()
        return cache_root() / "original" / kind / key[:2] / key

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """The original's logits for each row of ``ids [B, T]``, fp32, on ``ids``' device."""
        from safetensors.torch import load_file, save

        rows = []
        for row in ids:
            entry = self._entry("logits", row.cpu().to(torch.int64).numpy().tobytes())
            if entry is not None and entry.with_suffix(".safetensors").is_file():
                self.hits += 1
                rows.append(load_file(entry.with_suffix(".safetensors"))["logits"].to(ids.device))
                continue
            self.misses += 1
            logits = self.compute_logits(row[None])[0].float()
            if entry is not None:
                _write(entry.with_suffix(".safetensors"), lambda file, t=logits: file.write(save({"logits": t.cpu()})))
            rows.append(logits)
        return torch.stack(rows)

    def answer(self, ids: list[int], new: int) -> list[int]:
        """The original's ``new`` greedy tokens after ``ids``."""
        entry = self._entry("answer", json.dumps([ids, new]).encode())
        if entry is not None and entry.with_suffix(".json").is_file():
            self.hits += 1
            return [int(t) for t in json.loads(entry.with_suffix(".json").read_text())]
        self.misses += 1
        tokens = self.compute_answer(ids, new)
        if entry is not None:
            _write(entry.with_suffix(".json"), lambda file: file.write(json.dumps(tokens).encode()))
        return tokens


def _write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` ``path`` whole (``replace_file``): a reader never sees half a file. A cache that cannot
    be written is skipped, the result is still returned."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        replace_file(path, write)
