"""A converted model's tokenizer: where it is, loading it as data, and rendering chat messages with it.

Below the commands and the text layer (``runtime.text``) alike, so that ``model.generate("text")``,
``rnnify chat`` and evaluation find and read the same tokenizer the same way. A tokenizer in a model
directory is data like the rest of it: it loads with ``trust_remote_code=False``, and a chat template
renders in transformers' sandboxed Jinja environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rnnify.errors import RnnifyError, first_line

__all__ = [
    "TOKENIZER_FILES",
    "TOKENIZER_FIX",
    "check_template",
    "check_tokenizer_files",
    "check_tokenizer_json",
    "check_tokenizer_reads",
    "encode",
    "has_tokenizer",
    "load_tokenizer",
    "render",
    "tokenizer_dir",
    "tokenizer_places",
]

# Files of which a directory must hold one to have a tokenizer: without any, transformers may still
# build one from config.json alone (GPT-2's: an empty vocabulary) instead of failing.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
TOKENIZER_FIX = "pass one with --tokenizer DIR (command line) or tokenizer= (Python)"


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(directory: str | os.PathLike, fix: str = TOKENIZER_FIX):
    """The Hugging Face tokenizer saved in ``directory``; errors end with ``fix`` (what to do instead).

    Refuses a directory without tokenizer files and a tokenizer of at most one token, which
    transformers builds from some configs alone and which would turn text into nothing.
    """
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise RnnifyError(f"tokenizer directory {directory} does not exist; {fix}")
    if not has_tokenizer(directory):
        raise RnnifyError(f"{directory} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); {fix}")
    from transformers import AutoTokenizer, PreTrainedTokenizerBase

    from rnnify.runtime.hf_files import source_pretrained_config

    config = source_pretrained_config(directory)  # a converted directory: the tokenizer is its source's
    check_tokenizer_reads(directory)
    _check_tokenizer_class(directory, config, fix)
    try:
        tokenizer = (
            AutoTokenizer.from_pretrained(  # a tokenizer is data: never a tokenizer class's code from the directory
                str(directory),
                local_files_only=True,
                trust_remote_code=False,
                **({"config": config} if config is not None else {}),
                **_files_within(directory),
            )
        )
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad file
        # also ImportError: a tokenizer class whose backend is not installed (transformers names the package)
        raise RnnifyError(f"cannot load a tokenizer from {directory} ({first_line(exc)}); {fix}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise RnnifyError(f"{directory} gives a {type(tokenizer).__name__}, not a tokenizer; {fix}")
    if len(tokenizer) <= 1:
        raise RnnifyError(f"the tokenizer in {directory} has {len(tokenizer)} token(s), no vocabulary; {fix}")
    return tokenizer


def _read_json(path: Path) -> Any:
    """``path``'s JSON; None where there is no such file or transformers would refuse it on its own."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None


# tokenizer_config.json keys a tokenizer class may open as files when they hold a string (``vocab``
# and ``merges`` also take the data itself): transformers puts the directory's own file in place of
# each ``*_file`` its class declares, and leaves the others to be opened wherever they point
_FILE_KEYS = ("vocab", "merges", "entity_vocab")
_FILE_SUFFIXES = ("_file", "_files")
# what transformers reads besides: the versioned tokenizer file a list names, every template of a folder
_VERSIONED, _TEMPLATES = "fast_tokenizer_files", "additional_chat_templates"


def _files_within(directory: Path) -> dict[str, str | None]:
    """``from_pretrained`` keywords over tokenizer_config.json's file names: a bare name of a file in
    ``directory`` becomes that file, anything else (a path elsewhere, ``..``) None, so that a
    tokenizer reads the directory's own files or none, never one outside it and its sha256 record."""
    config = _read_json(directory / "tokenizer_config.json")
    if not isinstance(config, dict):
        return {}
    within = {}
    for key, value in config.items():
        if isinstance(value, str) and (key in _FILE_KEYS or key.endswith(_FILE_SUFFIXES)):
            within[key] = str(directory / value) if _bare(value) and (directory / value).is_file() else None
    return within


