"""The names the command line offers and the defaults its help states, without importing torch.

``rnnify COMMAND --help`` and a mistyped flag should answer at once, but the modules that implement
these names import torch. So each name, and each default that a flag shares with the library function
its command calls, is stated here, once: the library's signature and the flag both import it, and
the help shows the flag's default as it is. Here are the ``--to`` targets (with the line of help each
gets), the feature maps, the hybrid's memories, the kernel backends, the dtypes, the row length, how
``--to auto`` scores and chooses heads, the defaults of verify, generate, chat, bench and eval, and
the distillation stages, what fine-tuning trains, its learning rates, schedules and other settings.
``rnnify.cells`` builds the targets and feature maps from their classes; tests/test_cli_usage.py checks
that they are the ones named here.
"""

from __future__ import annotations

__all__ = [
    "AUTO_ALL_MAX_PARAMETERS",
    "AUTO_CONTEXT",
    "AUTO_KINDS",
    "AUTO_SINKS",
    "AUTO_WINDOW",
    "BACKENDS",
    "BENCH_BATCHES",
    "BENCH_CONTEXTS",
    "BENCH_PREFILL_MAX",
    "BENCH_STEPS",
    "CALIB_LEN",
    "CALIB_PASSKEY",
    "CALIB_ROWS",
    "CHAT_MAX_NEW_TOKENS",
    "CHECKPOINT_EVERY",
    "DEFAULT_DTYPE",
    "DEFAULT_KERNELS",
    "DEFAULT_LR",
    "DEFAULT_SCHEDULE",
    "DEFAULT_SCORE",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_TRAIN",
    "DISTILL_BATCH_SIZE",
    "DTYPES",
    "EVAL_BATCH_SIZE",
    "FEATURE_MAPS",
    "GATE_LR_SCALE",
    "KERNELS",
    "KL_WEIGHT",
    "LORA_RANK",
    "MAX_NEW_TOKENS",
    "GATES",
    "MEMORIES",
    "PASSKEY_TRIALS",
    "SCHEDULES",
    "SCORES",
    "SEED",
    "STAGES",
    "TARGETS",
    "TEMPERATURE",
    "TOP_K",
    "TRAIN",
    "VERIFY_BATCH",
    "VERIFY_TOKENS",
    "WORTH_COMPILING_BELOW",
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
    "lola": "select's sinks, window and kept tokens (kept by a linear memory's recall error) plus that memory (LoLA)",
}
FEATURE_MAPS = ("elu", "relu", "identity", "performer", "taylor", "hedgehog", "t2r")  # ``cells.linear.FEATURE_MAPS``
MEMORIES = ("linear", "gla", "delta", "gated-delta")  # what holds the tokens that left the hybrid's window
GATES = ("retnet", "gla", "gateloop")  # ``cells.gated.GATES``
KV_DTYPES = ("float16", "bfloat16", "int8")  # how a window may store its keys and values (``kernels.slots``)

BACKENDS = ("auto", "triton", "reference")  # the fused ops' ``backend=``
# A model's ``kernels``: a backend of its cells' fused ops, or "none": the cells' own PyTorch forms.
KERNELS = (*BACKENDS, "none")
DEFAULT_KERNELS = "auto"  # what a model is converted with unless told otherwise

DTYPES = ("float32", "bfloat16", "float16")  # the dtypes a model is converted to
DEFAULT_DTYPE = "float32"

# a decode step that reads fewer bytes of weights than this is compiled ahead of time by default:
# compiling saves per-op overhead, which a heavier step hardly has (docs/performance.md)
WORTH_COMPILING_BELOW = 1 << 30

DEFAULT_SEQ_LEN = 1024  # tokens per row unless told otherwise, clamped to the model's position limit
SEED = 0  # of every random draw not given a seed (token ids, keys, data order), so that a run repeats

# --to auto (``rnnify.auto``): the streaming heads' window and sinks, and how the heads are scored
SCORES = ("kl", "mass")  # kl: one pass per kv head and row, the KL each head costs; mass: one pass per row
DEFAULT_SCORE = "kl"  # the score that measures what windowing a head costs the output (docs/fidelity.md)
AUTO_WINDOW, AUTO_SINKS = 64, 4
AUTO_CONTEXT = 4096  # the context at which a state budget is counted
AUTO_KINDS = ("exact", "window", "select", "lola")  # what --levels may list: the cells a probe of the original can run
CALIB_LEN, CALIB_ROWS, CALIB_PASSKEY = 1024, 2, 2  # tokens per row; text rows; pass-key prompts

VERIFY_TOKENS, VERIFY_BATCH = 32, 2  # ``rnnify.verify.run_checks``: tokens per sequence, sequences

MAX_NEW_TOKENS = 20  # ``RecurrentModel.generate``
CHAT_MAX_NEW_TOKENS = 256  # ``rnnify.chat.Chat``, ``model.chat``: a reply, longer than a continuation
TEMPERATURE = 1.0  # sampling from the model's own distribution
TOP_K = 50  # sampling from the 50 most likely tokens, as transformers' GenerationConfig; 0 or None: from all

# ``rnnify.bench.benchmark``: contexts, batch sizes, timed steps per point, longest prefill timed
BENCH_CONTEXTS, BENCH_BATCHES = (256, 1024, 4096, 16384), (1, 8)
BENCH_STEPS, BENCH_PREFILL_MAX = 10, 2048

EVAL_BATCH_SIZE = 8  # ``rnnify.eval.evaluate``: rows per batch
PASSKEY_TRIALS = 8  # ``rnnify.passkey``: prompts per length and probe, the key at as many depths

STAGES = ("transfer", "finetune")  # distillation's stages, in the order they run
TRAIN = ("auto", "lora", "attention", "all")  # what the finetune stage trains besides the cells' parameters
AUTO_ALL_MAX_PARAMETERS = 1_000_000_000  # train "auto": every weight up to this size, LoRA above
DEFAULT_TRAIN = "auto"
DEFAULT_LR = {"transfer": 1e-2, "finetune": 1e-4}  # LoLCATs' learning rates
SCHEDULES = ("cosine", "constant")
DEFAULT_SCHEDULE = "cosine"
# ``rnnify.distill``: rows per optimizer step, LoRA rank, weight of the KL term, the gates' learning rate
# as a multiple of the stage's, steps between checkpoints
DISTILL_BATCH_SIZE, LORA_RANK, KL_WEIGHT, GATE_LR_SCALE, CHECKPOINT_EVERY = 8, 8, 1.0, 1.0, 500
