"""The ``rnnify`` command: convert, verify, generate, chat, inspect, compile, bench, evaluate and distil
recurrent models.

Each command is a module here, named as the command, with its ``HELP`` and ``DESCRIPTION``, the
function ``add_arguments`` that adds its arguments and its handler ``run`` (``common.add_command``
registers it); ``common`` holds what several share. A command's arguments are
added only when that command runs (``arguments.Command``), from names and defaults that
``rnnify.choices`` states without torch, and torch, transformers, rich and the rnnify modules that
need them are imported inside the handlers, so ``rnnify COMMAND --help`` and a mistyped flag answer
at once.

User mistakes (``RnnifyError``, and argparse's usage errors) print one ``error:`` line and exit 2;
a failed verification exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from rnnify import __version__, arguments
from rnnify.cli import (
    bench,
    chat,
    compile,
    convert,
    distill,
    eval,
    generate,
    info,
    verify,
)
from rnnify.cli.common import (
    add_command,
    one_line_warnings,
    quiet_transformers,
    torch_threads,
    user_error,
)
from rnnify.errors import RnnifyError

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS = (convert, verify, generate, chat, info, compile, bench, eval, distill)  # in the order --help lists them
PIPED_WIDTH = 120  # columns of output that is not a terminal, where rich would take 80

_EXAMPLES = """\
examples:
  rnnify convert path/to/hf-model --to exact -o out/exact
  rnnify convert path/to/hf-model --to linear --feature-map elu -o out/linear
  rnnify verify out/exact --against path/to/hf-model
  rnnify generate out/exact --prompt "def main():" --max-new-tokens 40
  rnnify chat out/exact --system "You are brief."
  rnnify info out/linear
  rnnify bench out/linear --against path/to/hf-model --contexts 256,16384 --json bench.json --plot bench.png
  rnnify eval out/linear --data corpus/ --max-tokens 100000 --json eval.json
  rnnify distill out/hybrid --data corpus/ -o out/hybrid-distilled --max-tokens 2000000
  rnnify convert path/to/hf-model --to hybrid --feature-map hedgehog --distill corpus/ -o out/hybrid-distilled
"""


def build_parser() -> argparse.ArgumentParser:
    parser = arguments.Parser(
        prog="rnnify",
        description="Compile attention-based Hugging Face causal LMs into recurrent models.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rnnify {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=arguments.Command)
    for command in COMMANDS:
        add_command(commands, command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 verification failed, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help, or argparse's own usage error (code 2)
        return exc.code if isinstance(exc.code, int) else 0
    except RnnifyError as exc:  # a value its flag's type refuses (``rnnify.arguments``)
        return user_error(exc)
    from rich.console import Console

    # A terminal's own width; piped output gets PIPED_WIDTH columns (or $COLUMNS).
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    console = Console(highlight=False, width=PIPED_WIDTH if piped else None)
    try:
        with warnings.catch_warnings():  # restores the default format on return (main may run in-process)
            warnings.showwarning = one_line_warnings(warnings.showwarning)
            quiet_transformers()
            with torch_threads(args):
                return args.run(args, console)
    except RnnifyError as exc:
        return user_error(exc)
    except KeyboardInterrupt:
        print("interrupted" + getattr(args, "on_interrupt", lambda: "")(), file=sys.stderr)
        return 130
