"""How close a converted model is to its original, measured on real data.

``verify`` proves a model computes what it claims on random tokens; ``evaluate`` says how much an
approximate target costs on text: perplexity of both models, KL(original || converted) per token,
and each layer's attention error with the layer fed the original model's activations (teacher
forcing, ``rnnify.original.attention_transfer``), so one bad layer does not hide behind the others.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from rnnify.choices import EVAL_BATCH_SIZE
from rnnify.data import row_length, token_batches, tokenizer_for
from rnnify.errors import RnnifyError
from rnnify.original import LayerError, attention_transfer, load_teacher, local_source, teacher_logits
from rnnify.original.outputs import OriginalOutputs, content_digest
from rnnify.runtime.manifest import MANIFEST_FILE
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.output_dir import replace_file
from rnnify.runtime.storage import load, load_or_take

__all__ = ["CopyKL", "EvalResult", "PositionKL", "copy_kinds", "evaluate", "position_ranges", "write_json"]

COPY_SPAN = 4  # tokens of a repeat: the next token and the 3 before it
COPY_WINDOW = 64  # as far back as a copy is "near": the first of ``position_ranges``, a common window
COPY_KINDS = ("new", f"copy within {COPY_WINDOW}", f"copy beyond {COPY_WINDOW}")  # ``copy_kinds`` codes 0, 1, 2
# positions whose log-probabilities a row's metrics hold at once: long rows cost the two models'
# logits, not several vocabulary-wide copies of them
METRIC_POSITIONS = 1024


@dataclass
class PositionKL:
    """KL(teacher || converted) per real token at row positions [start, end)."""

    start: int
    end: int
    kl: float
    tokens: int


@dataclass
class CopyKL:
    """KL(teacher || converted) per token at the positions of one kind of ``copy_kinds``."""

    kind: str  # "new", "copy within 64" or "copy beyond 64"
    kl: float
    tokens: int


def position_ranges(seq_len: int) -> list[tuple[int, int]]:
    """[0, 64), [64, 128), [128, 256), ... up to ``seq_len``: where a constant-state model's error
    grows with the context it has read (a 64-token window is exact in the first range)."""
    edges = [0, *(2**k for k in range(6, seq_len.bit_length()) if 2**k < seq_len), seq_len]
    return list(zip(edges[:-1], edges[1:]))


def copy_kinds(ids: torch.Tensor, window: int = COPY_WINDOW, span: int = COPY_SPAN) -> torch.Tensor:
    """For each position t < T - 1 of a row ``ids [T]``, what predicting token t + 1 asks of the
    context: 0 (new) if the ``span`` tokens ending at t + 1 did not occur earlier in the row,
    1 (copy within ``window``) if they last did ending at most ``window`` positions before,
    2 (copy beyond ``window``) if only further back. Copies from beyond the window are text a
    windowed model cannot see and its memory has to carry (repeated names, quoted code), so they
    show how much of a constant-state model's KL is recall and how much is the rest."""
    kinds, last = [0] * max(len(ids) - 1, 0), {}
    tokens = ids.tolist()
    for t in range(span - 2, len(tokens) - 1):
        key = tuple(tokens[t - span + 2 : t + 2])
        if key in last:
            kinds[t] = 1 if last[key] >= t - window else 2
        last[key] = t
    return torch.tensor(kinds, dtype=torch.long)


