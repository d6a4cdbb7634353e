"""Streaming token batches for distillation and evaluation.

``token_batches`` turns text files, a folder, a ``.jsonl`` file or token-id tensors into
fixed-shape batches without reading the corpus into memory, and gives every rank of a
data-parallel run its slice of the same global batches, so results do not depend on how many
processes share the work.
"""

from __future__ import annotations

import codecs
import json
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rnnify.choices import DEFAULT_SEQ_LEN
from rnnify.errors import RnnifyError, check_int
from rnnify.runtime.tokenizer import (
    TOKENIZER_FILES,
    TOKENIZER_FIX,
    load_tokenizer,
    tokenizer_dir,
    tokenizer_places,
)

__all__ = [
    "DEFAULT_SEQ_LEN",
    "TOKENIZER_FILES",
    "adds_bos",
    "check_sizes",
    "load_tokenizer",
    "read_text",
    "row_length",
    "token_batches",
    "tokenizer_dir",
    "tokenizer_for",
    "tokenizer_places",
]

_PIECE_CHARS = 1 << 20  # text files are tokenized in line-aligned pieces of about this many characters
_TOKENIZE_DOCS = 64  # documents per tokenizer call: fast tokenizers batch, Python overhead amortised
_SNIFF_BYTES = 8192  # a folder's file is text if this many leading bytes hold no NUL and decode as UTF-8


