"""Training checkpoints: everything needed to continue a distillation exactly where it stopped.

One file, ``checkpoint.pt`` in the checkpoint directory, replaced atomically (written beside it,
then renamed) so an interruption while saving leaves the previous one intact. It holds the
trainable tensors (cell parameters and LoRA factors, by parameter name), the optimizer state, the
stage and step reached (which is also the data position: one step reads one global batch), the
per-stage records so far and the settings (the model's source and cells among them); a resumed
run must use the same settings. No random state: training draws nothing at random after LoRA's
initialisation, which the checkpoint's tensors replace. A run that does not resume moves an
earlier checkpoint aside first (``set_aside``), so a later resume cannot continue an older run.
Once the trained model is saved the checkpoint has served its purpose (``remove_checkpoint``).
Loaded with ``weights_only=True``: nothing in it is code.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import torch

from rnnify.errors import RnnifyError
from rnnify.runtime.output_dir import file_in_the_way, replace_file

__all__ = [
    "CHECKPOINT_FILE",
    "Checkpoint",
    "check_checkpoint_dir",
    "load_checkpoint",
    "remove_checkpoint",
    "save_checkpoint",
    "set_aside",
]

CHECKPOINT_FILE = "checkpoint.pt"
PREVIOUS_FILE = CHECKPOINT_FILE + ".previous"


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


def check_checkpoint_dir(directory: str | os.PathLike | None, resume: bool) -> None:
    """Refuse, before any training, a checkpoint directory that the first checkpoint could not be
    written to (a file in its place or in place of a folder above it), and a resume without one."""
    if directory is None:
        if resume:
            raise RnnifyError("resume needs checkpoint_dir (--checkpoint-dir): the directory of the interrupted run")
        return
    place = file_in_the_way(Path(directory).expanduser())
    if place is not None:
        raise RnnifyError(f"checkpoint_dir (--checkpoint-dir) {directory}: {place} is a file, not a directory")


def save_checkpoint(directory: str | os.PathLike, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint`` to ``directory/checkpoint.pt``, replacing any previous one atomically."""
    directory = Path(directory).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CHECKPOINT_FILE
        replace_file(path, lambda file: torch.save(asdict(checkpoint), file))
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
        for name, kind in get_type_hints(Checkpoint).items():
            if not isinstance(getattr(checkpoint, name), get_origin(kind) or kind):
                raise TypeError(f"its {name} is a {type(getattr(checkpoint, name)).__name__}")
    except Exception as exc:  # unpickling raises many types; all mean the same to the user
        raise RnnifyError(f"{path}: unreadable checkpoint ({exc}); delete it to start over") from exc
    changed = sorted(
        k for k in settings.keys() | checkpoint.settings.keys() if settings.get(k) != checkpoint.settings.get(k)
    )
    if changed:
        detail = ", ".join(_difference(k, checkpoint.settings.get(k), settings.get(k)) for k in changed)
        raise RnnifyError(
            f"{path} was written with other settings ({detail}); resume with the same settings, "
            "or use another checkpoint directory to start over"
        )
    return checkpoint


def _difference(key: str, old: Any, new: Any) -> str:
    """``key: old -> new``; of two lists as long, only the first entry that differs (a model has many cells)."""
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        i = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
        return f"{key}[{i}]: {old[i]!r} -> {new[i]!r}"
    return f"{key}: {old!r} -> {new!r}"


def set_aside(directory: str | os.PathLike) -> Path | None:
    """Rename ``directory``'s checkpoint to ``checkpoint.pt.previous`` (replacing an older one) so that
    a fresh run's ``--resume`` later cannot continue the earlier run; the new path, None if there was none.
    Renamed rather than deleted: a forgotten ``--resume`` must not cost a run's progress."""
    directory = Path(directory).expanduser()
    path = directory / CHECKPOINT_FILE
    if not path.is_file():
        return None
    try:
        os.replace(path, directory / PREVIOUS_FILE)
    except OSError as exc:
        raise RnnifyError(
            f"cannot move the earlier checkpoint {path} aside: {exc.strerror or exc}; "
            "delete it, or pass --resume to continue that run"
        ) from exc
    return directory / PREVIOUS_FILE


def remove_checkpoint(directory: str | os.PathLike) -> bool:
    """Delete ``directory``'s checkpoint, and ``directory`` if that leaves it empty; whether it is gone.

    Only the file training wrote goes: an earlier run's ``checkpoint.pt.previous`` (see ``set_aside``)
    or anything else the user put there keeps the directory."""
    directory = Path(directory).expanduser()
    try:
        (directory / CHECKPOINT_FILE).unlink(missing_ok=True)
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
    except OSError as exc:
        raise RnnifyError(
            f"cannot delete the checkpoint in {directory}: {exc.strerror or exc}; "
            "delete it yourself (the model is saved)"
        ) from exc
    return not directory.exists()