@dataclass
class EvalResult:
    """Metrics over the real tokens of the evaluated data (padding never counts)."""

    model: str  # the converted model's directory, or "(in memory)"
    target: str  # with its layer rules counted (``RecurrentModel.target_in_words``), as the header says
    against: str  # the model compared with
    seq_len: int
    batch_size: int
    tokens: int  # real tokens read
    perplexity: float  # converted model, next-token, over `predicted` targets
    teacher_perplexity: float
    predicted: int  # next-token targets: real tokens that follow a real token in their row
    kl: float  # KL(teacher || converted) in nats per real token
    top1_agreement: float  # share of real positions where both models' most likely next token agree
    state_bytes: int  # recurrent state per sequence after seq_len tokens
    layers: list[LayerError]  # per cell: mean over real tokens of ||cell - softmax|| / ||softmax||, and MSE
    kl_by_position: list[PositionKL]  # KL over the positions of each range (``position_ranges``)
    kl_by_copy: list[CopyKL]  # KL over the positions with a next token, by ``copy_kinds``

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def evaluate(
    model_or_dir: RecurrentModel | str | os.PathLike,
    data: Any,
    *,
    against: str | os.PathLike | torch.nn.Module | None = None,
    seq_len: int | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    max_tokens: int | None = None,
    tokenizer: Any = None,
    device: torch.device | str | None = None,
    kernels: str | None = None,
    layer_errors: bool = True,
    cache: bool = True,
    prefill_chunk: int | None = None,
    progress: bool = False,
) -> EvalResult:
    """Evaluate a converted model on ``data`` (anything ``rnnify.data.token_batches`` reads).

    ``against`` is the model to compare with: a Hugging Face directory or loaded model, or
    another rnnify directory; by default the source recorded in the manifest. ``seq_len``
    defaults to 1024, or the model's position limit if lower (``rnnify.data.row_length``). Text is
    tokenized with ``tokenizer``, by default the one saved with the model, else its source's
    (``rnnify.data.tokenizer_for``). ``device`` and ``kernels`` are how a directory is loaded
    (``rnnify.load``'s meanings: default the CPU and the recorded kernels); a loaded model runs as
    it is. ``layer_errors=False`` skips the per-layer attention error, a second pass of the
    converted model. ``cache=False`` recomputes the original's logits instead of reading (and
    storing) them in the user's cache (``rnnify.original.outputs``). ``prefill_chunk`` reads each
    row ``prefill_chunk`` tokens at a time in both models (the converted one from its state, the
    original through its KV cache): less memory for long rows, the same logits within float error;
    the per-layer errors need whole rows, so it goes with ``layer_errors=False``; the cache holds the
    original's logits however they were read (equal within float error). ``progress``
    shows a tqdm bar of tokens on a terminal.
    """
    if prefill_chunk is not None and prefill_chunk < 1:
        raise RnnifyError(f"the prefill chunk must be at least 1 token, got {prefill_chunk}")
    if prefill_chunk is not None and layer_errors:
        raise RnnifyError("each layer's attention error needs whole rows: read rows in chunks with layer_errors=False")
    model = load_or_take(model_or_dir, device, kernels, "evaluate")
    seq_len = row_length(model, seq_len)
    # the data's mistakes surface here, before the (possibly large) teacher loads
    batches = token_batches(
        data, tokenizer_for(model, data, tokenizer), seq_len=seq_len, batch_size=batch_size, max_tokens=max_tokens
    )
    teacher, teacher_name = _teacher(model, against, cache, prefill_chunk)
    sums = _Sums(len(model.cells), seq_len)
    from rnnify.progress import bar

    with bar(progress, total=max_tokens, unit="tok", desc="evaluate", leave=False) as shown:
        for batch in batches:
            real = _evaluate_batch(model, teacher, batch, sums, layer_errors, prefill_chunk)
            shown.update(real)
    if sums.predicted == 0:
        raise RnnifyError("no token follows another in the data's rows: give rows of at least 2 tokens")
    layers = (
        [
            LayerError(entry.layer, entry.module, mse / max(n, 1), rel / max(n, 1), int(n))
            for entry, (mse, rel, n) in zip(model.manifest.cells, sums.layers.tolist())
        ]
        if layer_errors
        else []
    )
    return EvalResult(
        model=str(model.path) if model.path is not None else "(in memory)",
        target=model.target_in_words,
        against=teacher_name,
        seq_len=seq_len,
        batch_size=batch_size,
        tokens=int(sums.tokens),
        perplexity=math.exp(sums.nll / sums.predicted),
        teacher_perplexity=math.exp(sums.teacher_nll / sums.predicted),
        predicted=int(sums.predicted),
        kl=float(sums.position_kl[:, 0].sum()) / sums.tokens,
        top1_agreement=sums.agree / sums.tokens,
        state_bytes=model.state_nbytes(seq_len),
        layers=layers,
        kl_by_position=[
            PositionKL(start, end, kl / max(n, 1), int(n))
            for (start, end), (kl, n) in zip(sums.ranges, sums.position_kl.tolist())
        ],
        kl_by_copy=[CopyKL(kind, kl / max(n, 1), int(n)) for kind, (kl, n) in zip(COPY_KINDS, sums.copy_kl.tolist())],
    )


def write_json(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it): never half a file."""
    path = Path(path).expanduser()
    try:
        replace_file(path, lambda file: file.write((json.dumps(data, indent=1) + "\n").encode()))
    except OSError as exc:
        raise RnnifyError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _prefill_logits(model: RecurrentModel, ids: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """The converted model's logits for ``ids``: one prefill, or one per ``chunk`` tokens from the state."""
    if chunk is None:
        return model.prefill(ids)[0]
    state, pieces = None, []
    for start in range(0, ids.shape[1], chunk):
        logits, state = model.prefill(ids[:, start : start + chunk], state)
        pieces.append(logits)
    return torch.cat(pieces, dim=1)


def _teacher(
    model: RecurrentModel, against, cache: bool, chunk: int | None = None
) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """A function from token ids to the compared model's logits (read ``chunk`` tokens at a time
    when given), and that model's name.

    An original given as a local directory loads on the first row the cache (``cache``,
    ``rnnify.original.outputs``) does not hold: a sweep that has seen the rows never loads it.
    """
    if against is None:
        against = local_source(model, "--against (command line) or against= (Python)")
    if isinstance(against, (str, os.PathLike)) and (Path(against).expanduser() / MANIFEST_FILE).is_file():
        against = load(against, device=model.device)
    if isinstance(against, RecurrentModel):
        other = against
        if other.manifest.vocab_size != model.manifest.vocab_size:
            raise RnnifyError(
                f"the compared model has a vocabulary of {other.manifest.vocab_size} tokens but the evaluated "
                f"model has {model.manifest.vocab_size}; compare models with the same tokenizer"
            )
        return (lambda ids: _prefill_logits(other, ids, chunk)), str(other.path or "(in memory)")
    if not isinstance(against, (str, os.PathLike)):
        teacher = load_teacher(model, against)
        return (lambda ids: teacher_logits(teacher, ids, chunk)), type(against).__name__
    loaded: list[torch.nn.Module] = []

    def logits(ids: torch.Tensor) -> torch.Tensor:
        if not loaded:
            loaded.append(load_teacher(model, against))
        return teacher_logits(loaded[0], ids, chunk)

    digest = content_digest(against) if cache else None
    outputs = OriginalOutputs(None if digest is None else f"{digest}:{model.dtype}", logits)
    return outputs.logits, str(against)


