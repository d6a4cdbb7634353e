"""The original model, loaded as a frozen teacher for a converted one.

Fine-tuning distils the original model's next-token distribution into the converted one (a KL
term on the logits), and evaluation compares against it. The teacher defaults to the model the
manifest names as the source, so a converted directory carries everything needed to find it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from rnnify.errors import RnnifyError
from rnnify.runtime.model import RecurrentModel

__all__ = ["check_vocabulary", "load_teacher", "local_source", "teacher_logits"]


def local_source(model: RecurrentModel, how_to_pass: str) -> str:
    """The manifest's source when it is here: a local directory or GGUF file (a hub id is not looked up
    again); else an error that says ``how_to_pass`` one."""
    from rnnify.compiler.gguf import is_gguf

    source = model.manifest.source
    if not source or not (Path(source).expanduser().is_dir() or is_gguf(source)):
        raise RnnifyError(
            f"the source model of this converted model ({source or 'not recorded'}) is not a local directory "
            f"or GGUF file; pass the original model with {how_to_pass}"
        )
    return source


def load_teacher(model: RecurrentModel, teacher: str | os.PathLike | nn.Module | None = None) -> nn.Module:
    """``load_teacher(model, teacher=None) -> PreTrainedModel``: the original model of ``model``.

    ``teacher`` is None (the manifest's ``source``, when that is a local directory or GGUF file), a local
    Hugging Face directory or cached hub id, or a loaded ``nn.Module`` (used as is). The result
    is in eval mode, has ``requires_grad=False`` everywhere and ``model``'s dtype and device; its
    vocabulary must match ``model``'s. Raises ``RnnifyError`` when no teacher can be found.
    """
    from rnnify.compiler.capture import load_source

    if teacher is None:
        teacher = local_source(model, "teacher= (Python) or --teacher (command line)")
    if isinstance(teacher, nn.Module):
        from transformers import PreTrainedModel

        module = load_source(teacher) if isinstance(teacher, PreTrainedModel) else teacher.eval()
    elif isinstance(teacher, (str, os.PathLike)):
        module = load_source(os.fspath(teacher), dtype=model.dtype)
    else:
        raise RnnifyError(f"teacher must be a model directory, hub id or nn.Module, got {type(teacher).__name__}")
    check_vocabulary(module, model, "the teacher")
    module = module.to(device=model.device, dtype=model.dtype).eval()
    module.requires_grad_(False)
    return module


def check_vocabulary(original: nn.Module, model: RecurrentModel, what: str) -> None:
    """Refuse an ``original`` whose vocabulary is not ``model``'s (``what`` names it): the ids of one
    index past the other's embeddings, and their logits cannot be compared."""
    vocab = getattr(getattr(original, "config", None), "vocab_size", None)
    if vocab is not None and vocab != model.manifest.vocab_size:
        raise RnnifyError(
            f"{what} has a vocabulary of {vocab} tokens but the converted model has "
            f"{model.manifest.vocab_size}; pass the model it was converted from"
        )


def teacher_logits(teacher: nn.Module, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """The original's logits for ``ids [B, T]``: in one call, or ``chunk`` tokens a call, each
    attending to the earlier ones through the model's own KV cache (less memory for long rows)."""
    if chunk is None or ids.shape[1] <= chunk:
        return teacher(input_ids=ids, use_cache=False).logits
    past, pieces = None, []
    for start in range(0, ids.shape[1], chunk):
        out = teacher(input_ids=ids[:, start : start + chunk], past_key_values=past, use_cache=True)
        past = out.past_key_values
        pieces.append(out.logits)
    return torch.cat(pieces, dim=1)
