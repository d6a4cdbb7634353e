"""The ``rnnify`` command: convert, verify, generate, inspect, compile, bench, evaluate and distil recurrent models.

Each command has a section below: ``add_<command>(commands)`` declares its arguments beside the
handler that runs it; ``build_parser`` calls them all. A command's arguments are added only when
that command runs (``arguments.Command``), from names that ``rnnify.choices`` states without
torch, and torch, transformers, rich and the rnnify modules that need them are imported inside the
handlers, so ``rnnify COMMAND --help`` and a mistyped flag answer in a fraction of a second.

User mistakes (``RnnifyError``, and argparse's usage errors) print one ``error:`` line and exit 2;
a failed verification exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from rnnify import arguments
from rnnify.errors import RnnifyError, RnnifyWarning, first_line

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["main", "build_parser"]

_DTYPES = ("float32", "bfloat16", "float16")
_LENGTHS = (1, 1024, 16384)  # context lengths at which `info` reports state size

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


# -- formatting ---------------------------------------------------------------------------


def _nbytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}"


def _memory_line(model) -> str:
    """Whether the state grows with the context, in words."""
    if not model.constant_memory:
        per_token = model.state_nbytes(1025) - model.state_nbytes(1024)
        return f"state grows with context, like a KV cache: {_nbytes(per_token)} per token per sequence"
    if any(cell.spec.window is not None for cell in model.cells if cell.grows_with_context):
        return "state is constant once the model's sliding window is full: memory does not grow with context"
    return "state is constant: memory does not grow with context"


# -- arguments and helpers shared by the commands -------------------------------------------


def _add_command(
    commands: argparse._SubParsersAction,
    name: str,
    run: Callable[[argparse.Namespace, Console], int],
    arguments: Callable[[argparse.ArgumentParser], None],
    computes: bool = True,
    **kwargs: Any,
) -> None:
    """Register command ``name``: ``run`` handles it, ``arguments`` adds its arguments when it is used;
    a command that ``computes`` also gets ``--threads``, which ``main`` applies before ``run``."""

    def add(p: argparse.ArgumentParser) -> None:
        arguments(p)
        if computes:
            _add_threads_flag(p)

    commands.add_parser(name, arguments=add, **kwargs).set_defaults(run=run)


def _add_threads_flag(p: argparse.ArgumentParser) -> None:
    from rnnify.runtime.threads import default_threads

    p.add_argument(
        "--threads", type=int, default=None, metavar="N",
        help="torch threads to compute with (default: $OMP_NUM_THREADS if set, else the physical cores this "
        f"process may use, at most its cgroup CPU quota, here {default_threads()}); on a machine that other "
        "work shares, fewer threads (often 1) run faster and steadier",
    )


@contextmanager
def _torch_threads(args: argparse.Namespace) -> Iterator[None]:
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


def _add_output_flags(p: argparse.ArgumentParser, help: str) -> None:
    """``-o DIR`` and ``--overwrite``, checked by ``_claims_output``."""
    p.add_argument("-o", "--output", required=True, metavar="DIR", help=help)
    p.add_argument("--overwrite", action="store_true",
                   help="replace -o DIR if it holds a converted model already, as distilling a model into its own "
                   "directory does (default: refuse, before any work, rather than replace it unasked)")


def _claims_output(run: Callable[[argparse.Namespace, Console], int]) -> Callable[[argparse.Namespace, Console], int]:
    """``run`` refused at its start if its ``-o DIR`` holds a model and ``--overwrite`` was not given (on
    every process under torchrun, so that all stop), and holding DIR against other writers from its
    start (``runtime.output_dir.claim``): a second run on it is refused now, not after hours of work.
    Only the process that writes DIR claims it (``_writes_results``)."""

    @functools.wraps(run)
    def claimed(args: argparse.Namespace, console: Console) -> int:
        from rnnify.runtime import output_dir
        from rnnify.runtime.manifest import MANIFEST_FILE
        from rnnify.runtime.storage import check_output

        output = check_output(Path(args.output))
        if not args.overwrite and (output / MANIFEST_FILE).is_file():
            raise RnnifyError(f"{args.output} already holds a converted model; pass --overwrite to replace it")
        if not _writes_results():
            return run(args, console)
        with output_dir.claim(output):
            return run(args, console)

    return claimed


def _writes_results() -> bool:
    """Whether this process writes what the command makes: rank 0 under torchrun, or the only process."""
    return int(os.environ.get("RANK", "0")) == 0


def _add_dir(p: argparse.ArgumentParser, help: str = "converted model directory") -> None:
    """``DIR``, and the flags of how it is loaded (``_load``)."""
    p.add_argument("dir", metavar="DIR", help=help)
    p.add_argument(
        "--no-verify", "--no-verify-weights", dest="verify", action="store_false",
        help="load DIR without comparing its files with the sha256 its manifest recorded (a read of the "
        "weights, about 1 s per GB); altered files then run unnoticed. Needed for directories of rnnify "
        "before manifest format 3, which recorded none",
    )
    _add_trust_flags(p)


def _add_trust_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-compiled-step", action="store_true",
        help="run the compiled decode step DIR ships (native code: rnnify compile --ship) if its sha256 matches "
        "DIR's manifest; without this a shipped step is never opened",
    )
    p.add_argument(
        "--expect-digest", metavar="HEX",
        help="refuse DIR unless its digest (rnnify info) is HEX, as someone you trust gave it to you",
    )


def _load(args: argparse.Namespace, **kwargs: Any):
    """``rnnify.load`` of ``DIR`` as its flags say (``--kernels`` where the command has it)."""
    import rnnify

    kernels = getattr(args, "kernels", None)
    return rnnify.load(args.dir, kernels=kernels, verify=args.verify, trust_compiled_step=args.trust_compiled_step,
                       expected_digest=args.expect_digest, **kwargs)


def _add_kernels_flag(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import KERNELS

    p.add_argument(
        "--kernels", choices=KERNELS, default=None,
        help="backend of the fused ops, overriding the one DIR was converted with: auto, triton or reference; "
        "none runs the cells' own PyTorch forms (default: DIR's)",
    )


def _add_device_flag(p: argparse.ArgumentParser, what: str = "device to run on", note: str = "") -> None:
    """``--device``, the same default everywhere (``_device``)."""
    p.add_argument(
        "--device", metavar="DEVICE",
        help=f"{what}, e.g. cpu or cuda:0 (default: cuda:$LOCAL_RANK when CUDA is available, else cpu){note}",
    )


def _add_dtype_flag(p: argparse.ArgumentParser, default: str | None, help: str) -> None:
    """``--dtype``, the same choices everywhere."""
    p.add_argument("--dtype", choices=_DTYPES, default=default, help=help)


def _device(name: str | None):
    """``--device``: as given, else this process's GPU (``cuda:$LOCAL_RANK``, 0 outside torchrun)
    when CUDA is available, else the CPU."""
    import os

    import torch

    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RnnifyError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RnnifyError(f"--device {name}: no CUDA device is available; use --device cpu")
    return device


def _check_writable(flag: str, path: str | None) -> None:
    """Refuse an output file whose directory does not exist now, not after the work that fills it."""
    if path is not None and not Path(path).expanduser().parent.is_dir():
        raise RnnifyError(f"{flag} {path}: directory {Path(path).expanduser().parent} does not exist; "
                          "create it or choose another path")


def _save(model, output: str) -> Path:
    """``model.save(output)``, a refusal to write being the user's to fix."""
    try:
        return model.save(output)
    except OSError as exc:
        raise RnnifyError(f"cannot write {output}: {exc.strerror or exc}; choose another output directory") from exc


