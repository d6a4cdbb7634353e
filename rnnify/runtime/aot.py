"""A decode step compiled ahead of time: compiling it, and loading it with a model's weights.

``RecurrentModel.compile_step`` compiles in the process that decodes: on a CPU a minute or more
before the first token, which a short generation never pays back (docs/performance.md). AOTInductor
does the same compile once, into a package (``compile_package``), and later processes load it
without compiling. A package is native code (a zip holding a shared object), so where one is kept
and when it is trusted is ``runtime.step_cache``'s business, not this module's.

The package holds the step's code, not its weights: the model's own parameters are handed to it
when it is loaded (shared, not copied), so it adds no weight bytes on disk or in memory, and a
weight changed in place is seen. It is compiled for the cells' own PyTorch forms on this CPU
(any batch size; ``exact``'s growing state too, not a cache that grows up to a sliding window).
What it was compiled for is its ``fingerprint``, which says which models and machines it serves;
once the model's graph or weights have been replaced the step runs eagerly (``serves``). The code
reads its inputs as laid out at compile time, unchecked: token ids go in as int64 and every input
contiguous.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import stat
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch

from rnnify.choices import WORTH_COMPILING_BELOW
from rnnify.errors import RnnifyError, RnnifyWarning, first_line
from rnnify.runtime.child_reaper import reaping_children
from rnnify.runtime.state import RecurrentState

if TYPE_CHECKING:
    from rnnify.runtime.model import RecurrentModel

__all__ = [
    "STEP_PACKAGE",
    "StepPackage",
    "check_archive",
    "compile_package",
    "fingerprint",
    "gains_little",
    "load_package",
    "refusal",
]

STEP_PACKAGE = "step-cpu.pt2"  # AOTInductor's package: the compiled step for CPUs
# what a new package is checked on before it is kept (``_disagreement``): two rows of a prompt this
# long, then this many one-token steps
CHECK_PROMPT, CHECK_STEPS = 6, 3
_INDUCTOR_CONFIGS = {
    # the weights are the model's own, handed over at load: not copied into the package
    "aot_inductor.package_constants_in_so": False,
    # parallel loops that take the decoding process's thread count when they run: a package is found
    # by later loads at any thread count (its fingerprint holds none), and torch 2.13's loops generated
    # for a fixed count (the compiling process's, unless told) miscompiled a head split's step
    # (tests/test_aot.py)
    "cpp.dynamic_threads": True,
}


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (Linux), else its name: inductor builds the package's code
    for the CPU it compiles on (``-march=native``), which another CPU may not run."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@functools.cache
def _source_digest() -> str:
    """A hash of rnnify's own source: a package compiles the cells' code as it was, and rnnify's
    version does not change with every fix of it."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if any(part.startswith(".") for part in name.split("/")):
            continue  # an editor's lock or backup file, not rnnify's code
        try:
            digest.update(name.encode() + b"\0" + path.read_bytes())
        except OSError:
            continue
    return digest.hexdigest()


