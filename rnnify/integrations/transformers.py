"""A converted model as a transformers causal LM: ``generate``, ``pipeline`` and the Auto classes.

``RnnifyForCausalLM`` wraps a ``RecurrentModel``; its cache (``RecurrentCache``) is the recurrent
state, so transformers' own decoding loops (greedy, sampling, beam search, with their logits
processors, stopping criteria and streamers) run over it one token per step. The decoding modes
that need what a recurrent state does not keep are refused up front (``REFUSED``). Only public
hooks are overridden: ``generate`` (the refusals, and the cache passed in as ``cache=``),
``prepare_inputs_for_generation`` and ``forward``; the loss is transformers' ``loss_function``.

Importing this module registers the classes with ``AutoConfig`` and ``AutoModelForCausalLM``, so
``AutoModelForCausalLM.from_pretrained(dir)`` then loads a converted directory without
``trust_remote_code``; without the import, the directory's ``modeling_rnnify.py`` does the same.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from rnnify.errors import RnnifyError
from rnnify.runtime import hf_files
from rnnify.runtime.model import RIGHT_PADDED, RecurrentModel
from rnnify.runtime.sampling import token_ids
from rnnify.runtime.state import RecurrentState

__all__ = ["RnnifyConfig", "RecurrentCache", "RnnifyForCausalLM", "SUPPORTED_MODES", "REFUSED"]

SUPPORTED_MODES = (
    GenerationMode.GREEDY_SEARCH,
    GenerationMode.SAMPLE,
    GenerationMode.BEAM_SEARCH,
    GenerationMode.BEAM_SAMPLE,
)
# transformers' own max_length where neither it nor max_new_tokens is set: counted from the prompt, and within
# the config's max_position_embeddings (GenerationMixin._prepare_generated_length)
_DEFAULT_MAX_LENGTH = 20
# Why each other decoding mode cannot run on a recurrent state.
REFUSED = {
    GenerationMode.CONTRASTIVE_SEARCH: "it compares candidates with the past keys, which a recurrent state does not keep",
    GenerationMode.ASSISTED_GENERATION: "it rolls the cache back past rejected draft tokens; a recurrent state cannot go back",
    GenerationMode.DOLA_GENERATION: "it reads every layer's hidden states, which the compiled step does not return",
    GenerationMode.GROUP_BEAM_SEARCH: "transformers runs it from a hub repository (custom_generate), which rnnify does not fetch",
    GenerationMode.CONSTRAINED_BEAM_SEARCH: "transformers runs it from a hub repository (custom_generate), which rnnify does not fetch",
}


class RnnifyConfig(PreTrainedConfig):
    """``config.json`` of a converted directory: the source config whole, and rnnify's model type."""

    model_type = hf_files.MODEL_TYPE
    source_config: dict | None = None
    vocab_size: int = 0


def _check_positions(
    position_ids: torch.Tensor | None, state: RecurrentState, attention_mask: torch.Tensor | None, length: int
) -> None:
    """Refuse ``position_ids`` other than the ones the state gives its next ``length`` tokens: it
    numbers its real tokens itself, continuing from those it has read (padding, ``attention_mask``
    0, takes none, and any id passed for it is left alone)."""
    if position_ids is None:
        return
    real = None if attention_mask is None else attention_mask.to(state.positions.device, torch.bool)
    own = state.next_positions(length, real).to(position_ids.device)
    padding = torch.zeros_like(own, dtype=torch.bool) if real is None else ~real.to(position_ids.device)
    if position_ids.shape[-1] != length or not bool(((position_ids == own) | padding).all()):
        raise ValueError(
            "position_ids: an rnnify model numbers positions from its state (the tokens it has read, "
            "padding excluded by attention_mask); leave position_ids out"
        )