def _add_compile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile", dest="compile_step", action=argparse.BooleanOptionalAction, default=None,
        help="compile the decode step ahead of time into this machine's cache, on a CPU: every later load of DIR "
        "here decodes with it. "
        "By default only where that pays: a model whose step reads under 1 GiB of weights (decoding 1.15-3.2x "
        "faster at batch 1 where measured); a larger one's step is mostly those reads. Takes tens of seconds to a few "
        "minutes, once, and a C++ compiler; `rnnify compile DIR` does it later. --no-compile: never",
    )


def _compile_step(model, path: Path, forced: bool = False) -> str:
    """See that this machine's cache holds the decode step compiled ahead of time for the saved model
    ``path`` (``runtime.step_cache``): found there when it was compiled for a model of the same graph
    and weight layout (a distilled copy, the model converted again), else compiled (unless that gains
    little and is not ``forced``), from the saved model when ``model`` was trained on another device.
    The model is saved already, so a compile that fails only warns. Returns how ``path`` decodes."""
    import rnnify
    from rnnify.runtime.aot import gains_little, refusal
    from rnnify.runtime.step_cache import cached, compile_into_cache

    little = None if forced else gains_little(model)
    if model.device.type != "cpu":  # the step is for CPUs: found or compiled from the saved model, loaded there
        if little is not None:  # not worth loading a large model again to look
            return f"decode step: eager ({little})"
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
        warnings.warn(f"the decode step was not compiled ahead of time ({first_line(exc)}); {path} decodes "
                      f"eagerly. `rnnify compile {path}` tries again and shows the whole error", RnnifyWarning,
                      stacklevel=2)
        return "decode step: eager"
    return f"decode step: compiled ahead of time (into this machine's cache: {found})"


