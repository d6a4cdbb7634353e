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

from typing import TYPE_CHECKING

from rnnify.lazy import lazy_attributes

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


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
