"""Pass-key prompts in several wordings, kept apart: the ones that choose heads never grade them.

A probe that both calibrates a model (``rnnify.auto`` picks the heads that recall the key) and
grades it rewards heads that learned the probe's sentences, not recall: a model chosen on one
wording can fail another. So each prompt family here is a ``Probe``, and the family
``rnnify.auto`` calibrates on (``CALIBRATION``, the landmark-attention probe of Mohtashami & Jaggi
that LongLoRA reused) shares no sentence with the families that evaluation uses by default
(``EVALUATION``): other wordings and fillers, real text as filler, the question asked through the
model's chat template, and RULER's multi-key variant (Hsieh et al. 2024: several keys, each with
its own label, one asked for). Keys come from a random stream per family and seed, so calibration
and evaluation never draw the same sequence of keys either.

Torch-free: building a prompt needs only a tokenizer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rnnify.choices import PASSKEY_TRIALS, SEED
from rnnify.errors import RnnifyError

__all__ = [
    "CALIBRATION",
    "EVALUATION",
    "PROBES",
    "Probe",
    "Prompt",
    "PromptTooLong",
    "build_prompt",
    "depths",
    "prompts",
    "prose_sentences",
]


@dataclass(frozen=True)
class Probe:
    """One family of pass-key prompts: the sentences around the filler and how the question is put."""

    name: str
    header: str
    needle: str  # with {key}, and {label} where several keys are hidden
    question: str  # the prompt's last words; with {label} where several keys are hidden
    filler: tuple[str, ...] = ()  # sentences repeated in turn; empty: sentences of real text, given per call
    labels: tuple[str, ...] = ()  # several keys: one needle per label, the question asks for one of them
    chat: bool = False  # put the text and the question in one user turn of the tokenizer's chat template


CALIBRATION = Probe(
    "calibration",
    header=(
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there."
    ),
    needle="The pass key is {key}. Remember it.",
    question="What is the pass key? The pass key is",
    filler=("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."),
)
_SAFE = {
    "header": "Below is a long note. Somewhere in it is a number that you will be asked for at the end.",
    "needle": "Write this down: the code to the safe is {key}.",
    "question": "What is the code to the safe? The code to the safe is",
}
_TOWN = (
    "A river runs past the old mill.",
    "Children play in the park after school.",
    "The train leaves the station at noon.",
    "Clouds gather over the hills in the evening.",
    "A cat sleeps on the warm windowsill.",
    "The baker opens his shop before dawn.",
)
EVALUATION = (
    Probe("reworded", filler=_TOWN, **_SAFE),
    Probe(
        "prose",
        header="Read the following text carefully; one sentence in it does not belong there.",
        needle="The magic number is {key}.",
        question="What is the magic number in the text? The magic number is",
    ),
    Probe(
        "chat",
        filler=_TOWN,
        chat=True,
        header=_SAFE["header"],
        needle=_SAFE["needle"],
        question="What is the code to the safe? Answer with the number only.",
    ),
    Probe(
        "multikey",
        filler=_TOWN,
        header="Below is a long note with several numbers in it, each with its own name.",
        needle="The special number for the {label} is {key}.",
        question="What is the special number for the {label}? The special number for the {label} is",
        labels=("red door", "blue box", "green lamp", "white boat"),
    ),
)
PROBES = {probe.name: probe for probe in (CALIBRATION, *EVALUATION)}


@dataclass
class Prompt:
    ids: list[int]
    key: str  # the key asked for
    depth: float  # requested share of the filler sentences before the key asked for
    probe: str = CALIBRATION.name
    others: list[str] = field(default_factory=list)  # the other keys hidden in a multi-key prompt


def depths(trials: int) -> list[float]:
    """``trials`` depths evenly spaced from the start of the filler (0) to its end (1)."""
    if trials < 1:
        raise RnnifyError(f"passkey trials (--passkey-trials) must be >= 1, got {trials}")
    return [0.5] if trials == 1 else [i / (trials - 1) for i in range(trials)]


def prose_sentences(text: str, limit: int = 4000) -> tuple[str, ...]:
    """Up to ``limit`` sentences of ``text``, whitespace folded, those with digits left out (no rival keys)."""
    found = []
    for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        if 20 <= len(sentence) <= 300 and not re.search(r"\d", sentence):
            found.append(sentence)
            if len(found) == limit:
                break
    return tuple(found)


def _body(probe: Probe, filler: Sequence[str], count: int, depth: float, needles: list[str]) -> str:
    """The header, ``count`` filler sentences with the needles inserted, and (outside chat) the question."""
    sentences = [filler[i % len(filler)] for i in range(count)]
    # the asked-for needle (first) at ``depth``, the others spread evenly around it
    spots = [round(depth * count)] + [
        round((i + 1) * count / len(needles)) % (count + 1) for i in range(len(needles) - 1)
    ]
    for spot, needle in sorted(zip(spots, needles), key=lambda pair: -pair[0]):
        sentences.insert(spot, needle)
    return " ".join([probe.header, *sentences])


class PromptTooLong(RnnifyError):
    """A pass-key prompt longer than the length asked for, even with one filler sentence: ``needed`` is
    its fewest tokens, so that a caller can name its own flag and the value that would fit."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed


