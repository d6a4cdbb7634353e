"""The manifest (``rnnify.json``): what a saved directory holds and how to rebuild it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rnnify.errors import RnnifyError

# rnnify.json's version (graph.json has its own: serialize.GRAPH_FORMAT_VERSION). 2 adds ``kernels``
# (and each cell's fused ops) and ``distill``; version 1 still loads, unfused.
MANIFEST_FORMAT_VERSION = 2
MANIFEST_FILE = "rnnify.json"


@dataclass
class CellEntry:
    """One attention site: where it was and which cell replaced it."""

    module: str  # submodule name in the graph, e.g. "cells.0"
    layer: int
    module_path: str
    target: str
    spec: dict[str, Any]
    options: dict[str, Any]
    kernels: dict[str, str] = field(default_factory=dict)  # fused op per phase, e.g. {"decode": "window_attn_step"}


@dataclass
class Manifest:
    uid: str
    target: str
    options: dict[str, Any]
    source: str | None
    dtype: str
    vocab_size: int
    positions: dict[str, Any]
    cells: list[CellEntry]
    layers: list[str] = field(default_factory=list)  # per-layer rules over `target`, e.g. "0-1:exact"
    versions: dict[str, str] = field(default_factory=dict)
    weights_sha256: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # tied tensors: alias -> stored name
    buffers: list[str] = field(default_factory=list)  # tensors that are buffers, not parameters
    distill: dict[str, Any] | None = None  # settings and tokens of `rnnify distill`, if it trained the model
    kernels: str = "none"  # backend of the fused ops (auto, triton, reference), or none: the cells' PyTorch forms
    format_version: int = MANIFEST_FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Manifest":
        data = dict(data)
        data["cells"] = [CellEntry(**c) for c in data["cells"]]
        data["kernels"] = data.get("kernels") or "none"  # format 1 has none; early format 2 wrote null for none
        return cls(**data)

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = directory / MANIFEST_FILE
        if not directory.is_dir():
            raise RnnifyError(f"{directory}: no such directory")
        if not path.is_file():
            raise RnnifyError(f"{directory}: not an rnnify model directory (no {MANIFEST_FILE}); make one with `rnnify convert`")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RnnifyError(f"{path}: corrupted manifest ({exc})") from exc
        version = data.get("format_version") if isinstance(data, dict) else None
        if not isinstance(version, int):
            raise RnnifyError(f"{path}: corrupted manifest (no format_version)")
        if version > MANIFEST_FORMAT_VERSION:
            raise RnnifyError(
                f"{path}: written by a newer rnnify (format version {version}; this one reads up to "
                f"{MANIFEST_FORMAT_VERSION}): upgrade rnnify"
            )
        try:
            return cls.from_json(data)
        except (KeyError, TypeError) as exc:
            raise RnnifyError(f"{path}: corrupted manifest ({exc})") from exc

    def write(self, directory: Path) -> None:
        (directory / MANIFEST_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")
