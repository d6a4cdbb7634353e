"""Load a Hugging Face causal LM and capture its forward pass as a torch.fx graph.

Capture goes through ``torch.export.export(strict=False)`` (transformers v5 removed its fx
tracer). The graph takes ``(input_ids [B, T], position_ids [B, T])`` and returns the logits, with
batch and sequence length dynamic and no KV cache inside: the passes put the recurrence there.
Positions come in counted from 0; the graph starts them where the source does (``numbering``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.export import Dim

from rnnify.compiler.block_selection import block_selections
from rnnify.compiler.composite import language_model, loading_class
from rnnify.compiler.data_dependence import data_dependence
from rnnify.compiler.export_lengths import agreement, check_lengths, probed_lengths, refused_lengths
from rnnify.compiler.numbering import first_position
from rnnify.compiler.passes.eager_attention import normalises_scores
from rnnify.compiler.recurrences import own_recurrences
from rnnify.compiler.routing import routing_forms
from rnnify.errors import RnnifyError, UnsupportedModelError, first_line

__all__ = ["GRAPH_LIMIT", "load_source", "capture", "source_name"]

# Batch 2 and length 8 are example values only: both dimensions are dynamic. Length starts at 2
# because export specialises size-1 dimensions (and is_causal may otherwise become symbolic).
_EXAMPLE_BATCH, _EXAMPLE_LENGTH = 2, 8
_MAX_LENGTH = 1 << 20
# key of ``GraphModule.meta`` that holds the tokens a captured graph holds for, where it is limited
GRAPH_LIMIT = "rnnify_graph_limit"


def source_location(path_or_id: str) -> dict[str, Any] | None:
    """Where ``from_pretrained`` finds the source ``path_or_id`` (None: a GGUF file), or the mistake
    that needs no loading to see (no such path, no config.json, a directory rnnify converted): the
    CLI asks before it shows any progress. Never the source's own code: without an explicit
    ``trust_remote_code=False`` transformers asks on stdin whether to run a model's ``auto_map``."""
    from rnnify.compiler.gguf import is_gguf

    if not path_or_id.strip():
        raise RnnifyError("the model is an empty name: give its directory, .gguf file or cached hub id")
    local = Path(path_or_id).expanduser()
    if is_gguf(local):
        return None
    if local.exists():
        if not (local / "config.json").is_file():
            raise RnnifyError(f"{path_or_id}: no config.json here; pass a Hugging Face model directory or a .gguf file")
        if (local / "rnnify.json").is_file():
            raise RnnifyError(
                f"{path_or_id} is a model rnnify already converted, not the Hugging Face model it came from; "
                "give its source (the `source` in its rnnify.json) instead"
            )
        return {"pretrained_model_name_or_path": str(local), "trust_remote_code": False}
    if path_or_id.lower().endswith(".gguf"):
        raise RnnifyError(f"{path_or_id}: no such file")
    if path_or_id.startswith((".", "/", "~")) or os.sep in path_or_id.strip("/").replace("/", "", 1):
        raise RnnifyError(f"{path_or_id}: no such directory")
    return {"pretrained_model_name_or_path": path_or_id, "local_files_only": True, "trust_remote_code": False}