def _named_weights(graph: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name it has (a tied weight has several; the package
    may know it by any of them)."""
    return [*graph.named_parameters(remove_duplicate=False), *graph.named_buffers(remove_duplicate=False)]


def fingerprint(model: RecurrentModel) -> str:
    """What a package must match: the model (``model_key``), rnnify's version and source and torch's
    version (the package's runtime and the code it compiled) and the CPU it was compiled for."""
    from rnnify import __version__

    versions = [__version__, _source_digest(), torch.__version__, platform.machine(), _cpu_flags()]
    return hashlib.sha256(json.dumps([versions, model_key(model)]).encode()).hexdigest()


def model_key(model: RecurrentModel) -> str:
    """The model a package is compiled for, whatever compiled it: the step graph's code, every
    cell's target, spec and options and the state's shapes and dtypes (the compiled code has them
    built in), and the name, shape, strides and dtype of every weight (the package takes the model's
    own at load and reads them as laid out when it was compiled: ``runtime.weight_layout``)."""
    graph = model.graph
    # by name: a converted model and the same model loaded from its directory list them in other orders
    weights = sorted((name, tuple(t.shape), t.stride(), str(t.dtype)) for name, t in _named_weights(graph))
    cells = [(entry.module, entry.target, entry.spec, entry.options) for entry in model.manifest.cells]
    state = [(tuple(t.shape), str(t.dtype)) for t in model.init_state(1).tensors]
    text = json.dumps([graph.code, cells, state, weights], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def refusal(model: RecurrentModel) -> str | None:
    """Why ``model``'s step is not compiled ahead of time, in words; None when it can be."""
    if model.device.type != "cpu":
        return f"an ahead-of-time step is compiled for CPUs; this model is on {model.device}"
    if any(cell.grows_with_context and cell.spec.keys_read is not None for cell in model.cells):
        return (
            "an ahead-of-time step is not built for caches that grow up to a sliding window or chunk "
            "(exact layers of a sliding-window or chunked-attention model): decode this model eagerly"
        )
    if model.guard_budget is not None:
        return (
            "this model's step makes tensors whose sizes follow the values it reads (a split by a router's "
            "counts, a mask), so it runs eagerly under a size guard, which a compiled step would not keep"
        )
    if any(cell.spec.selects for cell in model.cells):
        return (
            "an ahead-of-time step is not built for sparse attention (an indexer's top-k over a cache that "
            "grows): decode this model eagerly"
        )
    return None


def gains_little(model: RecurrentModel) -> str | None:
    """Why compiling ``model``'s step is not worth its time by default, in words; None when it is."""
    nbytes = model.weight_nbytes_per_token()
    if nbytes < WORTH_COMPILING_BELOW:
        return None
    return (
        f"a step reads {nbytes / 2**30:.1f} GiB of weights, where compiling gained 7-13% for minutes of "
        "compiling; --compile compiles it anyway"
    )


def _example(model: RecurrentModel) -> tuple[tuple[torch.Tensor, ...], list[dict[int, Any]]]:
    """One decode token's graph inputs at batch 2 after a 3-token prompt, and their dynamic dims:
    the batch, and any state dim that grows with the context (found by a 4-token prompt)."""
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], device=model.device)
    _, state = model.prefill(ids[:, :3])
    _, longer = model.prefill(ids)
    batch, context = torch.export.Dim("batch", min=1), torch.export.Dim("context", min=1)
    shapes: list[dict[int, Any]] = [{0: batch}] * 3
    for tensor, grown in zip(state.tensors, longer.tensors):
        grows = {dim: context for dim, (a, b) in enumerate(zip(tensor.shape, grown.shape)) if a != b}
        shapes.append({0: batch, **grows})
    token = torch.ones(2, 1, dtype=torch.long, device=model.device)
    mask = torch.ones(2, 1, dtype=torch.bool, device=model.device)
    return (token, state.positions[:, None], mask, *(t.contiguous() for t in state.tensors)), shapes


@contextlib.contextmanager
def _own_forms(model: RecurrentModel) -> Iterator[None]:
    """``model`` running its cells' own forms (plain aten ops, which inductor compiles and the package
    holds), its fused ops' backend put back after."""
    kernels = model.kernels
    model.use_kernels("none")
    try:
        yield
    finally:
        model.use_kernels(kernels)


def _export(model: RecurrentModel) -> torch.export.ExportedProgram:
    """The one-token step graph as an exported program, from the cells' own forms."""
    with _own_forms(model):
        inputs, shapes = _example(model)
        with torch.no_grad():
            return torch.export.export(model.graph, inputs, dynamic_shapes=shapes, strict=False)


def compile_package(model: RecurrentModel, package: Path) -> Path:
    """Compile ``model``'s one-token step with AOTInductor into the file ``package`` (named
    ``STEP_PACKAGE``), replacing any there; it appears whole or not at all. CPU only."""
    reason = refusal(model)
    if reason is not None:
        raise RnnifyError(reason)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)  # torch's own, not ours
        program = _export(model)
        try:
            with tempfile.TemporaryDirectory(dir=package.parent, prefix=".step-") as scratch:
                built = Path(scratch) / STEP_PACKAGE  # the archive's folder is named after the file
                try:
                    with reaping_children():  # the C++ compiler it starts ends with this process
                        torch._inductor.aoti_compile_and_package(
                            program,
                            package_path=str(built),
                            inductor_configs=_INDUCTOR_CONFIGS,
                        )
                except Exception as exc:  # noqa: BLE001 - only a compiler that is missing or fails is the user's
                    if not _compiler_failed(exc):
                        raise
                    raise RnnifyError(
                        f"compiling the step failed ({first_line(exc)}); an ahead-of-time step "
                        "needs a working C++ compiler (gcc or clang) on PATH; without one, decode "
                        "eagerly"
                    ) from exc
                wrong = _disagreement(model, built)
                if wrong is not None:
                    raise RnnifyError(
                        f"the compiled step was not kept: {wrong} (the compiler's fault, not the model's); "
                        "decode eagerly"
                    )
                built.chmod(0o600)
                os.replace(built, package)
        except OSError as exc:
            raise RnnifyError(f"cannot write the compiled step into {package.parent}: {exc.strerror or exc}") from exc
    return package


