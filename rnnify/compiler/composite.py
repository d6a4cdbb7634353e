"""The language model inside a composite (vision- or audio-language) model, taken out of the whole.

Many checkpoints of text models ship as a whole with an image or audio encoder (Gemma 3 from 4B,
Gemma 4, Mistral Small 3.1, LLaVA, Qwen-VL): their config keeps the text model's in
``text_config``, and the class transformers loads (``...ForConditionalGeneration``) runs the
encoder, merges its features into the token embeddings, then runs a plain decoder and an output
head. rnnify converts that text path, the whole's own decoder and head: in the causal LM class
transformers has for the text config (``Gemma3ForCausalLM`` for ``Gemma3TextConfig``), or where it
has none, in ``TextPath`` (decoder, then head), so the capture, the passes and the exact check see a
causal LM like any other. The encoder is left out, so the converted model reads text only.

What is taken out must compute what the whole computes on text, and it might not (a head the whole
scales differently, tokens the whole treats apart): so both run on a few tokens, and a whole whose
text path differs is refused (a check on a few tokens: a difference that shows only on longer or
padded inputs is the exact check's and verify's to find). A Qwen-VL decoder takes 2-D positions
as every position axis at once, which makes its multimodal RoPE the plain RoPE of text; the check
holds it to the whole as well.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from rnnify.errors import RnnifyWarning, UnsupportedModelError, first_line, is_positive_finite

__all__ = ["is_composite", "language_model", "loading_class"]

_PROBE_TOKENS = 8


def is_composite(config: Any) -> bool:
    """Whether ``config`` keeps its text model's config apart (``text_config``) from its own."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config is not None and get_text_config(decoder=True) is not config


