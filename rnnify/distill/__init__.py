"""Distillation of a converted model back towards its original (LoLCATs; docs/distill.md).

The math: docs/math.md §Attention transfer.

``rnnify.distill(model, data, ...)`` runs ``train.distill`` (the package is callable, so the
submodules below stay importable as ``rnnify.distill.<name>``). ``rnnify.original`` (re-exported
here) compares each cell with the softmax attention it replaced (stage 1, and ``rnnify eval``) and
loads the original model; ``lora`` adds and merges LoRA; ``losses``, ``checkpoint``, ``distributed`` and
``fsdp`` (sharding per decoder layer) serve the training loop; ``options`` holds its
command-line flags.
"""

import sys
import types

from rnnify.distill.train import DEFAULT_LR, STAGES, distill
from rnnify.original import AttentionRecorder, LayerError, attention_transfer, load_teacher, softmax_attention

__all__ = [
    "AttentionRecorder", "DEFAULT_LR", "LayerError", "STAGES", "attention_transfer", "distill", "load_teacher",
    "softmax_attention",
]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return distill(*args, **kwargs)

    __call__.__doc__ = distill.__doc__


sys.modules[__name__].__class__ = _CallablePackage
