"""The manifest (``rnnify.json``): what a saved directory holds and how to rebuild it.

It also records the sha256 of the directory's files (``files``) and seals itself with ``digest``,
the sha256 of its own canonical JSON (``content_digest``): a manifest edited by hand, or a file
changed without its record, no longer matches (``runtime.integrity`` checks both). The digest
covers every file's sha256, so it names the whole directory: a user who got it from someone they
trust can ask a load for it (``expected_digest``). A digest stored beside the files proves only that
nothing was damaged or half changed; whoever can rewrite the directory can rewrite the record too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rnnify.errors import RnnifyError, check_int, first_line
from rnnify.runtime.json_fields import check_fields, is_attribute_path
from rnnify.runtime.output_dir import replace_file

# rnnify.json's version (graph.json has its own: serialize.GRAPH_FORMAT_VERSION). 2 adds ``kernels``
# (and each cell's fused ops) and ``distill``; version 1 still loads, unfused. 3 records every file's
# sha256 (``files``, where 1 and 2 had the weights' alone) and seals the manifest (``digest``): 1 and 2
# load only unchecked (``rnnify.load(verify=False)``).
MANIFEST_FORMAT_VERSION = 3
MANIFEST_FILE = "rnnify.json"
DTYPES = ("float32", "bfloat16", "float16", "float64")  # the dtypes a model is saved in (``Manifest.dtype``)


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
    files: dict[str, str] = field(default_factory=dict)  # name -> sha256 of every file saved beside the manifest
    aliases: dict[str, str] = field(default_factory=dict)  # tied tensors: alias -> stored name
    buffers: list[str] = field(default_factory=list)  # tensors that are buffers, not parameters
    distill: dict[str, Any] | None = None  # settings and tokens of `rnnify distill`, if it trained the model
    kernels: str = "none"  # backend of the fused ops (auto, triton, reference), or none: the cells' PyTorch forms
    shipped_step: str | None = None  # what a shipped step-cpu.pt2 was compiled for (``aot.fingerprint``), if one ships
    format_version: int = MANIFEST_FORMAT_VERSION
    digest: str | None = None  # ``content_digest`` of the rest, set by ``write``

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Manifest":
        """The manifest of ``data``; ``ValueError`` naming the first field that does not fit."""
        if not isinstance(data, dict):
            raise ValueError(f"the manifest must be an object, got {type(data).__name__}")
        data = dict(data)
        data["kernels"] = data.get("kernels") or "none"  # format 1 has none; early format 2 wrote null for none
        data.pop("weights_sha256", None)  # formats 1 and 2 recorded the weights' sha256 alone; 3 has ``files``
        check_fields(cls, data, "manifest")
        if data["dtype"] not in DTYPES:
            raise ValueError(f"manifest.dtype must be one of {', '.join(DTYPES)}, got {data['dtype']!r}")
        check_int("manifest.vocab_size", data["vocab_size"], error=ValueError)
        for name in data.get("files", {}):  # names of files beside the manifest, never a path elsewhere
            if name in ("", ".", "..") or "/" in name or "\\" in name:
                raise ValueError(f"manifest.files names {name!r}, not a file of the directory")
        aliases = data.get("aliases", {})
        names = [cell["module"] for cell in data["cells"]] + [*aliases, *aliases.values(), *data.get("buffers", [])]
        for name in names:
            if not is_attribute_path(name):  # installed as attributes of the step module: no way out of it
                raise ValueError(f"manifest names a module or tensor {name!r:.60}, not a dotted attribute path")
        for key in ("limit", "graph_limit"):
            if data["positions"].get(key) is not None:
                check_int(f"manifest.positions.{key}", data["positions"][key], error=ValueError)
        data["cells"] = [CellEntry(**c) for c in data["cells"]]
        return cls(**data)

    def token_limit(self) -> tuple[int, str] | None:
        """(tokens, what they are) a sequence may not reach, or None where it may be of any length.

        Learned positions end where their table does (``positions.limit``); a graph captured below
        the length its config declares, from a source that branches on the length past it, holds
        below that length alone (``positions.graph_limit``, ``rnnify.compiler.capture``).
        """
        limits = []
        if self.positions.get("kind") == "learned" and self.positions.get("limit") is not None:
            limits.append((self.positions["limit"], "learned positions"))
        if self.positions.get("graph_limit") is not None:
            limits.append((self.positions["graph_limit"], "positions its graph holds for"))
        return min(limits) if limits else None

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        return cls.parse(read_data(directory), directory)

    @classmethod
    def parse(cls, data: dict[str, Any], directory: Path) -> "Manifest":
        """The manifest ``read_data`` read from ``directory``."""
        try:
            return cls.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise RnnifyError(f"{directory / MANIFEST_FILE}: corrupted manifest ({exc})") from exc

    def write(self, directory: Path) -> None:
        """Write ``rnnify.json`` into ``directory``, sealed with its ``digest``; the file is replaced whole
        (a manifest rewritten in place, by ``rnnify compile --ship``, is never seen half written)."""
        data = json.loads(json.dumps(self.to_json()))  # as it will be read back: tuples as lists, keys as strings
        self.digest = data["digest"] = content_digest(data)
        text = json.dumps(data, indent=2) + "\n"
        replace_file(directory / MANIFEST_FILE, lambda file: file.write(text.encode()))


def content_digest(data: dict[str, Any]) -> str:
    """sha256 of a manifest's canonical JSON (sorted keys, no spaces) without its ``digest``: what
    ``digest`` records, and the directory's digest (it covers every file's sha256)."""
    rest = {key: value for key, value in data.items() if key != "digest"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_data(directory: Path) -> dict[str, Any]:
    """``directory``'s manifest as JSON, of a format this rnnify reads (``Manifest.parse`` builds it)."""
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise RnnifyError(
            f"{directory}: {'a file, not a model directory' if directory.exists() else 'no such directory'}"
        )
    if not path.is_file():
        raise RnnifyError(
            f"{directory}: not an rnnify model directory (no {MANIFEST_FILE}); make one with `rnnify convert`"
        )
    try:
        data = json.loads(path.read_text())
    except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, bad UTF-8, an integer of 4,300+ digits
        raise RnnifyError(f"{path}: corrupted manifest ({first_line(exc)})") from exc
    version = data.get("format_version") if isinstance(data, dict) else None
    if not isinstance(version, int):
        raise RnnifyError(f"{path}: corrupted manifest (no format_version)")
    if version > MANIFEST_FORMAT_VERSION:
        raise RnnifyError(
            f"{path}: written by a newer rnnify (format version {version}; this one reads up to "
            f"{MANIFEST_FORMAT_VERSION}): upgrade rnnify"
        )
    return data
