"""Pass-key retrieval: can the model still recall one fact buried in a long context?

Perplexity averages over every token and hides whether a constant-size state can carry a single
fact across thousands of tokens. The classic probe (Mohtashami & Jaggi's landmark attention,
reused by LongLoRA) tests that directly: a random 5-digit key is stated once, at some depth of
filler, and the prompt ends by asking for it. Both models decode greedily and a trial counts when
the first number in the answer is the key. The prompts come in several families
(``rnnify.probes``); evaluation uses those that ``--to auto`` never calibrates on.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rnnify.choices import PASSKEY_TRIALS, SEED
from rnnify.data import load_tokenizer, tokenizer_for
from rnnify.errors import RnnifyError
from rnnify.probes import (
    CALIBRATION,
    EVALUATION,
    PROBES,
    Probe,
    Prompt,
    prose_sentences,
)
from rnnify.probes import prompts as probe_prompts
from rnnify.runtime.manifest import MANIFEST_FILE
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.storage import load, load_or_take

__all__ = [
    "PasskeyResult",
    "PasskeyTrial",
    "answer_tokens",
    "converted_generator",
    "evaluate_passkey",
    "original_generator",
    "passkey_trials",
    "score",
    "usable_probes",
]

ANSWER_MARGIN = 4  # new tokens beyond the key's own, for a space, a colon or a newline before it
CHAT_LEAD = 16  # more new tokens where a chat model answers in a sentence ("The code to the safe is ...")

# prompt ids, number of new tokens -> the greedily decoded new token ids
Generator = Callable[[list[int], int], list[int]]


@dataclass
class PasskeyTrial:
    length: int  # requested prompt tokens
    tokens: int  # prompt tokens built (at most `length`)
    depth: float  # share of the filler before the key: 0 at the start, 1 just before the question
    key: str
    answers: dict[str, str]  # model name ("converted", "original") -> decoded answer
    correct: dict[str, bool]
    probe: str = CALIBRATION.name  # the prompt family (rnnify.probes)


@dataclass
class PasskeyResult:
    model: str
    against: str | None  # the original compared with, None when only the converted model ran
    seed: int
    trials: list[PasskeyTrial]

    def accuracy(self, probe: str | None = None) -> dict[str, dict[int, float]]:
        """Model name -> requested length -> share of trials answered with the key (of ``probe``, else all)."""
        out: dict[str, dict[int, list[bool]]] = {}
        for trial in self.trials:
            if probe is not None and trial.probe != probe:
                continue
            for name, ok in trial.correct.items():
                out.setdefault(name, {}).setdefault(trial.length, []).append(ok)
        return {name: {n: sum(oks) / len(oks) for n, oks in by.items()} for name, by in out.items()}

    def probes(self) -> list[str]:
        return list(dict.fromkeys(trial.probe for trial in self.trials))

    def to_json(self) -> dict[str, Any]:
        def keyed(accuracy: dict[str, dict[int, float]]) -> dict[str, dict[str, float]]:
            return {name: {str(n): a for n, a in by.items()} for name, by in accuracy.items()}

        by_probe = {probe: keyed(self.accuracy(probe)) for probe in self.probes()}
        return {**asdict(self), "accuracy": keyed(self.accuracy()), "accuracy_by_probe": by_probe}


def score(answer: str, key: str) -> bool:
    """Whether the first number in ``answer`` is ``key`` (a longer number that starts with it is wrong)."""
    found = re.search(r"\d+", answer)
    return found is not None and found.group() == key


def answer_tokens(tokenizer: Any, prompt: Prompt) -> int:
    """New tokens a model gets to state the key: the key's own, a margin, and a lead-in sentence where
    the question goes through a chat template (a chat answer restates the question first)."""
    lead = CHAT_LEAD if PROBES[prompt.probe].chat else 0
    return len(tokenizer(f" {prompt.key}.", add_special_tokens=False)["input_ids"]) + ANSWER_MARGIN + lead


def usable_probes(tokenizer: Any, text: Sequence[str] = ()) -> list[Probe]:
    """The evaluation probes this tokenizer and text can build: prose needs text, chat a chat template."""
    return [
        probe
        for probe in EVALUATION
        if (probe.filler or text) and (not probe.chat or getattr(tokenizer, "chat_template", None))
    ]


def passkey_trials(
    generators: dict[str, Generator], tokenizer: Any, prompts: list[tuple[int, Prompt]], progress: bool = False
) -> list[PasskeyTrial]:
    """Run every generator on the same ``prompts`` (``rnnify.probes.prompts``) and score the answers."""
    from rnnify.progress import bar

    out = []
    for length, prompt in bar(progress, iterable=prompts, unit="prompt", desc="pass key", leave=False):
        key = prompt.key
        new = answer_tokens(tokenizer, prompt)
        answers = {
            name: tokenizer.decode(generate(prompt.ids, new), skip_special_tokens=True)
            for name, generate in generators.items()
        }
        out.append(
            PasskeyTrial(
                length,
                len(prompt.ids),
                prompt.depth,
                key,
                answers,
                {name: score(a, key) for name, a in answers.items()},
                prompt.probe,
            )
        )
    return out


def converted_generator(model: RecurrentModel) -> Generator:
    """Greedy decoding with the converted model: one prefill, then one step per token."""

    def generate(ids: list[int], new: int) -> list[int]:
        prompt = torch.tensor([ids], device=model.device)
        return model.generate(prompt, max_new_tokens=new)[0, len(ids) :].tolist()

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
    trials: int = PASSKEY_TRIALS,
    seed: int = SEED,
    against: str | os.PathLike | torch.nn.Module | None = None,
    original: bool = True,
    tokenizer: Any = None,
    device: torch.device | str | None = None,
    kernels: str | None = None,
    probes: Sequence[str] | None = None,
    text: str | None = None,
    cache: bool = True,
    progress: bool = False,
) -> PasskeyResult:
    """Pass-key accuracy of a converted model at each prompt length in ``lengths``, and of its original.

    ``against``, ``tokenizer``, ``device`` and ``kernels`` mean what they mean for ``rnnify.evaluate``;
    ``original=False`` runs the converted model alone. ``trials`` prompts per length and probe put
    the key at depths evenly spaced through the filler; ``seed`` draws the keys. ``probes`` names
    the prompt families (``rnnify.probes.PROBES``); by default every evaluation family that can be
    built (``usable_probes``: the prose filler needs ``text``, the chat probe a chat template), never
    the one ``--to auto`` calibrates on. ``cache`` as for ``rnnify.evaluate``: the original's answers.
    """
    model = load_or_take(model_or_dir, device=device, kernels=kernels, caller="evaluate_passkey")
    lengths = _check_lengths(model, lengths)
    tokenizer = tokenizer_for(model, "the pass-key prompt", tokenizer)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    sentences = prose_sentences(text) if text else ()
    chosen = usable_probes(tokenizer, sentences) if probes is None else [_probe(name) for name in probes]
    # a context too short fails here, before a model runs
    prompts = probe_prompts(tokenizer, lengths, trials, seed, chosen, sentences)
    generators = {"converted": converted_generator(model)}
    name = None
    if original:
        generators["original"], name = _original(model, against, cache)
    trials_run = passkey_trials(generators, tokenizer, prompts, progress)
    return PasskeyResult(str(model.path) if model.path is not None else "(in memory)", name, seed, trials_run)


def _probe(name: str) -> Probe:
    if name not in PROBES:
        raise RnnifyError(f"unknown pass-key probe {name!r}; choose from {', '.join(PROBES)}")
    return PROBES[name]


def _check_lengths(model: RecurrentModel, lengths) -> list[int]:
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise RnnifyError(
            f"passkey lengths (--passkey) must be positive token counts, e.g. 512,1024,2048; got {lengths}"
        )
    limit, what = model.manifest.token_limit() or (None, None)
    if limit is not None and max(lengths) + 16 > limit:
        raise RnnifyError(
            f"passkey length {max(lengths)} plus the answer is past the model's {limit} {what}; "
            f"use at most {limit - 16}"
        )
    return lengths


def _original(model: RecurrentModel, against, cache: bool) -> tuple[Generator, str]:
    """A generator for the compared model (a transformers model, or another rnnify directory) and its name.

    An original given as a local directory answers from the cache where it can
    (``rnnify.original.outputs``), and loads on the first prompt the cache does not hold.
    """
    from rnnify.original import load_teacher, local_source
    from rnnify.original.outputs import OriginalOutputs, content_digest

    if against is None:
        against = local_source(model, "--against (command line) or against= (Python)")
    if isinstance(against, (str, os.PathLike)) and (Path(against).expanduser() / MANIFEST_FILE).is_file():
        return converted_generator(load(against, device=model.device)), str(against)
    if isinstance(against, RecurrentModel):
        return converted_generator(against), str(against.path or "(in memory)")
    if not isinstance(against, (str, os.PathLike)):
        return original_generator(load_teacher(model, against)), type(against).__name__
    loaded: list[Generator] = []

    def answer(ids: list[int], new: int) -> list[int]:
        if not loaded:
            loaded.append(original_generator(load_teacher(model, against)))
        return loaded[0](ids, new)

    digest = content_digest(against) if cache else None
    outputs = OriginalOutputs(None if digest is None else f"{digest}:{model.dtype}", None, answer)
    return outputs.answer, str(against)
