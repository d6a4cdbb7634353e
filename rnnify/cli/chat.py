"""``rnnify chat``: a conversation on stdin, its recurrent state carrying it from turn to turn."""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING

from rnnify import arguments
from rnnify.cli.common import add_dir, add_eager_step_flag, add_kernels_flag, load_to_decode, nbytes
from rnnify.cli.generate import add_sampling_flags, sampling_options
from rnnify.errors import PositionError, RnnifyError

if TYPE_CHECKING:
    from rich.console import Console

# How ``Chat.ask`` told a turn's new tokens from what the state read (its rules, in order; rnnify/chat.py).
_RULES = {
    "tokens": "the history tokenizes again to the tokens the state read",
    "text": "the history tokenizes differently, but its text is what the state read",
    "messages": "the template rewrote earlier turns; the state keeps them as it read them",
}
# a line that is one /word is a command (/reset), however mistyped; any other line is a message
_COMMAND = re.compile(r"/\w+")


HELP = "chat with a converted model, its recurrent state carrying the conversation"
DESCRIPTION = (
    "Read one user message per line from stdin, apply the chat template saved in DIR and "
    "stream the reply. Each turn reads only its new tokens, continuing from the state after the "
    "previous reply (history is never re-read); after each reply a dim line shows the tokens so far "
    "and the state's size, constant for recurrent targets. /reset starts a new conversation (a line "
    "that is one other /word is not sent); "
    "Ctrl-D or Ctrl-C ends. Greedy unless --do-sample."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import CHAT_MAX_NEW_TOKENS

    add_dir(p, "converted model directory with a tokenizer and chat template")
    add_eager_step_flag(p)
    p.add_argument(
        "--system", type=arguments.utf8("--system"), metavar="TEXT", help="system prompt that opens every conversation"
    )
    add_sampling_flags(p, max_new_tokens=CHAT_MAX_NEW_TOKENS, fewest_new_tokens=1)  # a reply has a token
    p.add_argument(
        "--verbose",
        action="store_true",
        help="before each reply, show how many new tokens the turn read and how they were told from the "
        "history the state holds, in the order tried: " + "; or ".join(_RULES.values()) + " (rnnify/chat.py)",
    )
    add_kernels_flag(p)


def run(args: argparse.Namespace, console: Console) -> int:
    """Read user messages from stdin, one per line, and stream each reply; /reset starts over."""
    from rich.text import Text
    from transformers import TextStreamer

    from rnnify.chat import Chat
    from rnnify.data import load_tokenizer

    if sys.stdin is None:  # started with stdin closed (``<&-``)
        raise RnnifyError("chat reads its messages from stdin, which is closed; give it a terminal or a pipe")
    model = load_to_decode(args)
    tokenizer = load_tokenizer(args.dir, "chat needs the tokenizer and chat template of the source model in DIR")
    chat = Chat(model, tokenizer, system=args.system, **sampling_options(args, model, tokenizer))
    interactive = sys.stdin.isatty()
    if interactive:
        console.print(Text("one message per line; /reset starts a new conversation; Ctrl-D ends", "dim"))
    try:
        while True:
            try:
                text = input("> " if interactive else "").strip()
            except EOFError:
                break
            except UnicodeDecodeError as exc:  # the tokenizer takes text: say which bytes are not
                bad = exc.object[exc.start : exc.end].hex(" ")
                raise RnnifyError(
                    f"stdin is not {exc.encoding} text ({exc.reason}: {bad}); send the messages in {exc.encoding}"
                ) from None
            text = arguments.utf8("stdin")(text)  # a pipe's other bytes arrive as lone surrogates
            if text == "/reset":
                chat.reset()
                console.print(Text("(new conversation)", "dim"))
            elif _COMMAND.fullmatch(text):  # a mistyped command, not a message to the model
                console.print(Text(f"unknown command {text}: /reset is the one command; nothing was sent", "red"))
            elif text:
                try:
                    read, rule = chat.ask(text)
                except PositionError as exc:  # the conversation is full: at a terminal, /reset goes on
                    if not interactive:
                        raise
                    console.print(Text(f"error: {exc}", "red"))
                    continue
                if args.verbose:
                    console.print(Text(f"(read {read} new tokens; {_RULES[rule]})", "dim"))
                chat.reply(TextStreamer(tokenizer, skip_special_tokens=True))
                full = " (no room for another turn: /reset starts a new conversation)" if chat.full() else ""
                console.print(Text(f"[{len(chat.consumed):,} tokens, state {nbytes(chat.state.nbytes)}]{full}", "dim"))
    except KeyboardInterrupt:
        print()
    return 0