def _ids(tokenizer: Any, probe: Probe, body: str, question: str) -> list[int]:
    if not probe.chat:
        return list(tokenizer(f"{body} {question}")["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise RnnifyError(
            f"the pass-key probe {probe.name!r} asks through a chat template and this tokenizer has "
            "none; leave that probe out"
        )
    messages = [{"role": "user", "content": f"{body}\n\n{question}"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def build_prompt(
    tokenizer: Any,
    length: int,
    depth: float,
    key: str,
    probe: Probe = CALIBRATION,
    filler: Sequence[str] = (),
    others: Sequence[str] = (),
) -> Prompt:
    """The longest prompt of ``probe`` of at most ``length`` tokens (whole filler sentences) with ``key`` at ``depth``.

    ``filler``: the sentences of real text for a probe without its own; ``others``: the keys of the
    other labels of a multi-key probe (the first label is asked for). Tokenized with the tokenizer's
    special tokens (a BOS where the model expects one).
    """
    filler = probe.filler or tuple(filler)
    if not filler:
        raise RnnifyError(
            f"the pass-key probe {probe.name!r} fills its prompts with real text: give text "
            "(rnnify eval --data) or leave that probe out"
        )
    labels = probe.labels or ("",)
    needles = [probe.needle.format(key=k, label=label) for k, label in zip([key, *others], labels)]
    question = probe.question.format(label=labels[0])

    def encoded(count: int) -> list[int]:
        return _ids(tokenizer, probe, _body(probe, filler, count, depth, needles), question)

    def size(count: int) -> int:
        return len(encoded(count))

    if size(1) > length:
        raise PromptTooLong(
            f"a pass-key prompt ({probe.name}) needs at least {size(1)} tokens with this tokenizer; "
            f"ask for longer contexts than {length}",
            size(1),
        )
    sample = min(len(filler), 32)
    per_sentence = max(1, (size(sample + 1) - size(1)) // sample)
    count = max(1, (length - size(1)) // per_sentence + 1)  # an estimate, then whole sentences either way
    while count > 1 and size(count) > length:
        count -= 1
    while size(count + 1) <= length:
        count += 1
    return Prompt(encoded(count), key, depth, probe.name, list(others))


def _key(rng: random.Random, taken: set[str]) -> str:
    while (key := str(rng.randrange(10_000, 100_000))) in taken:
        pass
    taken.add(key)
    return key


def prompts(
    tokenizer: Any,
    lengths: Sequence[int],
    trials: int = PASSKEY_TRIALS,
    seed: int = SEED,
    probes: Sequence[Probe] = (CALIBRATION,),
    text: Sequence[str] = (),
) -> list[tuple[int, Prompt]]:
    """(requested length, prompt) pairs: per probe and length, ``trials`` depths, each with random keys.

    Keys are drawn from a stream per (probe, seed); ``text`` is the sentences of real text
    (``prose_sentences``) for the probes that fill with it, a different stretch for every prompt.
    """
    out = []
    for probe in probes:
        rng = random.Random(f"{probe.name}:{seed}")
        for length in lengths:
            for depth in depths(trials):
                taken: set[str] = set()
                key, others = _key(rng, taken), [_key(rng, taken) for _ in probe.labels[1:]]
                start = rng.randrange(len(text)) if text else 0
                filler = tuple(text[start:]) + tuple(text[:start])
                out.append((length, build_prompt(tokenizer, length, depth, key, probe, filler, others)))
    return out