def _load_pretrained(path_or_id: str, dtype: torch.dtype):
    from transformers import AutoConfig

    from rnnify.compiler.gguf import load_gguf

    where = source_location(path_or_id)
    if where is None:
        return load_gguf(Path(path_or_id).expanduser(), dtype)
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError

    try:
        config = AutoConfig.from_pretrained(**where)
    except StrictDataclassError as exc:  # values its config class refuses (heads that do not divide the width)
        raise RnnifyError(f"{path_or_id}: its config.json does not describe a model ({first_line(exc)})") from exc
    except OSError as exc:
        if "local_files_only" in where:
            raise RnnifyError(
                f"{path_or_id}: not a local directory and not in the local Hugging Face cache; "
                "rnnify works offline: download the model elsewhere and pass its local directory"
            ) from exc
        raise RnnifyError(f"{path_or_id}: cannot read the model config ({first_line(exc)})") from exc
    except ValueError as exc:  # an unknown model type, or one whose code comes with it (``auto_map``)
        own_code = "trust_remote_code" in str(exc)
        why = "it names code of its own (auto_map), which rnnify never runs" if own_code else first_line(exc)
        raise UnsupportedModelError(f"{path_or_id}: cannot read the model config ({why})") from exc
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{path_or_id}: encoder-decoder model ({config.model_type}); only decoder-only causal "
            "LMs can become recurrent (their cross-attention is not causal)"
        )
    auto_class = loading_class(config)
    try:
        try:
            return auto_class.from_pretrained(**where, dtype=dtype, attn_implementation="sdpa")
        except ValueError as exc:
            if "scaled_dot_product_attention" not in str(exc):
                raise
            # no SDPA (softcapping, sinks, ALiBi models): its eager attention, which find_attention matches
            return auto_class.from_pretrained(**where, dtype=dtype, attn_implementation="eager")
    except ValueError as exc:
        raise UnsupportedModelError(f"{path_or_id}: cannot load as a causal LM ({first_line(exc)})") from exc
    except (OSError, SafetensorError) as exc:  # no weights file, or a damaged one
        raise RnnifyError(f"{path_or_id}: cannot read the model's weights ({first_line(exc)})") from exc


def load_source(model, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Return the source model in eval mode with SDPA attention, or its eager attention where it has no SDPA.

    ``model`` is a local directory, a GGUF file (dequantised to ``dtype``, see ``rnnify.compiler.gguf``), a
    hub id already in the local cache, or a loaded ``PreTrainedModel`` (used as is, switched to SDPA).
    Of a composite (vision- or audio-language) model, its language model (``rnnify.compiler.composite``).
    """
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        if getattr(model.config, "is_encoder_decoder", False):
            raise UnsupportedModelError(f"{type(model).__name__}: encoder-decoder models cannot become recurrent")
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, AttributeError):
            pass  # eager or custom attention: find_attention matches what the captured graph computes
        return language_model(model.eval())
    if isinstance(model, (str, os.PathLike)):
        return language_model(_load_pretrained(os.fspath(model), dtype).eval())
    raise RnnifyError(f"expected a model directory, hub id or PreTrainedModel, got {type(model).__name__}")


def source_name(model) -> str | None:
    """The id or path recorded in the manifest for ``model``."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser()
        return str(path.resolve()) if path.exists() else str(model)
    return getattr(getattr(model, "config", None), "_name_or_path", None) or None


def refuse_bidirectional_attention(name: str, config: Any) -> None:
    """Raise for a model whose config makes its attention read later tokens too (PaliGemma's language
    model, a prefix LM; Gemma 4's ``"all"``; its ``"vision"`` leaves text causal; XLM's and Flaubert's
    ``causal`` off): a recurrence reads the tokens in order, so none computes that."""
    if getattr(config, "use_bidirectional_attention", None) in (True, "all"):
        field = "use_bidirectional_attention"
    elif getattr(config, "causal", None) is False:
        field = "causal: false"
    else:
        return
    raise UnsupportedModelError(
        f"{name}: bidirectional attention ({field}): each token also reads the tokens after it, which no "
        "recurrence computes; rnnify converts causal attention"
    )


class _LogitsOnly(torch.nn.Module):
    """Calls the HF model with explicit positions, from ``first`` on as it numbers them
    (``rnnify.compiler.numbering``), and no cache, returning only the logits.

    A model that takes each row's length (XLM's ``lengths``) is told every row is whole: untold, it
    counts a row's tokens other than the padding id, and zeroes the positions past that count (the
    last ones of a left-padded row). rnnify pads rows with ``attention_mask``, which the cells read.
    """

    def __init__(self, model: torch.nn.Module, first: int):
        super().__init__()
        self.model = model
        self.first = first
        self.takes_lengths = "lengths" in inspect.signature(model.forward).parameters

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.first:
            position_ids = position_ids + self.first
        lengths = {}
        if self.takes_lengths:
            lengths["lengths"] = torch.full_like(input_ids[:, 0], input_ids.shape[1])
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **lengths).logits