def _quiet_transformers() -> None:
    """Keep transformers' loading bars and notices out of the command's output."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


# -- convert ------------------------------------------------------------------------------


def add_convert(commands: argparse._SubParsersAction) -> None:
    _add_command(
        commands, "convert", _convert, _convert_arguments,
        help="compile a Hugging Face causal LM (or GGUF file) into a recurrent model directory",
        description="Load MODEL, capture its forward pass, replace every attention with a recurrent "
        "cell and save the result to -o DIR (no pickle; loads without the source model).",
    )


def _convert_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import FEATURE_MAPS, KERNELS, MEMORIES, TARGETS
    from rnnify.distill.options import add_training_flags

    p.add_argument(
        "model", metavar="MODEL",
        help="local Hugging Face model directory, a .gguf file (dequantised to --dtype; needs "
        "pip install 'rnnify[gguf]'), or a hub id already in the local cache",
    )
    targets = "; ".join(f"{name}: {text}" for name, text in TARGETS.items())
    p.add_argument("--to", choices=[*TARGETS, "auto"], required=True,
                   help=f"target cell ({targets}); auto: per kv head, exact for the heads that read far back and "
                   "window with sinks (or, with --memory, a hybrid, which takes the other cell options) for the rest, chosen on "
                   "calibration data (flags below)")
    _add_output_flags(p, "directory to write the converted model to")
    _add_dtype_flag(p, "float32", "dtype to load and save the weights in (default: float32)")
    p.add_argument(
        "--layers", metavar="SPEC",
        help="targets per layer range, overriding --to: e.g. '0-1:exact,2-:hybrid' (ranges inclusive, "
        "'N-' runs to the last layer; later rules win)",
    )
    p.add_argument(
        "--keep-softmax", metavar="LAYERS", help="comma-separated layers kept exact softmax attention, e.g. 0,3"
    )
    p.add_argument(
        "--kernels", choices=KERNELS, default="auto",
        help="backend of the fused Triton ops the cells run where they have them: auto (Triton on CUDA, "
        "the PyTorch reference elsewhere), triton or reference; none: the cells' own PyTorch forms; "
        "saved with the model (default: auto)",
    )
    cell = p.add_argument_group("cell options (passed to every cell that accepts them)")
    cell.add_argument("--window", type=int, metavar="W", help="softmax window in tokens (window, hybrid)")
    cell.add_argument("--sinks", type=int, metavar="S",
                      help="first tokens always attended to (window, hybrid; default: 4 for hybrid, 0 for window)")
    cell.add_argument(
        "--feature-map", choices=sorted(FEATURE_MAPS), default=None,
        help="feature map phi (linear, hybrid, gated; default: hedgehog for hybrid, whose memory distillation "
        "fits through it, else elu)"
    )
    cell.add_argument("--gate", metavar="NAME", help="gate of the gated target: retnet, gla or gateloop")
    cell.add_argument(
        "--memory", metavar="NAME", default=None,
        help=f"hybrid: what holds the tokens that left the window, one of {', '.join(MEMORIES)}: linear attention "
        "(the default for --to hybrid), gated linear attention (gla) or a delta-rule memory (delta, gated-delta), blended into the "
        "window's output by a learned gate that starts at 0; with --to auto, the streaming heads become such hybrids",
    )
    cell.add_argument(
        "--option", action="append", metavar="KEY=VALUE",
        help="any other cell option, repeatable; VALUE is read as JSON when it parses (chunk_size=128, "
        'feature_options={"num_features":256})',
    )
    auto = p.add_argument_group("--to auto: which kv heads are retrieval heads, exact or with a long window (the rest: "
                                "--window, default 64, with --sinks, default 4; with --memory NAME hybrids of that window and memory)")
    auto.add_argument("--state-budget", metavar="BYTES",
                      help="state per sequence at --at-context tokens: bytes (2000000, 2MB, 1.5MiB) or a share of the "
                      "original's KV cache (30%%); the heads that score highest per byte stay exact while it fits")
    auto.add_argument("--at-context", type=int, default=4096, metavar="N", help="context of --state-budget (default: 4096)")
    auto.add_argument("--max-kl", type=float, metavar="X",
                      help="instead of a budget: the fewest exact heads whose KL to the original on the calibration "
                      "rows is at most X nats per token")
    auto.add_argument("--data", metavar="PATH", help="calibration text: a file, folder or .jsonl (required with auto)")
    auto.add_argument("--score", choices=("kl", "mass"), default="kl",
                      help="kl: KL increase when the head alone is windowed (one pass per kv head and row); mass: "
                      "attention beyond the window and sinks (one pass per row, much faster, chose far worse on "
                      "SmolLM2); docs/fidelity.md compares them (default: kl)")
    auto.add_argument("--calib-rows", type=int, default=2, metavar="N", help="text rows to score on (default: 2)")
    auto.add_argument("--calib-len", type=int, default=1024, metavar="T",
                      help="tokens per text row and per pass-key prompt (default: 1024)")
    auto.add_argument("--calib-passkey", type=int, default=2, metavar="N",
                      help="pass-key prompts (made here, key at evenly spaced depths) to score on (default: 2)")
    auto.add_argument("--per-layer", action="store_true", help="choose whole layers instead of single heads")
    auto.add_argument("--scores-from", metavar="FILE",
                      help="choose again from the scores in an earlier run's head_map.json (same model, --score, "
                      "--window and --sinks) instead of scoring: one pass per calibration row, for the calibration KL")
    auto.add_argument("--retrieval-window", type=int, metavar="N",
                      help="the retrieval heads keep the last N tokens (and the sinks) instead of every token: the "
                      "state stops growing at N, so the model decodes in constant memory (default: they stay exact)")
    p.add_argument(
        "--distill", metavar="PATH",
        help="then distil the converted model on this text file, folder or .jsonl before saving (flags below)",
    )
    _add_compile_flag(p)
    _add_training_flags(p, add_training_flags)


@_claims_output
def _convert(args: argparse.Namespace, console: Console) -> int:
    from rich.text import Text

    import rnnify
    from rnnify import progress
    from rnnify.auto import check_memory
    from rnnify.passes import PIPELINE
    from rnnify.plan import parse_options

    check_memory(args.memory)  # before the model is loaded
    options = {name: getattr(args, name) for name in _CELL_FLAGS if getattr(args, name) is not None}
    options.update(parse_options(args.option or [], lambda pair: f"--option {pair!r}: expected KEY=VALUE, e.g. chunk_size=128"))
    keep = _parse_layer_list(args.keep_softmax) if args.keep_softmax else None
    training = _training_options(args) if args.distill else None  # the flags' mistakes before converting
    stages = ["load", "capture", *(p.__name__ for p in PIPELINE), *(["distill"] if args.distill else []), "save"]
    stages = ["choose heads", "save"] if args.to == "auto" else stages  # auto converts while it chooses
    stages += ["decode step"] if args.compile_step is not False else []  # compiled, or why not
    if args.to == "auto":
        _check_auto(args, keep)
    else:
        _no_auto_flags(args)
    report = None
    with progress.stages(len(stages), "stage") as start:
        if args.to == "auto":
            start("choose heads")
            model, report = _auto(args, options)
        else:
            model = rnnify.convert(
                args.model, to=args.to, layers=args.layers, keep_softmax=keep, dtype=args.dtype, kernels=args.kernels,
                progress=start, **options,
            )
        if args.distill:
            start("distill")
            if not _train(model, args.distill, args.teacher or args.model, training):
                return 0
        start("save")
        path = _save(model, args.output)
        if args.compile_step is not False:
            start("decode step", spin=True)  # one call of seconds to minutes: nothing else moves meanwhile
            decode_note = _compile_step(model, path, forced=bool(args.compile_step))
    if report is not None:
        _print_head_report(report, console)
    growth = "grows with context, like a KV cache" if not model.constant_memory else "constant"
    console.print(Text(f"saved to {path}"), soft_wrap=True)
    console.print(
        Text(
            f"{model.target}: {len(model.cells)} layers, {model.manifest.dtype}, "
            f"state {_nbytes(model.state_nbytes(1024))} per sequence at 1k tokens ({growth})"
        ),
        soft_wrap=True,
    )
    if args.compile_step is not False:
        console.print(Text(decode_note), soft_wrap=True)
    if args.distill:
        _drop_checkpoint(training["checkpoint_dir"], args.keep_checkpoints, console)
    return 0


_CELL_FLAGS = ("window", "sinks", "feature_map", "gate", "memory")  # first-class cell options; others via --option
_AUTO_FLAGS = {"state_budget": None, "max_kl": None, "data": None, "score": "kl", "calib_rows": 2, "calib_len": 1024,
               "calib_passkey": 2, "per_layer": False, "at_context": 4096, "retrieval_window": None,
               "scores_from": None}


def _no_auto_flags(args: argparse.Namespace) -> None:
    given = [name for name, default in _AUTO_FLAGS.items() if getattr(args, name) != default]
    if given:
        raise RnnifyError(f"--{given[0].replace('_', '-')} applies to --to auto only")


def _check_auto(args: argparse.Namespace, keep) -> None:
    """What --to auto refuses or needs, before anything loads."""
    if args.layers or keep or args.distill:
        raise RnnifyError("--to auto chooses every layer's heads itself: it takes --window, --sinks, --memory and the "
                          "memory's cell options, not --layers, --keep-softmax or --distill")
    if args.data is None:
        raise RnnifyError("--to auto needs calibration text: --data PATH (a file, folder or .jsonl)")


def _auto(args: argparse.Namespace, options: dict):
    """Score the heads and choose (flags checked by ``_check_auto``); the converted model (saved by the
    caller) and the report of the choice."""
    from rnnify.auto import SINKS, WINDOW, auto_convert

    return auto_convert(
        args.model, args.data, budget=args.state_budget, context=args.at_context, max_kl=args.max_kl,
        score=args.score, window=options.get("window", WINDOW), sinks=options.get("sinks", SINKS),
        calib_len=args.calib_len, calib_rows=args.calib_rows, passkey=args.calib_passkey, per_layer=args.per_layer,
        retrieval_window=args.retrieval_window, memory=options.get("memory"), scores_from=args.scores_from,
        memory_options={k: v for k, v in options.items() if k not in ("window", "sinks", "memory")},
        dtype=args.dtype, kernels=args.kernels, progress=True,
    )


def _options_text(options: dict) -> str:
    """`` (key=value, ...)`` for a head report's memory options, or nothing."""
    text = [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in options.items()]
    return f" ({', '.join(text)})" if text else ""


