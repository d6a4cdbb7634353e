"""``rnnify convert``: a Hugging Face causal LM or GGUF file into a recurrent model directory, with
``--to auto`` (``rnnify.cli.auto``) choosing per kv head and ``--distill`` training it before it is saved."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rnnify import arguments
from rnnify.cli.auto import (
    add_auto_flags,
    check_auto,
    convert_auto,
    no_auto_flags,
    print_head_report,
)
from rnnify.cli.common import (
    add_dtype_flag,
    add_output_flags,
    claims_output,
    nbytes,
    save,
)
from rnnify.cli.compile import add_compile_flag, compile_step
from rnnify.cli.distill import (
    add_training_flags,
    drop_checkpoint,
    train,
    training_flags_given,
    training_options,
)
from rnnify.errors import RnnifyError

if TYPE_CHECKING:
    from rich.console import Console

# first-class cell options; others via --option
_CELL_FLAGS = ("window", "sinks", "kv_dtype", "feature_map", "gate", "memory")


HELP = "compile a Hugging Face causal LM (or GGUF file) into a recurrent model directory"
DESCRIPTION = (
    "Load MODEL, capture its forward pass, replace every attention with a recurrent "
    "cell and save the result to -o DIR (no pickle; loads without the source model)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import (
        DEFAULT_DTYPE,
        DEFAULT_KERNELS,
        FEATURE_MAPS,
        GATES,
        KERNELS,
        KV_DTYPES,
        MEMORIES,
        TARGETS,
    )

    p.add_argument(
        "model",
        metavar="MODEL",
        help="local Hugging Face model directory, a .gguf file (dequantised to --dtype; needs "
        "pip install 'rnnify[gguf]'), or a hub id already in the local cache",
    )
    targets = "; ".join(f"{name}: {text}" for name, text in TARGETS.items())
    p.add_argument(
        "--to",
        choices=[*TARGETS, "auto"],
        required=True,
        help=f"target cell ({targets}); auto: per kv head, exact for the heads that read far back and "
        "window with sinks (or, with --memory, a hybrid, which takes the other cell options) for the "
        "rest, chosen on calibration data (flags below)",
    )
    add_output_flags(p, "directory to write the converted model to")
    add_dtype_flag(p, DEFAULT_DTYPE, "dtype to load and save the weights in")
    p.add_argument(
        "--layers",
        metavar="SPEC",
        help="targets per layer range, overriding --to: e.g. '0-1:exact,2-:hybrid' (ranges inclusive, "
        "'N-' runs to the last layer; later rules win)",
    )
    p.add_argument(
        "--keep-softmax",
        type=arguments.layer_list("--keep-softmax"),
        metavar="LAYERS",
        help="comma-separated layers kept exact softmax attention, e.g. 0,3",
    )
    p.add_argument(
        "--kernels",
        choices=KERNELS,
        default=DEFAULT_KERNELS,
        help="backend of the fused Triton ops the cells run where they have them: auto (Triton on CUDA; "
        "elsewhere, per phase, the faster of the ops' PyTorch reference and the cell's own form), triton or "
        "reference; none: the cells' own PyTorch forms; saved with the model",
    )
    cell = p.add_argument_group(
        "cell options (passed to every cell that accepts them; default: the cell's own, which rnnify info shows)"
    )
    cell.add_argument(
        "--window",
        type=arguments.at_least(1, "--window"),
        metavar="W",
        help="softmax window in tokens (window, select, lola, hybrid, auto)",
    )
    cell.add_argument(
        "--sinks",
        type=arguments.at_least(0, "--sinks"),
        metavar="S",
        help="first tokens always attended to (window, select, lola, hybrid, auto)",
    )
    cell.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        help="how the cache stores its keys and values (window, select): int8 (each vector's entries at a shared "
        "power-of-two scale) holds about 4x the tokens of float32 in the same bytes, float16 and bfloat16 2x "
        "(default: the model's dtype)",
    )
    cell.add_argument(
        "--feature-map",
        choices=sorted(FEATURE_MAPS),
        default=None,
        help="feature map phi (linear, hybrid, gated); the hybrid's own is trainable, so that "
        "distillation can fit its memory through it",
    )
    cell.add_argument("--gate", choices=GATES, help="gate of the gated target")
    cell.add_argument(
        "--memory",
        metavar="NAME",
        default=None,
        help=f"hybrid: what holds the tokens that left the window, one of {', '.join(MEMORIES)}: linear attention, "
        "gated linear attention (gla) or a delta-rule memory (delta, gated-delta), blended into the window's output "
        "by a learned gate that starts at 0; with --to auto, the streaming heads become such hybrids",
    )
    cell.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="any other cell option, repeatable; VALUE is read as JSON when it parses (chunk_size=128, "
        'feature_options={"num_features":256})',
    )
    add_auto_flags(p)
    p.add_argument(
        "--distill",
        type=arguments.text_path("--distill"),
        metavar="PATH",
        help="then distil the converted model on this text file, folder or .jsonl before saving (flags below)",
    )
    add_compile_flag(p)
    add_training_flags(p)


@claims_output
def run(args: argparse.Namespace, console: Console) -> int:
    from rich.text import Text

    import rnnify
    from rnnify import progress
    from rnnify.auto import check_memory
    from rnnify.compiler.capture import source_location
    from rnnify.compiler.convert import check_source_tokenizer
    from rnnify.compiler.passes import PIPELINE
    from rnnify.compiler.plan import parse_options

    source_location(args.model)  # a wrong path in one line, before any progress shows
    check_source_tokenizer(args.model)  # a broken tokenizer.json, before minutes of loading (and --to auto's scoring)
    check_memory(args.memory)  # before the model is loaded
    options = {name: getattr(args, name) for name in _CELL_FLAGS if getattr(args, name) is not None}
    given = parse_options(args.option or [], lambda pair: f"--option {pair!r}: expected KEY=VALUE, e.g. chunk_size=128")
    twice = sorted(given.keys() & options.keys())  # which one would win is no way to say it
    if twice:
        flag = "--" + twice[0].replace("_", "-")
        raise RnnifyError(f"--option {twice[0]}={given[twice[0]]} and {flag} {options[twice[0]]}: give it once")
    options.update(given)
    unused = [] if args.distill else training_flags_given(args)
    if unused:
        them = "it" if len(unused) == 1 else "them"
        raise RnnifyError(f"{', '.join(unused)}: only --distill PATH uses {them}; add --distill or leave {them} out")
    if args.distill and args.to == "exact" and not args.layers:  # known now, not after the conversion
        from rnnify.distillation.worth import EXACT_ALREADY

        raise RnnifyError(EXACT_ALREADY)
    training = training_options(args) if args.distill else None  # the flags' mistakes before converting
    stages = ["load", "capture", *(p.__name__ for p in PIPELINE), *(["distill"] if args.distill else []), "save"]
    stages = ["choose heads", "save"] if args.to == "auto" else stages  # auto converts while it chooses
    stages += ["decode step"] if args.compile_step is not False else []  # compiled, or why not
    if args.to == "auto":
        check_auto(args)
    else:
        no_auto_flags(args)
    report = None
    with progress.stages(len(stages), "stage") as start:
        if args.to == "auto":
            start("choose heads")
            model, report = convert_auto(args, options)
        else:
            model = rnnify.convert(
                args.model,
                to=args.to,
                layers=args.layers,
                keep_softmax=args.keep_softmax or None,
                dtype=args.dtype,
                kernels=args.kernels,
                progress=start,
                **options,
            )
        if args.distill:
            start("distill")
            if not train(model, args.distill, args.teacher or args.model, training):
                return 0
        start("save")
        path = save(model, args.output)
        if args.compile_step is not False:
            start("decode step", spin=True)  # one call of seconds to minutes: nothing else moves meanwhile
            decode_note = compile_step(model, path, forced=bool(args.compile_step))
    if report is not None:
        print_head_report(report, console)
    growth = "grows with context, like a KV cache" if not model.constant_memory else "constant"
    console.print(Text(f"saved to {path}"), soft_wrap=True)
    console.print(
        Text(
            f"{model.target_in_words}: {len(model.cells)} layers, {model.manifest.dtype}, "
            f"state {nbytes(model.state_nbytes(1024))} per sequence at 1k tokens ({growth})"
        ),
        soft_wrap=True,
    )
    if args.compile_step is not False:
        console.print(Text(decode_note), soft_wrap=True)
    if args.distill:
        drop_checkpoint(training["checkpoint_dir"], args.keep_checkpoints, console)
    return 0
