"""Pass-key retrieval: can the model still recall one fact buried in a long context?

Perplexity averages over every token and hides whether a constant-size state can carry a single
fact across thousands of tokens. The classic probe (Mohtashami & Jaggi's landmark attention,
reused by LongLoRA) tests that directly: a random 5-digit key is stated once, at some depth of
repetitive filler, and the prompt ends by asking for it. Both models decode greedily and a trial
counts when the first number in the answer is the key.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rnnify.data import load_tokenizer, tokenizer_for
from rnnify.errors import RnnifyError
from rnnify.runtime.manifest import MANIFEST_FILE
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.storage import load, load_or_take

__all__ = ["PasskeyResult", "PasskeyTrial", "Prompt", "build_prompt", "depths", "evaluate_passkey",
           "passkey_prompts", "passkey_trials", "score", "converted_generator", "original_generator"]

HEADER = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.")
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it."
QUESTION = "What is the pass key? The pass key is"
ANSWER_MARGIN = 4  # new tokens beyond the key's own, for a space, a colon or a newline before it

# prompt ids, number of new tokens -> the greedily decoded new token ids
Generator = Callable[[list[int], int], list[int]]


@dataclass
class Prompt:
    ids: list[int]
    key: str
    depth: float  # requested share of the filler sentences before the key


@dataclass
class PasskeyTrial:
    length: int  # requested prompt tokens
    tokens: int  # prompt tokens built (at most `length`)
    depth: float  # share of the filler before the key: 0 at the start, 1 just before the question
    key: str
    answers: dict[str, str]  # model name ("converted", "original") -> decoded answer
    correct: dict[str, bool]


@dataclass
class PasskeyResult:
    model: str
    against: str | None  # the original compared with, None when only the converted model ran
    seed: int
    trials: list[PasskeyTrial]

    def accuracy(self) -> dict[str, dict[int, float]]:
        """Model name -> requested length -> share of trials answered with the key."""
        out: dict[str, dict[int, list[bool]]] = {}
        for trial in self.trials:
            for name, ok in trial.correct.items():
                out.setdefault(name, {}).setdefault(trial.length, []).append(ok)
        return {name: {n: sum(oks) / len(oks) for n, oks in by.items()} for name, by in out.items()}

    def to_json(self) -> dict[str, Any]:
        accuracy = {name: {str(n): a for n, a in by.items()} for name, by in self.accuracy().items()}
        return {**asdict(self), "accuracy": accuracy}


def depths(trials: int) -> list[float]:
    """``trials`` depths evenly spaced from the start of the filler (0) to its end (1)."""
    if trials < 1:
        raise RnnifyError(f"passkey trials (--passkey-trials) must be >= 1, got {trials}")
    return [0.5] if trials == 1 else [i / (trials - 1) for i in range(trials)]


def _text(key: str, filler: int, before: int) -> str:
    sentences = [FILLER[i % len(FILLER)] for i in range(filler)]
    return " ".join([HEADER, *sentences[:before], NEEDLE.format(key=key), *sentences[before:], QUESTION])


def build_prompt(tokenizer: Any, length: int, depth: float, key: str) -> Prompt:
    """The longest prompt of at most ``length`` tokens (whole filler sentences) with ``key`` at ``depth``.

    Tokenized as one text, with the tokenizer's special tokens (a BOS where the model expects one).
    """
    def size(filler: int) -> int:
        return len(tokenizer(_text(key, filler, round(depth * filler)))["input_ids"])

    if size(1) > length:
        raise RnnifyError(f"a pass-key prompt needs at least {size(1)} tokens with this tokenizer; "
                          f"ask for longer contexts than {length}")
    per_sentence = max(1, (size(len(FILLER) + 1) - size(1)) // len(FILLER))
    filler = max(1, (length - size(1)) // per_sentence + 1)  # an estimate, then whole sentences either way
    while filler > 1 and size(filler) > length:
        filler -= 1
    while size(filler + 1) <= length:
        filler += 1
    return Prompt(tokenizer(_text(key, filler, round(depth * filler)))["input_ids"], key, depth)


def score(answer: str, key: str) -> bool:
    """Whether the first number in ``answer`` is ``key`` (a longer number that starts with it is wrong)."""
    found = re.search(r"\d+", answer)
    return found is not None and found.group() == key


def passkey_prompts(tokenizer: Any, lengths: list[int], trials: int = 6, seed: int = 0) -> list[tuple[int, Prompt]]:
    """(requested length, prompt) pairs: ``trials`` depths per length, a random key each (seeded)."""
    rng = random.Random(seed)
    jobs = [(n, d, str(rng.randrange(10_000, 100_000))) for n in lengths for d in depths(trials)]
    return [(n, build_prompt(tokenizer, n, d, key)) for n, d, key in jobs]


def passkey_trials(generators: dict[str, Generator], tokenizer: Any, prompts: list[tuple[int, Prompt]],
                   progress: bool = False) -> list[PasskeyTrial]:
    """Run every generator on the same ``prompts`` (``passkey_prompts``) and score the answers."""
    from tqdm import tqdm

    out = []
    for length, prompt in tqdm(prompts, unit="prompt", disable=None if progress else True, leave=False):
        key = prompt.key
        new = len(tokenizer(f" {key}.", add_special_tokens=False)["input_ids"]) + ANSWER_MARGIN
        answers = {name: tokenizer.decode(generate(prompt.ids, new), skip_special_tokens=True)
                   for name, generate in generators.items()}
        out.append(PasskeyTrial(length, len(prompt.ids), prompt.depth, key, answers,
                                {name: score(a, key) for name, a in answers.items()}))
    return out


def converted_generator(model: RecurrentModel) -> Generator:
    """Greedy decoding with the converted model: one prefill, then one step per token."""
    def generate(ids: list[int], new: int) -> list[int]:
        prompt = torch.tensor([ids], device=model.device)
        return model.generate(prompt, max_new_tokens=new)[0, len(ids):].tolist()

    return generate


def original_generator(hf_model: torch.nn.Module) -> Generator:
    """Greedy decoding with a transformers model and its KV cache (no generation config applies)."""
    device = next(hf_model.parameters()).device

    @torch.no_grad()
    def generate(ids: list[int], new: int) -> list[int]:
        out = hf_model(input_ids=torch.tensor([ids], device=device), use_cache=True)
        tokens = []
        for i in range(new):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            if i < new - 1:
                out = hf_model(input_ids=token, cache=out.cache, use_cache=True)
        return tokens

    return generate


def evaluate_passkey(
    model_or_dir: RecurrentModel | str | os.PathLike,
    lengths: Sequence[int] = (512, 1024, 2048),
    *,
    trials: int = 6,
    seed: int = 0,
    against: str | os.PathLike | torch.nn.Module | None = None,
    original: bool = True,
    tokenizer: Any = None,
    device: torch.device | str | None = None,
    kernels: str | None = None,
    progress: bool = False,
) -> PasskeyResult:
    """Pass-key accuracy of a converted model at each prompt length in ``lengths``, and of its original.

    ``against``, ``tokenizer``, ``device`` and ``kernels`` mean what they mean for ``rnnify.evaluate``;
    ``original=False`` runs the converted model alone. ``trials`` prompts per length put the key at
    depths evenly spaced through the filler; ``seed`` draws the keys.
    """
    model = load_or_take(model_or_dir, device=device, kernels=kernels, caller="evaluate_passkey")
    lengths = _check_lengths(model, lengths)
    tokenizer = tokenizer_for(model, "the pass-key prompt", tokenizer)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    prompts = passkey_prompts(tokenizer, lengths, trials, seed)  # a context too short fails before a model runs
    generators = {"converted": converted_generator(model)}
    name = None
    if original:
        generators["original"], name = _original(model, against)
    trials_run = passkey_trials(generators, tokenizer, prompts, progress)
    return PasskeyResult(str(model.path) if model.path is not None else "(in memory)", name, seed, trials_run)


def _check_lengths(model: RecurrentModel, lengths) -> list[int]:
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise RnnifyError(f"passkey lengths (--passkey) must be positive token counts, e.g. 512,1024,2048; got {lengths}")
    positions = model.manifest.positions
    limit = positions.get("limit") if positions.get("kind") == "learned" else None
    if limit is not None and max(lengths) + 16 > limit:
        raise RnnifyError(f"passkey length {max(lengths)} plus the answer is past the model's {limit} learned "
                          f"positions; use at most {limit - 16}")
    return lengths


def _original(model: RecurrentModel, against) -> tuple[Generator, str]:
    """A generator for the compared model (a transformers model, or another rnnify directory) and its name."""
    from rnnify.original import load_teacher, source_directory

    if against is None:
        against = source_directory(model, "--against (command line) or against= (Python)")
    if isinstance(against, (str, os.PathLike)) and (Path(against).expanduser() / MANIFEST_FILE).is_file():
        return converted_generator(load(against, device=model.device)), str(against)
    if isinstance(against, RecurrentModel):
        return converted_generator(against), str(against.path or "(in memory)")
    name = str(against) if isinstance(against, (str, os.PathLike)) else type(against).__name__
    return original_generator(load_teacher(model, against)), name