@torch.no_grad()
def _disagreement(model: RecurrentModel, package: Path) -> str | None:
    """Where ``package``'s step parts from the model's own graph (eager, the cells' own forms it was
    exported from) on a seeded prompt and the steps after it, in words; None when every output agrees
    within ``agreement.tolerance`` of the model's ``rounding_dtype``. The compiler can be wrong (torch 2.13's AOTInductor miscompiled a
    head split's output, ``_INDUCTOR_CONFIGS``), and a kept package decodes every later load's
    tokens: checked once, before it is kept."""
    from rnnify.kernels.slots import decode
    from rnnify.runtime.agreement import relative_difference, rounding_dtype, tolerance

    loaded = load_package(model, package)
    if loaded is None:
        return "it does not load on the machine that compiled it"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.manifest.vocab_size, (2, CHECK_PROMPT + CHECK_STEPS), generator=generator)
    mask = torch.ones(2, 1, dtype=torch.bool)
    with _own_forms(model):
        _, state = model.prefill(ids[:, :CHECK_PROMPT])
        for t in range(CHECK_PROMPT, ids.shape[1]):
            inputs = (ids[:, t : t + 1], state.positions[:, None], mask, *(x.contiguous() for x in state.tensors))
            want, got = model.graph(*inputs), loaded(*inputs)
            for index, (a, b) in enumerate(zip(got, want)):
                if a.dtype == torch.int8:  # int8 slots (``kv_dtype``): compared as the values they hold
                    a, b = decode(a), decode(b)
                gap = relative_difference(a, b)
                if gap > tolerance(rounding_dtype(model)):
                    what = "logits" if index == 0 else f"state tensor {index - 1}"
                    return f"its {what} after {t} tokens differ from the eager step's by {gap:.2g} (relative)"
            state = RecurrentState(tuple(want[1:]), state.positions + 1, state.model_uid)
    return None


def check_archive(package: Path) -> None:
    """Refuse (``RnnifyError``) a package whose zip could put anything outside the folder torch's loader
    unpacks it into, which joins the names as they are: every entry must be a plain file or folder
    under the package's own folder, by a relative path without ``..``."""
    folder = PurePosixPath(STEP_PACKAGE).stem
    try:
        with zipfile.ZipFile(package) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise RnnifyError(f"{package}: not a compiled step ({exc}); it is not loaded") from exc
    for entry in entries:
        name, kind = entry.filename, stat.S_IFMT(entry.external_attr >> 16)
        parts = PurePosixPath(name).parts
        if (
            "\\" in name
            or name.startswith("/")
            or ".." in parts
            or not parts
            or parts[0] != folder
            or kind not in (0, stat.S_IFREG, stat.S_IFDIR)
        ):
            raise RnnifyError(
                f"{package}: its entry {name!r} is not a file under {folder}/ (a link, an absolute "
                "path or one that climbs out with ..): refused, not loaded"
            )


def _compiler_failed(exc: BaseException | None) -> bool:
    """Does ``exc`` (or what caused it: inductor wraps its errors) come from the C++ compiler?"""
    from torch._inductor.exc import CppCompileError  # (a second to import: not at load)

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (CppCompileError, FileNotFoundError)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class StepPackage:
    """A loaded package with the model's weights: called as the step graph is."""

    def __init__(self, runner: Any, weights: dict[str, torch.Tensor], model: RecurrentModel, path: Path, shipped: bool):
        self.runner = runner
        self.path, self.shipped = path, shipped  # where it was loaded from: this machine's cache, or the directory
        self.weights = weights  # the runner holds their pointers: they must outlive it
        self.graph, self.code = model.graph, model.graph.code
        # where each weight sits, and its memory: a flat list, checked every step without walking modules
        self.slots = [
            (owner, name, t, t.data_ptr())
            for module in model.graph.modules()
            for owner in (module._parameters, module._buffers)
            for name, t in owner.items()
            if t is not None
        ]

    def serves(self, model: RecurrentModel) -> bool:
        """Is this still the model's step: the same graph and code, the same weights in place?"""
        return (
            model.graph is self.graph
            and model.graph.code == self.code
            and all(owner.get(name) is t and t.data_ptr() == at for owner, name, t, at in self.slots)
        )

    def __call__(self, input_ids: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
        # compiled for int64 ids and contiguous inputs (a prefill's state may hold views; a step's
        # own are contiguous already): the code reads the memory as laid out then, unchecked
        return self.runner.boxed_run([input_ids.long().contiguous(), *(t.contiguous() for t in inputs)])

    def __deepcopy__(self, memo: dict) -> None:
        return None  # the loader cannot be copied: a copied model decodes eagerly


def load_package(model: RecurrentModel, package: Path, shipped: bool = False) -> StepPackage | None:
    """The package file ``package`` bound to ``model``'s weights (``check_archive`` first, refused by
    ``RnnifyError``); None, warned, when torch cannot load it on this machine. The caller vouches that
    the package was compiled for ``model`` (``fingerprint``) and that its code may run."""
    check_archive(package)
    try:  # torch's own loader (``aoti_load_package`` wraps it, importing the whole of inductor first)
        runner = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
        names = set(runner.get_constant_fqns())
        weights = {name: t for name, t in _named_weights(model.graph) if name in names}
        # into the active constants, checked complete, user-managed: the model's tensors are used in place
        runner.load_constants(weights, False, True, True, False)
    except (RuntimeError, OSError) as exc:
        warnings.warn(
            f"{package} could not be loaded on this machine ({first_line(exc)}): decoding eagerly",
            RnnifyWarning,
            stacklevel=4,
        )
        return None
    return StepPackage(runner, weights, model, package, shipped)