def loading_class(config: Any):
    """The Auto class that loads the whole model ``config`` describes: transformers' causal-LM class
    where it has one for the config (Gemma 3's whole is among them), else its multimodal-LM class
    (LLaVA, Mistral 3, Qwen-VL, speech models); the causal-LM class for anything else, whose
    error then says that transformers has no causal LM for it."""
    from transformers import AutoModelForCausalLM, AutoModelForMultimodalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MULTIMODAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and type(config) in MODEL_FOR_MULTIMODAL_LM_MAPPING:
        return AutoModelForMultimodalLM
    return AutoModelForCausalLM


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` itself when it is a causal LM of its own; for a composite, its language model, sharing
    the whole's modules: its decoder where that is a causal LM already, else whichever of the causal
    LM class and ``TextPath`` (with each finish of the logits the text config names, and without:
    ``_finishes``) computes closest to what the whole computes on text, within the tolerance (module
    docstring). Closest, not first: a cap barely bends small logits, so an uncapped path may pass the
    tolerance where the whole caps."""
    if not is_composite(model.config):
        return model
    name, head, decoder = type(model).__name__, model.get_output_embeddings(), model.get_decoder()
    text_path = _text_path_class()
    if decoder.get_output_embeddings() is not None:  # its language model is a causal LM already (Kosmos-2.5)
        candidates = [decoder]
    elif head is None:
        raise UnsupportedModelError(f"{name}: a composite model without an output head over tokens")
    else:
        text_config = model.config.get_text_config(decoder=True)
        candidates = [
            _in_causal_lm_class(text_config, decoder, head),
            *(text_path(text_config, decoder, head, scale, softcap) for scale, softcap in _finishes(text_config)),
        ]
    from rnnify.runtime.agreement import tolerance

    ids, want = _whole_on_text(model)
    limit = tolerance(want.dtype)
    differences, ran, unfinished = [], [], None
    for text in (candidate.eval() for candidate in candidates if candidate is not None):
        if isinstance(text, text_path):  # every finish of one run of the decoder and head
            unfinished = unfinished or _logits(text.unfinished_logits, ids)
            got, problem = unfinished
            got = None if got is None else text.finished(got)
        else:
            got, problem = _logits(text, ids)
        difference, problem = (None, problem) if problem else _difference(got, want)
        if problem is None:
            ran.append((difference, text))
            problem = f"relative difference {difference:.2g}, tolerance {limit:g}"
        differences.append(f"{type(text).__name__}{getattr(text, 'finish', '')}: {problem}")
    difference, text = min(ran, key=lambda pair: pair[0], default=(None, None))
    if difference is None or difference > limit:
        raise UnsupportedModelError(
            f"{name}: its language model alone does not compute what the whole computes on text "
            f"({'; '.join(differences)}), so converting it would not be the original"
        )
    warnings.warn(
        f"{name} is a composite model: rnnify converts its language model "
        f"({type(text).__name__}{getattr(text, 'finish', '')}); "
        "its image or audio encoder is left out, so the converted model reads text only",
        RnnifyWarning,
        stacklevel=3,
    )
    return text


# text-config fields a whole scales its head's logits by: multiplies (+1), divides (-1), or either
# (0: Granite's wholes divide by ``logits_scaling``, HyperCLOVA X's multiply)
_LOGIT_SCALES = {"logits_scaling": 0, "output_multiplier": 1, "logit_scale": 1}


def _finishes(text_config: Any) -> list[tuple[float, float | None]]:
    """``(scale, softcap)`` pairs a whole may apply to its head's logits, from its text config: each
    scale its fields give (``_LOGIT_SCALES``; 1 first), without and with the config's final logit cap
    (``final_logit_softcapping``: Mistral Large 4, MuseSpark)."""
    scales = [1.0]
    for name, way in _LOGIT_SCALES.items():
        value = getattr(text_config, name, None)
        if is_positive_finite(value) and value != 1:
            scales += [float(value)] * (way >= 0) + [1 / float(value)] * (way <= 0)
    softcap = getattr(text_config, "final_logit_softcapping", None)
    caps = [None] + ([float(softcap)] if is_positive_finite(softcap) else [])
    return [(scale, cap) for scale in dict.fromkeys(scales) for cap in caps]


def _in_causal_lm_class(text_config: Any, decoder: torch.nn.Module, head: torch.nn.Module) -> torch.nn.Module | None:
    """The whole's decoder and head in transformers' causal LM class for its text config (which adds
    what that family computes after the decoder: Gemma's final softcap); None where it has none, or
    its decoder or weights are not the whole's."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        text_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]
    except KeyError:
        return None
    try:
        with torch.device("meta"):
            text = text_class(text_config)
    except Exception:  # noqa: BLE001 - a class that does not build from the whole's text config: TextPath then
        return None
    if type(getattr(text, text.base_model_prefix, None)) is not type(decoder):
        return None
    setattr(text, text.base_model_prefix, decoder)
    text.set_output_embeddings(head)
    return None if any(t.is_meta for t in (*text.parameters(), *text.buffers())) else text


@functools.cache
def _text_path_class() -> type:
    """``TextPath``: a whole's decoder, then its output head, as a transformers model (the fallback
    where transformers has no causal LM class for the text config: Qwen-VL's, GLM-4V's), its logits
    times ``scale``, then with ``softcap`` c capped to c tanh(logits / c): what the whole does after
    its head (``_finishes``)."""
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class TextPath(PreTrainedModel):
        base_model_prefix = "model"
        # what the whole's decoder supports, which transformers reads from a model class's source
        _supports_sdpa = _supports_flex_attn = _supports_attention_backend = True
        _can_set_attn_implementation_cached_value = _can_set_experts_implementation_cached_value = True

        def __init__(
            self,
            config: Any,
            decoder: torch.nn.Module,
            head: torch.nn.Module,
            scale: float = 1.0,
            softcap: float | None = None,
        ):
            super().__init__(config)
            self.model, self.lm_head, self.scale, self.softcap = decoder, head, scale, softcap

        @property
        def finish(self) -> str:
            """What follows the head, for messages: `` (logits x 0.25, capped at 30)``."""
            steps = ([f"logits x {self.scale:g}"] if self.scale != 1.0 else []) + (
                [f"capped at {self.softcap:g}"] if self.softcap is not None else []
            )
            return f" ({', '.join(steps)})" if steps else ""

        def unfinished_logits(self, input_ids=None, position_ids=None, attention_mask=None, use_cache=False, **kwargs):
            """The head's logits, before the finish (which the check of each finish applies itself)."""
            hidden = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=use_cache,
                **kwargs,
            ).last_hidden_state
            return self.lm_head(hidden)

        def finished(self, logits: torch.Tensor) -> torch.Tensor:
            """``logits`` times ``scale``, then capped at ``softcap``."""
            if self.scale != 1.0:
                logits = logits * self.scale
            if self.softcap is not None:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return logits

        def forward(self, input_ids=None, position_ids=None, attention_mask=None, use_cache=False, **kwargs):
            logits = self.unfinished_logits(input_ids, position_ids, attention_mask, use_cache, **kwargs)
            return CausalLMOutput(logits=self.finished(logits))

    return TextPath


def _reserved_ids(config: Any) -> set[int]:
    """Token ids the config names (image, audio, boundary tokens): the whole may treat them apart."""
    found: set[int] = set()

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, key)
        elif "token" in key and isinstance(value, int) and not isinstance(value, bool):
            found.add(value)

    walk(config.to_dict())
    return found


@torch.no_grad()
def _whole_on_text(whole: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A few ordinary tokens (none a config names) and the whole's logits of them."""
    reserved = _reserved_ids(whole.config)
    vocab = whole.config.get_text_config(decoder=True).vocab_size
    ordinary = torch.tensor([i for i in range(vocab) if i not in reserved])
    pick = torch.randint(0, len(ordinary), (1, _PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    ids = ordinary[pick].to(next(whole.parameters()).device)
    try:
        return ids, whole(input_ids=ids, use_cache=False).logits
    except Exception as exc:  # a whole that needs its images or audio: any error means the same
        raise UnsupportedModelError(
            f"{type(whole).__name__}: the whole model does not run on text alone ({first_line(exc)}), so its "
            "language model cannot be checked against it"
        ) from exc


@torch.no_grad()
def _logits(run, ids: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """``(logits, None)`` of ``run`` (a model, or a callable that returns logits) on ``ids``, or
    ``(None, why)`` where it does not run."""
    try:
        out = run(input_ids=ids, use_cache=False)
    except Exception as exc:  # noqa: BLE001 - a decoder that does not run alone: any error means the same
        return None, f"does not run apart from the whole ({first_line(exc)})"
    return getattr(out, "logits", out), None


def _difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float | None, str | None]:
    """``(relative difference, None)`` of the logits ``got`` from the whole's ``want``, or
    ``(None, why)`` where they cannot be compared."""
    from rnnify.runtime.agreement import relative_difference

    if got.shape != want.shape:
        return None, f"logits of shape {tuple(got.shape)}, the whole's {tuple(want.shape)}"
    return relative_difference(got, want), None