def vocab_size(config: Any) -> int:
    """The vocabulary the logits span, from the config's own ``vocab_size``. A composite config (a
    vision-language model's, whose ``vocab_size`` sits in ``text_config``) is refused: ``load_source``
    takes out its language model, and capturing the whole gave wrong results for some (Gemma 3's)."""
    value = getattr(config, "vocab_size", None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        where = " (it is in its text config: a composite model)" if hasattr(config, "text_config") else ""
        raise UnsupportedModelError(
            f"{type(config).__name__} names no vocab_size of its own{where}; rnnify converts "
            "causal language models whose config does"
        )
    return value


def capture(model: torch.nn.Module) -> torch.fx.GraphModule:
    """Export ``model`` and return a plain GraphModule ``(input_ids, position_ids) -> logits``.

    Parameters keep the source model's state-dict names (``model.layers.0.self_attn...``).
    """
    device = next(model.parameters()).device
    vocab = vocab_size(model.config)
    refuse_bidirectional_attention(type(model).__name__, model.config)
    first = first_position(model, vocab)
    # seeded: the capture draws nothing from the caller's random stream
    example = torch.randint(0, vocab, (_EXAMPLE_BATCH, _EXAMPLE_LENGTH), generator=torch.Generator().manual_seed(0))
    input_ids = example.to(device)
    position_ids = torch.arange(_EXAMPLE_LENGTH, device=device).expand(_EXAMPLE_BATCH, -1)
    wrapper = _LogitsOnly(model, first)
    with routing_forms(model), block_selections(model), index_masks():
        try:
            graph = _plain_graph_module(_export(wrapper, input_ids, position_ids, _MAX_LENGTH).module())
        except Exception as exc:  # export failures come in many types; report them as one
            graph = _capture_after_failure(wrapper, input_ids, position_ids, exc)
    _refuse_vmap(type(model).__name__, graph)
    return graph


@contextlib.contextmanager
def index_masks():
    """Within the block, transformers builds every SDPA and eager mask from index arithmetic.

    It builds a mask with ``torch.vmap`` wherever a model adds a mask function of its own
    (Unlimited-OCR's reference layers: a window, or'ed with the prompt), and export keeps vmap's
    batching ops, which run nowhere else. Broadcast index tensors give the same mask for functions
    of the indices (transformers' own default path); an exact conversion is checked against the
    original, which builds its masks as it always does.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    saved = {name: mapping[name] for name in ("sdpa", "eager")}
    try:
        for name, build in saved.items():
            mapping[name] = functools.partial(_without_vmap, build)
        yield
    finally:
        mapping.update(saved)


def _without_vmap(build, *args, **kwargs):
    return build(*args, **{**kwargs, "use_vmap": False})


def _refuse_vmap(name: str, graph: torch.fx.GraphModule) -> None:
    """Raise where export kept ``torch.vmap``'s batching ops (a mask built with vmap, as Unlimited-OCR's
    reference masks are): outside the vmap that made them they do not run, so neither would the graph."""
    for node in graph.graph.nodes:
        if node.op == "call_function" and "_add_batch_dim" in str(node.target):
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', node.meta.get("stack_trace") or "")
            where = f"{os.path.basename(frames[-1][0])}:{frames[-1][1]} in {frames[-1][2]}" if frames else node.name
            raise UnsupportedModelError(
                f"{name}: its forward pass computes with torch.vmap ({where}), whose batching ops a captured "
                "graph cannot run outside it"
            )


# what a failed export says when the length's declared range does not hold: its own message, or the
# AssertionError torch 2.13 raises while it words the fix for a length derived from another
# (DeepSeek-V4's compressed attention)
_RANGE_VIOLATED = ("Constraints violated", "Cannot create Dim with inconsistent")


def _capture_after_failure(
    wrapper: _LogitsOnly, input_ids: torch.Tensor, position_ids: torch.Tensor, exc: Exception
) -> torch.fx.GraphModule:
    """Capture ``wrapper`` once its export over any length failed with ``exc``, or raise the one line that says why not."""
    model, name = wrapper.model, type(wrapper.model).__name__
    if any(marker in str(exc) for marker in _RANGE_VIOLATED):
        table = _declared_length(model.config)
        if table is not None:
            graph = None
            with contextlib.suppress(Exception):  # the first failure is the one to report
                graph = _plain_graph_module(_export(wrapper, input_ids, position_ids, table - 1).module())
            if graph is not None:
                return _beyond_the_table(graph, wrapper, input_ids, position_ids, table)
        inferred = _capture_inferring_length(wrapper, input_ids, position_ids)
        if inferred is not None:
            return inferred
    if not _has_attention(model):
        raise _no_attention(f"{name} has no attention layers", "Mamba") from exc
    refusal = data_dependence(name, exc)
    if refusal is not None:
        raise refusal from exc
    raise UnsupportedModelError(
        f"{name}: torch.export could not capture the forward pass: {first_line(exc, with_type=True)}"
    ) from exc


def _beyond_the_table(
    graph: torch.fx.GraphModule, wrapper: _LogitsOnly, input_ids: torch.Tensor, position_ids: torch.Tensor, table: int
) -> torch.fx.GraphModule:
    """The graph for ``wrapper`` at lengths past the ``table`` tokens its config declares, given
    ``graph``, exported below them.

    A model that slices a table of the length its config declares to the tokens read (MPT's ALiBi, a
    causal-mask buffer, learned positions) exports only below that length, where export can prove the
    slice's size, and cannot itself read further. A bias or a mask dies with the attention the cells
    replace, so ``graph`` reads any length; learned positions keep their limit (find_positions
    records it). A source that does read past the table may branch on the length there (Doge's
    dynamic mask keeps only its ``keep_window_size`` best keys past that many tokens), which a graph
    exported below it does not hold: the graph export gives with the length left to it, where that
    holds for every length, else the graph exported up to the table (or ``graph``, below it) with
    that limit recorded (``GRAPH_LIMIT``). A source whose control flow past the table depends on its
    tensors' values is kept to the table too: no trace checks what it computes there.
    """
    traced = _traces_at(wrapper, table + 1, input_ids.device)
    if traced is False:
        return graph
    if traced:
        with contextlib.suppress(Exception):  # refused past some length: the table's limit is the one kept
            inferred = _capture_inferring_length(wrapper, input_ids, position_ids)
            if inferred is not None:
                return inferred
    limited, limit = graph, table - 1
    with contextlib.suppress(Exception):  # a guard that holds below the table alone: ``graph`` it is
        limited, limit = _plain_graph_module(_export(wrapper, input_ids, position_ids, table).module()), table
    limited.meta[GRAPH_LIMIT] = limit
    return limited


def _traces_at(wrapper: _LogitsOnly, length: int, device: torch.device) -> bool | None:
    """Whether the source computes ``length`` tokens, traced by export at that length alone (its
    tensors fake, so a length far past what a real pass could hold costs nothing): True where it
    traces, False where the source fails there (it refuses the length, or its table is too short),
    None where its control flow there depends on the tensors' values (``data_dependence``)."""
    input_ids = torch.zeros(1, length, dtype=torch.long, device=device)
    fake_tensors = logging.getLogger("torch._subclasses.fake_tensor")  # logs the failure before raising it
    level = fake_tensors.level
    fake_tensors.setLevel(logging.CRITICAL)
    try:
        _export(wrapper, input_ids, torch.arange(length, device=device)[None], max_length=None)
    except Exception as exc:  # noqa: BLE001  (a table too short for the tokens, in whatever error the model raises)
        return None if data_dependence("", exc) is not None else False
    finally:
        fake_tensors.setLevel(level)
    return True


