"""Which converted directories vLLM can host, decided from the manifest alone (no weights read).

vLLM keeps each sequence's recurrent state in a state-cache slot of one fixed size, declared when
the engine starts. A target whose state grows with the context (``exact``, or a head split with an
``exact`` group) does not fit; it is refused up front, in the process that builds vLLM's config, with
a one-line error that names it, rather than in vLLM's worker process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rnnify.cells import CellSpec, build_cell
from rnnify.errors import RnnifyError
from rnnify.runtime.manifest import Manifest, read_data
from rnnify.runtime.storage import saved_options

__all__ = ["check_hostable", "growing_targets"]


def growing_targets(manifest: Manifest) -> list[str]:
    """The targets of ``manifest``'s cells whose state grows with the context (no window bounds it)."""
    grows = set()
    with torch.device("meta"):  # the cells' own parameters are not needed, only their kind
        for entry in manifest.cells:
            cell = build_cell(entry.target, CellSpec(**entry.spec), saved_options(entry.target, entry.options))
            if cell.grows_with_context and cell.spec.window is None:
                grows.add(entry.target)
    return sorted(grows)


def check_hostable(path: str | Path) -> Manifest:
    """``path``'s manifest, or a one-line ``RnnifyError`` when vLLM cannot hold its state."""
    path = Path(path)
    manifest = Manifest.parse(read_data(path), path)
    grows = growing_targets(manifest)
    if grows:
        raise RnnifyError(
            f"vLLM cannot host target {manifest.target!r} yet: its state grows with the context "
            f"({', '.join(grows)} cells) and vLLM's state cache holds a fixed size per sequence; "
            "convert with a constant-memory target (e.g. --to window)"
        )
    return manifest
