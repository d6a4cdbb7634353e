"""Checking a converted directory against the sha256 its manifest recorded when it was saved.

A directory is data that travels: every file a load reads (the weights, the graph, the tokenizer
and config files, the ``modeling_rnnify.py`` transformers runs) must be the one that was saved, so
a file changed, added or removed since is refused by name rather than run. The manifest is sealed
too (``manifest.content_digest``): editing a recorded sha256 without resealing is refused. What
this proves is integrity (nothing damaged or half replaced), not who wrote the directory: anyone
who can rewrite it can rewrite the record and the seal. The seal is also the directory's digest,
and a digest the user got from someone they trust (``expected``) is what makes it authentic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rnnify.errors import RnnifyError
from rnnify.runtime.manifest import MANIFEST_FILE, MANIFEST_FORMAT_VERSION, content_digest

__all__ = ["check", "record", "sha256_file"]

_UNCHECKED = "load it unchecked with verify=False (--no-verify) only if you trust where it came from"


def sha256_file(path: Path) -> str:
    """``path``'s sha256, read in blocks (a weights file need not fit in memory twice)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """The sha256 of each of ``names`` in ``directory``, as the manifest records them."""
    return {name: sha256_file(directory / name) for name in names}


def check(
    directory: Path,
    data: dict[str, Any],
    required: Iterable[str],
    optional: Iterable[str] = (),
    expected: str | None = None,
) -> None:
    """Refuse ``directory`` (one ``RnnifyError`` line naming what differs) unless its manifest ``data``
    (as read, ``manifest.read_data``) is sealed and every one of ``required`` files, and of ``optional``
    files present or recorded, is there with the sha256 it records; ``expected`` is the directory's
    digest as the user was given it."""
    manifest = directory / MANIFEST_FILE
    version = data.get("format_version")
    if version < MANIFEST_FORMAT_VERSION:
        raise RnnifyError(
            f"{directory}: written by an older rnnify (manifest format {version}), which records no "
            f"sha256 of its files: convert the model again, or {_UNCHECKED}"
        )
    files = data.get("files")
    if not isinstance(files, dict) or not files or not data.get("digest"):
        raise RnnifyError(
            f"{manifest} has no sha256 record of the directory's files (it was edited): convert the "
            f"model again, or {_UNCHECKED}"
        )
    digest = content_digest(data)
    if digest != data["digest"]:
        raise RnnifyError(
            f"{manifest} does not match its own digest: it was edited after it was saved; convert the "
            f"model again, or {_UNCHECKED}"
        )
    if expected is not None and digest != expected.strip().lower():
        raise RnnifyError(
            f"{directory}: its digest is {digest}, not the {expected.strip()} expected: it is not the "
            "directory that digest was given for; do not load it"
        )
    optional = [name for name in optional if name in files or (directory / name).is_file()]
    for name in dict.fromkeys([*required, *optional]):
        path = directory / name
        if name not in files:
            raise RnnifyError(
                f"{path} is not in the sha256 record of {manifest}: it was added after the model was "
                f"saved; remove it, or {_UNCHECKED}"
            )
        if not path.is_file():
            raise RnnifyError(
                f"{path} is missing, though {manifest} records it: copy the whole directory, or {_UNCHECKED}"
            )
        if sha256_file(path) != files[name]:
            raise RnnifyError(
                f"{path} does not match the sha256 recorded in {MANIFEST_FILE} when it was saved: it was "
                f"changed or damaged since; convert the model again, or {_UNCHECKED}"
            )