def check_tokenizer_json(directory: Path, fix: str) -> None:
    """Refuse ``directory``'s tokenizer.json (if any) where the ``tokenizers`` library, which transformers
    loads it with, cannot: cut short, not JSON, not a tokenizer. Parsed as JSON first, so that a file
    cut short is named as such, in Python's words, rather than in the library's."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return
    try:
        json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise RnnifyError(f"{path} is not valid JSON ({first_line(exc)}); {fix}") from exc
    import tokenizers

    try:
        tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for a bad file
        raise RnnifyError(
            f"{path} is not a tokenizer that tokenizers {tokenizers.__version__} can load ({first_line(exc)}); {fix}"
        ) from exc


def check_tokenizer_reads(directory: Path) -> None:
    """Refuse what would make transformers read a tokenizer from files that neither the directory's
    record holds nor its tokenizer_config.json names by a bare name: ``fast_tokenizer_files`` by a path
    (the one for this transformers version is opened wherever it points), and, in a converted
    directory, which rnnify writes without either, that key at all or an ``additional_chat_templates``
    folder (its ``*.jinja`` files, links followed, become chat templates: adding one needs no reseal)."""
    from rnnify.runtime.manifest import MANIFEST_FILE

    converted = (directory / MANIFEST_FILE).is_file()
    config = _read_json(directory / "tokenizer_config.json")
    versions = config.get(_VERSIONED) if isinstance(config, dict) else None
    if versions is not None and (converted or not (isinstance(versions, list) and all(map(_bare, versions)))):
        raise RnnifyError(
            f"{directory / 'tokenizer_config.json'}: {_VERSIONED} {versions!r:.80} names files "
            + ("rnnify never writes" if converted else "outside the directory")
        )
    if converted and (directory / _TEMPLATES).exists():
        raise RnnifyError(
            f"{directory / _TEMPLATES}: rnnify writes no such folder, and its files would become chat "
            "templates that the directory's record does not hold; remove it"
        )


def check_tokenizer_files(directory: Path) -> None:
    """For a loader that calls ``AutoTokenizer.from_pretrained(directory)`` itself (vLLM): what
    ``load_tokenizer`` refuses, and the tokenizer_config.json file names it would replace with the
    directory's own (``_files_within``) where they point at a file outside, which such a loader opens."""
    check_tokenizer_reads(directory)
    _check_tokenizer_class(directory, None, "serve the model that was converted")
    within = _files_within(directory)
    config = _read_json(directory / "tokenizer_config.json") if within else {}
    outside = [key for key, value in within.items() if value is None and (directory / config[key]).exists()]
    if outside:
        raise RnnifyError(
            f"{directory / 'tokenizer_config.json'}: {outside[0]} names {config[outside[0]]!r:.80}, outside the directory"
        )


def _bare(name: Any) -> bool:
    """A file name alone: no folder, no ``..``, no Windows separator."""
    return isinstance(name, str) and name == Path(name).name and name not in ("", ".", "..") and "\\" not in name


def _check_tokenizer_class(directory: Path, config: Any, fix: str) -> None:
    """Refuse a ``tokenizer_class`` (tokenizer_config.json's, or ``config``'s, else config.json's, which
    transformers reads when given no config) that names anything but a tokenizer: transformers
    resolves the name among every attribute of its package and calls the result's ``from_pretrained``
    on the directory, a model class's included. A tokenizer whose backend is not installed (a
    placeholder class) is left to transformers, which says what to install."""
    from transformers import PreTrainedTokenizerBase
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    from transformers.utils import DummyObject

    def named(file: str) -> Any:
        data = _read_json(directory / file)
        return data.get("tokenizer_class") if isinstance(data, dict) else None

    given = getattr(config, "tokenizer_class", None) if config is not None else named("config.json")
    for name in (named("tokenizer_config.json"), given):
        if not isinstance(name, str):
            continue
        found = tokenizer_class_from_name(name) or tokenizer_class_from_name(name.removesuffix("Fast"))
        if found is None or isinstance(found, DummyObject):
            continue
        if not (isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase)):
            raise RnnifyError(f"{directory}: tokenizer_class {name!r} is not a tokenizer class; {fix}")


def _tokenizer_places(model: Any) -> list[str]:
    return [str(directory) for directory in (model.path, model.manifest.source) if directory is not None]


def tokenizer_dir(model: Any) -> str | None:
    """The directory of ``model``'s tokenizer: its own directory if that holds tokenizer files, else its
    source's (a converted directory copied without them still names its source); None if neither does."""
    return next((d for d in _tokenizer_places(model) if has_tokenizer(Path(d).expanduser())), None)


def tokenizer_places(model: Any) -> str:
    """Where ``tokenizer_dir`` looks, for an error that says where no tokenizer was found."""
    return " or ".join(_tokenizer_places(model)) or "the model (in memory, no source recorded)"


def check_template(tokenizer: Any) -> None:
    """Refuse a tokenizer without a chat template: there is no way to render messages for its model."""
    if not getattr(tokenizer, "chat_template", None):
        raise RnnifyError(
            "the tokenizer has no chat template; give a plain text prompt (rnnify generate, model.generate(text))"
        )


def render(
    tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, continue_final_message: bool = False
) -> str:
    """``messages`` as the tokenizer's chat template writes them, with the assistant header when
    ``generation_prompt``, the last message left open when ``continue_final_message``; a template
    that fails on them is one ``RnnifyError``."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            continue_final_message=continue_final_message,
        )
    except Exception as exc:  # jinja raises its own types, and templates raise_exception() on bad turns
        raise RnnifyError(f"the chat template cannot render this conversation ({exc})") from exc


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered ``text``: without the tokenizer's special tokens, as templates write their own bos."""
    return tokenizer(text, add_special_tokens=False).input_ids