class _Sums:
    """Running sums over batches, in float64."""

    def __init__(self, cells: int, seq_len: int):
        self.tokens = self.predicted = self.nll = self.teacher_nll = self.agree = 0.0
        self.layers = torch.zeros(cells, 3, dtype=torch.float64)  # per cell: mse sum, rel sum, tokens
        self.ranges = position_ranges(seq_len)
        self.position_kl = torch.zeros(len(self.ranges), 2, dtype=torch.float64)  # per range: KL sum, tokens
        # the range of each row position
        self.range_index = torch.cat([torch.full((end - start,), i) for i, (start, end) in enumerate(self.ranges)])
        self.copy_kl = torch.zeros(len(COPY_KINDS), 2, dtype=torch.float64)  # per copy kind: KL sum, tokens


@torch.no_grad()
def _evaluate_batch(
    model: RecurrentModel, teacher, batch: dict[str, torch.Tensor], sums: _Sums, layer_errors: bool, chunk: int | None
) -> int:
    """Add one batch to ``sums``; returns its real tokens.

    Rows are right-padded, so every call runs without a mask (causal: real positions never see
    the padding) and masked positions are dropped from every sum. Columns past the longest row's
    last real token are cut first: a short last batch (``max_tokens``) is not computed at the full
    row length, nor read at positions it never scores. Metrics go row by row so that at most the
    two models' logits are held at full batch size.
    """
    width = int(batch["attention_mask"].sum(1).max())
    ids = batch["input_ids"][:, :width].to(model.device)
    mask = batch["attention_mask"][:, :width].to(model.device)
    if layer_errors:
        with attention_transfer(model, teacher_forcing=True) as recorder:
            recorder.loss_mask = mask
            model.prefill(ids)
            for i, layer in enumerate(recorder.errors()):
                sums.layers[i] += torch.tensor([layer.mse * layer.tokens, layer.rel_error * layer.tokens, layer.tokens])
    logits, original = _prefill_logits(model, ids, chunk), teacher(ids)
    for row in range(ids.shape[0]):
        _add_row(sums, logits[row], original[row], ids[row], mask[row])
    return int(mask.sum())


def _add_row(
    sums: _Sums, logits: torch.Tensor, teacher_logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor
) -> None:
    """Add one row's metrics, ``METRIC_POSITIONS`` positions of log-probabilities at a time."""
    length = ids.shape[0]
    follows = torch.zeros_like(mask)  # right padding: a real target follows a real token
    follows[:-1] = mask[1:]
    kl = torch.zeros(length, dtype=torch.float64, device=logits.device)  # KL(teacher || converted) per position
    for start in range(0, length, METRIC_POSITIONS):
        end = min(start + METRIC_POSITIONS, length)
        logp, teacher_logp = (
            logits[start:end].float().log_softmax(-1),
            teacher_logits[start:end].float().log_softmax(-1),
        )
        targets = ids[start + 1 : end + 1, None]  # one fewer than the positions at the row's end
        real = follows[start : start + targets.shape[0]]
        sums.nll -= float(logp[: targets.shape[0]].gather(-1, targets).squeeze(-1)[real].double().sum())
        sums.teacher_nll -= float(teacher_logp[: targets.shape[0]].gather(-1, targets).squeeze(-1)[real].double().sum())
        kl[start:end] = F.kl_div(logp, teacher_logp, log_target=True, reduction="none").sum(-1).double()
        sums.agree += int((logp.argmax(-1) == teacher_logp.argmax(-1))[mask[start:end]].sum())
    predicted = int(follows.sum())  # so the first `predicted` positions have a real next token
    sums.predicted += predicted
    kl = torch.where(mask, kl.clamp_min(0), 0.0)  # >= 0 per position; below is float rounding
    per_range = torch.zeros_like(sums.position_kl, device=kl.device)
    per_range.index_add_(0, sums.range_index[:length].to(kl.device), torch.stack([kl, mask.double()], -1))
    sums.position_kl += per_range.cpu()
    counted = torch.stack([kl[:predicted].cpu(), torch.ones(predicted, dtype=torch.float64)], -1)
    sums.copy_kl.index_add_(0, copy_kinds(ids[: predicted + 1].cpu()), counted)
    sums.tokens += int(mask.sum())
