"""What the commands share: how a command is registered, the flags several take and what they mean,
how sizes print, and how a user's mistake or an rnnify warning reaches the terminal.

Torch-free, as every module of the command line is when imported: the flags' help answers before
torch loads, and torch, rich and the rnnify modules that need them are imported inside the functions
that use them.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from rnnify import arguments
from rnnify.choices import DTYPES
from rnnify.errors import RnnifyError, RnnifyWarning

if TYPE_CHECKING:
    from rich.console import Console

Run = Callable[[argparse.Namespace, "Console"], int]  # a command's handler: its exit code


def nbytes(n: float) -> str:
    """A size in bytes, in the largest binary unit that keeps it at least 1."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


# -- registering a command -------------------------------------------------------------------


def printable(text: str) -> str:
    """``text`` from a model directory, its control characters written out (``\\x1b``): a
    terminal would act on them (clear the screen, set the title, hide a line)."""
    return "".join(c if c.isprintable() or c == "\n" else ascii(c)[1:-1] for c in text)


def add_command(commands: argparse._SubParsersAction, command: ModuleType) -> None:
    """Register the command that module ``command`` defines, named as the module: ``HELP`` (its line in
    ``rnnify --help``), ``DESCRIPTION``, ``add_arguments(p)``, which adds its arguments when it is used, and
    ``run(args, console)``, which handles it. A command that computes (all but those whose ``COMPUTES``
    is False) also gets ``--threads``, which ``main`` applies before ``run``."""

    def add(p: argparse.ArgumentParser) -> None:
        command.add_arguments(p)
        if getattr(command, "COMPUTES", True):
            _add_threads_flag(p)

    name = command.__name__.rpartition(".")[2]
    parser = commands.add_parser(name, arguments=add, help=command.HELP, description=command.DESCRIPTION)
    parser.set_defaults(run=command.run)


def _add_threads_flag(p: argparse.ArgumentParser) -> None:
    from rnnify.runtime.threads import default_threads

    p.add_argument(
        "--threads",
        type=arguments.threads("--threads"),
        default=None,
        metavar="N",
        help="torch threads to compute with (default: $OMP_NUM_THREADS if set, else the physical cores this "
        f"process may use, at most its cgroup CPU quota, here {default_threads()}); on a machine that other "
        "work shares, fewer threads can run faster and steadier",
    )


@contextmanager
def torch_threads(args: argparse.Namespace) -> Iterator[None]:
    """torch's thread count as ``--threads`` and ``rnnify.runtime.threads`` choose it, for a command that
    computes; restored after (``main`` may run in-process)."""
    if not hasattr(args, "threads"):
        yield
        return
    import torch

    from rnnify.runtime.threads import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(args.threads)
        yield
    finally:
        torch.set_num_threads(before)


# -- the output directory --------------------------------------------------------------------


def add_output_flags(p: argparse.ArgumentParser, help: str) -> None:
    """``-o DIR`` and ``--overwrite``, checked by ``claims_output``."""
    p.add_argument("-o", "--output", required=True, metavar="DIR", help=help)
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace -o DIR if it holds a converted model already, as distilling a model into its own "
        "directory does (default: refuse, before any work, rather than replace it unasked)",
    )


def claims_output(run: Run) -> Run:
    """``run`` refused at its start if its ``-o DIR`` holds a model and ``--overwrite`` was not given (on
    every process under torchrun, so that all stop), and holding DIR against other writers from its
    start (``runtime.output_dir.claim``): a second run on it is refused now, not after hours of work.
    Only the process that writes DIR claims it (``writes_results``)."""

    @functools.wraps(run)
    def claimed(args: argparse.Namespace, console: Console) -> int:
        from rnnify.runtime import output_dir
        from rnnify.runtime.manifest import MANIFEST_FILE
        from rnnify.runtime.saving import check_output

        output = check_output(Path(args.output))
        if not args.overwrite and (output / MANIFEST_FILE).is_file():
            raise RnnifyError(f"{args.output} already holds a converted model; pass --overwrite to replace it")
        if not writes_results():
            return run(args, console)
        with output_dir.claim(output):
            return run(args, console)

    return claimed


def writes_results() -> bool:
    """Whether this process writes what the command makes: rank 0 under torchrun, or the only process."""
    return int(os.environ.get("RANK", "0")) == 0


def save(model, output: str) -> Path:
    """``model.save(output)``, a refusal to write being the user's to fix."""
    try:
        return model.save(output)
    except OSError as exc:
        raise RnnifyError(f"cannot write {output}: {exc.strerror or exc}; choose another output directory") from exc


