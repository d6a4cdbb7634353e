"""Training checkpoints: everything needed to continue a distillation exactly where it stopped.

One file, ``checkpoint.pt`` in the checkpoint directory, replaced atomically (written beside it,
then renamed) so an interruption while saving leaves the previous one intact. It holds the
trainable tensors (cell parameters and LoRA factors, by parameter name), the optimizer state, the
stage and step reached (which is also the data position: one step reads one global batch), the
per-stage records so far, the RNG state and the settings; a resumed run must use the same
settings. Loaded with ``weights_only=True``: nothing in it is code.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rnnify.errors import RnnifyError

__all__ = ["CHECKPOINT_FILE", "Checkpoint", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class Checkpoint:
    stage: str  # the stage being trained when saved
    step: int  # optimizer steps (= global batches read) done in that stage
    done: bool  # the stage finished
    tokens: int  # real tokens read in that stage, all ranks together
    trainable: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    settings: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)  # finished stages
    rng: torch.Tensor | None = None


def save_checkpoint(directory: str | os.PathLike, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` to ``directory/checkpoint.pt``, replacing any previous one atomically."""
    directory = Path(directory).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CHECKPOINT_FILE
        tmp = directory / f".{CHECKPOINT_FILE}.tmp"
        torch.save(asdict(checkpoint), tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise RnnifyError(f"cannot write a checkpoint to {directory}: {exc.strerror or exc}") from exc
    return path


def load_checkpoint(directory: str | os.PathLike, settings: dict[str, Any]) -> Checkpoint | None:
    """The checkpoint in ``directory`` (None if there is none); its settings must equal ``settings``."""
    path = Path(directory).expanduser() / CHECKPOINT_FILE
    if not path.is_file():
        return None
    try:
        checkpoint = Checkpoint(**torch.load(path, map_location="cpu", weights_only=True))
    except Exception as exc:  # unpickling raises many types; all mean the same to the user
        raise RnnifyError(f"{path}: unreadable checkpoint ({exc}); delete it to start over") from exc
    changed = sorted(k for k in settings.keys() | checkpoint.settings.keys() if settings.get(k) != checkpoint.settings.get(k))
    if changed:
        detail = ", ".join(f"{k}: {checkpoint.settings.get(k)!r} -> {settings.get(k)!r}" for k in changed)
        raise RnnifyError(
            f"{path} was written with other settings ({detail}); resume with the same settings, "
            "or use another checkpoint directory to start over"
        )
    return checkpoint