def _print_head_report(report, console: Console) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    scores = report.scores[report.score]
    layers = sorted({int(k.split(".")[0]) for k in scores})
    heads = sorted({int(k.split(".")[1]) for k in scores})
    chosen = {tuple(h) for h in report.retrieval}
    long = "exact" if report.retrieval_window is None else f"window {report.retrieval_window}"
    streaming = f"window {report.window}" if report.memory is None else f"hybrid {report.window}"
    table = Table(box=box.SIMPLE_HEAD, title=Text(
        f"kv heads: {report.score} score and choice ({long} {_nbytes(report.head_bytes['retrieval'])}, {streaming}"
        f"{'' if report.memory is None else ' + ' + report.memory + ' memory' + _options_text(report.memory_options)} "
        f"{_nbytes(report.head_bytes['streaming'])} per head at {report.context:,} tokens)"))
    table.add_column("layer", justify="right")
    for h in heads:
        table.add_column(f"kv {h}", justify="right")
    for layer in layers:
        cells = []
        for h in heads:
            kept = (layer, h) in chosen
            cells.append(Text(f"{long if kept else streaming} {scores[f'{layer}.{h}']:.3g}",
                              "bold" if kept else ""))
        table.add_row(str(layer), *cells)
    console.print(table)
    share = report.state_bytes / report.kv_cache_bytes
    console.print(Text(
        f"{len(chosen)} of {len(layers) * len(heads)} kv heads {long}; state {_nbytes(report.state_bytes)} per sequence "
        f"at {report.context:,} tokens ({share:.1%} of the original's KV cache, {_nbytes(report.kv_cache_bytes)}); "
        f"calibration KL {report.calibration_kl:.4f} nats/token; report saved as head_map.json"), soft_wrap=True)


def _parse_layer_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise RnnifyError(f"--keep-softmax {text!r}: expected comma-separated layer indices, e.g. 0,3") from None


# -- verify -------------------------------------------------------------------------------


def add_verify(commands: argparse._SubParsersAction) -> None:
    _add_command(
        commands, "verify", _verify, _verify_arguments,
        help="check that a converted model is consistent (and matches the original)",
        description="Run the converted model on random tokens and compare: weights against the manifest "
        "digest, token-by-token steps against one-shot prefill, a prefill split in two against one "
        "shot, and with --against the original model's logits. Exits 1 if any check fails.",
    )


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="converted model directory")
    _add_trust_flags(p)
    p.add_argument(
        "--against", metavar="MODEL",
        help="original model (directory or cached hub id) to compare logits with; "
        "judged for 'exact', reported only for approximate targets",
    )
    p.add_argument("--tokens", type=int, default=32, metavar="N", help="tokens per sequence (default: 32)")
    p.add_argument("--batch", type=int, default=2, metavar="B", help="sequences per batch (default: 2)")
    p.add_argument("--seed", type=arguments.seed("--seed"), default=0, metavar="S",
                   help="seed of the random token ids (default: 0)")
    _add_kernels_flag(p)


def _verify(args: argparse.Namespace, console: Console) -> int:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    import rnnify
    from rnnify import progress
    from rnnify.verify import CHECKS, run_checks, tolerance

    # unchecked, as the "integrity" check reports it; but a shipped step (native code) runs only once
    # everything, the expected digest included, is checked
    trusted = args.trust_compiled_step
    model = rnnify.load(args.dir, kernels=args.kernels, verify=trusted, trust_compiled_step=trusted,
                        expected_digest=args.expect_digest if trusted else None)
    total = len(CHECKS) if args.against is not None else len(CHECKS) - 1
    with progress.stages(total, "check", leave=False, lines=False) as start:  # the table says the rest
        results = run_checks(model, args.against, tokens=args.tokens, batch=args.batch, seed=args.seed, progress=start,
                             expected_digest=args.expect_digest)
    step = ", step compiled ahead of time" if model.step_package is not None else ""  # the step the checks ran
    title = (f"{model.target} model, {model.manifest.dtype}{step}, batch {args.batch}, "
             f"tolerance {tolerance(model.dtype):g} relative")
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


# -- generate -----------------------------------------------------------------------------


def add_generate(commands: argparse._SubParsersAction) -> None:
    _add_command(
        commands, "generate", _generate, _generate_arguments,
        help="generate text or token ids, streamed as they are produced",
        description="Continue a prompt with the converted model, one recurrent step per token, printing "
        "each token as it comes (the prompt first). Greedy unless --do-sample.",
    )


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", type=arguments.utf8("--prompt"), metavar="TEXT",
                        help="text prompt, tokenized with the tokenizer saved in DIR")
    prompt.add_argument("--ids", metavar="IDS", help="prompt as comma-separated token ids, e.g. 1,2,3; prints ids back")
    _add_sampling_flags(p, max_new_tokens=20)
    _add_kernels_flag(p)


def _add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """How tokens are chosen, shared by ``generate`` and ``chat``: greedy unless --do-sample."""
    p.add_argument(
        "--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
        help=f"most tokens to generate (default: {max_new_tokens})",
    )
    p.add_argument("--do-sample", action="store_true", help="sample instead of taking the most likely token")
    p.add_argument("--temperature", type=arguments.temperature("--temperature"), default=1.0, metavar="T",
                   help="sampling temperature, > 0 (default: 1.0)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample only from the K most likely tokens")
    p.add_argument(
        "--top-p", type=float, default=None, metavar="P",
        help="sample only from the smallest set of tokens whose probability adds up to P",
    )
    p.add_argument("--seed", type=arguments.seed("--seed"), default=None, metavar="S",
                   help="seed for sampling, for repeatable output")


class _IdStreamer:
    """Prints token ids as ``generate`` produces them, comma-separated, prompt first."""

    def __init__(self) -> None:
        self._first = True

    def put(self, ids) -> None:
        for token in ids.flatten().tolist():
            print(("" if self._first else ",") + str(token), end="", flush=True)
            self._first = False

    def end(self) -> None:
        print(flush=True)