def check_writable(flag: str, path: str | None) -> None:
    """Refuse an output file that cannot be written now, not after the work that fills it: a
    directory in its place, or a directory that does not exist or takes no new file (tried)."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise RnnifyError(f"{flag} {path} is a directory; give a file name")
    if not target.parent.is_dir():
        raise RnnifyError(f"{flag} {path}: directory {target.parent} does not exist; create it or choose another path")
    try:
        tempfile.TemporaryFile(dir=target.parent).close()
    except OSError as exc:
        raise RnnifyError(f"{flag} {path}: cannot write in {target.parent} ({exc.strerror or exc})") from None


# -- the model directory and how it loads ----------------------------------------------------


def add_dir(p: argparse.ArgumentParser, help: str = "converted model directory") -> None:
    """``DIR``, and the flags of how it is loaded (``load``)."""
    p.add_argument("dir", metavar="DIR", help=help)
    p.add_argument(
        "--no-verify",
        "--no-verify-weights",
        dest="verify",
        action="store_false",
        help="load DIR without comparing its files with the sha256 its manifest recorded (which reads every "
        "weight); altered files then run unnoticed. Needed for directories of rnnify before manifest format "
        "3, which recorded none",
    )
    add_trust_flags(p)


def add_trust_flags(p: argparse.ArgumentParser) -> None:
    """What of DIR is trusted: its shipped compiled step, and its digest as someone else gave it."""
    p.add_argument(
        "--trust-compiled-step",
        action="store_true",
        help="run the compiled decode step DIR ships (native code: rnnify compile --ship) if its sha256 matches "
        "DIR's manifest; without this a shipped step is never opened",
    )
    p.add_argument(
        "--expect-digest",
        type=arguments.digest("--expect-digest"),
        metavar="HEX",
        help="refuse DIR unless its digest (rnnify info) is HEX, as someone you trust gave it to you",
    )


def add_eager_step_flag(p: argparse.ArgumentParser) -> None:
    """``--eager-step``, for the commands that decode: ``load(aot_step=False)``."""
    p.add_argument(
        "--eager-step",
        action="store_true",
        help="decode with the model's own step run eagerly, not a step compiled ahead of time for it (from "
        "this machine's cache, or shipped and trusted): slower, and free of the compiler's mistakes",
    )


def load_to_decode(args: argparse.Namespace):
    """``load``, refused at once where the model's kernels cannot run on its device: a command that
    prints as it decodes (the prompt first) would say so only at its first token."""
    from rnnify.kernels.utils import check_runnable

    model = load(args)
    check_runnable(model.kernels, model.device)
    return model


def load(args: argparse.Namespace, **kwargs: Any):
    """``rnnify.load`` of ``DIR`` as its flags say (``--kernels`` and ``--device`` where the command has
    them), ``kwargs`` over them."""
    import rnnify

    if "device" not in kwargs and hasattr(args, "device"):
        kwargs["device"] = device(args.device)
    kwargs.setdefault("aot_step", aot_step(args))
    return rnnify.load(
        args.dir,
        kernels=getattr(args, "kernels", None),
        verify=args.verify,
        trust_compiled_step=args.trust_compiled_step,
        expected_digest=args.expect_digest,
        **kwargs,
    )


def aot_step(args: argparse.Namespace) -> bool:
    """``rnnify.load``'s ``aot_step`` as ``--eager-step`` says (True where the command has no such flag)."""
    eager = getattr(args, "eager_step", False)
    if eager and args.trust_compiled_step:
        raise RnnifyError("--eager-step runs no compiled step: it cannot go with --trust-compiled-step")
    return not eager


def add_data_flag(p: argparse.ArgumentParser) -> None:
    """``--data``, the text a command reads (``rnnify.data.token_batches``)."""
    p.add_argument(
        "--data",
        type=arguments.text_path("--data"),
        required=True,
        metavar="PATH",
        help='text file, folder of text files or .jsonl file with a "text" field per line',
    )


def add_kernels_flag(p: argparse.ArgumentParser) -> None:
    """``--kernels`` of a command that loads DIR: DIR's own unless given."""
    from rnnify.choices import KERNELS

    p.add_argument(
        "--kernels",
        choices=KERNELS,
        default=None,
        help="backend of the fused ops, overriding the one DIR was converted with: auto, triton or reference; "
        "none runs the cells' own PyTorch forms (default: DIR's)",
    )


def add_device_flag(p: argparse.ArgumentParser, what: str = "device to run on", note: str = "") -> None:
    """``--device``, the same default everywhere (``device``)."""
    p.add_argument(
        "--device",
        metavar="DEVICE",
        help=f"{what}, e.g. cpu or cuda:0 (default: cuda:$LOCAL_RANK when CUDA is available, else cpu){note}",
    )


def add_dtype_flag(p: argparse.ArgumentParser, default: str | None, help: str) -> None:
    """``--dtype``, the same choices everywhere."""
    p.add_argument("--dtype", choices=DTYPES, default=default, help=help)


def device(name: str | None):
    """``--device``: as given, else this process's GPU (``cuda:$LOCAL_RANK``, 0 outside torchrun)
    when CUDA is available, else the CPU."""
    import torch

    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    from rnnify.runtime.devices import usable_device

    return usable_device(name, "--device")


def int_list(flag: str, text: str, example: str = "256,1024") -> list[int]:
    """``flag``'s comma-separated positive integers (``example``: what its error suggests)."""
    values = arguments.integers(text)
    if not values or any(v < 1 for v in values):
        raise RnnifyError(f"{flag} {text!r}: expected comma-separated positive integers, each once, e.g. {example}")
    return values


# -- what reaches the terminal ---------------------------------------------------------------


def quiet_transformers() -> None:
    """Keep transformers' loading bars and notices out of the command's output."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def user_error(exc: RnnifyError) -> int:
    """Print a user's mistake as one ``error:`` line (a model directory's words in it made ``printable``);
    the exit code that says so."""
    print("error: " + printable(" ".join(str(exc).split())), file=sys.stderr)
    return 2


def one_line_warnings(default: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints rnnify's own warnings as one ``warning:`` line (they are
    for the user, who has no use for the file and line that raised them) and others as ``default`` does."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, RnnifyWarning):
            return default(message, category, filename, lineno, file, line)
        text = printable(" ".join(str(message).split()))
        print("warning: " + text, file=file if file is not None else sys.stderr)

    return show