class RecurrentCache(Cache):
    """transformers' cache over a ``RecurrentState``.

    ``length`` counts the columns of ``input_ids`` already read (padding included), which is how
    generation tells the new tokens of a call from those the state holds.
    """

    def __init__(self, state: RecurrentState | None = None, length: int = 0):
        super().__init__(layers=[])
        self.state = state
        self.length = length

    def __repr__(self) -> str:
        rows = None if self.state is None else self.state.batch_size
        return f"RecurrentCache(rows={rows}, length={self.length})"

    @property
    def is_croppable(self) -> bool:
        return False  # a recurrent state cannot drop its last tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def _select(self, rows: torch.Tensor) -> None:
        if self.state is not None:
            rows = rows.to(self.state.positions.device)
            self.state = RecurrentState(
                tuple(t.index_select(0, rows) for t in self.state.tensors),
                self.state.positions.index_select(0, rows),
                self.state.model_uid,
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues the beam ``beam_idx[i]``."""
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            rows = torch.arange(self.state.batch_size, device=self.state.positions.device)
            self._select(rows.repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("a recurrent state cannot drop tokens it has read")

    def reset(self) -> None:
        self.state, self.length = None, 0


def _read_json(files: dict[str, bytes], name: str) -> dict[str, Any] | None:
    try:
        return json.loads(files[name]) if name in files else None
    except (ValueError, RecursionError):
        return None


# transformers' placement strategies; with one device to place on they all mean that device
_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _device(device_map: Any) -> torch.device:
    """The one device ``device_map`` puts the model on: None (the CPU), a device (``"cuda:1"``, ``1``,
    a ``torch.device``), a strategy such as ``"auto"`` (CUDA when available, else the CPU), or a dict
    mapping every module to one device (``{"": "cpu"}``, as lm-eval and accelerate pass it)."""
    if device_map is None:
        return torch.device("cpu")
    if isinstance(device_map, str) and device_map in _STRATEGIES:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    devices = {_one_device(value) for value in values}
    if len(devices) != 1 or None in devices:
        raise RnnifyError(
            f"device_map={device_map!r}: an rnnify model runs on one device; give one, such as 'cuda:0', 'cpu' "
            "or {'': 'cuda:0'}"
        )
    return devices.pop()


def _one_device(value: Any) -> torch.device | None:
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"cuda:{value}"  # transformers' GPU index
    if not isinstance(value, (str, torch.device)):
        return None
    try:
        device = torch.device(value)
    except RuntimeError:  # "disk" (offloading), a typo
        return None
    return None if device.type == "meta" else device


class RnnifyForCausalLM(PreTrainedModel, GenerationMixin):
    """A converted model behind transformers' causal-LM interface; build it with ``from_pretrained``
    (a converted directory) or ``from_rnnify`` (a ``RecurrentModel`` in memory)."""

    config_class = RnnifyConfig
    base_model_prefix = "rnn"
    main_input_name = "input_ids"

    def __init__(self, config: RnnifyConfig, recurrent: RecurrentModel | None = None):
        super().__init__(config)
        self.post_init()  # before the recurrent model joins: there is nothing to initialise
        if recurrent is None:
            raise RnnifyError("build RnnifyForCausalLM with from_pretrained(directory) or from_rnnify(model)")
        self.rnn = recurrent

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def from_rnnify(cls, model: RecurrentModel) -> "RnnifyForCausalLM":
        """Wrap a converted model; its source config and generation config come with it."""
        source = _read_json(model.files, hf_files.CONFIG_FILE) or {"vocab_size": model.manifest.vocab_size}
        wrapped = hf_files.wrap_config(json.dumps(source).encode(), model.manifest.to_json())
        config = RnnifyConfig.from_dict(json.loads(wrapped))
        wrapper = cls(config, model)
        generation = _read_json(model.files, "generation_config.json")
        wrapper.generation_config = (
            GenerationConfig.from_dict(generation) if generation else GenerationConfig.from_model_config(config)
        )
        return wrapper

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | Path,
        *model_args: Any,
        device_map: Any = None,
        dtype: Any = None,
        torch_dtype: Any = None,
        kernels: str | None = None,
        verify: bool = True,
        trust_compiled_step: bool = False,
        expected_digest: str | None = None,
        **kwargs: Any,
    ) -> "RnnifyForCausalLM":
        """Load a converted directory with ``rnnify.load`` (``kernels``, ``verify``, ``trust_compiled_step``
        and ``expected_digest`` as it takes them). ``device_map`` names one device: a device, ``"auto"``
        (CUDA when available, else the CPU) or a map of everything to one device (``{"": "cpu"}``, as
        lm-eval's ``hf`` model passes); a map over several devices is refused. ``dtype`` must be the one
        the model was converted in (or ``"auto"``); hub options are ignored: rnnify reads local
        directories only."""
        import rnnify

        model = rnnify.load(
            pretrained_model_name_or_path,
            device=_device(device_map),
            kernels=kernels,
            verify=verify,
            trust_compiled_step=trust_compiled_step,
            expected_digest=expected_digest,
        )
        wanted = dtype if dtype is not None else torch_dtype
        if wanted not in (None, "auto") and str(wanted).removeprefix("torch.") != model.manifest.dtype:
            raise RnnifyError(
                f"dtype={wanted}: {pretrained_model_name_or_path} was converted in {model.manifest.dtype}; "
                f"convert again with --dtype {str(wanted).removeprefix('torch.')} or drop dtype"
            )
        return cls.from_rnnify(model)

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:
        """Save as an rnnify directory (``RecurrentModel.save``); transformers' options do not apply."""
        self.rnn.save(save_directory)

    # -- running ----------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache: RecurrentCache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Read ``input_ids`` (continuing ``cache``'s state); logits, the loss on ``labels``, the new cache.

        ``attention_mask`` may cover earlier tokens too (as in ``generate``): its last columns are used.
        ``past_key_values`` is the cache's name before transformers 5.24, which decode loops still pass.
        ``position_ids`` are the state's own (the tokens it has read): others are refused, not ignored.
        """
        _refuse_other_outputs(kwargs.get)
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("inputs_embeds: an rnnify model reads token ids; pass input_ids")
        if kwargs.get("past_key_values") is not None:
            if cache is not None:
                raise ValueError("cache and past_key_values name the same state: pass one")
            cache = kwargs["past_key_values"]
        if cache is not None and not isinstance(cache, RecurrentCache):
            raise ValueError(f"cache must be a RecurrentCache (an rnnify model's state), got {type(cache).__name__}")
        state = cache.state if cache is not None else None
        state = state if state is not None else self.rnn.init_state(input_ids.shape[0])
        if attention_mask is not None:
            attention_mask = attention_mask[:, -input_ids.shape[1] :]
        _check_positions(kwargs.get("position_ids"), state, attention_mask, input_ids.shape[1])
        try:
            logits, state = self.rnn(input_ids, state, attention_mask)
        except RnnifyError as exc:
            raise ValueError(str(exc)) from exc
        loss = None
        if labels is not None:  # transformers' causal-LM loss (ForCausalLMLoss): shifted, float32, -100 ignored
            options = {key: kwargs[key] for key in ("num_items_in_batch", "shift_labels") if key in kwargs}
            loss = self.loss_function(logits=logits.contiguous(), labels=labels, vocab_size=logits.shape[-1], **options)
        new_cache = None
        if use_cache is not False:
            new_cache = cache if cache is not None else RecurrentCache()
            new_cache.state, new_cache.length = state, new_cache.length + input_ids.shape[1]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=new_cache)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        cache: RecurrentCache | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The tokens the state has not read yet; the mask only for a prompt (a decoded token is always real)."""
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("inputs_embeds: an rnnify model reads token ids; pass input_ids")
        read = cache.length if cache is not None else 0
        if read >= input_ids.shape[1]:
            raise ValueError(
                f"the cache has read {read} tokens but input_ids has {input_ids.shape[1]}: nothing new to read"
            )
        inputs = {"input_ids": input_ids[:, read:], "cache": cache}
        if attention_mask is not None and next_sequence_length != 1:
            inputs["attention_mask"] = attention_mask[:, read:]
        for key in ("use_cache", "logits_to_keep"):
            if key in kwargs:
                inputs[key] = kwargs[key]
        return inputs

    # -- what generate may and may not do ----------------------------------------------------

    def generate(
        self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs: Any
    ) -> Any:
        """transformers' ``generate``, over a ``RecurrentCache``, after refusing what a recurrent state cannot do
        (``REFUSED``, ``cache_implementation``, ``prefill_chunk_size``, a cache of another kind).

        Public API only, so that it does not break when transformers' internals move: the options are read
        from copies (``GenerationConfig.get_generation_mode``) before transformers reads them, and the cache
        goes in as ``cache=``, as a user's would (transformers' default ``DynamicCache`` needs the attention
        layers' shapes, which ``RnnifyConfig`` does not have)."""
        options = self._generation_options(generation_config, kwargs)
        _refuse_other_outputs(lambda flag: getattr(options, flag, None))  # generate would drop them quietly
        if kwargs.get("custom_generate") is None:
            mode = options.get_generation_mode(kwargs.get("assistant_model"))
            if mode not in SUPPORTED_MODES:
                why = REFUSED.get(mode, "it is not one of the modes rnnify supports")
                raise ValueError(
                    f"{mode.value} cannot run on an rnnify model: {why}. Use greedy decoding, sampling "
                    "(do_sample=True) or beam search (num_beams > 1)"
                )
        if options.cache_implementation not in (None, "dynamic", "hybrid"):  # "hybrid": transformers' old default
            raise ValueError(
                f"cache_implementation={options.cache_implementation!r}: an rnnify model keeps its own "
                "recurrent state; leave cache_implementation unset"
            )
        if options.prefill_chunk_size is not None:
            raise ValueError(
                "prefill_chunk_size: an rnnify model reads a prompt in one prefill already; leave it unset"
            )
        names = [name for name in ("cache", "past_key_values", "cache_params") if kwargs.get(name) is not None]
        for name in names:
            if not isinstance(kwargs[name], RecurrentCache):
                raise ValueError(
                    f"{name} must be a RecurrentCache (an rnnify model's state), got {type(kwargs[name]).__name__}"
                )
        if getattr(options, "is_assistant", None):  # set by transformers on the assistant's own config
            raise ValueError(
                "an rnnify model cannot be an assistant_model: assisted decoding drops the draft tokens the "
                "main model rejects, and a recurrent state cannot drop tokens it has read"
            )
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask[:, -1].all()):
            raise ValueError(RIGHT_PADDED)  # transformers only warns, and decodes from the padding
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        self._check_room(prompt, mask, options)
        if not names and options.use_cache is not False:
            kwargs["cache"] = RecurrentCache()
            if options.cache_implementation == "dynamic":  # the default cache, here the recurrent state; transformers
                kwargs["cache_implementation"] = None  # refuses it beside a cache (it unsets "hybrid" itself)
        return super().generate(inputs, generation_config, **kwargs)

    def _check_room(self, input_ids: Any, attention_mask: torch.Tensor | None, options: GenerationConfig) -> None:
        """Refuse, before the prompt is read, a generation that would pass the positions the model has
        (``RecurrentModel.check_room``): transformers would stop part way with the error of a step.
        The new tokens and the prompt's mask are counted as transformers counts them: ``max_new_tokens``,
        else ``max_length`` less the prompt, else its default; padding found by ``pad_token_id`` where no
        mask is given and the padding is not an end of sequence."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return  # generate says what is wrong with it
        length = input_ids.shape[1]
        if options.max_new_tokens is not None:
            new = options.max_new_tokens
        elif options.max_length is not None:
            new = options.max_length - length
        else:
            table = getattr(self.config, "max_position_embeddings", None)
            new = _DEFAULT_MAX_LENGTH if table is None else min(length + _DEFAULT_MAX_LENGTH, table) - length
        if attention_mask is None and isinstance(options.pad_token_id, int):
            if options.pad_token_id not in token_ids(options.eos_token_id) and bool(
                (input_ids == options.pad_token_id).any()
            ):
                attention_mask = input_ids != options.pad_token_id
        if new > 0:
            try:
                self.rnn.check_room(input_ids, attention_mask, new)
            except RnnifyError as exc:
                raise ValueError(str(exc)) from exc

    def _generation_options(self, generation_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
        """The options ``generate`` runs with: ``generation_config`` (else the model's), its unset ones
        from the model's, then ``kwargs``; a copy, so nothing the caller passed changes."""
        options = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        for key, value in self.generation_config.to_dict().items():
            if hasattr(options, key) and getattr(options, key) is None:
                setattr(options, key, value)
        for key, value in kwargs.items():
            if hasattr(options, key):
                setattr(options, key, value)
        return options


def _refuse_other_outputs(get: Any) -> None:
    """Raise where ``get(flag)`` asks for attention weights or hidden states, which a converted
    model does not compute (its cells keep state, not attention maps)."""
    for flag in ("output_attentions", "output_hidden_states"):
        if get(flag):
            raise ValueError(f"{flag}=True: an rnnify model returns logits only")


def register() -> None:
    """Let the Auto classes load converted directories without ``trust_remote_code``."""
    AutoConfig.register(hf_files.MODEL_TYPE, RnnifyConfig, exist_ok=True)
    AutoModelForCausalLM.register(RnnifyConfig, RnnifyForCausalLM, exist_ok=True)


register()
