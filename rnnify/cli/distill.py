"""``rnnify distill``, and the training that ``rnnify convert --distill`` runs with the same flags."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rnnify.choices import AUTO_ALL_MAX_PARAMETERS
from rnnify.cli.common import (
    add_data_flag,
    add_device_flag,
    add_dir,
    add_kernels_flag,
    add_output_flags,
    claims_output,
    device,
    load,
    save,
    writes_results,
)
from rnnify.cli.compile import add_compile_flag, compile_step

if TYPE_CHECKING:
    from rich.console import Console


_UP_TO = f"{AUTO_ALL_MAX_PARAMETERS / 1e9:g}B parameters"  # --train auto: every weight up to it, LoRA above
HELP = (
    "train a converted model towards its original: attention transfer, then fine-tuning of every weight "
    f"(LoRA above {_UP_TO})"
)
DESCRIPTION = (
    "After LoLCATs' recipe (docs/distill.md): 'transfer' trains the cells' own parameters to "
    "match the original softmax attention layer by layer; 'finetune' trains the cells and what --train says "
    f"(by default every weight of a model up to {_UP_TO}, and LoRA on the attention projections of a larger one, "
    "merged into its weights at the end) on next-token loss and KL to the original model. Writes -o DIR; "
    "checkpoints allow --resume. Runs under torchrun for data parallelism (--batch-size is the global batch), "
    "with --fsdp sharding the weights per decoder layer."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    add_data_flag(p)
    add_output_flags(p, "directory to write the distilled model to (DIR itself with --overwrite)")
    add_kernels_flag(p)
    add_compile_flag(p)
    add_training_flags(p)


@claims_output
def run(args: argparse.Namespace, console: Console) -> int:
    from rich.text import Text

    training = training_options(args)
    model = load(args, device="cpu")  # distill moves it to --device (or, under FSDP, its shards)
    if not train(model, args.data, args.teacher, training):
        return 0
    path = save(model, args.output)
    console.print(Text(f"saved to {path}"), soft_wrap=True)
    if args.compile_step is not False:
        with console.status("compiling the decode step (AOTInductor)"):
            decode_note = compile_step(model, path, forced=bool(args.compile_step))
        console.print(Text(decode_note), soft_wrap=True)
    drop_checkpoint(training["checkpoint_dir"], args.keep_checkpoints, console)
    return 0


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """The training flags of ``rnnify.distillation.options``, and ``--device`` among them; their
    defaults recorded as ``args.training_defaults``, so that ``training_flags_given`` can tell
    which were given (as ``rnnify.cli.auto`` records its own)."""
    from rnnify.distillation.options import add_training_flags

    group = add_training_flags(p)
    add_device_flag(
        group, "device to train on", "; with --fsdp the model stays on the CPU and only its shards go there"
    )
    flags = group._group_actions  # argparse keeps a group's flags here alone
    p.set_defaults(training_defaults={flag.option_strings[0]: (flag.dest, flag.default) for flag in flags})


def training_flags_given(args: argparse.Namespace) -> list[str]:
    """The training flags given on ``args``' command line (``convert``'s apply only with ``--distill``)."""
    return [flag for flag, (dest, default) in args.training_defaults.items() if getattr(args, dest) != default]


def training_options(args: argparse.Namespace) -> dict:
    """``rnnify.distill``'s keyword arguments from the training flags, checked; an interruption from
    now on says where its checkpoint is (``args.on_interrupt``, read by ``rnnify.cli.main``)."""
    from rnnify.distillation.checkpoint import CHECKPOINT_FILE
    from rnnify.distillation.options import training_options

    options = {**training_options(args), "device": device(args.device)}
    checkpoint = Path(options["checkpoint_dir"]) / CHECKPOINT_FILE
    args.on_interrupt = lambda: (
        f"; {checkpoint} holds the last checkpoint: run the same command with --resume to continue"
        if checkpoint.is_file()
        else ""
    )
    return options


def train(model, data: str, teacher, options: dict) -> bool:
    """Distil ``model`` in place (docs/distill.md); True on the process that writes the result (rank 0)."""
    from rnnify.distillation import distill

    distill(model, data, teacher=teacher, **options)  # reports each stage on stderr
    return writes_results()


def drop_checkpoint(directory: Path, keep: bool, console: Console) -> None:
    """Delete the checkpoint of a run whose model is saved, unless ``--keep-checkpoints``."""
    from rich.text import Text

    from rnnify.distillation.checkpoint import remove_checkpoint

    if keep:
        console.print(Text(f"checkpoint kept in {directory}"), soft_wrap=True)
    elif not remove_checkpoint(directory):
        console.print(Text(f"kept {directory}: it holds more than this run's checkpoint"), soft_wrap=True)