def _parse_ids(text: str, vocab_size: int) -> list[int]:
    ids = []
    for part in text.split(","):
        try:
            ids.append(int(part.strip()))
        except ValueError:
            message = f"--ids: {part.strip()!r} is not an integer; give comma-separated token ids like 1,2,3"
            raise RnnifyError(message) from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RnnifyError(f"--ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def _generate(args: argparse.Namespace, console: Console) -> int:
    import torch

    from rnnify.runtime.text import eos_ids

    model = _load(args)
    if args.ids is not None:
        tokenizer, streamer = None, _IdStreamer()
        ids = _parse_ids(args.ids, model.manifest.vocab_size)
    else:
        from transformers import TextStreamer

        from rnnify.data import load_tokenizer

        tokenizer = load_tokenizer(args.dir, "pass the prompt as token ids with --ids")
        ids = tokenizer(args.prompt, add_special_tokens=True).input_ids
        if not ids:
            raise RnnifyError("--prompt is empty: give some text")
        streamer = TextStreamer(tokenizer, skip_special_tokens=True)
    model.generate(
        torch.tensor([ids], device=model.device),
        args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=eos_ids(model, tokenizer) or None,
        seed=args.seed,
        streamer=streamer,
    )
    return 0


# -- chat ---------------------------------------------------------------------------------


def add_chat(commands: argparse._SubParsersAction) -> None:
    _add_command(
        commands, "chat", _chat, _chat_arguments,
        help="chat with a converted model, its recurrent state carrying the conversation",
        description="Read one user message per line from stdin, apply the chat template saved in DIR and "
        "stream the reply. Each turn reads only its new tokens, continuing from the state after the "
        "previous reply (history is never re-read); after each reply a dim line shows the tokens so far "
        "and the state's size, constant for recurrent targets. /reset starts a new conversation; "
        "Ctrl-D or Ctrl-C ends. Greedy unless --do-sample.",
    )


def _chat_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p, "converted model directory with a tokenizer and chat template")
    p.add_argument("--system", type=arguments.utf8("--system"), metavar="TEXT",
                   help="system prompt that opens every conversation")
    _add_sampling_flags(p, max_new_tokens=256)
    p.add_argument("--verbose", action="store_true",
                   help="before each reply, show how many new tokens the turn read and how they were told from the "
                   "history the state holds, in the order tried: " + "; or ".join(_RULES.values()) + " (rnnify/chat.py)")
    _add_kernels_flag(p)


# How ``Chat.ask`` told a turn's new tokens from what the state read (its rules, in order; rnnify/chat.py).
_RULES = {
    "tokens": "the history tokenizes again to the tokens the state read",
    "text": "the history tokenizes differently, but its text is what the state read",
    "messages": "the template rewrote earlier turns; the state keeps them as it read them",
}


def _chat(args: argparse.Namespace, console: Console) -> int:
    """Read user messages from stdin, one per line, and stream each reply; /reset starts over."""
    from rich.text import Text
    from transformers import TextStreamer

    from rnnify.chat import Chat
    from rnnify.data import load_tokenizer
    from rnnify.runtime.text import eos_ids

    model = _load(args)
    tokenizer = load_tokenizer(args.dir, "chat needs the tokenizer and chat template of the source model in DIR")
    chat = Chat(
        model, tokenizer, system=args.system, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        eos_token_id=eos_ids(model, tokenizer) or None, seed=args.seed,
    )
    interactive = sys.stdin.isatty()
    if interactive:
        console.print(Text("one message per line; /reset starts a new conversation; Ctrl-D ends", "dim"))
    try:
        while True:
            try:
                text = input("> " if interactive else "").strip()
            except EOFError:
                break
            except UnicodeDecodeError as exc:  # the tokenizer takes text: say which bytes are not
                bad = exc.object[exc.start : exc.end].hex(" ")
                raise RnnifyError(f"stdin is not {exc.encoding} text ({exc.reason}: {bad}); send the messages "
                                  f"in {exc.encoding}") from None
            if text == "/reset":
                chat.reset()
                console.print(Text("(new conversation)", "dim"))
            elif text:
                read, rule = chat.ask(text)
                if args.verbose:
                    console.print(Text(f"(read {read} new tokens; {_RULES[rule]})", "dim"))
                chat.reply(TextStreamer(tokenizer, skip_special_tokens=True))
                console.print(Text(f"[{len(chat.consumed):,} tokens, state {_nbytes(chat.state.nbytes)}]", "dim"))
    except KeyboardInterrupt:
        print()
    return 0


# -- info ---------------------------------------------------------------------------------


def add_info(commands: argparse._SubParsersAction) -> None:
    _add_command(
        commands, "info", _info, _add_dir, computes=False,
        help="describe a converted model: source, target, positions, state size per layer",
        description="Print what DIR holds: its source model, target cell and options, dtype, the versions "
        "it was converted with, how it encodes positions, and the recurrent state per layer at "
        f"{', '.join(map(str, _LENGTHS))} tokens.",
    )


