"""Does a converted model compute what its original computes? Checked before an exact model is saved.

An ``exact`` conversion claims the original's outputs. Where the capture or a pass misses
something the original computes outside softmax attention (an additive position bias that reached
attention as a float mask, the state of a convolution layer, positions numbered from an offset),
the converted model still runs and is silently wrong. So ``convert`` runs both models on a few
random tokens, a prefill and then decoding steps, and refuses a model that differs, naming the
first decoder layer whose output differs in the prefill (by the ``nn_module_stack`` that
torch.export records on every node), or saying that only the steps differ (state that a step does
not carry).

The random tokens leave out the padding id. Some originals set it apart where a row holds it as a
token (RoBERTa's family numbers positions past it, XLM zeroes a row's last positions by its count),
while the conversion reads it as any other token; a row holding it is checked too, and where the two
differ the user is warned: tokenizers do not make that id from text, and rnnify pads rows with
``attention_mask``, so such rows come only from a caller who pads with the id alone (or a model that
generates it).

In half precision a mixture of experts may meet a tie on the tokens drawn: a router whose two
experts score closer than the conversion's rounding differs from the original's sends a token to
the other expert, and the two part from there on by far more than the tolerance. Where they first
part at such a tie (``met_a_router_tie``: ``rnnify.runtime.expert_choices``), every token before it
agreeing, the check draws other tokens, up to ``_DRAWS`` draws, and passes only on a draw that
agrees whole.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rnnify.errors import RnnifyError, RnnifyWarning
from rnnify.runtime.expert_choices import ExpertChoices, expert_sizes, routed_apart

if TYPE_CHECKING:
    from rnnify.runtime.model import RecurrentModel

__all__ = [
    "check_against_original",
    "differences",
    "met_a_router_tie",
    "padding_id",
    "relative_difference",
    "tokens_but",
    "rounding_dtype",
    "tolerance",
]

_HALF = (torch.bfloat16, torch.float16)
CHECK_TOKENS = 12  # random tokens: half read as a prompt, half as decoding steps
_PROMPT = CHECK_TOKENS // 2
_DRAWS = 4  # draws of tokens for a half-precision mixture of experts whose router met a tie


def tolerance(dtype: torch.dtype) -> float:
    """Largest relative difference that passes: half precision rounds every op, float32 barely."""
    return 2e-2 if dtype in _HALF else 1e-4


def rounding_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype whose rounding a model's checks against itself allow (a step against the prefill, a
    compiled step against the eager one): the model's, or half precision where a cell stores its keys
    and values in fewer bits than the model computes them (``Cell.storage``). There a last-bit
    difference of a key, which two routes through the same layers make, moves the stored entry a
    whole step wherever it crosses a rounding boundary."""
    from rnnify.cells.base import Cell

    narrowed = any(isinstance(m, Cell) and m.storage is not None for m in model.modules())
    return torch.bfloat16 if narrowed and model.dtype not in _HALF else model.dtype


