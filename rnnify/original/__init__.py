"""The original model a converted one is measured against, shared by evaluation and distillation.

``teacher`` loads the original (by default the source the manifest names); ``attention`` compares
each cell with the softmax attention it replaced, on the cell's own inputs.
"""

from rnnify.original.attention import AttentionRecorder, LayerError, attention_transfer, softmax_attention
from rnnify.original.teacher import load_teacher, local_source, teacher_logits

__all__ = [
    "AttentionRecorder",
    "LayerError",
    "attention_transfer",
    "load_teacher",
    "local_source",
    "softmax_attention",
    "teacher_logits",
]