def _info(args: argparse.Namespace, console: Console) -> int:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from rnnify.runtime.step_cache import describe

    model = _load(args)
    manifest = model.manifest
    # the first cell's options show the defaults it filled in; a per-head cell's are its groups
    options = manifest.cells[0].options if manifest.cells and manifest.cells[0].target != "heads" else manifest.options
    positions = manifest.positions
    if positions.get("kind") == "learned":
        where = f"learned, {positions.get('limit')} positions (cannot decode past them)"
    else:
        limit = positions.get("limit")
        where = f"{positions.get('kind', 'unknown')}" + (f", trained up to {limit} positions" if limit else "")
    fused_ops = ["\n".join(f"{phase} {op}" for phase, op in entry.kernels.items()) for entry in manifest.cells]
    same_ops = len(set(fused_ops)) == 1  # then said once, above the table
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold", no_wrap=True)
    header.add_column(overflow="fold")
    rows = {
        "directory": str(model.path),
        "source": manifest.source or "(unknown)",
        "target": manifest.target + (" (" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")" if options else ""),
        **({"layers": ", ".join(manifest.layers)} if manifest.layers else {}),
        "dtype": manifest.dtype,
        "vocab size": str(manifest.vocab_size),
        "positions": where,
        "kernels": _kernels_line(model),
        "decode step": describe(model, args.trust_compiled_step),
        "digest": (manifest.digest or "none (saved by an older rnnify)") + ("" if args.verify else " (not checked)"),
        **({"fused ops": f"{', '.join(fused_ops[0].splitlines())} (every layer)"} if same_ops and fused_ops[0] else {}),
        "converted with": ", ".join(f"{k} {v}" for k, v in manifest.versions.items()) or "(unknown)",
    }
    for key, value in rows.items():
        header.add_row(key, Text(value))
    console.print(header)

    windowed = any(cell.spec.window is not None for cell in model.cells)
    notes = any(cell.describe() for cell in model.cells)
    fused = any(fused_ops) and not same_ops
    columns = ["layer", "module path", "cell", "heads (kv) × dim"] + (["window"] if windowed else [])
    columns += (["notes"] if notes else []) + (["fused ops"] if fused else [])
    lengths = " / ".join(f"{length:,}" for length in _LENGTHS)
    table = Table(box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False,
                  title=f"recurrent state per sequence after {lengths} tokens")
    for column in columns:  # names wrap at spaces and fold where they must, never cut short
        text = column in ("module path", "cell", "notes", "fused ops")
        table.add_column(column, justify="left" if text else "right", overflow="fold")
    for length in _LENGTHS:
        table.add_column(f"{length:,}", justify="right")
    for entry, cell, ops in zip(manifest.cells, model.cells, fused_ops):
        spec = cell.spec
        row = [str(entry.layer), Text(entry.module_path), entry.target]
        row.append(f"{spec.num_heads} ({spec.num_kv_heads}) × {spec.head_dim}")
        if windowed:
            row.append("" if spec.window is None else str(spec.window))
        if notes:
            row.append(Text(cell.describe()))
        if fused:
            row.append(Text(ops or "-"))
        table.add_row(*row, *(_nbytes(cell.state_nbytes(length, 1, model.dtype)) for length in _LENGTHS))
    table.add_section()
    table.add_row("total", *[""] * (len(columns) - 1), *(_nbytes(model.state_nbytes(length)) for length in _LENGTHS))
    console.print(table)
    console.print(Text(_memory_line(model), "bold"), soft_wrap=True)
    return 0


def _kernels_line(model) -> str:
    """The backend of the fused ops and how many layers run them, in words."""
    if model.kernels == "none":
        return "none: every cell runs its own PyTorch forms"
    meaning = {"auto": " (Triton on CUDA, PyTorch reference elsewhere)", "reference": " (the ops' PyTorch references)"}
    count = sum(bool(entry.kernels) for entry in model.manifest.cells)
    return f"{model.kernels}{meaning.get(model.kernels, '')}; fused ops in {count} of {len(model.cells)} layers"


# -- compile ------------------------------------------------------------------------------


def add_compile(commands: argparse._SubParsersAction) -> None:
    _add_command(
        commands, "compile", _compile, _compile_arguments,
        help="compile DIR's decode step ahead of time, so every later load here decodes compiled (CPU)",
        description="Compile the one-token step of DIR with AOTInductor, once, into this machine's step cache "
        "($RNNIFY_CACHE, else $XDG_CACHE_HOME/rnnify, else ~/.cache/rnnify): rnnify.load (and every command) "
        "then decodes with it on this CPU, with no compile in the process that decodes, for DIR and every "
        "model of the same graph and weight shapes. rnnify convert and rnnify distill do this by default; this "
        "command does it for a directory written with --no-compile, copied from another machine, or again "
        "after a torch or rnnify upgrade. The package holds code only (the weights stay in DIR's weights file) "
        "and fits any batch size. Takes tens of seconds and needs a C++ compiler. Not for exact layers of a "
        "sliding-window model. See docs/performance.md.",
    )


def _compile_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument(
        "--ship", action="store_true",
        help="also write the compiled step into DIR as step-cpu.pt2, its sha256 recorded in DIR's manifest: "
        "machines like this one run it when loading DIR with --trust-compiled-step (it is native code)",
    )


def _compile(args: argparse.Namespace, console: Console) -> int:
    import time

    from rich.text import Text

    from rnnify.runtime.step_cache import compile_into_cache, ship

    if args.ship and not args.verify:
        raise RnnifyError("--ship records the step in DIR's checked manifest: drop --no-verify")
    model = _load(args, aot_step=False)
    start = time.perf_counter()
    with console.status("compiling the decode step (AOTInductor)"):
        path = ship(model, model.path) if args.ship else compile_into_cache(model)
    users = "with --trust-compiled-step on a CPU like this one" if args.ship else "on this machine's CPU"
    console.print(Text(f"wrote {path} in {time.perf_counter() - start:.0f} s: loading {args.dir} {users} now "
                       "decodes with the compiled step"), soft_wrap=True)
    return 0


# -- bench --------------------------------------------------------------------------------


def add_bench(commands: argparse._SubParsersAction) -> None:
    _add_command(
        commands, "bench", _bench, _bench_arguments,
        help="measure decode latency, memory and prefill time (and against the original with its KV cache)",
        description="Time decode steps after each context length at each batch size, the state's bytes, "
        "peak memory and prefill time of DIR, and with --against the same for the original model "
        "decoding with transformers' KV cache; and the batch-1 limit set by reading the weights at the "
        "memory bandwidth measured here (rnnify.bench.benchmark). See docs/performance.md for how "
        "contexts are reached.",
    )


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    _add_dir(p)
    p.add_argument("--against", metavar="MODEL", help="original model (directory or cached hub id) to compare with")
    p.add_argument("--contexts", default="256,1024,4096,16384", metavar="LIST",
                   help="context lengths (default: 256,1024,4096,16384)")
    p.add_argument("--batch", default="1,8", metavar="LIST", help="batch sizes (default: 1,8)")
    _add_device_flag(p)
    _add_dtype_flag(p, None, "dtype; must be the one DIR was converted to (default: DIR's)")
    p.add_argument("--steps", type=int, default=10, metavar="N", help="timed decode steps, median reported (default: 10)")
    p.add_argument("--compile", action="store_true", help="decode with torch.compile of the step graph")
    p.add_argument("--prefill-max", type=int, default=2048, metavar="N",
                   help="longest context whose prefill is timed (default: 2048; prefill is slow on CPU)")
    p.add_argument("--json", metavar="OUT", help="write the results and the machine to OUT as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write latency and memory vs context plots to OUT.png")
    _add_kernels_flag(p)