def differences(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got - want|, relative difference)``: the relative one is max |got - want| over max
    |want| of the finite entries. Entries equal on both sides count as agreeing, infinities (a model
    that masks some logits to -inf) and NaNs included; a NaN or an infinity on one side only makes
    the relative difference infinite, so no comparison with a tolerance passes it. Empty tensors (a
    window's sink buffers without sinks) agree."""
    got, want = got.float(), want.float()
    if want.numel() == 0 and got.shape == want.shape:
        return 0.0, 0.0
    agree = (got == want) | (got.isnan() & want.isnan())
    gap = float((got - want).masked_fill(agree, 0).abs().max())
    if not (agree | (got.isfinite() & want.isfinite())).all():
        return gap, math.inf
    finite = want.masked_fill(~want.isfinite(), 0)
    return gap, gap / max(float(finite.abs().max()), torch.finfo(torch.float32).tiny)


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The relative difference of ``differences``."""
    return differences(got, want)[1]


@torch.no_grad()
def check_against_original(model: RecurrentModel, source: torch.nn.Module, seed: int = 0) -> None:
    """Raise ``RnnifyError`` unless ``model`` (every cell exact) gives ``source``'s logits on
    ``CHECK_TOKENS`` random tokens, read as a prompt and then step by step; warn where a row holding
    the padding id differs (module docstring). A half-precision mixture of experts whose router met
    a tie on the tokens drawn (``rnnify.runtime.expert_choices``) is checked on other tokens."""
    padding = padding_id(source, model.manifest.vocab_size)
    limit = tolerance(model.dtype)
    sizes = expert_sizes(_text_config(source)) if model.dtype in _HALF else set()
    for draw in range(_DRAWS if sizes else 1):
        ids = tokens_but(padding, model.manifest.vocab_size, (1, CHECK_TOKENS), seed + draw).to(model.device)
        want = _original(source, ids)
        full, _ = model.prefill(ids)
        stepped = _stepped(model, ids) if relative_difference(full, want) <= limit else None
        if stepped is not None and relative_difference(stepped, want) <= limit:
            break
        got = full if stepped is None else stepped
        if not (sizes and met_a_router_tie(model, source, ids, limit, stepped is not None, got, want)):
            break
    else:
        raise RnnifyError(
            f"the exact conversion could not be checked in {str(model.dtype).removeprefix('torch.')}: on each of "
            f"{_DRAWS} draws of random tokens a router sent a token to other experts than the original's (two "
            "experts' scores closer than rounding moves them) and the two parted from there; convert in "
            "float32 to check it; nothing was saved"
        )
    if stepped is None:
        layer = _first_diverging_layer(model, source, ids, limit)
        where = f"from layer {layer}" if layer else "after the last decoder layer"
        raise RnnifyError(
            f"the exact conversion differs from the original {where} (relative difference "
            f"{relative_difference(full, want):.2g} on random tokens, tolerance {limit:g}): this "
            "architecture computes something the conversion does not carry; nothing was saved"
        )
    if relative_difference(stepped, want) > limit:
        raise RnnifyError(
            f"the exact conversion reads a prompt as the original does but decodes differently "
            f"(relative difference {relative_difference(stepped, want):.2g} over {CHECK_TOKENS - _PROMPT} "
            f"steps, tolerance {limit:g}): a layer keeps state between tokens that the conversion does "
            "not carry; nothing was saved"
        )
    if padding is not None:
        _warn_where_the_padding_id_differs(model, source, ids, padding, limit)


@torch.no_grad()
def met_a_router_tie(
    model: RecurrentModel,
    source: torch.nn.Module,
    ids: torch.Tensor,
    limit: float,
    in_steps: bool = False,
    got: torch.Tensor | None = None,
    want: torch.Tensor | None = None,
) -> bool:
    """Whether ``model`` (its prompt of ``ids``, one row, or ``in_steps`` its steps: logits ``got``)
    and ``source`` (logits ``want``) first part where a router's choice between near-tied experts
    went the other way by rounding (``routed_apart``), their logits agreeing on every token before
    it; False for a model without routed experts, or whose routers the recording cannot follow. A
    tie only earns another draw of tokens: the check passes on a draw that agrees whole."""
    sizes = expert_sizes(_text_config(source))
    if not sizes:
        return False

    def run(choices: ExpertChoices) -> None:
        if in_steps:
            _stepped(model, ids, choices.one_pass)
        else:
            with choices.one_pass():
                model.prefill(ids)

    def reference(choices: ExpertChoices) -> None:
        with choices.one_pass():
            _original(source, ids)

    try:
        flip = routed_apart(run, reference, sizes, limit)
    except Exception:  # noqa: BLE001  (routers read otherwise: no tie, and the check refuses as without one)
        return False
    if flip is None or not flip["rounding"]:
        return False
    got = got if got is not None else _stepped(model, ids) if in_steps else model.prefill(ids)[0]
    want = want if want is not None else _original(source, ids)
    before = flip["token"]
    return before == 0 or relative_difference(got[:, :before], want[:, :before]) <= limit


def _text_config(source: torch.nn.Module) -> Any:
    config = getattr(source, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def padding_id(source: torch.nn.Module, vocab_size: int) -> int | None:
    """The source config's padding id, where one other token is left to draw random tokens from."""
    value = getattr(_text_config(source), "pad_token_id", None)
    valid = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size
    return value if valid and vocab_size > 1 else None


def tokens_but(padding: int | None, vocab_size: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random token ids of ``shape`` (on the CPU, from ``seed``), every one but ``padding``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size - (padding is not None), shape, generator=generator)
    return ids if padding is None else ids + (ids >= padding).long()


def _original(source: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return source(input_ids=ids.to(next(source.parameters()).device), use_cache=False).logits.to(ids.device)


def _stepped(
    model: RecurrentModel, ids: torch.Tensor, each_pass: Callable[[], Any] = contextlib.nullcontext
) -> torch.Tensor:
    """``model``'s logits of ``ids`` read as a prompt of the first ``_PROMPT``, then a step a token
    (each call within ``each_pass()``)."""
    with each_pass():
        logits, state = model.prefill(ids[:, :_PROMPT])
    steps = [logits]
    for t in range(_PROMPT, ids.shape[1]):
        with each_pass():
            logits, state = model.step(ids[:, t : t + 1], state)
        steps.append(logits)
    return torch.cat(steps, dim=1)


def _warn_where_the_padding_id_differs(
    model: RecurrentModel, source: torch.nn.Module, ids: torch.Tensor, padding: int, limit: float
) -> None:
    """Warn when ``ids`` holding ``padding`` in the prompt and in the steps read differently by ``model``."""
    ids = ids.clone()
    ids[:, [2, _PROMPT + 2]] = padding
    want = _original(source, ids)
    difference = max(relative_difference(got, want) for got in (model.prefill(ids)[0], _stepped(model, ids)))
    if difference > limit:
        warnings.warn(
            f"{type(source).__name__} sets its padding id {padding} apart where a row holds it as a "
            "token and the conversion does not: such a row decodes differently from the original "
            f"(relative difference {difference:.2g}); pad rows with attention_mask",
            RnnifyWarning,
            stacklevel=2,
        )


def _layer_paths(model: RecurrentModel) -> list[str]:
    """The decoder layers' module paths in the source (the parents of the attention sites), in order."""
    paths = [entry.module_path.rpartition(".")[0] for entry in model.manifest.cells]
    return [p for p in dict.fromkeys(paths) if p]


def _first_diverging_layer(
    model: RecurrentModel, source: torch.nn.Module, ids: torch.Tensor, limit: float
) -> str | None:
    """The first decoder layer (``model.layers.3``) whose prefill output differs from the source's."""
    wanted: dict[str, Any] = {}
    hooks = []
    for path in _layer_paths(model):
        try:
            module = source.get_submodule(path)
        except AttributeError:
            return None
        hooks.append(
            module.register_forward_hook(
                lambda _m, _a, out, path=path: wanted.__setitem__(path, out[0] if isinstance(out, tuple) else out)
            )
        )
    try:
        source(input_ids=ids.to(next(source.parameters()).device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    got = _graph_layer_outputs(model, ids, list(wanted))
    for path, want in wanted.items():
        if path not in got or got[path].shape != want.shape:
            return None
        if relative_difference(got[path], want.to(got[path].device)) > limit:
            return path
    return None


def _graph_layer_outputs(model: RecurrentModel, ids: torch.Tensor, paths: list[str]) -> dict[str, torch.Tensor]:
    """Each layer's output in the converted graph's prefill: the value of the last node that
    torch.export recorded as inside that layer's module."""
    last: dict[str, torch.fx.Node] = {}
    for node in model.graph.graph.nodes:
        for owner, _ in (node.meta.get("nn_module_stack") or {}).values():
            for path in paths:
                if owner == path or owner.endswith("." + path):
                    last[path] = node
    wanted = {node: path for path, node in last.items()}
    out: dict[str, torch.Tensor] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if node in wanted and isinstance(value, torch.Tensor):
                out[wanted[node]] = value
            return value

    state = model.init_state(1)
    mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    Recorder(model.graph).run(ids, model._position_ids(ids, state, None), mask, *state.tensors)
    return out