def _capture_inferring_length(
    wrapper: _LogitsOnly, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> torch.fx.GraphModule | None:
    """The graph export gives with the length's range left to it, if it holds for the lengths its guards
    refuse (``rnnify.compiler.export_lengths``); None when export fails that way too."""
    try:
        module = _export(wrapper, input_ids, position_ids, _MAX_LENGTH, infer=True).module()
    except Exception:  # noqa: BLE001  (the first failure is the one to report)
        return None
    guards = getattr(module, "_guards_fn", None)
    if guards is None:
        return None
    probed = probed_lengths(_MAX_LENGTH)
    refused = refused_lengths(guards, probed)
    graph = _plain_graph_module(module)
    agrees_at = agreement(graph, wrapper, vocab_size(wrapper.model.config), input_ids.device)
    try:
        check_lengths(type(wrapper.model).__name__, refused, probed, _EXAMPLE_LENGTH, agrees_at)
    except UnsupportedModelError as refusal:
        if not normalises_scores(graph):  # a recurrence of its own, in a loop over the tokens (RWKV's)
            raise _no_attention(
                f"{type(wrapper.model).__name__}'s graph has no softmax or logsumexp", "RWKV"
            ) from refusal
        raise
    return graph


def _no_attention(found: str, like: str) -> UnsupportedModelError:
    """The refusal of a model that mixes its tokens without attention: ``found``, what was checked."""
    return UnsupportedModelError(
        f"no attention found: {found} (it is recurrent already, as {like} is); rnnify converts a model's attention"
    )


def _has_attention(model: torch.nn.Module) -> bool:
    """Whether any submodule is named or typed as attention (``self_attn``, ``LlamaAttention``): a
    model without one fails export for its own recurrence, and is told that instead of export's error."""
    return any(
        "attn" in name.lower() or "attention" in type(module).__name__.lower() for name, module in model.named_modules()
    )


def _export(
    wrapper: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    max_length: int | None,
    infer: bool = False,
):
    """``torch.export`` of ``wrapper`` with batch and length dynamic, length up to ``max_length``
    (``infer``: within that range, the lengths export's guards allow); ``max_length=None``: at the
    inputs' shapes alone."""
    dynamic = None
    if max_length is not None:
        batch = Dim("batch", min=1, max=1 << 16)
        length = Dim.AUTO(min=2, max=max_length) if infer else Dim("length", min=2, max=max_length)
        dynamic = ({0: batch, 1: length},) * 2
    with torch.no_grad(), own_recurrences(wrapper.model), _without_partial_graph():
        return torch.export.export(wrapper, (input_ids, position_ids), dynamic_shapes=dynamic, strict=False)


@contextlib.contextmanager
def _without_partial_graph():
    """Within the block, stderr drops the graph-so-far that a failed export prints there before it
    raises (``partial_fx_graph``: thousands of lines before rnnify's one-line reason); everything
    else passes on as it is written."""
    with contextlib.redirect_stderr(_NoPartialGraph(sys.stderr)):
        yield


class _NoPartialGraph(io.TextIOBase):
    """A stream that writes to ``target`` all but a printed GraphModule (its code, then print's newline)."""

    def __init__(self, target):
        self.target, self._dropped = target, False

    def write(self, text: str) -> int:
        dropped, self._dropped = self._dropped, text.lstrip("\n").startswith("def forward(self")
        if not self._dropped and not (dropped and text == "\n"):
            self.target.write(text)
        return len(text)

    def flush(self) -> None:
        self.target.flush()


def _declared_length(config: Any) -> int | None:
    """The longest input the config declares (``max_seq_len``, ``max_position_embeddings``, ...), if
    it is longer than the example input export starts from."""
    for name in ("max_seq_len", "max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > _EXAMPLE_LENGTH:
            return value
    return None


def _plain_graph_module(exported: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Drop export's input checks and pytree calling convention; strip the wrapper prefix."""
    graph = exported.graph
    attrs: dict[str, torch.Tensor] = {}
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
        elif node.op == "get_attr":
            name = node.target.removeprefix("model.")
            attrs[name] = functools.reduce(getattr, node.target.split("."), exported)
            node.target = name
    graph._codegen = torch.fx.graph.CodeGen()
    return torch.fx.GraphModule(attrs, graph, class_name="CapturedModel")
