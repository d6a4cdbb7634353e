"""``rnnify compile``, and the compile of the decode step that ``convert`` and ``distill`` run after
saving: one module, so that both say the same about when it pays and report its outcome alike."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from rnnify.choices import WORTH_COMPILING_BELOW
from rnnify.cli.common import add_dir, load
from rnnify.errors import RnnifyError, RnnifyWarning, first_line

if TYPE_CHECKING:
    from rich.console import Console


HELP = "compile DIR's decode step ahead of time, so every later load here decodes compiled (CPU)"
DESCRIPTION = (
    "Compile the one-token step of DIR with AOTInductor, once, into this machine's step cache "
    "($RNNIFY_CACHE, else $XDG_CACHE_HOME/rnnify, else ~/.cache/rnnify): rnnify.load (and every command) "
    "then decodes with it on this CPU, with no compile in the process that decodes, for DIR and every "
    "model of the same graph and weight shapes. rnnify convert and rnnify distill do this by default; this "
    "command does it for a directory written with --no-compile, copied from another machine, or again "
    "after a torch or rnnify upgrade. The package holds code only (the weights stay in DIR's weights file) "
    "and fits any batch size. Takes tens of seconds and needs a C++ compiler. Not for exact layers of a "
    "sliding-window model. See docs/performance.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_dir(p)
    p.add_argument(
        "--ship",
        action="store_true",
        help="also write the compiled step into DIR as step-cpu.pt2, its sha256 recorded in DIR's manifest: "
        "machines like this one run it when loading DIR with --trust-compiled-step (it is native code)",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    import time

    from rich.text import Text

    from rnnify.runtime.step_cache import compile_into_cache, ship

    if args.ship and not args.verify:
        raise RnnifyError("--ship records the step in DIR's checked manifest: drop --no-verify")
    model = load(args, aot_step=False)
    start = time.perf_counter()
    with console.status("compiling the decode step (AOTInductor)"):
        path = ship(model, model.path) if args.ship else compile_into_cache(model)
    users = "with --trust-compiled-step on a CPU like this one" if args.ship else "on this machine's CPU"
    console.print(
        Text(
            f"wrote {path} in {time.perf_counter() - start:.0f} s: loading {args.dir} {users} now "
            "decodes with the compiled step"
        ),
        soft_wrap=True,
    )
    return 0


# -- after convert and distill save a model --------------------------------------------------


def add_compile_flag(p: argparse.ArgumentParser) -> None:
    """``--compile``/``--no-compile`` of a command that saves a model (``compile_step``)."""
    p.add_argument(
        "--compile",
        dest="compile_step",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the decode step ahead of time into this machine's cache, on a CPU: every later load of DIR "
        "here decodes with it. By default only where that pays: a model whose step reads under "
        f"{WORTH_COMPILING_BELOW / 2**30:g} GiB of weights; a larger one's step is mostly those reads. Takes "
        "tens of seconds to a few minutes, once, and a C++ compiler; `rnnify compile DIR` does it later. "
        "--no-compile: never",
    )


def compile_step(model, path: Path, forced: bool = False) -> str:
    """See that this machine's cache holds the decode step compiled ahead of time for the saved model
    ``path`` (``runtime.step_cache``): found there when it was compiled for a model of the same graph
    and weight layout (a distilled copy, the model converted again), else compiled (unless that gains
    little and is not ``forced``), from the saved model as ``rnnify.load`` makes it.
    The model is saved already, so a compile that fails only warns. Returns how ``path`` decodes."""
    import rnnify
    from rnnify.runtime.aot import gains_little, refusal
    from rnnify.runtime.step_cache import cached, compile_into_cache

    little = None if forced else gains_little(model)
    if model.device.type != "cpu" and little is not None:  # not worth loading a large model again to look
        return f"decode step: eager ({little})"
    # the step is for the saved model as a load makes it: on the CPU, guarded where its sizes follow data
    model = rnnify.load(path, aot_step=False, verify=False)
    reason = refusal(model)
    if reason is not None:
        return f"decode step: eager ({reason})"
    found = cached(model)
    if found is not None:
        return f"decode step: compiled ahead of time (found in this machine's cache: {found})"
    if little is not None:
        return f"decode step: eager ({little})"
    try:
        found = compile_into_cache(model)
    except Exception as exc:  # noqa: BLE001 - the model is whole without it; say why and go on
        warnings.warn(
            f"the decode step was not compiled ahead of time ({first_line(exc)}); {path} decodes "
            f"eagerly. `rnnify compile {path}` tries again and shows the whole error",
            RnnifyWarning,
            stacklevel=2,
        )
        return "decode step: eager"
    return f"decode step: compiled ahead of time (into this machine's cache: {found})"
