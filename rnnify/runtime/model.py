"""``RecurrentModel``: a compiled step graph plus the bookkeeping that makes it a language model.

The graph computes ``(input_ids, position_ids, attention_mask, *state) -> (logits, *state)``.
This class owns what the graph cannot know: position ids (continued from the state, and counting
only real tokens so left-padded rows match unpadded ones), input and state checks, and decoding.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch import nn

from rnnify.cells import Cell
from rnnify.choices import MAX_NEW_TOKENS, TEMPERATURE, TOP_K
from rnnify.errors import PositionError, RnnifyError, RnnifyWarning
from rnnify.kernels.utils import check_kernels, check_runnable
from rnnify.runtime.devices import retarget_devices
from rnnify.runtime.direct_calls import direct_forward
from rnnify.runtime.head import head_input_size, split_head
from rnnify.runtime.manifest import Manifest
from rnnify.runtime.new_shapes import NewShapes
from rnnify.runtime.sampling import check_sampling, next_token, token_ids
from rnnify.runtime.size_guard import check_step, running
from rnnify.runtime.state import RecurrentState, check_inputs, check_state
from rnnify.runtime.weight_layout import lay_out_linear_weights

__all__ = ["RecurrentModel"]

# generation continues each row from its last column: padding there would be read as the prompt's end
RIGHT_PADDED = (
    "attention_mask: a row ends in padding, and each row continues from its last column: pad on the left "
    "(tokenizer.padding_side = 'left')"
)

_NOT_LOADED = object()  # ``RecurrentModel.tokenizer`` before its first use
# rows from which a donated step writes states in place, eagerly, rather than run the compiled step
# (``RecurrentModel.step``; benchmarks/donated_step.py, docs/performance.md)
IN_PLACE_FROM_ROWS = 8


class RecurrentModel(nn.Module):
    """A converted model that reads tokens into a recurrent state and decodes one token at a time.

    ``prefill``, ``step`` and ``generate`` run under ``torch.inference_mode`` (a CPU's decode step is
    mostly per-op overhead, which that mode trims: docs/performance.md): what they return are inference
    tensors, which later in-place updates or autograd outside that mode refuse; ``.clone()`` one
    for those. Calling the model itself (``forward``) keeps autograd, for training.
    """

    def __init__(self, graph: torch.fx.GraphModule, manifest: Manifest, files: dict[str, bytes] | None = None):
        super().__init__()
        self.graph = graph
        self.manifest = manifest
        self.files = dict(files or {})  # source config and tokenizer files, written beside the weights
        self.path: Path | None = None  # the directory this model was loaded from, if any
        self._warned_positions = False
        self._step_graph: Any = None  # set by compile_step
        self._step_package: Any = None  # a ``runtime.aot.StepPackage``, set by ``rnnify.load``
        self._cuda_graphs = False  # compile_step on CUDA: the step replays as a CUDA graph
        self._direct: tuple[Any, str, dict] | None = None  # (graph, its code, direct forwards of it and its halves)
        self._tokenizer: Any = _NOT_LOADED  # see ``tokenizer``
        self.guard_budget: tuple[int, int] | None = None  # one token's, where sizes follow data (``size_guard``)
        self.growth: int | None = None  # set by ``rnnify.load``: state bytes a token adds (``size_guard.check_step``)
        self.new_shapes: NewShapes | None = None  # set by ``rnnify.load`` where sizes follow shapes alone

    # -- description ------------------------------------------------------------------------

    @property
    def target(self) -> str:
        return self.manifest.target

    @property
    def target_in_words(self) -> str:
        """The target as the commands' headers name it: with the number of ``--layers`` rules that give
        layers or heads another (``--to auto``'s choice is such rules), so a per-head map is not
        called a plain window model."""
        rules = len(self.manifest.layers or ())
        return self.target if not rules else f"{self.target} + {rules} layer rule{'s' if rules > 1 else ''}"

    @property
    def cells(self) -> list[Cell]:
        """The cells in state order."""
        return [self.graph.get_submodule(entry.module) for entry in self.manifest.cells]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest.dtype)

    @property
    def device(self) -> torch.device:
        return next(self.graph.parameters()).device

    @property
    def kernels(self) -> str:
        """Backend of the cells' fused ops (``use_kernels``), or ``"none"``: the cells' own PyTorch forms."""
        return self.manifest.kernels

    def use_kernels(self, kernels: str) -> "RecurrentModel":
        """Run the cells' fused ``rnnify.kernels`` ops with backend ``kernels``: ``"auto"`` (Triton on
        CUDA; elsewhere, per phase, the faster of the ops' PyTorch reference and the cell's own form),
        ``"triton"`` or ``"reference"``; ``"none"`` runs the
        cells' own PyTorch forms. Cells without a fused form are unaffected. Recorded in the manifest."""
        check_kernels(kernels)
        for entry, cell in zip(self.manifest.cells, self.cells):
            entry.kernels = cell.use_kernels(kernels)
        self.manifest.kernels = kernels
        return self

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply``, what ``to``, ``cuda``, ``half`` and a wrapper's ``to`` run: the graph's
        device constants follow the weights (``retarget_devices``), linear weights take the layout
        their device reads fastest (``runtime.weight_layout``), and a change of dtype is refused, as
        the graph computes in the dtype it was converted in (refused before anything moves here;
        modules beside this one, in a parent's ``to``, may have moved already)."""
        moved = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        dtype = getattr(moved, "dtype", self.dtype)
        if dtype != self.dtype:
            name = str(dtype).removeprefix("torch.")
            raise RnnifyError(
                f"this model was converted in {self.manifest.dtype} and runs in it; for {name}, convert "
                f"again with --dtype {name} (rnnify.convert(..., dtype={name!r}))"
            )
        before = self.device
        super()._apply(fn, recurse)
        if self.device != before:
            retarget_devices(self.graph, self.device)
        lay_out_linear_weights(self.graph)
        return self

    @property
    def step_package(self) -> Any:
        """The decode step compiled ahead of time that one-token calls run (``rnnify.runtime.aot``,
        found by ``rnnify.load`` in this machine's cache or, trusted, in the directory:
        ``runtime.step_cache``), or None: none was found, or the graph or its weights were replaced
        since it was loaded."""
        package = self._step_package
        return package if package is not None and package.serves(self) else None

    @property
    def constant_memory(self) -> bool:
        """True when the state does not grow with the context."""
        return all(not c.grows_with_context or c.spec.keys_read is not None for c in self.cells)

    def state_nbytes(self, length: int, batch_size: int = 1) -> int:
        """Bytes of state per ``batch_size`` sequences after ``length`` tokens."""
        cells = sum(c.state_nbytes(length, batch_size, self.dtype) for c in self.cells)
        return cells + batch_size * torch.empty((), dtype=torch.long).element_size()

    def weight_nbytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every tensor, but one row of a table only looked up."""
        read: dict[int, int] = {}  # storage pointer -> bytes read
        for node in self.graph.graph.nodes:
            if node.op != "get_attr":
                continue
            tensor = operator.attrgetter(node.target)(self.graph)
            if not isinstance(tensor, torch.Tensor):
                continue
            lookup_only = all(
                user.op == "call_function" and user.target is torch.ops.aten.embedding.default and user.args[0] is node
                for user in node.users
            )
            nbytes = tensor[0].nbytes if lookup_only and tensor.dim() == 2 else tensor.nbytes
            key = tensor.untyped_storage().data_ptr()
            read[key] = max(read.get(key, 0), nbytes)
        return sum(read.values())

    # -- state ------------------------------------------------------------------------------

    def init_state(self, batch_size: int = 1) -> RecurrentState:
        """The state of ``batch_size`` empty sequences."""
        device, dtype = self.device, self.dtype
        tensors = tuple(t for c in self.cells for t in c.init_state(batch_size, device, dtype))
        positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        return RecurrentState(tensors, positions, self.manifest.uid)

    # -- running ----------------------------------------------------------------------------

    def _position_ids(self, input_ids: torch.Tensor, state: RecurrentState, mask: torch.Tensor | None) -> torch.Tensor:
        """Position ids of the new tokens, checking token ids and positions with one device-to-host read.

        One read instead of one per check: on a GPU each read waits for the device, once per step.
        """
        position_ids = state.next_positions(input_ids.shape[1], mask)
        if not input_ids.numel():
            return position_ids
        low, high, last = torch.stack([input_ids.min(), input_ids.max(), position_ids.max()]).tolist()
        vocab = self.manifest.vocab_size
        if low < 0 or high >= vocab:
            raise RnnifyError(f"token ids must be in [0, {vocab}), got {low}..{high}")
        hard = self.manifest.token_limit()
        if hard is not None and last >= hard[0]:
            raise PositionError(
                f"position {last} is past the {hard[0]} {hard[1]} ({self.manifest.source or 'this model'}); "
                "it cannot represent longer sequences"
            )
        limit = self.manifest.positions.get("limit")
        if limit is not None and last >= limit:
            if not self._warned_positions:
                self._warned_positions = True
                memory = " (memory stays constant)" if self.constant_memory else ""
                warnings.warn(
                    f"decoding past max_position_embeddings={limit}: the model was not trained this far, "
                    f"quality may degrade{memory}",
                    RnnifyWarning,
                    stacklevel=3,
                )
        return position_ids

    def forward(
        self, input_ids: torch.Tensor, state: RecurrentState, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RecurrentState]:
        """One call of the step graph: read ``input_ids`` into ``state``; returns (logits, new state)."""
        return self._read(input_ids, state, attention_mask, hidden=False)

    def _read(
        self,
        input_ids: torch.Tensor,
        state: RecurrentState,
        attention_mask: torch.Tensor | None,
        hidden: bool,
        eager: bool = False,
    ) -> tuple[torch.Tensor, RecurrentState]:
        """``forward``, or with ``hidden`` the body's hidden states in place of the logits
        (``prefill_hidden``); ``eager``: through the graph's own code, never a compiled step."""
        mask = check_inputs(input_ids, attention_mask)
        check_state(state, self.manifest.uid, input_ids.shape[0])
        check_runnable(self.kernels, input_ids.device)
        position_ids = self._position_ids(input_ids, state, mask)
        if mask is None:
            graph_mask = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
            positions = state.positions + input_ids.shape[1]
        else:
            graph_mask, positions = mask, state.positions + mask.long().sum(1)
        inputs = (input_ids, position_ids, graph_mask, *state.tensors)
        # where sizes follow data, every call is guarded, and no compiled step (which would not keep the guard) runs
        part = "body" if hidden and self._direct_forward("body") is not None else "graph"
        with running(self, input_ids.numel()):
            out = self.new_shapes and self.new_shapes.first_call(self.graph, part, input_ids, inputs)
            if out is None:
                out = self._call(inputs, hidden, eager, compiled=self.guard_budget is None)
            logits, *tensors = out
        if self.growth is not None:
            check_step(str(self.path), input_ids, logits, state.tensors, tensors, self.growth)
        return logits, RecurrentState(tuple(tensors), positions, state.model_uid)

    def _call(self, inputs: tuple, hidden: bool, eager: bool, compiled: bool) -> tuple:
        """(logits or hidden states, *state): see ``_read``; ``compiled``: a compiled step may run."""
        one_token = compiled and inputs[0].shape[1] == 1
        body = self._direct_forward("body") if hidden else None
        if body is not None:
            return body(self.graph, *inputs)  # the hidden states: the head is left out
        if eager:
            return self._direct_forward()(self.graph, *inputs)
        if self._step_graph is not None and one_token:
            if self._cuda_graphs:
                # a replay overwrites the last one's outputs: copy them out, so every state stays valid
                torch.compiler.cudagraph_mark_step_begin()
                return tuple(t.clone() for t in self._step_graph(*inputs))
            return self._step_graph(*inputs)
        if torch.is_grad_enabled():  # training: through the module, its hooks and wrappers
            return self.graph(*inputs)
        if one_token and self.step_package is not None:
            return self._step_package(*inputs)  # compiled ahead of time (``runtime.aot``)
        return self._direct_forward()(self.graph, *inputs)

    def _direct_forward(self, part: str = "graph") -> Any:
        """The graph's forward with direct torch calls (``runtime.direct_calls``), regenerated
        whenever the graph is replaced or recompiled; with ``part`` "body" or "head", that of the
        graph's half (``runtime.head``), or None when the graph's head is not split."""
        graph, code = self.graph, self.graph.code
        if self._direct is None or self._direct[0] is not graph or self._direct[1] is not code:
            self._direct = (graph, code, {"graph": direct_forward(graph)})
        forwards = self._direct[2]
        if part not in forwards:
            halves = split_head(graph.graph)
            forwards["body"], forwards["head"] = (direct_forward(graph, h) for h in halves) if halves else (None, None)
        return forwards[part]

    @property
    def hidden_size(self) -> int:
        """Width of what ``prefill_hidden`` returns per position: the head's input, or the vocabulary
        when the graph's head is not split."""
        head = self._direct_forward("head")
        return self.manifest.vocab_size if head is None else head_input_size(self.graph)

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of hidden states from ``prefill_hidden`` (any leading shape)."""
        head = self._direct_forward("head")
        if head is None:
            return hidden
        with running(self, hidden.shape[:-1].numel()):
            out = self.new_shapes and self.new_shapes.first_call(self.graph, "head", hidden, (hidden,))
            return head(self.graph, hidden) if out is None else out

    @torch.inference_mode()
    def prefill_hidden(
        self, input_ids: torch.Tensor, state: RecurrentState, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, RecurrentState]:
        """``prefill`` without the language-model head: the hidden state at every position, which
        ``head`` turns into logits where they are wanted (``runtime.head``; for a graph whose head
        is not split, the logits themselves and ``head`` returns them as they are)."""
        return self._read(input_ids, state, attention_mask, hidden=True)

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        state: RecurrentState | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, RecurrentState]:
        """Read a prompt (continuing from ``state`` if given); logits for every position, or with
        ``last_only`` for the last one (``[B, 1, V]``; where the graph's head is split,
        ``runtime.head``, it runs on that position alone).

        Rows of different lengths are left-padded with ``attention_mask`` 0 on the padding.
        """
        if state is None:
            state = self.init_state(
                input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 else 1
            )
        if not last_only or input_ids.shape[1] == 1:  # one token: the (compiled) step's own path
            logits, state = self(input_ids, state, attention_mask)
            return (logits[:, -1:] if last_only else logits), state
        hidden, state = self.prefill_hidden(input_ids, state, attention_mask)
        return self.head(hidden[:, -1:]), state

    @torch.inference_mode()
    def step(
        self, input_ids: torch.Tensor, state: RecurrentState, *, donate: bool = False
    ) -> tuple[torch.Tensor, RecurrentState]:
        """Read one token per row (``input_ids [B, 1]``); logits ``[B, 1, V]`` and the new state.

        With ``donate`` the step may write the new state into ``state``'s tensors (the state it
        returns then shares them), so ``state`` must not be used again, nor anything sharing its
        tensors (a ``state.to`` the same device); after a donated step that raised, it is undefined.
        For a caller that keeps only the newest state (``generate``, vLLM's plugin), it saves copying
        each window's ring every token. A step that writes in place runs eagerly (a compiled step
        cannot write into its inputs), so it is taken only where a cell would write in place
        (``Cell.overwrites_state``) and that is the faster step: without a compiled step, or from
        ``IN_PLACE_FROM_ROWS`` rows (below, the compiled step's fewer ops weigh more than the copy
        it makes). One donated step at a time per model: the cells hold the permission while it runs."""
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
            input_ids = input_ids[:, None]
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise RnnifyError("step takes one token per row: input_ids of shape [batch, 1]")
        compiled = self._step_graph is not None or self.step_package is not None
        if not donate or (compiled and input_ids.shape[0] < IN_PLACE_FROM_ROWS):
            return self(input_ids, state)
        # every cell, a head split's parts too (a walk of the graph's modules: a small share of a step)
        writers = [m for m in self.graph.modules() if isinstance(m, Cell) and m.overwrites_state(input_ids)]
        if not writers:
            return self(input_ids, state)
        try:
            for cell in writers:
                cell.overwrite_state = True
            return self._read(input_ids, state, None, hidden=False, eager=True)
        finally:
            for cell in writers:
                cell.overwrite_state = False

    def compile_step(self) -> "RecurrentModel":
        """Run one-token calls through ``torch.compile`` of the graph (static shapes; prefill stays eager).

        On CUDA, a constant-state model's step is also captured as a CUDA graph (inductor's
        ``mode="reduce-overhead"``): one launch a step instead of one per kernel.

        The first step per batch size pays the compile; docs/performance.md weighs it against the
        time it saves. A state that grows (``exact``) changes shape every step, so its shapes are
        left for dynamo to mark dynamic after the first recompile instead of one compile a step.
        Call it once the model is on its device; refused where sizes follow data (``guard_budget``).
        """
        if self.guard_budget is not None:
            raise RnnifyError(f"{self.path}: its step runs eagerly, under a size guard no compiled step keeps")
        self._cuda_graphs = self.device.type == "cuda" and self.constant_memory
        mode = "reduce-overhead" if self._cuda_graphs else None
        self._step_graph = torch.compile(self.graph, dynamic=None if not self.constant_memory else False, mode=mode)
        return self

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | str,
        max_new_tokens: int = MAX_NEW_TOKENS,
        *,
        attention_mask: torch.Tensor | None = None,
        do_sample: bool = False,
        temperature: float = TEMPERATURE,
        top_k: int | None = TOP_K,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        streamer: Any = None,
        **unknown: Any,
    ) -> torch.Tensor | str:
        """Prompt plus up to ``max_new_tokens`` new tokens per row, the options as in transformers' ``generate``.

        A batch of prompts of different lengths is left-padded, with ``attention_mask`` 0 on the padding.
        Rows that produced ``eos_token_id`` are filled with ``pad_token_id`` (default: the eos id)
        and generation stops when every row has finished; token ids given without ``eos_token_id``
        run to ``max_new_tokens`` (fixed-length runs, as benchmarks want), unlike transformers,
        which ends at the generation config's. ``streamer`` gets ``put(ids)`` and ``end()`` calls, as
        transformers' streamers expect.

        A string prompt returns the text generated after it instead (``runtime.text``): read with
        ``tokenizer``, ending at the model's end-of-sequence ids unless ``eos_token_id`` is given.
        """
        if unknown:
            from rnnify.runtime.text import unknown_option

            raise unknown_option(sorted(unknown)[0], type(self).generate, text=isinstance(input_ids, str))
        if not isinstance(input_ids, (str, torch.Tensor)):
            raise RnnifyError(
                f"generate takes a string or token ids ([B, T] LongTensor), got {type(input_ids).__name__}; "
                "chat messages go to chat; texts of a batch go as ids, left-padded, with attention_mask"
            )
        decoding = dict(
            attention_mask=attention_mask,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            seed=seed,
        )
        if isinstance(input_ids, str):
            from rnnify.runtime.text import generate_text

            return generate_text(self, input_ids, dict(decoding, max_new_tokens=max_new_tokens, streamer=streamer))
        steps = self._new_tokens(input_ids, max_new_tokens, **decoding)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        tokens = [input_ids]
        for token in steps:
            tokens.append(token[:, None])
            if streamer is not None:
                streamer.put(token.cpu())
        if streamer is not None:
            streamer.end()
        return torch.cat(tokens, dim=1)

    def _new_tokens(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        attention_mask: torch.Tensor | None,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        eos_token_id: int | list[int] | None,
        pad_token_id: int | None,
        seed: int | None,
    ) -> Iterator[torch.Tensor]:
        """``generate``'s new tokens, one ``[B]`` tensor a step, each decoded when the iterator is read
        (so a text stream, ``runtime.text``, shows each piece as it comes, and stopping reading stops
        decoding). The options, checked now rather than at the first token, mean what they mean
        for ``generate``, which states their defaults."""
        check_sampling(do_sample, temperature, top_k, top_p, seed)
        if max_new_tokens < 0:
            raise RnnifyError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        mask = check_inputs(input_ids, attention_mask)
        if mask is not None and not bool(mask[:, -1].all()):
            raise RnnifyError(RIGHT_PADDED)
        self.check_room(input_ids, attention_mask, max_new_tokens)
        eos = token_ids(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return self._steps(
            input_ids, attention_mask, max_new_tokens, (do_sample, temperature, top_k, top_p, generator), eos, pad
        )

    def check_room(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int) -> None:
        """Refuse, before any token is decoded, a generation that would pass the positions the model
        has (``Manifest.token_limit``): it would stop part way with a PositionError and half a
        reply. The prompt's tokens take positions, and so does every new token but the last,
        which is never read back."""
        hard = self.manifest.token_limit()
        if hard is None:
            return
        mask = check_inputs(input_ids, attention_mask)
        limit, what = hard
        prompt = input_ids.shape[1] if mask is None else int(mask.sum(1).max())
        where = self.manifest.source or "this model"
        if prompt > limit:
            raise PositionError(f"the prompt is {prompt} tokens, past the {limit} {what} ({where})")
        if prompt + max_new_tokens - 1 > limit:
            raise PositionError(
                f"a prompt of {prompt} tokens and {max_new_tokens} new tokens need {prompt + max_new_tokens - 1} "
                f"positions, past the {limit} {what} ({where}); ask for at most {limit - prompt + 1} new tokens"
            )

    @torch.inference_mode()
    def _steps(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int,
        sampling: tuple,
        eos: list[int],
        pad: int,
    ) -> Iterator[torch.Tensor]:
        logits, state = self.prefill(input_ids, attention_mask=attention_mask, last_only=True)
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        eos_ids = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
        for i in range(max_new_tokens):
            token = next_token(logits[:, -1], *sampling)
            token = torch.where(finished, torch.full_like(token, pad), token)
            yield token
            finished |= torch.isin(token, eos_ids)
            if bool(finished.all()) or i == max_new_tokens - 1:
                return
            logits, state = self.step(token[:, None], state, donate=True)

    # -- text -------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of this model's directory, else of its source (``data.tokenizer_dir``),
        loaded on first use with ``trust_remote_code=False``; None when neither holds one. Assign
        another to use it instead."""
        if self._tokenizer is _NOT_LOADED:
            from rnnify.runtime.text import find_tokenizer

            self._tokenizer = find_tokenizer(self)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def stream(self, prompt: str | list[dict[str, Any]], **options: Any) -> Iterator[str]:
        """The text generated after ``prompt`` (a string, or chat messages as ``chat`` takes them), in
        pieces as they decode; they join to what ``generate`` or ``chat`` returns. ``options`` are
        ``generate``'s (``runtime.text``)."""
        from rnnify.runtime.text import stream

        return stream(self, prompt, options)

    def chat(self, messages: list[dict[str, Any]], **options: Any) -> str:
        """The assistant's reply to ``messages`` (``[{"role": "user", "content": "..."}, ...]``), rendered
        with the tokenizer's chat template and its generation prompt (a last message of the assistant's
        is continued). ``options`` are ``generate``'s, up to ``CHAT_MAX_NEW_TOKENS`` new tokens by default."""
        from rnnify.runtime.text import chat

        return chat(self, messages, options)

    @torch.no_grad()
    def calibrate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> "RecurrentModel":
        """Initialise cells that learn from data (``Cell.calibrates``: ``cell.calibrate(q, mask)``, e.g. Aaren's query).

        One prefill over ``input_ids``; each such cell calibrates on the q it receives just before
        it runs, so later layers see the outputs of already calibrated earlier layers.
        """

        def hook(cell, args, kwargs):
            q, _, _, mask = args[:4]
            cell.calibrate(q, mask)

        handles = [cell.register_forward_pre_hook(hook, with_kwargs=True) for cell in self.cells if cell.calibrates]
        if not handles:
            raise RnnifyError(f"no cell of this model learns from calibration data (targets: {self.target})")
        try:
            self.prefill(input_ids, attention_mask=attention_mask)
        finally:
            for handle in handles:
                handle.remove()
        return self

    # -- saving -----------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the model to directory ``path`` (see ``rnnify.runtime.storage``)."""
        from rnnify.runtime.saving import save

        return save(self, Path(path))

    def extra_repr(self) -> str:
        return f"target={self.target}, source={self.manifest.source}, cells={len(self.manifest.cells)}"