def _bench(args: argparse.Namespace, console: Console) -> int:
    import shlex

    from rich.text import Text

    from rnnify.bench import benchmark, plot
    from rnnify.eval import write_json

    contexts, batches = _int_list("--contexts", args.contexts), _int_list("--batch", args.batch)
    device = _device(args.device)
    _check_writable("--json", args.json)
    _check_writable("--plot", args.plot)
    run = benchmark(
        _load(args, device=device), contexts, batches, against=args.against, dtype=args.dtype, steps=args.steps, prefill_max=args.prefill_max, compile=args.compile,
        command="rnnify " + shlex.join(args.argv), progress=True,
    )
    console.print(_bench_table(run))
    console.print(_prefill_table(run, args.prefill_max))
    step = next((r.step_ms for r in run.results if r.model == "converted" and r.batch == 1), None)
    line = (
        f"batch-1 limit: {_nbytes(run.weight_bytes)} of weights per token / "
        f"{run.machine.bandwidth_gb_s:.1f} GB/s measured = {run.limit_ms:.2f} ms"
    )
    if step is not None:
        line += f"; measured step {step:.2f} ms = {step / run.limit_ms:.2f}x the limit"
    console.print(Text(line), soft_wrap=True)
    for warning in run.warnings:  # also in --json
        console.print(Text(f"warning: {warning}", "yellow"), soft_wrap=True)
    if args.json is not None:
        write_json(args.json, run.to_json())
    if args.plot is not None:
        try:
            plot(run, args.plot)
        except OSError as exc:
            raise RnnifyError(f"cannot write {args.plot}: {exc.strerror or exc}") from exc
    return 0


def _int_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise RnnifyError(f"{flag} {text!r}: expected comma-separated positive integers, e.g. 256,1024")
    return values


def _bench_table(run) -> Table:
    from rich import box
    from rich.table import Table
    from rich.text import Text
    rows = {(r.batch, r.context, r.model): r for r in run.results}
    against = any(r.model == "original" for r in run.results)
    title = f"{run.target} vs original with KV cache" if against else f"{run.target}"
    table = Table(box=box.SIMPLE_HEAD, title=Text(f"decode, {title}, {run.dtype}, {run.machine.device}"))
    columns = ["batch", "context", "step ms", "tokens/s", "state", "peak +"]
    if against:
        columns += ["original ms", "original tok/s", "KV cache", "original peak +", "speedup", "KV / state"]
    for column in columns:
        table.add_column(column, justify="right")
    for (batch, context, model), r in rows.items():
        if model != "converted":
            continue
        row = [str(batch), f"{context:,}", f"{r.step_ms:.2f}", f"{r.tokens_per_s:.1f}",
               _nbytes(r.memory_bytes), _nbytes(r.peak_delta_bytes)]
        o = rows.get((batch, context, "original"))
        if against and o is not None:
            row += [f"{o.step_ms:.2f}", f"{o.tokens_per_s:.1f}", _nbytes(o.memory_bytes), _nbytes(o.peak_delta_bytes),
                    f"{o.step_ms / r.step_ms:.2f}x", f"{o.memory_bytes / r.memory_bytes:.1f}x"]
        table.add_row(*row)
    return table


def _prefill_table(run, cap: int) -> Table:
    from rich import box
    from rich.table import Table
    from rich.text import Text
    table = Table(box=box.SIMPLE_HEAD, title=Text(f"prefill, batch 1, one call (contexts up to {cap:,})"))
    table.add_column("context", justify="right")
    for name in run.prefill_ms:
        table.add_column(f"{name} ms", justify="right")
    contexts = sorted({c for times in run.prefill_ms.values() for c in times})
    for c in contexts:
        table.add_row(f"{c:,}", *(f"{times[c]:.0f}" for times in run.prefill_ms.values()))
    return table


# -- eval ---------------------------------------------------------------------------------


