"""``rnnify eval``: how close a converted model is to its original on text (perplexity, KL, per-layer
error), and with ``--passkey`` how well both recall a key stated once."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rnnify import arguments
from rnnify.cli.common import (
    add_data_flag,
    add_device_flag,
    add_dir,
    add_eager_step_flag,
    add_kernels_flag,
    check_writable,
    int_list,
    load,
    nbytes,
)
from rnnify.errors import RnnifyError

PROSE_CHARS = 1 << 20  # of --data, the real text the prose probe fills its prompts with

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


HELP = "measure how close a converted model is to its original on text: perplexity, KL, per-layer error"
DESCRIPTION = (
    "Read --data in rows of --seq-len tokens and report both models' perplexity, "
    "KL(original || converted) per token, top-1 agreement, the state per sequence, and each layer's "
    "attention error against softmax attention with the layer fed the original's activations."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import DEFAULT_SEQ_LEN, EVAL_BATCH_SIZE, PASSKEY_TRIALS, SEED
    from rnnify.probes import PROBES

    add_dir(p)
    add_eager_step_flag(p)
    add_data_flag(p)
    p.add_argument(
        "--against",
        metavar="MODEL",
        help="model to compare with: Hugging Face or rnnify directory (default: the source in DIR's manifest)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="directory of the tokenizer to read --data with (default: DIR's, else its source's)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help=f"tokens per row (default: {DEFAULT_SEQ_LEN}, or the model's position limit if lower)",
    )
    p.add_argument(
        "--batch-size",
        type=arguments.at_least(1, "--batch-size"),
        default=EVAL_BATCH_SIZE,
        metavar="B",
        help="rows per batch",
    )
    p.add_argument(
        "--max-tokens",
        type=arguments.at_least(1, "--max-tokens"),
        default=None,
        metavar="N",
        help="stop after N tokens (default: all the data)",
    )
    p.add_argument("--json", metavar="OUT", help="write the results to OUT as JSON")
    add_device_flag(p, "device to run both models on")
    p.add_argument(
        "--passkey",
        metavar="LIST",
        help="also test recall at these prompt lengths, e.g. 512,1024,2048: a random 5-digit key stated "
        "once in filler text, then asked for; both models answer greedily (default: off)",
    )
    p.add_argument(
        "--passkey-trials",
        type=arguments.at_least(1, "--passkey-trials"),
        default=PASSKEY_TRIALS,
        metavar="N",
        help="prompts per length, the key at N depths evenly spaced from start to end",
    )
    p.add_argument("--passkey-seed", type=int, default=SEED, metavar="S", help="seed of the random keys")
    p.add_argument(
        "--passkey-probes",
        metavar="LIST",
        help=f"prompt families to test, of {','.join(PROBES)}: other wordings and fillers, real text from "
        "--data as filler, the question through the chat template, several keys with one asked for "
        "(default: every family but calibration, the one --to auto chooses heads with, that can be "
        "built: chat needs a chat template)",
    )
    p.add_argument(
        "--no-layer-errors",
        action="store_true",
        help="skip each layer's attention error (a second pass of the converted model over the data)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="read each row N tokens at a time in both models (the converted one from its state, the "
        "original through its KV cache): less memory for long rows, the same results within float "
        "error; needs --no-layer-errors (default: whole rows)",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute the original's logits and answers instead of reading them from (and storing "
        "them in) the rnnify cache, where they are kept by the SHA-256 of its files and the tokens",
    )
    add_kernels_flag(p)


def run(args: argparse.Namespace, console: Console) -> int:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from rnnify.eval import evaluate, write_json

    check_writable("--json", args.json)
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise RnnifyError(f"--prefill-chunk must be at least 1, got {args.prefill_chunk}")
    if args.prefill_chunk is not None and not args.no_layer_errors:
        raise RnnifyError("--prefill-chunk needs --no-layer-errors: each layer's attention error needs whole rows")
    lengths, probes = None, None
    if args.passkey is not None:
        from rnnify.probes import PROBES, depths

        lengths = int_list("--passkey", args.passkey)
        depths(args.passkey_trials)  # checks it, before anything loads
        if args.passkey_probes is not None:
            probes = [name.strip() for name in args.passkey_probes.split(",") if name.strip()]
            unknown = [name for name in probes if name not in PROBES]
            if unknown or not probes:
                raise RnnifyError(f"--passkey-probes {args.passkey_probes!r}: choose from {', '.join(PROBES)}")
    elif args.passkey_probes is not None:
        raise RnnifyError("--passkey-probes needs --passkey LENGTHS")
    model = load(args)
    # both evaluations compare with the same original, read the same way
    alike = {"against": args.against, "tokenizer": args.tokenizer, "cache": not args.no_cache, "progress": True}
    passkey = None  # first: a context too short for its prompts fails before the long pass
    if lengths is not None:
        from rnnify.data import check_sizes, read_text, row_length
        from rnnify.passkey import evaluate_passkey

        check_sizes(row_length(model, args.seq_len), args.batch_size, args.max_tokens)  # the pass's, still first

        passkey = evaluate_passkey(
            model,
            lengths,
            trials=args.passkey_trials,
            seed=args.passkey_seed,
            probes=probes,
            text=read_text(args.data, PROSE_CHARS),
            **alike,
        )
    result = evaluate(
        model,
        args.data,
        layer_errors=not args.no_layer_errors,
        prefill_chunk=args.prefill_chunk,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        **alike,
    )
    summary = Table(
        box=box.SIMPLE_HEAD,
        title=Text(f"{result.target} vs {result.against}: {result.tokens:,} tokens, rows of {result.seq_len}"),
    )
    for column in ("", "converted", "original"):
        summary.add_column(column, justify="left" if not column else "right")
    summary.add_row("perplexity", f"{result.perplexity:.4g}", f"{result.teacher_perplexity:.4g}")
    summary.add_row("KL(original || converted), nats/token", f"{result.kl:.3g}", "")
    summary.add_row("top-1 agreement", f"{result.top1_agreement:.1%}", "")
    summary.add_row(f"state per sequence at {result.seq_len:,} tokens", nbytes(result.state_bytes), "")
    console.print(summary)
    layers = Table(box=box.SIMPLE_HEAD, title=Text("attention error per layer, fed the original's activations"))
    for column in ("layer", "cell", "relative error", "MSE"):
        layers.add_column(column, justify="right")
    for layer in result.layers:
        layers.add_row(str(layer.layer), layer.module, f"{layer.rel_error:.3g}", f"{layer.mse:.3g}")
    if result.layers:
        console.print(layers)
    positions = Table(box=box.SIMPLE_HEAD, title=Text("KL by position in the row"))
    for column in ("positions", "tokens", "KL, nats/token"):
        positions.add_column(column, justify="right")
    for part in result.kl_by_position:
        positions.add_row(f"{part.start:,}-{part.end - 1:,}", f"{part.tokens:,}", f"{part.kl:.3g}")
    console.print(positions)
    copies = Table(box=box.SIMPLE_HEAD, title=Text("KL by copies of earlier text (4-token repeats)"))
    for column in ("next token", "tokens", "KL, nats/token"):
        copies.add_column(column, justify="right")
    for part in result.kl_by_copy:
        copies.add_row(part.kind, f"{part.tokens:,}", f"{part.kl:.3g}")
    console.print(copies)
    if passkey is not None:
        console.print(_passkey_table(passkey))
    if args.json is not None:
        write_json(args.json, {**result.to_json(), **({"passkey": passkey.to_json()} if passkey else {})})
    return 0


def _passkey_table(result) -> Table:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    names = list(result.accuracy())
    lengths = list(dict.fromkeys(trial.length for trial in result.trials))
    probes = result.probes()
    trials = len(result.trials) // (len(lengths) * len(probes))
    table = Table(
        box=box.SIMPLE_HEAD, title=Text(f"pass-key retrieval: {trials} depths per length and probe, greedy answers")
    )
    table.add_column("probe")
    table.add_column("prompt tokens", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    for probe in [*probes, None] if len(probes) > 1 else probes:
        accuracy = result.accuracy(probe)
        for length in lengths:
            table.add_row(probe or "all", f"{length:,}", *(f"{accuracy[name][length]:.0%}" for name in names))
    return table
