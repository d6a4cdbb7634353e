"""The names the command line offers and the defaults its help states, without importing torch.

``rnnify COMMAND --help`` and a mistyped flag should answer at once, but the modules that implement
these names import torch (about 1.5 s). So each name is stated here, once, and those modules import
it from here: the ``--to`` targets (with the line of help each gets), the feature maps, the hybrid's
memories, the kernel backends, the row length, and the distillation stages, what fine-tuning
trains, its learning rates and schedules. ``rnnify.cells`` builds the targets and feature maps
from their classes; tests/test_cli.py checks that they are the ones named here.
"""

from __future__ import annotations

__all__ = [
    "AUTO_ALL_MAX_PARAMETERS", "BACKENDS", "DEFAULT_LR", "DEFAULT_SEQ_LEN", "FEATURE_MAPS", "KERNELS", "MEMORIES",
    "SCHEDULES", "STAGES", "TARGETS", "TRAIN",
]

# --to: each cell's target name (``rnnify.cells.CELLS``, in its order) and what it computes
TARGETS = {
    "exact": "softmax attention, unchanged, as an RNN over a growing key/value state",
    "linear": "linear attention with a feature map (fixed or trainable), normalised or not",
    "aaren": "softmax attention of a learned per-head query over the prefix: constant state, trainable",
    "gated": "decayed linear attention with a fixed (retnet) or trained, input-dependent (gla, gateloop) gate",
    "window": "softmax over the last W tokens and the first S (attention sinks), with constant memory",
    "hybrid": "softmax over the last W tokens and the first S (sinks) plus a memory of the older ones "
              "(linear attention unless --memory), trainable",
    "gated-rnn": "linear attention written as the gated linear RNN that implements it (d^2 + d neurons per head)",
    "delta": "DeltaNet: linear attention whose writes first erase the key's old value (delta rule)",
    "gated-delta": "Gated DeltaNet: the delta rule with a data-dependent decay alpha_t of the whole state",
    "select": "softmax over sinks, a recent window and past tokens selected by attention (H2O, SnapKV), "
              "with constant memory",
}
FEATURE_MAPS = ("elu", "relu", "identity", "performer", "taylor", "hedgehog", "t2r")  # ``cells.linear.FEATURE_MAPS``
MEMORIES = ("linear", "gla", "delta", "gated-delta")  # what holds the tokens that left the hybrid's window

BACKENDS = ("auto", "triton", "reference")  # the fused ops' ``backend=``
# A model's ``kernels``: a backend of its cells' fused ops, or "none": the cells' own PyTorch forms.
KERNELS = (*BACKENDS, "none")

DEFAULT_SEQ_LEN = 1024  # tokens per row unless told otherwise, clamped to the model's position limit

STAGES = ("transfer", "finetune")  # distillation's stages, in the order they run
TRAIN = ("auto", "lora", "attention", "all")  # what the finetune stage trains besides the cells' parameters
AUTO_ALL_MAX_PARAMETERS = 1_000_000_000  # train "auto": every weight up to this size, LoRA above
DEFAULT_LR = {"transfer": 1e-2, "finetune": 1e-4}  # LoLCATs' learning rates
SCHEDULES = ("cosine", "constant")
