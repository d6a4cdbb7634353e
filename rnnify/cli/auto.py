"""``rnnify convert --to auto``: its flags, what it refuses before anything loads, the conversion
through ``rnnify.auto``, and the table of the heads it chose."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from rnnify import arguments
from rnnify.cli.common import nbytes
from rnnify.errors import RnnifyError

if TYPE_CHECKING:
    from rich.console import Console


_KEYWORDS = {"state_budget": "budget", "at_context": "context", "calib_passkey": "passkey"}  # flag's dest -> keyword


def add_auto_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``--to auto``, in their own help group: each gives the keyword of
    ``rnnify.auto.auto_convert`` it is named as (``_KEYWORDS`` where it is named otherwise), its default
    that function's; recorded as ``args.auto_defaults``, so that ``no_auto_flags`` can tell which were
    given and ``convert_auto`` pass them on."""
    from rnnify import choices  # the streaming heads' defaults, for the group's title
    from rnnify.choices import AUTO_CONTEXT, CALIB_LEN, CALIB_PASSKEY, CALIB_ROWS, DEFAULT_SCORE, SCORES

    g = p.add_argument_group(
        f"--to auto: which kind each kv head gets, exact, a long window or a "
        "selection cache (the rest stream: "
        f"--window, default {choices.AUTO_WINDOW}, with --sinks, default {choices.AUTO_SINKS}; with --memory NAME "
        "hybrids of that window and memory)"
    )
    flags = [
        g.add_argument(
            "--state-budget",
            metavar="BYTES",
            help="state of the attention layers per sequence at --at-context tokens (what replaces the "
            "KV cache; a hybrid's own recurrent layers keep theirs beside it): bytes (2000000, 2MB, 1.5MiB) "
            "or a share of the original's KV cache (30%%); the heads that score highest per byte stay exact "
            "(or get their --levels kind) while it fits",
        ),
        g.add_argument("--at-context", type=int, default=AUTO_CONTEXT, metavar="N", help="context of --state-budget"),
        g.add_argument(
            "--max-kl",
            type=float,
            metavar="X",
            help="instead of a budget: the fewest exact heads (or moves up the --levels kinds) whose KL to "
            "the original on the calibration rows is at most X nats per token",
        ),
        g.add_argument(
            "--data",
            type=arguments.text_path("--data"),
            metavar="PATH",
            help="calibration text: a file, folder or .jsonl (required with auto)",
        ),
        g.add_argument(
            "--score",
            choices=SCORES,
            default=DEFAULT_SCORE,
            help="kl: KL increase when the head alone is windowed (one pass per kv head and row); mass: "
            "attention beyond the window and sinks (one pass per row); docs/fidelity.md compares them",
        ),
        g.add_argument("--calib-rows", type=int, default=CALIB_ROWS, metavar="N", help="text rows to score on"),
        g.add_argument(
            "--calib-len",
            type=int,
            metavar="T",
            help=f"tokens per text row and per pass-key prompt (default: {CALIB_LEN}, or the model's position limit "
            "if lower)",
        ),
        g.add_argument(
            "--calib-passkey",
            type=int,
            default=CALIB_PASSKEY,
            metavar="N",
            help="pass-key prompts (made here, key at evenly spaced depths) to score on",
        ),
        g.add_argument("--per-layer", action="store_true", help="choose whole layers instead of single heads"),
        g.add_argument(
            "--scores-from",
            metavar="FILE",
            help="choose again from the scores in an earlier run's head_map.json (same model, --score, "
            "--window and --sinks) instead of scoring: one pass per calibration row, for the "
            "calibration KL",
        ),
        g.add_argument(
            "--retrieval-window",
            type=int,
            metavar="N",
            help="the retrieval heads keep the last N tokens (and the sinks) instead of every token: the "
            "state stops growing at N, so the model decodes in constant memory (default: they stay exact)",
        ),
        g.add_argument(
            "--retrieval-keep",
            type=int,
            metavar="K",
            help="with --retrieval-window: the retrieval heads also keep K older tokens chosen by the "
            "attention they draw, a select cell (default: none)",
        ),
        g.add_argument(
            "--levels",
            metavar="KINDS",
            help="the kinds a head may get, of exact, window(window=N), select(window=N,keep=K) and "
            "lola(window=N,keep=K), e.g. 'window(window=1024),select(window=512,keep=512),exact': "
            "each head is scored as each (kl: one pass per kv head, kind and row), and the kinds "
            "with most gain per byte are chosen within --state-budget or --max-kl (default: one kind, "
            "exact, or that of --retrieval-window and --retrieval-keep)",
        ),
    ]
    p.set_defaults(auto_defaults={flag.dest: flag.default for flag in flags})


