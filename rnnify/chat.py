"""A conversation whose history lives in the recurrent state (``rnnify chat``).

Each turn renders the whole conversation with the tokenizer's chat template, but the model reads
only what it has not read yet: the end of its previous reply as the template closes it, the new
user message and the assistant header. The history is never read again, so a recurrent target
answers the hundredth turn with the memory and the per-token time of the first.

Which tokens are new, in order of preference:

1. ``tokens``: the rendered conversation, tokenized, starts with every token the state has read
   (its own replies included, each with the end token that stopped it). The new tokens are the
   rest, and the state equals that of a fresh prefill of the whole rendered conversation.
2. ``text``: the tokens differ (a reply tokenizes differently when re-read) but the rendered text
   starts with the text read so far; the rest of the text is tokenized on its own.
3. ``messages``: the template renders earlier turns differently once a new message follows (e.g.
   it drops the reasoning of earlier replies, or closes a reply with another end token than the
   one the model produced). The state keeps the history as the model read it and reads the text
   the template adds after the conversation up to the previous reply.

If none applies the turn is refused with a message to ``/reset``.

A model with a last position (learned positions, ``Manifest.token_limit``) holds a conversation up
to it: a message that leaves no room for a reply is refused before it is read, and a reply stops
where the positions end; either way the state is left as the last complete turn made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rnnify.choices import CHAT_MAX_NEW_TOKENS, TEMPERATURE, TOP_K
from rnnify.errors import PositionError, RnnifyError
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.sampling import check_sampling, next_token, token_ids
from rnnify.runtime.state import RecurrentState
from rnnify.runtime.tokenizer import check_template, encode, render

__all__ = ["Chat", "Turn", "check_template", "encode", "render"]


@dataclass(frozen=True)
class Turn:
    """One reply and what the state holds after it."""

    reply: str  # the reply's text as the template will render it (the end token excluded)
    reply_ids: list[int]  # generated ids, the end token included when one stopped the reply
    read: int  # new tokens read before replying
    rule: str  # how they were found: "tokens", "text" or "messages" (see the module docstring)
    tokens: int  # tokens the state has read in this conversation, the reply included
    state_bytes: int  # bytes of the recurrent state now


class Chat:
    """Turns of a conversation with ``model``, its template from ``tokenizer`` and its history in the state.

    A reply ends after ``max_new_tokens`` or at ``eos_token_id`` (default: the tokenizer's eos token);
    the sampling options mean what they mean for ``RecurrentModel.generate``.
    """

    def __init__(
        self,
        model: RecurrentModel,
        tokenizer: Any,
        *,
        system: str | None = None,
        max_new_tokens: int = CHAT_MAX_NEW_TOKENS,
        eos_token_id: int | list[int] | None = None,
        do_sample: bool = False,
        temperature: float = TEMPERATURE,
        top_k: int | None = TOP_K,
        top_p: float | None = None,
        seed: int | None = None,
    ):
        check_sampling(do_sample, temperature, top_k, top_p, seed)
        if max_new_tokens < 1:
            raise RnnifyError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_template(tokenizer)
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.max_new_tokens = max_new_tokens
        self.sampling = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        if eos_token_id is None:
            eos_token_id = tokenizer.eos_token_id
        self.eos = set(token_ids(eos_token_id))
        self.generator = None if seed is None else torch.Generator(device=model.device).manual_seed(seed)
        self.reset()

    def reset(self) -> None:
        """Start a new conversation: no messages but the system prompt, an empty state."""
        self.messages: list[dict[str, str]] = [{"role": "system", "content": self.system}] if self.system else []
        self.state: RecurrentState | None = None
        self.consumed: list[int] = []  # every token the state has read
        self.consumed_text = ""  # the rendered text those tokens stand for
        self._logits: torch.Tensor | None = None  # next-token logits after the last token read

    # -- rendering --------------------------------------------------------------------------

    def _new_tokens(self) -> tuple[list[int], str, str]:
        """(new token ids, their rule, the rendered conversation) for the messages so far."""
        text = render(self.tokenizer, self.messages, True)
        ids, done = encode(self.tokenizer, text), len(self.consumed)
        if ids[:done] == self.consumed:
            return ids[done:], "tokens", text
        if text.startswith(self.consumed_text):
            return encode(self.tokenizer, text[len(self.consumed_text) :]), "text", text
        earlier = render(self.tokenizer, self.messages[:-1], False)
        if text.startswith(earlier):
            return encode(self.tokenizer, text[len(earlier) :]), "messages", text
        raise RnnifyError("the chat template renders earlier turns differently now; type /reset to start over")

    # -- turns ------------------------------------------------------------------------------

    def ask(self, text: str) -> tuple[int, str]:
        """Read user message ``text`` (and what precedes it) into the state; (tokens read, rule)."""
        self.messages.append({"role": "user", "content": text})
        try:
            new, rule, rendered = self._new_tokens()
        except RnnifyError:
            self.messages.pop()
            raise
        if not new:
            self.messages.pop()
            raise RnnifyError("the chat template renders nothing new for this message")
        room = self.room()
        if room is not None and len(new) >= room:  # a reply needs one position at least
            self.messages.pop()
            limit, what = self.model.manifest.token_limit()
            raise PositionError(
                f"this turn needs {len(new) + 1} positions (its {len(new)} tokens and one for the reply), and the "
                f"conversation has {room} left of the model's {limit} {what}; start a new conversation (/reset)"
            )
        ids = torch.tensor([new], device=self.model.device)
        try:
            logits, self.state = self.model.prefill(ids, self.state)
        except RnnifyError:
            self.messages.pop()
            raise
        self._logits = logits[:, -1]
        self.consumed += new
        self.consumed_text = rendered
        return len(new), rule

    @torch.no_grad()
    def reply(self, streamer: Any = None) -> list[int]:
        """Generate the assistant's reply after ``ask``, reading every generated token into the state
        (the end token too, so the next turn continues after it); returns the generated ids.

        ``streamer`` gets ``put(ids)`` per token and ``end()``, as transformers' streamers expect.
        """
        if self._logits is None:
            raise RnnifyError("reply() needs a user message first: call ask()")
        generated: list[int] = []
        room = self.room()
        for _ in range(self.max_new_tokens if room is None else min(self.max_new_tokens, room)):
            token = next_token(self._logits, generator=self.generator, **self.sampling)
            generated.append(int(token))
            if streamer is not None:
                streamer.put(token.cpu())
            logits, self.state = self.model.step(token[:, None], self.state)
            self._logits = logits[:, -1]
            if generated[-1] in self.eos:
                break
        if streamer is not None:
            streamer.end()
        self._logits = None
        ended = bool(generated) and generated[-1] in self.eos
        content = self.tokenizer.decode(generated[:-1] if ended else generated, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": content})
        self.consumed += generated
        self.consumed_text += content + (
            self.tokenizer.decode(generated[-1:], skip_special_tokens=False) if ended else ""
        )
        return generated

    def room(self) -> int | None:
        """Tokens the state can still read before the model's last position; None where it has none."""
        hard = self.model.manifest.token_limit()
        return None if hard is None else hard[0] - len(self.consumed)

    def full(self) -> bool:
        """Whether no turn fits any more: a turn reads a token at least, and its reply one more (``ask``)."""
        room = self.room()
        return room is not None and room < 2

    def send(self, text: str, streamer: Any = None) -> Turn:
        """``ask(text)`` then ``reply(streamer)``."""
        read, rule = self.ask(text)
        ids = self.reply(streamer)
        return Turn(self.messages[-1]["content"], ids, read, rule, len(self.consumed), self.state.nbytes)
