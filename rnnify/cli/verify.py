"""``rnnify verify``: the checks of ``rnnify.verify`` on a converted model, as a table; exit 1 if one fails."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rnnify import arguments
from rnnify.cli.common import add_eager_step_flag, add_kernels_flag, add_trust_flags, aot_step

if TYPE_CHECKING:
    from rich.console import Console


HELP = "check that a converted model is consistent (and matches the original)"
DESCRIPTION = (
    "Run the converted model on random tokens and compare: weights against the manifest "
    "digest, token-by-token steps against one-shot prefill, a prefill split in two against one "
    "shot, and with --against the original model's logits. Exits 1 if any check fails."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import SEED, VERIFY_BATCH, VERIFY_TOKENS

    p.add_argument("dir", metavar="DIR", help="converted model directory")
    add_trust_flags(p)
    add_eager_step_flag(p)
    p.add_argument(
        "--against",
        metavar="MODEL",
        help="original model (directory or cached hub id) to compare logits with; "
        "judged for 'exact', reported only for approximate targets",
    )
    p.add_argument(
        "--tokens",
        type=arguments.at_least(2, "--tokens"),
        default=VERIFY_TOKENS,
        metavar="N",
        help="tokens per sequence (at least 2: the split prefill reads two halves)",
    )
    p.add_argument(
        "--batch", type=arguments.at_least(1, "--batch"), default=VERIFY_BATCH, metavar="B", help="sequences per batch"
    )
    p.add_argument(
        "--seed", type=arguments.seed("--seed"), default=SEED, metavar="S", help="seed of the random token ids"
    )
    add_kernels_flag(p)


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}"


def run(args: argparse.Namespace, console: Console) -> int:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    import rnnify
    from rnnify import progress
    from rnnify.verify import CHECKS, rounding_dtype, run_checks, tolerance

    # unchecked, as the "integrity" check reports it; but a shipped step (native code) runs only once
    # everything, the expected digest included, is checked
    trusted = args.trust_compiled_step
    model = rnnify.load(
        args.dir,
        kernels=args.kernels,
        verify=trusted,
        trust_compiled_step=trusted,
        aot_step=aot_step(args),
        expected_digest=args.expect_digest if trusted else None,
    )
    total = len(CHECKS) if args.against is not None else len(CHECKS) - 1
    with progress.stages(total, "check", leave=False, lines=False) as start:  # the table says the rest
        results = run_checks(
            model,
            args.against,
            tokens=args.tokens,
            batch=args.batch,
            seed=args.seed,
            progress=lambda check: start(check, spin=True),  # a long check shows its time moving
            expected_digest=args.expect_digest,
        )
    step = ", step compiled ahead of time" if model.step_package is not None else ""  # the step the checks ran
    title = (
        f"{model.target_in_words} model, {model.manifest.dtype}{step}, batch {args.batch}, "
        f"tolerance {tolerance(rounding_dtype(model)):g} relative"
    )
    table = Table(box=box.SIMPLE_HEAD, title=Text(title))
    table.add_column("check", no_wrap=True)
    for column in ("max abs diff", "relative diff", "argmax agreement", "tokens"):
        table.add_column(column, justify="right")
    table.add_column("result")
    table.add_column("note", overflow="fold")
    for r in results:
        result = {True: Text("PASS", "green"), False: Text("FAIL", "bold red"), None: Text("info", "dim")}[r.passed]
        agreement = "" if r.argmax_agreement is None else f"{r.argmax_agreement:.1%}"
        tokens = "" if r.tokens is None else str(r.tokens)
        table.add_row(Text(r.name), _num(r.max_abs_diff), _num(r.rel_diff), agreement, tokens, result, Text(r.note))
    console.print(table)
    failed = [r.name for r in results if r.passed is False]
    if failed:
        console.print(Text(f"FAILED: {', '.join(failed)}", "bold red"), soft_wrap=True)
        return 1
    console.print(Text("all checks passed", "green"), soft_wrap=True)
    return 0
