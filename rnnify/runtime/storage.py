"""Saving and loading a converted model directory, without pickle.

A directory holds ``model.safetensors`` (every tensor, cell parameters included), ``graph.json``
(the step graph, see ``serialize``), ``rnnify.json`` (the manifest), the source model's tokenizer
and generation files, and a ``config.json`` plus ``modeling_rnnify.py`` that make transformers load
the converted model rather than the original (``rnnify.runtime.hf_files``). Writing goes to
a temporary directory that is swapped into place at the end, so a failed save leaves nothing
behind; one writer at a time holds the target, and what a killed one left is put right by the
next (``output_dir``). The directory and its files get the modes the umask gives (``mkdtemp`` makes
0700). The weights are written one tensor at a time from the model's own memory (``weights_file``),
so saving adds no copy of them. The manifest records every file's sha256, and loading checks each
file it reads against that record before using it (``runtime.integrity``; a streamed read, about a
second per GB of weights) unless told not to. A directory never brings code that a load runs: the
compiled decode step comes from this machine's cache (``runtime.step_cache``), or from a package the
directory ships only when the user trusts it.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.fx
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from rnnify.cells import CellSpec, build_cell
from rnnify.errors import RnnifyError, first_line
from rnnify.kernels.utils import check_kernels
from rnnify.runtime import hf_files, integrity, output_dir
from rnnify.runtime.devices import usable_device
from rnnify.runtime.json_fields import is_attribute_path
from rnnify.runtime.manifest import Manifest, read_data
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.new_shapes import PROBES, NewShapes
from rnnify.runtime.op_vocabulary import TOKEN_INPUTS, check_references, check_returns
from rnnify.runtime.saving import GRAPH_FILE, SOURCE_FILES, WEIGHTS_FILE, saved_options
from rnnify.runtime.serialize import GraphFormatError, graph_from_json
from rnnify.runtime.size_guard import SizeGuard, StepFailed, data_shaped
from rnnify.runtime.step_cache import find_step
from rnnify.runtime.weight_layout import lay_out_linear_weights


def install(root: nn.Module, path: str, value: Any) -> None:
    """Set ``root``'s attribute ``path`` to ``value``, creating plain containers on the way.

    The way goes through submodules alone (``add_module`` refuses a name that is another attribute):
    ``path`` comes from a directory, and a part naming a method or a class would leave the module.
    A path under a module installed earlier (a parametrized owner) is already there: skipped.
    """
    if not is_attribute_path(path):
        raise ValueError(f"{path!r:.60} is not a dotted attribute path")
    module = root
    *parents, leaf = path.split(".")
    for part in parents:
        child = module._modules.get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if getattr(module, leaf, None) is value:
        return
    if isinstance(value, nn.Module):
        module.add_module(leaf, value)
    elif isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(leaf, value)
    else:
        setattr(module, leaf, value)


# What a load reads, which the manifest must record: these always, and these others when present or
# recorded (a tokenizer file removed changes what is read too; transformers' route runs the modeling file).
READ_AT_LOAD = (WEIGHTS_FILE, GRAPH_FILE)
READ_IF_PRESENT = (hf_files.MODELING_FILE, *SOURCE_FILES)


def load(
    path: str | Path,
    device: torch.device | str | None = None,
    kernels: str | None = None,
    verify: bool = True,
    aot_step: bool = True,
    trust_compiled_step: bool = False,
    expected_digest: str | None = None,
    *,
    verify_weights: bool | None = None,
) -> RecurrentModel:
    """Load a directory written by ``RecurrentModel.save``; needs neither the source model nor a hub.

    ``kernels`` overrides the backend of the fused ops recorded at conversion (``auto``, ``triton``,
    ``reference``, or ``none`` for the cells' own PyTorch forms; see ``RecurrentModel.use_kernels``);
    None keeps the recorded one. ``verify`` compares every file the load reads with the sha256 the
    manifest recorded when it was saved (``runtime.integrity``), so altered or damaged files are
    refused rather than run; False skips those reads, and loads directories of older rnnify, which
    recorded none (``verify_weights`` is its earlier name, still accepted). ``expected_digest``: the
    directory's digest (``rnnify info``) as someone the user trusts gave it; anything else is refused.
    ``aot_step``: run one-token calls on a CPU through the decode step compiled ahead of time for this
    model when this machine's cache holds one (``runtime.step_cache``); False decodes eagerly.
    ``trust_compiled_step``: run the step the directory ships instead (native code, ``rnnify compile
    --ship``), once its sha256 matches the manifest's; without it a shipped step is never opened.
    """
    path = Path(path).expanduser()
    output_dir.check_not_left_aside(path)  # a save killed halfway through replacing it may have left it aside
    verify = verify if verify_weights is None else verify_weights
    if kernels is not None:
        check_kernels(kernels)
    device = usable_device(device) if device is not None else torch.device("cpu")  # before reading the weights
    if expected_digest is not None and not verify:
        raise RnnifyError("an expected digest is checked with the files it covers: drop verify=False (--no-verify)")
    data = read_data(path)
    if verify:
        integrity.check(path, data, READ_AT_LOAD, READ_IF_PRESENT, expected_digest)
    for name in READ_AT_LOAD:  # unchecked, a FIFO would hang the read and a device fill the memory
        if not (path / name).is_file():
            raise RnnifyError(f"{path / name}: missing or not a regular file; convert the model again")
    manifest = Manifest.parse(data, path)
    try:
        tensors = load_file(path / WEIGHTS_FILE, device=str(device))
    except (SafetensorError, OSError, ValueError) as exc:
        raise RnnifyError(
            f"{path / WEIGHTS_FILE}: missing or corrupted weights ({exc}); convert the model again"
        ) from exc
    try:
        graph = graph_from_json(json.loads((path / GRAPH_FILE).read_text()), device=device)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, GraphFormatError) as exc:
        raise RnnifyError(
            f"{path / GRAPH_FILE}: missing or corrupted graph ({first_line(exc)}); convert the model again"
        ) from exc
    files = {name: (path / name).read_bytes() for name in SOURCE_FILES if (path / name).is_file()}
    if hf_files.CONFIG_FILE in files:  # in memory, always the source's config (directories of either format)
        files[hf_files.CONFIG_FILE] = hf_files.source_config(files[hf_files.CONFIG_FILE])
    chosen_kernels = manifest.kernels if kernels is None else kernels
    model = RecurrentModel(_step_module(path, graph, manifest, tensors, device), manifest, files)
    model.path = path  # (the runs' refusals name it)
    _check_runs(model, path)
    model.use_kernels(chosen_kernels)
    model._step_package = find_step(model, path, trust_compiled_step) if aot_step else None
    return model


def _step_module(
    path: Path, graph: torch.fx.Graph, manifest: Manifest, tensors: dict[str, torch.Tensor], device: torch.device
) -> torch.fx.GraphModule:
    """The step graph bound to its cells and weights; a graph that reaches anything else, or weights
    that do not fit the cells, are refused (``op_vocabulary.check_references``)."""
    held = sum(t.numel() for t in tensors.values())  # before aliases, which name the same tensors again
    try:
        for alias, stored in manifest.aliases.items():
            tensors[alias] = tensors[stored]
        check_references(graph, tensors, (entry.module for entry in manifest.cells))
        root = nn.Module()
        room = GUARD_FACTOR * max(held, ROOM_FLOOR)
        for entry in manifest.cells:
            spec, options = CellSpec(**entry.spec), saved_options(entry.target, entry.options)
            prefix = entry.module + "."
            weights = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            check_spec_sizes(entry.module, spec, held)
            room -= _check_cell_fits(entry.module, entry.target, spec, options, weights, room)
            cell = build_cell(entry.target, spec, options).to(device)
            # assign: the saved tensors themselves, in their saved dtype, whatever dtype the cell was
            # built in (a caller's torch.set_default_dtype, as vLLM sets while it builds a model)
            cell.load_state_dict(weights, strict=True, assign=True)
            install(root, entry.module, cell)
        cell_prefixes = tuple(entry.module + "." for entry in manifest.cells)
        buffers = set(manifest.buffers)
        for name, tensor in tensors.items():
            if not name.startswith(cell_prefixes):
                install(root, name, tensor if name in buffers else nn.Parameter(tensor))
        module = torch.fx.GraphModule(root, graph, class_name="RecurrentStep")
        lay_out_linear_weights(module)
        _check_reads_installed(module)
        _check_state_places(module)
    except (
        RuntimeError,
        AttributeError,
        KeyError,
        TypeError,
        ValueError,
        OverflowError,
        MemoryError,
        GraphFormatError,
    ) as exc:
        raise RnnifyError(
            f"{path}: weights, cells and graph do not fit together ({first_line(exc)}); convert the model again"
        ) from exc
    return module


# the sizes a cell is built from (its weights' shapes, lists of heads), each no more than the weights hold
_BUILT_FROM = ("num_heads", "num_kv_heads", "head_dim", "value_dim", "hidden_size", "index_dim")
# What the cells compute from their sizes and options alone, all together (buffers, and the state of
# one sequence, which the load's dry run allocates), and what each op of that dry run reads, makes
# or computes, may be GUARD_FACTOR times the weights or ROOM_FLOOR elements (256 MiB in float32),
# whichever is more: one token's step touches each weight once, its state and a few activations, and
# a long window on a small model is a choice.
ROOM_FLOOR = 1 << 26
GUARD_FACTOR = 4


def check_spec_sizes(module: str, spec: CellSpec, held: int) -> None:
    """Refuse a spec that builds its cell from a size larger than ``held``, the elements its
    directory's weights hold (building it, even on the meta device, makes lists of that many heads),
    or holds an integer past int64 (``ValueError``)."""
    too_large = [name for name in _BUILT_FROM if (getattr(spec, name) or 0) > held]
    if too_large:
        size = getattr(spec, too_large[0])
        raise ValueError(f"cell {module}: spec {too_large[0]} {size:,} is more than the weights hold")
    wide = [f.name for f in fields(spec) if type(getattr(spec, f.name)) is int and abs(getattr(spec, f.name)) >= 2**63]
    if wide:
        raise ValueError(f"cell {module}: spec {wide[0]} is past int64")


def _check_cell_fits(
    module: str, target: str, spec: CellSpec, options: dict, weights: dict[str, torch.Tensor], room: int
) -> int:
    """The elements the cell computes from its spec and options alone (non-persistent buffers and one
    sequence's state), at most ``room`` (``GUARD_FACTOR`` times the weights' elements or ``ROOM_FLOOR``,
    less what earlier cells computed); its tensors must have the saved weights' shapes. A spec's sizes are a few bytes of JSON, and a cell
    built from them for real before this check would fill as much memory as they say: it is built
    on the meta device first, which allocates no tensor."""
    with torch.device("meta"):
        shadow = build_cell(target, spec, options)
    wanted = {name: tuple(t.shape) for name, t in shadow.state_dict().items()}
    for name in sorted(wanted.keys() | weights.keys()):
        saved = tuple(weights[name].shape) if name in weights else None
        if wanted.get(name) != saved:
            raise ValueError(f"cell {module}: {name} is {saved} in the weights, its spec makes it {wanted.get(name)}")
    computed = sum(b.numel() for name, b in shadow.named_buffers() if name not in wanted)
    computed += sum(t.numel() for t in shadow.init_state(1, "meta", torch.float32))
    if computed > room:
        raise ValueError(
            f"cell {module}: its spec and options make {computed:,} elements (buffers and one sequence's "
            "state), more than the weights hold"
        )
    return computed


def _check_reads_installed(module: torch.fx.GraphModule) -> None:
    """Every ``get_attr`` and ``call_module`` of the generated step must read the tensor or cell
    installed under its name: an attribute of the step module's own (a method such as
    ``to_folder``, fx's ``_wrapped_call``) comes first in Python's lookup, and a directory that
    names a cell or weight so would reach it instead."""
    for node in module.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        *parents, leaf = node.target.split(".")
        owner = module
        for part in parents:
            owner = owner._modules.get(part)
            if owner is None:
                break
        installed = None
        if owner is not None:
            installed = next(
                (place[leaf] for place in (owner._modules, owner._parameters, owner._buffers) if leaf in place), None
            )
        read = functools.reduce(getattr, node.target.split("."), module)
        if installed is None or read is not installed:
            raise GraphFormatError(
                f"node {node.name!r} ({node.op}): {node.target!r} names an attribute of the step itself"
            )


def _check_state_places(module: torch.fx.GraphModule) -> None:
    """Each cell call takes as many states, last, as its cell holds: ``check_state_flow`` found the
    states' places from the call alone, and an activation in a state's place would be one the cell
    grows (``op_vocabulary.TOKEN_INPUTS``: the inputs before the states)."""
    states = set([node for node in module.graph.nodes if node.op == "placeholder"][TOKEN_INPUTS:])
    for node in module.graph.nodes:
        if node.op == "call_module":
            taken = sum(arg in states for arg in node.args)
            held = len(module.get_submodule(node.target).state_names)
            if taken != held:
                raise GraphFormatError(f"node {node.name!r}: cell {node.target!r} holds {held} states, takes {taken}")


def _check_runs(model: RecurrentModel, path: Path) -> None:
    """Run a few tokens through the cells' own forms: graph, cells and weights that are each well formed
    but do not fit together (a weight of another shape or dtype, a node where a size goes) fail here,
    as one line, and not at a user's first prompt. No op may read or make more than a step of these
    weights needs (``SizeGuard``): the graph's constants size what its ops make. The runs are
    ``new_shapes.PROBES``, whose records bound the first call at each later shape."""
    stored = {t.untyped_storage().data_ptr(): t for t in model.graph.state_dict().values()}  # aliases once
    elements = sum(t.numel() for t in stored.values())
    nbytes = sum(t.numel() * t.element_size() for t in stored.values())
    budget = (GUARD_FACTOR * max(nbytes, 4 * ROOM_FLOOR), GUARD_FACTOR * max(elements, ROOM_FLOOR))
    model.growth = model.state_nbytes(1) - model.state_nbytes(0)  # the dtype is fixed (``RecurrentModel._apply``)
    try:
        check_returns(model.graph.graph, 1 + len(model.init_state(1).tensors))
        guard = SizeGuard(*budget)
        model.use_kernels("none")
        model.new_shapes = NewShapes(guard)  # each run recorded node by node
        for batch, tokens in PROBES:
            logits, _ = model.prefill(torch.zeros(batch, tokens, dtype=torch.long, device=model.device))
        if data_shaped(model.graph.graph, guard):  # the dry run cannot bound later tokens: each step is guarded
            model.guard_budget, model.new_shapes = budget, None
        else:
            model.new_shapes.fit()
        if model.manifest.vocab_size > logits.shape[-1]:  # ids are drawn and checked by the manifest's
            raise RnnifyError(
                f"{path}: its manifest says the vocabulary has {model.manifest.vocab_size:,} tokens, the step "
                f"gives logits over {logits.shape[-1]:,}; convert the model again"
            )
    except Exception as exc:  # noqa: BLE001 - whatever running a directory's graph raises is the directory's fault
        if isinstance(exc, StepFailed):  # (``size_guard.running``: the step's own error, said here)
            exc = exc.__cause__
        if isinstance(exc, RnnifyError) and not isinstance(exc, GraphFormatError):
            raise exc
        raise RnnifyError(
            f"{path}: the saved step does not run ({first_line(exc, with_type=True)}); convert the model again"
        ) from exc


def load_or_take(
    model_or_dir: RecurrentModel | str | os.PathLike,
    device=None,
    kernels: str | None = None,
    caller: str = "this function",
) -> RecurrentModel:
    """``model_or_dir`` loaded with ``load(device=, kernels=)``, or as it is when already loaded (then
    ``device`` and ``kernels`` must be None: a loaded model is not silently moved or changed)."""
    if not isinstance(model_or_dir, RecurrentModel):
        return load(model_or_dir, device=device, kernels=kernels)
    if device is not None or kernels is not None:
        raise RnnifyError(
            f"device= and kernels= say how {caller} loads a model directory; a loaded model runs "
            "as it is: pass its directory, or use rnnify.load(dir, device=..., kernels=...)"
        )
    return model_or_dir