def token_batches(
    data: Any,
    tokenizer: Any = None,
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    max_tokens: int | None = None,
    skip_batches: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``{"input_ids": LongTensor[b, seq_len], "attention_mask": BoolTensor[b, seq_len]}``.

    ``data`` is one of:

    - a text file, a folder or a ``.jsonl`` file (lines of ``{"text": ...}``): needs ``tokenizer``
      (an HF tokenizer or a directory to load one from, ``load_tokenizer``). A folder is read
      recursively: every regular file whose first 8 KiB hold no NUL byte and decode as UTF-8
      (``.jsonl`` files as jsonl), skipping hidden names (``.git``); the sorted file list is
      shuffled with ``seed``. A file is one document (jsonl: a line is), tokenized without special
      tokens; documents are packed back to back into rows of ``seq_len`` tokens, each followed by
      the tokenizer's EOS id (by nothing if it has none) and, if the tokenizer starts its own
      encodings with BOS (Llama's; not GPT-2's), preceded by the BOS id, so the model sees
      documents as it was trained to; a row starts wherever the packing cuts. Files over 1 MiB are
      tokenized in line-aligned pieces.
    - a LongTensor ``[N, T]``, a dict with ``input_ids`` (and optionally ``attention_mask``,
      either padding side), or an iterable of these: rows are taken in order and not packed; a
      row's real tokens longer than ``seq_len`` are split into consecutive rows of ``seq_len``.

    ``batch_size`` is the global batch; rank ``r`` of ``world_size`` gets rows ``[r*b, (r+1)*b)``
    of every global batch (``b = batch_size // world_size``), so any number of ranks sees the
    same rows. The last row and batch are padded on the right with id 0 and mask False: a causal
    model's real positions never see later padding, so run the model without this mask (a
    ``RecurrentModel``'s ``attention_mask`` means left padding) and drop masked positions from
    losses. A last batch in which some rank would get no real token is dropped, so with several
    ranks the run can end one global batch earlier than with one.

    ``max_tokens`` caps the real tokens of all global batches together, counted from the start
    of the data; ``skip_batches`` skips the first global batches (to resume from a checkpoint), so
    a resumed run sees exactly the batches the uninterrupted one would. Skipping still reads and
    tokenizes the skipped data (packing depends on every token before), only the batch tensors
    are not built: resuming late in a large corpus takes as long as tokenizing that part again.
    """
    _check_sizes(seq_len, batch_size, rank, world_size, max_tokens, skip_batches)
    if isinstance(data, (str, os.PathLike)):
        path = Path(data).expanduser()
        rows = _pack(_tokenize(_documents(_text_files(path, seed)), _tokenizer(tokenizer, path)), seq_len)
        name = str(path)
    else:
        rows = _split(_tensor_rows(data), seq_len)
        name = "the given token ids"
    if max_tokens is not None:
        rows = _limit(rows, max_tokens)
    return _batches(rows, name, seq_len, batch_size, rank, world_size, skip_batches)


def check_sizes(seq_len: int, batch_size: int, max_tokens: int | None) -> None:
    """``token_batches``' tokens per row, rows per global batch and token limit (None: all the data),
    checked; ``distill`` checks them before anything loads."""
    check_int("seq_len (--seq-len)", seq_len, 1, RnnifyError)
    check_int("batch_size (--batch-size)", batch_size, 1, RnnifyError)
    if max_tokens is not None:
        check_int("max_tokens (--max-tokens)", max_tokens, 1, RnnifyError, " (or None: all the data)")


def _check_sizes(seq_len, batch_size, rank, world_size, max_tokens, skip_batches) -> None:
    check_sizes(seq_len, batch_size, max_tokens)
    check_int("world_size", world_size, 1, RnnifyError)
    check_int("skip_batches", skip_batches, 0, RnnifyError)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise RnnifyError(f"rank must be in [0, {world_size}) for world_size {world_size}, got {rank!r}")
    if batch_size % world_size:
        raise RnnifyError(
            f"batch_size {batch_size} (the global batch) is not divisible by world_size {world_size}; "
            f"use a multiple of {world_size}"
        )


# -- text ---------------------------------------------------------------------------------


def tokenizer_for(model: Any, data: Any, tokenizer: Any = None) -> Any:
    """``tokenizer``, or for text ``data`` without one the model's (``tokenizer_dir``).

    Evaluation and distillation both use this, so they read the same text as the same tokens.
    """
    if tokenizer is not None or not isinstance(data, (str, os.PathLike)):
        return tokenizer
    directory = tokenizer_dir(model)
    if directory is None:
        raise RnnifyError(f"{data} is text, but no tokenizer files are in {tokenizer_places(model)}; {TOKENIZER_FIX}")
    return directory


def row_length(model: Any, seq_len: int | None) -> int:
    """Tokens per row for ``model``: ``seq_len``, by default ``DEFAULT_SEQ_LEN`` or the model's position
    limit if lower. Checked before anything large loads: at least 2 (a next-token target needs a
    token before it) and within the model's token limit (GPT-2's learned ``n_positions``), past which
    it cannot run at all."""
    hard = model.manifest.token_limit()
    if seq_len is None:
        limits = [DEFAULT_SEQ_LEN, model.manifest.positions.get("limit"), hard and hard[0]]
        return min(limit for limit in limits if limit)
    check_int("seq_len (--seq-len)", seq_len, 2, RnnifyError, " (a next-token target needs a token before it)")
    if hard is not None and seq_len > hard[0]:
        raise RnnifyError(
            f"seq_len (--seq-len) {seq_len} is past the model's {hard[0]} {hard[1]}; use at most {hard[0]}"
        )
    return seq_len


def _tokenizer(tokenizer: Any, data: Path):
    """``tokenizer`` itself, or loaded from the directory it names."""
    if tokenizer is None:
        raise RnnifyError(
            f"{data} is text and needs a tokenizer: {TOKENIZER_FIX} (a Hugging Face tokenizer or "
            "a directory holding one), or pass token ids as a LongTensor"
        )
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer)
    return tokenizer


def _is_text(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as exc:
        raise RnnifyError(f"cannot read {path}: {exc.strerror or exc}; fix its permissions or move it out") from exc
    if b"\0" in head:
        return False
    try:  # not final when the file goes on: the 8 KiB may end inside a multi-byte character
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _SNIFF_BYTES)
    except UnicodeDecodeError:
        return False
    return True


def read_text(data: str | os.PathLike, max_chars: int, seed: int = 0) -> str:
    """Up to ``max_chars`` characters of the text at ``data`` (what ``token_batches`` reads as text), its
    files in the order ``seed`` gives them: real prose for a probe to fill its prompts with."""
    out, size = [], 0
    for text, _ in _documents(_text_files(Path(data).expanduser(), seed)):
        out.append(text)
        size += len(text)
        if size >= max_chars:
            break
    return "".join(out)[:max_chars]


def _text_files(path: Path, seed: int) -> list[Path]:
    """The files to read, in the order ``seed`` gives them."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise RnnifyError(f"data {path} does not exist; pass a text file, a folder of text files or a .jsonl file")
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [Path(root, n) for n in names if not n.startswith(".") and Path(root, n).is_file()]
    files = sorted(f for f in files if _is_text(f))
    if not files:
        raise RnnifyError(
            f"folder {path} holds no text files (hidden names and files with NUL bytes or invalid UTF-8 "
            "in their first 8 KiB are skipped); point --data at text"
        )
    random.Random(seed).shuffle(files)
    return files


def _documents(files: list[Path]) -> Iterator[tuple[str, bool]]:
    """``(text, ends_document)`` pieces, file by file and line by line."""
    for path in files:
        try:
            yield from (_jsonl(path) if path.suffix == ".jsonl" else _text_pieces(path))
        except UnicodeDecodeError as exc:
            raise RnnifyError(
                f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); convert or remove it"
            ) from exc
        except OSError as exc:
            raise RnnifyError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _text_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    piece: list[str] = []
    size, pieces = 0, 0
    with open(path, encoding="utf-8", newline="") as f:
        for line in f:
            piece.append(line)
            size += len(line)
            if size >= _PIECE_CHARS:
                yield "".join(piece), False
                piece, size, pieces = [], 0, pieces + 1
    if piece or pieces:  # an empty file is no document (and gets no EOS)
        yield "".join(piece), True


