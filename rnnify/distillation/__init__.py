"""Distillation of a converted model back towards its original (LoLCATs; docs/distill.md).

The math: docs/math.md §Attention transfer.

``rnnify.distill(model, data, ...)`` is ``train.distill``. ``rnnify.original`` (re-exported
here) compares each cell with the softmax attention it replaced (stage 1, and ``rnnify eval``) and
loads the original model; ``lora`` adds and merges LoRA; ``losses``, ``checkpoint``, ``distributed`` and
``fsdp`` (sharding per decoder layer) serve the training loop; ``options`` holds its
command-line flags.

The names below import on first use (module ``__getattr__``), as ``rnnify``'s do: the command
line imports ``options`` to build its flags, which must not import torch (``rnnify.choices``).
"""

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_LAZY = {
    "distill": "rnnify.distillation.train",
    "DEFAULT_LR": "rnnify.choices",
    "STAGES": "rnnify.choices",
    "AttentionRecorder": "rnnify.original",
    "LayerError": "rnnify.original",
    "attention_transfer": "rnnify.original",
    "load_teacher": "rnnify.original",
    "softmax_attention": "rnnify.original",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from rnnify.choices import DEFAULT_LR, STAGES
    from rnnify.distillation.train import distill
    from rnnify.original import AttentionRecorder, LayerError, attention_transfer, load_teacher, softmax_attention


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rnnify.distillation' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
