"""The command-line flags of training, shared by ``rnnify distill`` and ``rnnify convert --distill``.

Torch-free, as ``--help`` and a mistyped flag must be (``rnnify.choices``): what checking the flags
needs of the runtime is imported when they are checked. Their defaults are ``rnnify.distill``'s,
from ``rnnify.choices``; the help shows them (``arguments.Command``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rnnify import arguments
from rnnify.choices import (
    AUTO_ALL_MAX_PARAMETERS,
    CHECKPOINT_EVERY,
    DEFAULT_LR,
    DEFAULT_SCHEDULE,
    DEFAULT_SEQ_LEN,
    DEFAULT_TRAIN,
    DISTILL_BATCH_SIZE,
    GATE_LR_SCALE,
    KL_WEIGHT,
    LORA_RANK,
    SCHEDULES,
    SEED,
    STAGES,
    TRAIN,
)
from rnnify.errors import RnnifyError

__all__ = ["add_training_flags", "training_options"]


def add_training_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the training flags to ``p`` in their own help group, returned for the command's own
    additions to it (``--device``, whose default is the command line's)."""
    g = p.add_argument_group("distillation (docs/distill.md)")
    g.add_argument(
        "--teacher",
        metavar="MODEL",
        help="original model for the KL term (default: the source model recorded in the manifest)",
    )
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="directory of the tokenizer to read the data with (default: the model's, else its source's)",
    )
    g.add_argument(
        "--stages",
        default=",".join(STAGES),
        metavar="LIST",
        help="stages to run, in order: transfer (the cells' parameters, to match softmax attention), "
        "finetune (the cells and what --train says, on next-token loss and KL to the teacher)",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="real tokens to train on, split evenly between the stages (default: one pass over the data per stage)",
    )
    g.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens per row (default: {DEFAULT_SEQ_LEN}, or the model's position limit if lower)",
    )
    g.add_argument(
        "--batch-size",
        type=int,
        default=DISTILL_BATCH_SIZE,
        metavar="B",
        help="rows per optimizer step, all processes together",
    )
    g.add_argument(
        "--lr",
        metavar="X[,X]",
        help="learning rate, one for all stages or one per stage (default: "
        + ", ".join(f"{s} {r:g}" for s, r in DEFAULT_LR.items())
        + ")",
    )
    g.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=DEFAULT_SCHEDULE,
        help="learning rate over each stage: cosine (warm-up over the first 5%% of its steps, then down to "
        "a tenth by the last; constant after the warm-up without --max-tokens) or constant",
    )
    g.add_argument(
        "--train",
        choices=TRAIN,
        default=DEFAULT_TRAIN,
        help="what the finetune stage trains besides the cells' parameters: lora (rank --lora-rank "
        "on the attention projections), attention (those projection weights in full), all (every "
        "weight: gradients and AdamW state take 3x the weights; docs/distill.md compares them) or auto: "
        f"all for models up to {AUTO_ALL_MAX_PARAMETERS / 1e9:g}B parameters, else lora",
    )
    g.add_argument(
        "--lora-rank",
        type=int,
        default=LORA_RANK,
        metavar="R",
        help="LoRA rank of the finetune stage with --train lora",
    )
    g.add_argument(
        "--gate-lr-scale",
        default=f"{GATE_LR_SCALE:g}",
        metavar="X[,X]",
        help="the cells' gates (the hybrid's memory gate and window share, one number per head) train at "
        "X times the stage's rate, one X for all stages or one per stage, so that a short stage moves "
        "them far enough",
    )
    g.add_argument(
        "--kl-weight",
        type=float,
        default=KL_WEIGHT,
        metavar="X",
        help="weight of KL(teacher || model) next to the next-token loss; 0 needs no teacher",
    )
    g.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where checkpoints go (default: the output directory's name + '.checkpoints', beside it)",
    )
    g.add_argument(
        "--checkpoint-every", type=int, default=CHECKPOINT_EVERY, metavar="N", help="steps between checkpoints"
    )
    g.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep the checkpoint once the distilled model is saved (default: delete it then)",
    )
    g.add_argument("--resume", action="store_true", help="continue from the checkpoint of an interrupted run")
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the weights over the processes, one FSDP unit per decoder layer, "
        "instead of a full copy per process (models that do not fit one device)",
    )
    g.add_argument(
        "--seed", type=arguments.seed("--seed"), default=SEED, metavar="S", help="seed of the data order and LoRA init"
    )
    return g


def training_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``rnnify.distill`` the flags give (all but model, data, teacher and device).

    Also refuses an ``--output`` that saving would refuse, now rather than after hours of training.
    """
    from rnnify.runtime.saving import check_output

    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    lr = _numbers("--lr", args.lr, "1e-2,1e-4")
    gate_lr_scale = _numbers("--gate-lr-scale", args.gate_lr_scale, "1,100")
    output = check_output(Path(args.output))
    return {
        "tokenizer": args.tokenizer,
        "stages": stages,
        "max_tokens": args.max_tokens,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "lr": lr,
        "lora_rank": args.lora_rank,
        "train": args.train,
        "kl_weight": args.kl_weight,
        "gate_lr_scale": gate_lr_scale,
        "schedule": args.schedule,
        "seed": args.seed,
        "checkpoint_dir": args.checkpoint_dir or output.with_name(output.name + ".checkpoints"),
        "checkpoint_every": args.checkpoint_every,
        "resume": args.resume,
        "fsdp": args.fsdp,
    }


def _numbers(flag: str, text: str | None, example: str) -> float | list[float] | None:
    """``X`` or ``X,X,...`` as a number or a list of them (None: the flag was not given)."""
    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise RnnifyError(f"{flag} {text!r}: expected a number or comma-separated numbers, e.g. {example}") from None
    return values[0] if len(values) == 1 else values