def _jsonl(path: Path) -> Iterator[tuple[str, bool]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise RnnifyError(
                    f'{path}:{number} is not JSON ({exc}); each line must be an object like {{"text": "..."}}'
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise RnnifyError(
                    f'{path}:{number} has no string "text" field; each line must be an object like {{"text": "..."}}'
                )
            if record["text"]:
                yield record["text"], True


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer`` starts its own encodings with its BOS id (Llama's do; GPT-2's do not)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    first = tokenizer("x")["input_ids"][:1]
    return first == [bos] and tokenizer("x", add_special_tokens=False)["input_ids"][:1] != first


def _tokenize(pieces: Iterator[tuple[str, bool]], tokenizer) -> Iterator[torch.Tensor]:
    """Token ids per piece, with the EOS id after each document's last piece and, for a tokenizer
    that adds BOS itself, the BOS id before its first."""
    eos = getattr(tokenizer, "eos_token_id", None)
    bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None
    batch: list[tuple[str, bool]] = []
    starts = [True]  # the next piece starts a document

    def flush() -> Iterator[torch.Tensor]:
        ids = tokenizer([text for text, _ in batch], add_special_tokens=False, verbose=False)["input_ids"]
        for tokens, (_, end) in zip(ids, batch):
            if starts[0] and bos is not None:
                tokens = [bos, *tokens]
            if end and eos is not None:
                tokens = [*tokens, eos]
            starts[0] = end
            if tokens:
                yield torch.tensor(tokens, dtype=torch.long)
        batch.clear()

    for piece in pieces:
        batch.append(piece)
        if len(batch) == _TOKENIZE_DOCS:
            yield from flush()
    if batch:
        yield from flush()


def _pack(segments: Iterator[torch.Tensor], seq_len: int) -> Iterator[torch.Tensor]:
    """Concatenate segments and cut them into rows of ``seq_len`` (the last row shorter)."""
    pending: list[torch.Tensor] = []
    have = 0
    for segment in segments:
        pending.append(segment)
        have += len(segment)
        if have >= seq_len:
            flat = torch.cat(pending)
            full = have - have % seq_len
            yield from flat[:full].split(seq_len)
            pending, have = [flat[full:]], have - full
    if have:
        yield torch.cat(pending)


# -- token ids ----------------------------------------------------------------------------


def _tensor_rows(data: Any) -> Iterator[torch.Tensor]:
    """The real tokens of each row, checking each item as it comes."""
    if isinstance(data, (torch.Tensor, Mapping)):
        items: Iterable = [data]
    elif isinstance(data, Iterable):
        items = data
    else:
        raise RnnifyError(
            f"data must be a path, a LongTensor [N, T], a dict with input_ids or an iterable of these, "
            f"got {type(data).__name__}"
        )
    checked: Iterable = (_check_item(item, i) for i, item in enumerate(items))
    if isinstance(items, (list, tuple)):  # check eagerly what is already in memory
        checked = list(checked)
    return (row[keep] for ids, mask in checked for row, keep in zip(ids, mask))


def _check_item(item: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N, T] long, mask [N, T] bool)`` of one item."""
    where = f"token ids item {index}"
    mask = None
    if isinstance(item, Mapping):
        if "input_ids" not in item:
            raise RnnifyError(f"{where} is a dict without input_ids; give {{'input_ids': LongTensor [N, T], ...}}")
        ids, mask = item["input_ids"], item.get("attention_mask")
    else:
        ids = item
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dtype.is_floating_point
        or ids.dtype.is_complex
        or ids.dtype == torch.bool
    ):
        got = f"a {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise RnnifyError(f"{where} must be an integer tensor of token ids (torch.long), got {got}")
    if ids.dim() != 2:
        raise RnnifyError(f"{where} has shape {tuple(ids.shape)}; token ids must be [N, T] (use ids[None] for one row)")
    if ids.numel() and int(ids.min()) < 0:
        raise RnnifyError(f"{where} holds negative token ids; token ids must be >= 0")
    if mask is None:
        mask = torch.ones(ids.shape, dtype=torch.bool)
    elif not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise RnnifyError(f"{where}: attention_mask {shape} must be a tensor shaped like input_ids {tuple(ids.shape)}")
    return ids.long().cpu(), mask.bool().cpu()


def _split(rows: Iterator[torch.Tensor], seq_len: int) -> Iterator[torch.Tensor]:
    for row in rows:
        if len(row):  # a row of only padding is no row
            yield from row.split(seq_len)


# -- batches ------------------------------------------------------------------------------


def _limit(rows: Iterator[torch.Tensor], max_tokens: int) -> Iterator[torch.Tensor]:
    left = max_tokens
    for row in rows:
        if len(row) >= left:
            yield row[:left]
            return
        left -= len(row)
        yield row


def _groups(rows: Iterator[torch.Tensor], size: int) -> Iterator[list[torch.Tensor]]:
    group: list[torch.Tensor] = []
    for row in rows:
        group.append(row)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _batches(
    rows: Iterator[torch.Tensor],
    name: str,
    seq_len: int,
    batch_size: int,
    rank: int,
    world_size: int,
    skip_batches: int,
) -> Iterator[dict[str, torch.Tensor]]:
    b = batch_size // world_size
    empty = True
    for index, group in enumerate(_groups(rows, batch_size)):
        empty = False
        if index < skip_batches:
            continue
        if len(group) <= (world_size - 1) * b:  # the last batch, and some rank would get only padding
            return
        ids = torch.zeros(b, seq_len, dtype=torch.long)
        mask = torch.zeros(b, seq_len, dtype=torch.bool)
        for i, row in enumerate(group[rank * b : (rank + 1) * b]):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = True
        yield {"input_ids": ids, "attention_mask": mask}
    if empty:
        raise RnnifyError(f"{name} holds no tokens; give non-empty data")