def add_eval(commands: argparse._SubParsersAction) -> None:
    _add_command(
        commands, "eval", _eval, _eval_arguments,
        help="measure how close a converted model is to its original on text: perplexity, KL, per-layer error",
        description="Read --data in rows of --seq-len tokens and report both models' perplexity, "
        "KL(original || converted) per token, top-1 agreement, the state per sequence, and each layer's "
        "attention error against softmax attention with the layer fed the original's activations.",
    )


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import DEFAULT_SEQ_LEN

    _add_dir(p)
    p.add_argument("--data", required=True, metavar="PATH",
                   help="text file, folder of text files or .jsonl file with a \"text\" field per line")
    p.add_argument("--against", metavar="MODEL",
                   help="model to compare with: Hugging Face or rnnify directory (default: the source in DIR's manifest)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="directory of the tokenizer to read --data with (default: DIR's, else its source's)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help=f"tokens per row (default: {DEFAULT_SEQ_LEN}, or the model's position limit if lower)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="rows per batch (default: 8)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N", help="stop after N tokens (default: all the data)")
    p.add_argument("--json", metavar="OUT", help="write the results to OUT as JSON")
    _add_device_flag(p, "device to run both models on")
    p.add_argument("--passkey", metavar="LIST",
                   help="also test recall at these prompt lengths, e.g. 512,1024,2048: a random 5-digit key stated "
                   "once in filler text, then asked for; both models answer greedily (default: off)")
    p.add_argument("--passkey-trials", type=int, default=6, metavar="N",
                   help="prompts per length, the key at N depths evenly spaced from start to end (default: 6)")
    p.add_argument("--passkey-seed", type=int, default=0, metavar="S", help="seed of the random keys (default: 0)")
    _add_kernels_flag(p)


def _eval(args: argparse.Namespace, console: Console) -> int:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from rnnify.eval import evaluate, write_json

    _check_writable("--json", args.json)
    lengths = None
    if args.passkey is not None:
        from rnnify.passkey import depths

        lengths = _int_list("--passkey", args.passkey)
        depths(args.passkey_trials)  # checks it, before anything loads
    model = _load(args, device=_device(args.device))
    result = evaluate(
        model, args.data, against=args.against, seq_len=args.seq_len, batch_size=args.batch_size,
        max_tokens=args.max_tokens, tokenizer=args.tokenizer, progress=True,
    )
    passkey = None
    if lengths is not None:
        from rnnify.passkey import evaluate_passkey

        passkey = evaluate_passkey(
            model, lengths, trials=args.passkey_trials, seed=args.passkey_seed, against=args.against,
            tokenizer=args.tokenizer, progress=True,
        )
    summary = Table(box=box.SIMPLE_HEAD, title=Text(
        f"{result.target} vs {result.against}: {result.tokens:,} tokens, rows of {result.seq_len}"
    ))
    for column in ("", "converted", "original"):
        summary.add_column(column, justify="left" if not column else "right")
    summary.add_row("perplexity", f"{result.perplexity:.4g}", f"{result.teacher_perplexity:.4g}")
    summary.add_row("KL(original || converted), nats/token", f"{result.kl:.3g}", "")
    summary.add_row("top-1 agreement", f"{result.top1_agreement:.1%}", "")
    summary.add_row(f"state per sequence at {result.seq_len:,} tokens", _nbytes(result.state_bytes), "")
    console.print(summary)
    layers = Table(box=box.SIMPLE_HEAD, title=Text("attention error per layer, fed the original's activations"))
    for column in ("layer", "cell", "relative error", "MSE"):
        layers.add_column(column, justify="right")
    for layer in result.layers:
        layers.add_row(str(layer.layer), layer.module, f"{layer.rel_error:.3g}", f"{layer.mse:.3g}")
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

    accuracy = result.accuracy()
    trials = len(result.trials) // len(accuracy["converted"])
    table = Table(box=box.SIMPLE_HEAD, title=Text(f"pass-key retrieval: {trials} depths per length, greedy answers"))
    table.add_column("prompt tokens", justify="right")
    for name in accuracy:
        table.add_column(name, justify="right")
    for length in accuracy["converted"]:
        table.add_row(f"{length:,}", *(f"{by[length]:.0%}" for by in accuracy.values()))
    return table


# -- distill ------------------------------------------------------------------------------


def add_distill(commands: argparse._SubParsersAction) -> None:
    from rnnify.choices import AUTO_ALL_MAX_PARAMETERS

    up_to = f"{AUTO_ALL_MAX_PARAMETERS / 1e9:g}B parameters"  # --train auto: every weight up to it, LoRA above
    _add_command(
        commands, "distill", _distill, _distill_arguments,
        help=f"train a converted model towards its original: attention transfer, then fine-tuning of every weight "
        f"(LoRA above {up_to})",
        description="After LoLCATs' recipe (docs/distill.md): 'transfer' trains the cells' own parameters to "
        "match the original softmax attention layer by layer; 'finetune' trains the cells and what --train says "
        f"(by default every weight of a model up to {up_to}, and LoRA on the attention projections of a larger one, "
        "merged into its weights at the end) on next-token loss and KL to the original model. Writes -o DIR; "
        "checkpoints allow --resume. Runs under torchrun for data parallelism (--batch-size is the global batch), "
        "with --fsdp sharding the weights per decoder layer.",
    )


def _distill_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.distill.options import add_training_flags

    _add_dir(p)
    p.add_argument("--data", required=True, metavar="PATH",
                   help="text file, folder of text files or .jsonl file with a \"text\" field per line")
    _add_output_flags(p, "directory to write the distilled model to (DIR itself with --overwrite)")
    _add_kernels_flag(p)
    _add_compile_flag(p)
    _add_training_flags(p, add_training_flags)


def _add_training_flags(p: argparse.ArgumentParser, add_training_flags) -> None:
    """The training flags of ``rnnify.distill.options``, and ``--device`` among them."""
    group = add_training_flags(p)
    _add_device_flag(group, "device to train on",
                     "; with --fsdp the model stays on the CPU and only its shards go there")


def _training_options(args: argparse.Namespace) -> dict:
    """``rnnify.distill``'s keyword arguments from the training flags, checked."""
    from rnnify.distill.options import training_options

    return {**training_options(args), "device": _device(args.device)}


def _train(model, data: str, teacher, options: dict) -> bool:
    """Distil ``model`` in place (docs/distill.md); True on the process that writes the result (rank 0)."""
    from rnnify.distill import distill

    distill(model, data, teacher=teacher, **options)  # reports each stage on stderr
    return _writes_results()


@_claims_output
def _distill(args: argparse.Namespace, console: Console) -> int:
    from rich.text import Text

    training = _training_options(args)
    model = _load(args)  # on the CPU: distill moves it (or, under FSDP, its shards)
    if not _train(model, args.data, args.teacher, training):
        return 0
    path = _save(model, args.output)
    console.print(Text(f"saved to {path}"), soft_wrap=True)
    if args.compile_step is not False:
        with console.status("compiling the decode step (AOTInductor)"):
            decode_note = _compile_step(model, path, forced=bool(args.compile_step))
        console.print(Text(decode_note), soft_wrap=True)
    _drop_checkpoint(training["checkpoint_dir"], args.keep_checkpoints, console)
    return 0


def _drop_checkpoint(directory: Path, keep: bool, console: Console) -> None:
    """Delete the checkpoint of a run whose model is saved, unless ``--keep-checkpoints``."""
    from rich.text import Text

    from rnnify.distill.checkpoint import remove_checkpoint

    if keep:
        console.print(Text(f"checkpoint kept in {directory}"), soft_wrap=True)
    elif not remove_checkpoint(directory):
        console.print(Text(f"kept {directory}: it holds more than this run's checkpoint"), soft_wrap=True)


# -- the parser and main -------------------------------------------------------------------

COMMANDS = (add_convert, add_verify, add_generate, add_chat, add_info, add_compile, add_bench, add_eval, add_distill)


def build_parser() -> argparse.ArgumentParser:
    parser = arguments.Parser(
        prog="rnnify",
        description="Compile attention-based Hugging Face causal LMs into recurrent models.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=arguments.Command)
    for add in COMMANDS:
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 verification failed, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help, or argparse's own usage error (code 2)
        return exc.code if isinstance(exc.code, int) else 0
    except RnnifyError as exc:  # a value its flag's type refuses (``rnnify.arguments``)
        return _user_error(exc)
    from rich.console import Console

    # A terminal's own width; piped output gets PIPED_WIDTH columns (or $COLUMNS), not rich's 80.
    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    console = Console(highlight=False, width=PIPED_WIDTH if piped else None)
    try:
        with warnings.catch_warnings():  # restores the default format on return (main may run in-process)
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
            _quiet_transformers()
            with _torch_threads(args):
                return args.run(args, console)
    except RnnifyError as exc:
        return _user_error(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


PIPED_WIDTH = 120


def _user_error(exc: RnnifyError) -> int:
    """Print a user's mistake as one ``error:`` line; the exit code that says so."""
    print("error: " + " ".join(str(exc).split()), file=sys.stderr)
    return 2


def _one_line_warnings(default: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints rnnify's own warnings as one ``warning:`` line (they are
    for the user, who has no use for the file and line that raised them) and others as ``default`` does."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, RnnifyWarning):
            return default(message, category, filename, lineno, file, line)
        print("warning: " + " ".join(str(message).split()), file=file if file is not None else sys.stderr)

    return show
