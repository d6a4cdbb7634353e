"""``rnnify.convert``: source model -> captured graph -> pass pipeline -> ``RecurrentModel``."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rnnify.choices import DEFAULT_DTYPE, DEFAULT_KERNELS, DTYPES
from rnnify.compiler.capture import GRAPH_LIMIT, capture, load_source, source_name, vocab_size
from rnnify.compiler.gguf import is_gguf, tokenizer_files
from rnnify.compiler.passes import PassContext, run_pipeline
from rnnify.compiler.passes.find_attention import SITE_KEY
from rnnify.compiler.passes.fuse_kernels import KERNELS_KEY
from rnnify.compiler.passes.rewrite_attention import cell_calls
from rnnify.compiler.plan import make_plan
from rnnify.errors import RnnifyError
from rnnify.kernels.utils import check_kernels
from rnnify.runtime.agreement import check_against_original
from rnnify.runtime.manifest import CellEntry, Manifest
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.saving import SOURCE_FILES
from rnnify.runtime.tokenizer import check_tokenizer_json
from rnnify.runtime.weight_layout import lay_out_linear_weights

__all__ = ["STAGES", "check_source_tokenizer", "convert"]

STAGES = ("load", "capture", "passes")

# what to do about a source tokenizer.json that cannot load: convert has no flag for another tokenizer
SOURCE_TOKENIZER_FIX = (
    "convert copies it beside the model: replace it with a good copy (e.g. download it again), "
    "or move the source's tokenizer files away to convert without a tokenizer"
)

_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise RnnifyError(f"unknown dtype {dtype!r}; choose from: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _source_files(model: Any, source: torch.nn.Module) -> dict[str, bytes]:
    """Config and tokenizer files to save beside the converted model: the source directory's, or for a
    GGUF file the tokenizer it stores, written as Hugging Face files."""
    if isinstance(model, (str, Path)) and is_gguf(model):
        files = {name: data for name, data in tokenizer_files(model).items() if name in SOURCE_FILES}
        return {**files, "config.json": source.config.to_json_string().encode()}
    directory = _source_directory(model, source)
    files = {}
    if directory is not None:
        files = {name: (directory / name).read_bytes() for name in SOURCE_FILES if (directory / name).is_file()}
    if "config.json" not in files or _model_type(files["config.json"]) != source.config.model_type:
        # none, or a composite's: the converted model is its language model, described by the text config
        files["config.json"] = source.config.to_json_string().encode()
    return files


def _source_directory(model: Any, source: torch.nn.Module) -> Path | None:
    """The directory whose files ``_source_files`` copies: ``model``'s, or the one a loaded model came
    from (a composite's: its text config names none); None for a GGUF file, whose tokenizer is its own."""
    if isinstance(model, (str, Path)) and is_gguf(model):
        return None
    directory = Path(model).expanduser() if isinstance(model, (str, Path)) else None
    if directory is None or not directory.is_dir():
        named = getattr(getattr(model, "config", None), "_name_or_path", "")
        named = named or getattr(source.config, "_name_or_path", "")
        candidate = Path(named or "/nonexistent")
        directory = candidate if candidate.is_dir() else None
    return directory


def check_source_tokenizer(directory: str | os.PathLike | None) -> None:
    """Refuse a source ``tokenizer.json`` that cannot load (cut short, not JSON, not a tokenizer):
    convert would copy it beside the model, and only a later generate or chat would fail. Cheap, so
    it runs before the capture (the command line's: before the load)."""
    path = None if directory is None else Path(directory).expanduser()
    if path is not None and path.is_dir():
        check_tokenizer_json(path, SOURCE_TOKENIZER_FIX)


def _model_type(config: bytes) -> str | None:
    try:
        return json.loads(config).get("model_type")
    except (ValueError, AttributeError):
        return None


def convert(
    model: Any,
    to: str = "exact",
    *,
    layers: str | None = None,
    keep_softmax: Iterable[int] | None = None,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    kernels: str = DEFAULT_KERNELS,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> RecurrentModel:
    """Compile a causal LM into a recurrent model.

    ``model`` is a local Hugging Face directory, a GGUF file (dequantised to ``dtype``; its tokenizer
    and chat template are saved too), a hub id already in the local cache, or a loaded ``PreTrainedModel``. ``to`` names the target cell (``rnnify.cells.CELLS``) of every layer,
    except those that ``layers`` (e.g. ``"0-1:exact,4-:hybrid"``) or ``keep_softmax`` (layers kept
    ``exact``) assign otherwise; ``options`` go to every cell that accepts them (e.g.
    ``feature_map="elu"``). ``kernels`` is the backend of the fused Triton ops the cells run where
    they have them (``auto``: Triton on CUDA; elsewhere, per phase, the faster of the ops' PyTorch
    reference and the cell's own form; ``triton``; ``reference``), or ``none`` for the cells' own
    PyTorch forms; it is saved with the model and can be overridden by ``rnnify.load``.
    ``progress(stage)`` is called as each stage and pass starts.
    """
    check_kernels(kernels)
    plan = make_plan(to, layers, keep_softmax, **options)
    report = progress or (lambda stage: None)
    report("load")
    source = load_source(model, resolve_dtype(dtype))
    check_source_tokenizer(_source_directory(model, source))  # a loaded model's directory is known only now
    report("capture")
    graph = capture(source)
    graph_limit = graph.meta.get(GRAPH_LIMIT)
    ctx = PassContext(config=source.config, plan=plan, kernels=kernels)
    graph = run_pipeline(graph, ctx, progress=report)
    if graph_limit is not None and not (ctx.positions["kind"] == "learned" and ctx.positions["limit"] <= graph_limit):
        ctx.positions["graph_limit"] = graph_limit  # where it says more than the learned positions do
    entries = []
    for call in cell_calls(graph):
        site, cell = call.meta[SITE_KEY], graph.get_submodule(call.target)
        entries.append(
            CellEntry(
                call.target,
                site.layer,
                site.module_path,
                cell.target,
                cell.spec.to_json(),
                cell.options(),
                call.meta.get(KERNELS_KEY, {}),
            )
        )
    manifest = Manifest(
        uid=uuid.uuid4().hex,
        target=to,
        options=options,
        layers=[str(rule) for rule in plan.rules],
        source=source_name(model),
        dtype=str(next(source.parameters()).dtype).removeprefix("torch."),
        vocab_size=vocab_size(source.config),
        positions=ctx.positions,
        cells=entries,
        kernels=kernels,
    )
    lay_out_linear_weights(graph)
    converted = RecurrentModel(graph, manifest, _source_files(model, source))
    if all(cell.exact for cell in converted.cells):  # a claim of the original's outputs: checked before it is saved
        report("check")
        check_against_original(converted, source)
    return converted
