"""How vLLM holds a converted directory's state, decided from the manifest alone (no weights read).

vLLM keeps each sequence's fixed-size recurrent state in a state-cache slot of one size, declared
when the engine starts (``state_template``: the shapes of one sequence's state), and a cache that
grows with the context in its paged KV cache. rnnify's ``exact`` cells are the only state that
grows: each exact site (a whole layer's cell, or the exact group of a head split) is paged
(``paged``), and a directory with any is served by the hybrid model class (``hf_files.PAGED_ARCHITECTURE``).
What vLLM's pages cannot hold is refused up front, in the process that builds vLLM's config, with
a one-line error that names it, rather than in vLLM's worker process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rnnify.cells import Cell, CellSpec, build_cell
from rnnify.cells.exact import ExactCell
from rnnify.cells.heads import HeadSplitCell
from rnnify.errors import RnnifyError, first_line
from rnnify.runtime.manifest import Manifest, read_data
from rnnify.runtime.state import RecurrentState
from rnnify.runtime.storage import WEIGHTS_FILE, check_spec_sizes, saved_options

__all__ = ["check_hostable", "exact_sites", "read_manifest", "state_template"]


def read_manifest(path: str | Path) -> Manifest:
    """``path``'s manifest, its cells' sizes no larger than its weights file (in bytes, so in
    elements too): the cells are built from it here, before ``rnnify.load`` reads any weight."""
    path = Path(path)
    manifest = Manifest.parse(read_data(path), path)
    try:
        room = (path / WEIGHTS_FILE).stat().st_size
        for entry in manifest.cells:
            check_spec_sizes(entry.module, CellSpec(**entry.spec), room)
    except (OSError, TypeError, ValueError) as exc:
        raise RnnifyError(f"{path}: {first_line(exc)}; convert the model again") from exc
    return manifest


def _cells(manifest: Manifest) -> list[Cell]:
    """The manifest's cells, in state order, on the meta device: their kinds and state shapes only."""
    with torch.device("meta"):
        return [
            build_cell(entry.target, CellSpec(**entry.spec), saved_options(entry.target, entry.options))
            for entry in manifest.cells
        ]


def exact_sites(manifest: Manifest) -> list[ExactCell]:
    """The exact cells of ``manifest``'s model, whole cells and head-split groups alike."""
    return [module for cell in _cells(manifest) for module in cell.modules() if isinstance(module, ExactCell)]


def state_template(manifest: Manifest) -> RecurrentState:
    """One empty sequence's state, on the meta device: its shapes and dtypes. Exact sites hold
    nothing there (their keys and values are paged)."""
    dtype = getattr(torch, manifest.dtype)
    tensors = tuple(t for cell in _cells(manifest) for t in cell.init_state(1, "meta", dtype))
    return RecurrentState(tensors, torch.zeros(1, dtype=torch.long, device="meta"), manifest.uid)


def check_hostable(path: str | Path, head_size: int | None = None, num_kv_heads: int | None = None) -> Manifest:
    """``path``'s manifest, or a one-line ``RnnifyError`` when vLLM cannot hold its state: a cell
    whose state grows that is not exact attention, or an exact site that vLLM's pages (``head_size``
    wide, ``num_kv_heads`` per token: the model's, as vLLM reads them) cannot hold."""
    manifest = read_manifest(path)
    for entry, cell in zip(manifest.cells, _cells(manifest)):
        where = f"vLLM cannot host target {manifest.target!r}: {entry.module}'s"
        computing = [m for m in cell.modules() if isinstance(m, Cell) and not isinstance(m, HeadSplitCell)]
        for part in computing:  # a head split's parts, not the split
            if part.grows_with_context and not isinstance(part, ExactCell):
                raise RnnifyError(f"{where} {part.target} state grows with the context and is not exact attention")
            if not isinstance(part, ExactCell):
                continue
            spec = part.spec
            if spec.chunk is not None:
                raise RnnifyError(
                    f"{where} exact attention attends in chunks of {spec.chunk} tokens (Llama 4's), which "
                    "rnnify's vLLM pages do not serve; decode it with rnnify generate or rnnify.load"
                )
            if spec.selects:
                raise RnnifyError(
                    f"{where} exact attention reads only the keys its indexer selects (sparse attention), which "
                    "rnnify's vLLM pages do not serve; decode it with rnnify generate or rnnify.load"
                )
            if spec.per_query_terms:
                raise RnnifyError(
                    f"{where} exact attention adds to its scores terms each query brings (Inkling's relative bias "
                    "or sink logits), which rnnify's vLLM pages do not serve; decode it with rnnify generate or "
                    "rnnify.load"
                )
            if spec.head_dim != spec.value_dim or (head_size is not None and spec.head_dim != head_size):
                raise RnnifyError(
                    f"{where} exact attention has keys {spec.head_dim} and values {spec.value_dim} wide; "
                    f"vLLM's pages hold both at the model's head size ({head_size or spec.head_dim})"
                )
            if num_kv_heads is not None and spec.num_kv_heads > num_kv_heads:
                raise RnnifyError(
                    f"{where} exact attention has {spec.num_kv_heads} kv heads; vLLM's pages hold the "
                    f"model's {num_kv_heads}"
                )
    return manifest
