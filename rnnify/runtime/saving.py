"""Writing a converted model directory (``RecurrentModel.save``); ``storage`` reads it back.

Kept apart from loading so that the model class can save itself without the loader, which builds
model classes, importing back: the writer needs a model's parts, never its class. What the directory
holds and why it is written the way it is: ``rnnify.runtime.storage``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rnnify.cells import CELLS
from rnnify.cells.heads import TARGET as HEADS_TARGET
from rnnify.errors import RnnifyError
from rnnify.runtime import hf_files, integrity, output_dir
from rnnify.runtime.manifest import MANIFEST_FILE, MANIFEST_FORMAT_VERSION
from rnnify.runtime.serialize import graph_to_json
from rnnify.runtime.weights_file import write_safetensors

if TYPE_CHECKING:
    from rnnify.runtime.model import RecurrentModel

WEIGHTS_FILE = "model.safetensors"
GRAPH_FILE = "graph.json"

# Files of the source model directory that travel with the converted model.
SOURCE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def versions() -> dict[str, str]:
    import transformers

    from rnnify import __version__

    return {"rnnify": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def _unique_tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """State dict with tied tensors stored once: (tensors, alias -> stored name, buffer names).

    The tensors are the module's own (detached, not copied): ``write_safetensors`` streams them."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
        )
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach()
    buffers = [name for name, _ in module.named_buffers() if name in tensors]
    return tensors, aliases, buffers


def saved_options(target: str, options: dict[str, Any]) -> dict[str, Any]:
    """A saved cell's options, with the value each option added since had before it existed
    (``Cell.manifest_defaults``), for every group of a head split too."""
    if target == HEADS_TARGET:
        groups = [{**g, "options": saved_options(g["target"], g.get("options") or {})} for g in options["groups"]]
        options = {**options, "groups": groups}
    return {**CELLS[target].manifest_defaults, **options} if target in CELLS else options


def follow_umask(directory: Path) -> None:
    """Give ``directory`` and the files in it the modes ``mkdir`` and ``open`` would under the umask: a
    directory from ``mkdtemp`` is 0700, and safetensors writes its files 0600."""
    mask = output_dir.umask()
    directory.chmod(0o777 & ~mask)
    for child in directory.iterdir():
        child.chmod(0o666 & ~mask)


def check_output(path: Path) -> Path:
    """``path`` if saving may write there: it is named (not the current directory), absent, an empty
    directory or an rnnify model directory (replaced whole), with no file in place of a folder above it.
    Training checks its output with this too, before hours of work rather than after."""
    if str(path) in ("", "."):
        raise RnnifyError(f"output directory {str(path)!r}: name a new directory for the model")
    path = path.expanduser()
    if path.exists() and not (path.is_dir() and (not any(path.iterdir()) or (path / MANIFEST_FILE).is_file())):
        raise RnnifyError(f"{path} exists and is not an rnnify model directory; choose another output directory")
    above = output_dir.file_in_the_way(path.parent)
    if above is not None:
        raise RnnifyError(f"{path}: {above} is a file, not a directory; choose another output directory")
    return path


def save(model: RecurrentModel, path: Path) -> Path:
    """Write ``model`` to the directory ``path``, holding it against other writers (``output_dir.claim``)."""
    path = check_output(path)
    with output_dir.claim(path):
        return _write(model, path)


def _write(model: RecurrentModel, path: Path) -> Path:
    """Write ``model`` into a new directory beside the claimed ``path`` and swap it in whole."""
    tmp = output_dir.scratch(path)
    try:
        tensors, aliases, buffers = _unique_tensors(model.graph)
        weights_sha256 = write_safetensors(tmp / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
        (tmp / GRAPH_FILE).write_text(json.dumps(graph_to_json(model.graph.graph)))
        for name, data in model.files.items():
            (tmp / name).write_bytes(data)
        if hf_files.CONFIG_FILE in model.files:
            wrapped = hf_files.wrap_config(model.files[hf_files.CONFIG_FILE], model.manifest.to_json())
            (tmp / hf_files.CONFIG_FILE).write_bytes(wrapped)
        (tmp / hf_files.MODELING_FILE).write_bytes(hf_files.modeling_file())
        written = sorted(p.name for p in tmp.iterdir() if p.name != WEIGHTS_FILE)
        manifest = replace(
            model.manifest,
            files={WEIGHTS_FILE: weights_sha256, **integrity.record(tmp, written)},
            shipped_step=None,  # a step compiled into the old directory is not carried over (``step_cache``)
            aliases=aliases,
            buffers=buffers,
            versions=versions(),
            format_version=MANIFEST_FORMAT_VERSION,  # what is written now, whatever the loaded manifest said
        )
        manifest.write(tmp)
        follow_umask(tmp)
        output_dir.install(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    model.manifest = manifest
    model.path = path
    return path
