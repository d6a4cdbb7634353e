"""``rnnify generate``: continue a prompt, streaming each token; and the sampling flags ``chat`` shares."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from rnnify import arguments
from rnnify.cli.common import add_dir, add_eager_step_flag, add_kernels_flag, load_to_decode
from rnnify.errors import RnnifyError

if TYPE_CHECKING:
    from rich.console import Console


HELP = "generate text or token ids, streamed as they are produced"
DESCRIPTION = (
    "Continue a prompt with the converted model, one recurrent step per token, printing "
    "each token as it comes (the prompt first). Greedy unless --do-sample."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rnnify.choices import MAX_NEW_TOKENS

    add_dir(p)
    add_eager_step_flag(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument(
        "--prompt",
        type=arguments.utf8("--prompt"),
        metavar="TEXT",
        help="text prompt, tokenized with the tokenizer saved in DIR",
    )
    prompt.add_argument(
        "--ids", type=_token_ids, metavar="IDS", help="prompt as comma-separated token ids, e.g. 1,2,3; prints ids back"
    )
    add_sampling_flags(p, max_new_tokens=MAX_NEW_TOKENS)
    add_kernels_flag(p)


def add_sampling_flags(p: argparse.ArgumentParser, max_new_tokens: int, fewest_new_tokens: int = 0) -> None:
    """How tokens are chosen, shared by ``generate`` and ``chat``: greedy unless --do-sample."""
    from rnnify.choices import TEMPERATURE, TOP_K

    p.add_argument(
        "--max-new-tokens",
        type=arguments.at_least(fewest_new_tokens, "--max-new-tokens"),
        default=max_new_tokens,
        metavar="N",
        help="most tokens to generate",
    )
    p.add_argument("--do-sample", action="store_true", help="sample instead of taking the most likely token")
    p.add_argument(
        "--temperature",
        type=arguments.temperature("--temperature"),
        default=TEMPERATURE,
        metavar="T",
        help="sampling temperature, > 0",
    )
    p.add_argument(
        "--top-k",
        type=arguments.at_least(0, "--top-k"),
        default=TOP_K,
        metavar="K",
        help="sample only from the K most likely tokens (default: %(default)s, as transformers; 0: from all)",
    )
    p.add_argument(
        "--top-p",
        type=arguments.probability("--top-p"),
        metavar="P",
        help="sample only from the smallest set of tokens whose probability adds up to P",
    )
    p.add_argument(
        "--seed", type=arguments.seed("--seed"), metavar="S", help="seed for sampling, for repeatable output"
    )


def sampling_options(args: argparse.Namespace, model, tokenizer) -> dict[str, Any]:
    """The sampling flags as ``RecurrentModel.generate`` and ``Chat`` take them, with the ids that end a
    reply: ``model``'s and ``tokenizer``'s end-of-sequence ids (``runtime.text.eos_ids``)."""
    from rnnify.runtime.sampling import SAMPLING_DEFAULTS, warn_if_greedy
    from rnnify.runtime.text import eos_ids

    sampling = {name: getattr(args, name) for name in SAMPLING_DEFAULTS}
    warn_if_greedy(args.do_sample, sampling, named=lambda name: f"--{name.replace('_', '-')}", switch="--do-sample")
    chosen = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample}
    if args.do_sample:  # greedy: warned once here, not again by generate
        chosen.update(sampling)
    return {**chosen, "eos_token_id": eos_ids(model, tokenizer) or None}


class _IdStreamer:
    """Prints token ids as ``generate`` produces them, comma-separated, prompt first."""

    def __init__(self) -> None:
        self._first = True

    def put(self, ids) -> None:
        for token in ids.flatten().tolist():
            print(("" if self._first else ",") + str(token), end="", flush=True)
            self._first = False

    def end(self) -> None:
        print(flush=True)


def _token_ids(text: str) -> list[int]:
    """``--ids`` as written (checked against the vocabulary once the model is loaded)."""
    ids = []
    for part in text.split(","):
        try:
            ids.append(int(part.strip()))
        except ValueError:
            message = f"--ids: {part.strip()!r} is not an integer; give comma-separated token ids like 1,2,3"
            raise RnnifyError(message) from None
    return ids


def run(args: argparse.Namespace, console: Console) -> int:
    import torch

    if args.prompt == "":  # before the model loads; text that tokenizes to nothing is refused after
        raise RnnifyError("--prompt is empty: give some text")
    model = load_to_decode(args)
    if args.ids is not None:
        tokenizer, streamer, ids = None, _IdStreamer(), args.ids
        bad = [i for i in ids if not 0 <= i < model.manifest.vocab_size]
        if bad:
            raise RnnifyError(f"--ids: token id {bad[0]} is outside the vocabulary [0, {model.manifest.vocab_size})")
    else:
        from transformers import TextStreamer

        from rnnify.data import load_tokenizer

        tokenizer = load_tokenizer(args.dir, "pass the prompt as token ids with --ids")
        ids = tokenizer(args.prompt, add_special_tokens=True).input_ids
        if not ids:
            raise RnnifyError("--prompt is empty: give some text")
        streamer = TextStreamer(tokenizer, skip_special_tokens=True)
    model.generate(
        torch.tensor([ids], device=model.device), streamer=streamer, **sampling_options(args, model, tokenizer)
    )
    return 0
