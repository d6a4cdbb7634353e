"""Text in, text out for a ``RecurrentModel``: ``model.generate("text")``, ``model.stream``, ``model.chat``.

The model reads and writes token ids; this layer adds its tokenizer (``RecurrentModel.tokenizer``),
the ids that end generation (``eos_ids``), chat messages through the tokenizer's template
(``rnnify.chat``), and decoding as transformers' ``TextStreamer`` does it: a word is held back until
a space or a line ends it, so a character whose bytes span several tokens comes out whole. A
returned text is the streamed pieces joined, so the two never differ. The sampling options are
``RecurrentModel.generate``'s, with the defaults its signature states.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import TextStreamer

from rnnify.choices import CHAT_MAX_NEW_TOKENS
from rnnify.errors import RnnifyError
from rnnify.runtime.tokenizer import check_template, encode, load_tokenizer, render, tokenizer_dir, tokenizer_places

if TYPE_CHECKING:  # annotations only: the model calls this module, which must not import it back
    from rnnify.runtime.model import RecurrentModel

__all__ = ["chat", "eos_ids", "find_tokenizer", "generate_text", "stream"]

# generate's options that describe token-id batches, not one text prompt
_IDS_ONLY = ("attention_mask", "pad_token_id", "streamer")


def find_tokenizer(model: RecurrentModel) -> Any:
    """The tokenizer in ``model``'s directory or its source's (``data.tokenizer_dir``), or None."""
    directory = tokenizer_dir(model)
    if directory is None:
        return None
    return load_tokenizer(directory, "assign one to model.tokenizer, or pass token ids")


def eos_ids(model: RecurrentModel, tokenizer: Any = None) -> list[int]:
    """The ids that end generation: the generation config's ``eos_token_id`` (else the model config's),
    and the tokenizer's eos token when those leave it out (a chat model's config may name only the end
    of a turn, its tokenizer the end of the text)."""
    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads(model.files.get(name, b"{}")).get("eos_token_id")
        except (ValueError, AttributeError, RecursionError):
            value = None
        if value is not None:
            eos = [value] if isinstance(value, int) else value
            if not isinstance(eos, list) or not all(type(i) is int for i in eos):
                raise RnnifyError(f"{name}: eos_token_id must be a token id or a list of them, got {value!r:.64}")
            break
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


def generate_text(model: RecurrentModel, prompt: str, options: dict[str, Any]) -> str:
    """What ``model.generate(prompt, **options)`` returns for a string prompt: the text after it."""
    return "".join(stream(model, prompt, options))


def chat(model: RecurrentModel, messages: list[dict[str, Any]], options: dict[str, Any]) -> str:
    """The reply to chat ``messages`` (``model.chat``)."""
    if not _is_messages(messages):
        raise RnnifyError(
            'chat takes a list of messages like [{"role": "user", "content": "..."}]; '
            "for a plain text prompt use generate"
        )
    return "".join(stream(model, messages, options))


def stream(model: RecurrentModel, prompt: str | list[dict[str, Any]], options: dict[str, Any]) -> Iterator[str]:
    """The text after ``prompt``, piece by piece as it decodes (``model.stream``). The prompt and the
    options are checked now, the tokens decoded as the pieces are read."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise RnnifyError(
            f"this model has no tokenizer (no tokenizer files in {tokenizer_places(model)}); "
            "assign one to model.tokenizer, or pass token ids"
        )
    ids = torch.tensor([_prompt_ids(tokenizer, prompt)], device=model.device)
    if _is_messages(prompt):  # a reply, not generate's continuation
        options = {"max_new_tokens": CHAT_MAX_NEW_TOKENS, **options}
    steps = model._new_tokens(ids, **_options(model, tokenizer, options))
    return _pieces(steps, tokenizer)


def _is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and bool(prompt)
        and all(isinstance(message, Mapping) and "role" in message for message in prompt)
    )


def _prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """A string as the tokenizer reads text (its own special tokens added), or chat messages as the
    template writes them with the assistant header (the template writes the special tokens); a last
    message of the assistant's is continued, as transformers' text-generation pipeline does."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=True).input_ids
        if not ids:
            raise RnnifyError("the prompt is empty: give some text")
        return ids
    if _is_messages(prompt):
        check_template(tokenizer)
        messages = list(prompt)
        reply = messages[-1]["role"] == "assistant"
        return encode(tokenizer, render(tokenizer, messages, not reply, continue_final_message=reply))
    raise RnnifyError(
        f'a text prompt is a string or a list of messages like [{{"role": "user", "content": "..."}}], '
        f"got {type(prompt).__name__}"
    )


def generate_options(generate: Callable[..., Any], text: bool) -> list[str]:
    """The options ``generate`` (``RecurrentModel.generate``) takes, read from its signature so that
    they are stated once; those of a text prompt where ``text``."""
    signature = inspect.signature(generate)
    return [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "input_ids")
        and parameter.kind is not parameter.VAR_KEYWORD
        and not (text and name in _IDS_ONLY)
    ]


def unknown_option(name: str, generate: Callable[..., Any], text: bool) -> RnnifyError:
    """The error for an option ``generate`` does not take, naming those it does (a text prompt's where
    ``text``) and where transformers' own options run."""
    return RnnifyError(
        f"unknown option {name!r}; {'a text prompt' if text else 'generate'} takes "
        f"{', '.join(generate_options(generate, text))}; transformers' own generate (penalties, beam search, ...) runs on "
        "the directory loaded with AutoModelForCausalLM (docs/interop.md)"
    )


def _options(model: RecurrentModel, tokenizer: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``RecurrentModel._new_tokens``: those given, ``generate``'s defaults for the rest,
    the model's end ids unless ``eos_token_id`` is given. Options that only token-id batches have are
    refused."""
    names = generate_options(type(model).generate, text=False)
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise unknown_option(unknown[0], type(model).generate, text=True)
    signature = inspect.signature(type(model).generate)
    bound = signature.bind_partial(**options)
    bound.apply_defaults()
    values = {name: value for name, value in bound.arguments.items() if name in names}
    for name in _IDS_ONLY:
        if values[name] is not None:
            instead = "; model.stream(text) gives the text as it decodes" if name == "streamer" else ""
            raise RnnifyError(f"{name} applies to token-id prompts, not text; leave it out{instead}")
    del values["streamer"]  # generate's own: the pieces are the text's stream
    if values["eos_token_id"] is None:
        values["eos_token_id"] = eos_ids(model, tokenizer) or None
    return values


class _Pieces(TextStreamer):
    """transformers' ``TextStreamer``, keeping its finished text for ``_pieces`` instead of printing it."""

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer, skip_special_tokens=True)
        self.ready: list[str] = []

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.ready.append(text)

    def take(self) -> list[str]:
        ready, self.ready = self.ready, []
        return ready


def _pieces(steps: Iterator[torch.Tensor], tokenizer: Any) -> Iterator[str]:
    streamer = _Pieces(tokenizer)
    for token in steps:
        streamer.put(token.cpu())
        yield from streamer.take()
    streamer.end()
    yield from streamer.take()