def no_auto_flags(args: argparse.Namespace) -> None:
    """Refuse a ``--to auto`` flag given with another target."""
    given = [dest for dest, default in args.auto_defaults.items() if getattr(args, dest) != default]
    if given:
        raise RnnifyError(f"--{given[0].replace('_', '-')} applies to --to auto only")


def check_auto(args: argparse.Namespace) -> None:
    """What --to auto refuses or needs, before anything loads."""
    if args.layers or args.keep_softmax or args.distill:
        raise RnnifyError(
            "--to auto chooses every layer's heads itself: it takes --window, --sinks, --memory and the "
            "memory's cell options, not --layers, --keep-softmax or --distill"
        )
    if args.kv_dtype is not None:
        raise RnnifyError(
            "--kv-dtype: --to auto scores and counts its windows in the model's dtype; "
            "give it with --to window or --to select, or leave it out"
        )
    if args.data is None:
        raise RnnifyError("--to auto needs calibration text: --data PATH (a file, folder or .jsonl)")
    if args.retrieval_keep is not None and (args.retrieval_window is None or args.retrieval_keep < 1):
        raise RnnifyError(
            "--retrieval-keep K needs --retrieval-window N (the selection cache's recent window) and K >= 1"
        )
    if args.levels is not None:
        from rnnify.auto.levels import parse_levels
        from rnnify.auto.scorer import check_retrieval
        from rnnify.choices import AUTO_WINDOW

        window = AUTO_WINDOW if args.window is None else args.window
        check_retrieval(parse_levels(args.levels, window), window, args.retrieval_window, args.retrieval_keep)


def convert_auto(args: argparse.Namespace, options: dict):
    """Score the heads and choose (flags checked by ``check_auto``); the converted model (saved by the
    caller) and the report of the choice. The streaming heads' window and sinks are ``rnnify.auto``'s
    unless given."""
    from rnnify.auto import auto_convert

    streaming = {name: options[name] for name in ("window", "sinks") if name in options}
    return auto_convert(
        args.model,
        memory=options.get("memory"),
        memory_options={k: v for k, v in options.items() if k not in ("window", "sinks", "memory")},
        dtype=args.dtype,
        kernels=args.kernels,
        progress=True,
        **streaming,
        **{_KEYWORDS.get(dest, dest): getattr(args, dest) for dest in args.auto_defaults},
    )


def _options_text(options: dict) -> str:
    """`` (key=value, ...)`` for a head report's memory options, or nothing."""
    text = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in options.items()]
    return f" ({', '.join(text)})" if text else ""


def print_head_report(report, console: Console) -> None:
    """Each kv head's score and kind, then how many heads got each kind, the state and the
    calibration KL of the choice."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    scores = report.scores[report.score]
    layers = sorted({int(k.split(".")[0]) for k in scores})
    heads = sorted({int(k.split(".")[1]) for k in scores})
    names = report.names()
    kinds = [*reversed(report.levels), "streaming"]  # the costliest first
    memory = "" if report.memory is None else f" + {report.memory} memory{_options_text(report.memory_options)}"
    costs = ", ".join(
        f"{names[kind]}{memory if kind == 'streaming' else ''} {nbytes(report.head_bytes[kind])}" for kind in kinds
    )
    table = Table(
        box=box.SIMPLE_HEAD,
        title=Text(f"kv heads: {report.score} score and kind ({costs} per head at {report.context:,} tokens)"),
    )
    table.add_column("layer", justify="right")
    for h in heads:
        table.add_column(f"kv {h}", justify="right")
    for layer in layers:
        cells = []
        for h in heads:
            kind = report.kinds.get(f"{layer}.{h}")  # layers may have fewer kv heads than others
            if kind is None:
                cells.append(Text(""))
                continue
            cells.append(Text(f"{names[kind]} {scores[f'{layer}.{h}']:.3g}", "" if kind == "streaming" else "bold"))
        table.add_row(str(layer), *cells)
    console.print(table)
    share = report.state_bytes / report.kv_cache_bytes
    counts = list(report.kinds.values())
    console.print(
        Text(
            f"kv heads: {', '.join(f'{counts.count(kind)} {names[kind]}' for kind in kinds)}; attention state "
            f"{nbytes(report.state_bytes)} per sequence at {report.context:,} tokens ({share:.1%} of the "
            f"original's KV cache, {nbytes(report.kv_cache_bytes)}); calibration KL "
            f"{report.calibration_kl:.4f} nats/token; report saved as head_map.json"
        ),
        soft_wrap=True,
    )
