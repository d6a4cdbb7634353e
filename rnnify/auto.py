"""``convert --to auto``: which kv heads keep softmax, under a memory budget or a quality bound.

The idea: docs/math.md §Retrieval and streaming heads. Most heads lose almost nothing as a window
with sinks ("streaming"); a few read far back ("retrieval") and must stay ``exact``. Each kv head
is scored on calibration rows (real text, plus pass-key prompts made here with their answers
appended) with the original model, its attention replaced by a probe that can window any heads:

- ``mass``: the attention its query heads put beyond the window and sinks (one forward pass);
- ``kl``: KL(original || this head alone windowed) per scored token (one pass per kv head).

Text scores every token; a pass-key prompt scores only the positions that predict its key. A
head's score is the mean over text plus the mean over pass-key answers. ``choose`` then starts
from every head windowed and makes heads exact by score per byte while the state at ``context``
tokens fits the budget, or, for ``max_kl``, makes the best-scored heads exact until the measured
KL of the whole assignment is at most the bound (a bisection on their number).

With ``retrieval_window`` the heads chosen keep a long window (``retrieval_window`` tokens and the
sinks) instead of the whole context: the state stops growing at that window, so the model decodes in
constant memory, and a head's cost is counted at ``min(context, retrieval_window)`` tokens. The
scores stay those of the short window (what a head loses when it streams).

With ``memory`` the streaming heads are hybrids: the window and a memory of what left it
(``cells.hybrid``), gated off at first, so the scores and the choice are those of the window and
distillation then trains the memories (docs/fidelity-smollm2.md's per-head hybrid). ``memory_options``
are those hybrids' other cell options (a feature map, ``share``, ``anneal``, ``memory_init``...): the
budget counts the state they make, and the choice is still scored on the windows.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

from rnnify.cells import CellSpec
from rnnify.errors import RnnifyError

__all__ = ["SCORES", "Calibration", "HeadReport", "HeadScorer", "auto_convert", "calibration_rows", "choose", "choose_heads",
           "convert_chosen", "head_costs", "layers_spec", "measure_kl", "read_scores", "score_heads"]

SCORES = ("kl", "mass")
# kl: on SmolLM2 its choices' calibration KL was a fraction of mass's; on the bundled model they tied but
# for one budget (docs/fidelity.md). mass costs 1/(kv heads + 1) of the passes.
DEFAULT_SCORE = "kl"
WINDOW, SINKS = 64, 4
_PROBE = "rnnify_head_probe"
Head = tuple[int, int]  # (layer, kv head)
Options = Mapping[str, Any] | None  # the streaming hybrids' cell options besides window, sinks and memory


@dataclass
class Calibration:
    """Rows ``[1, T]`` and, per row, the float weights ``[T]`` of the positions whose prediction counts."""

    rows: list[torch.Tensor]
    weights: list[torch.Tensor]
    kinds: list[str]  # "text" or "passkey": the two means a score adds


def calibration_rows(tokenizer: Any, data: Any, seq_len: int, rows: int, passkey: int, seed: int = 0) -> Calibration:
    """``rows`` rows of ``seq_len`` tokens of ``data`` (``rnnify.data.token_batches``) and ``passkey``
    pass-key prompts of at most ``seq_len`` tokens, each with its answer appended."""
    from rnnify.data import token_batches
    from rnnify.passkey import passkey_prompts

    out = Calibration([], [], [])
    if rows:
        for batch in token_batches(data, tokenizer, seq_len=seq_len, batch_size=1, max_tokens=rows * seq_len, seed=seed):
            if bool(batch["attention_mask"].all()):  # the last, padded row is left out
                out.rows.append(batch["input_ids"])
                out.weights.append(torch.ones(seq_len))
                out.kinds.append("text")
        if not out.rows:
            raise RnnifyError(f"the calibration data holds fewer than {seq_len} tokens: give more text or a lower --calib-len")
    if passkey:
        for _, prompt in passkey_prompts(tokenizer, [seq_len - 8], passkey, seed):
            answer = tokenizer(f" {prompt.key}.", add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt.ids + answer])
            weights = torch.zeros(ids.shape[1])
            weights[len(prompt.ids) - 1 : ids.shape[1] - 1] = 1.0  # the positions that predict the answer
            out.rows.append(ids)
            out.weights.append(weights)
            out.kinds.append("passkey")
    return out


class _Probe:
    """An attention function for transformers' ``AttentionInterface``: softmax attention in which
    each kv head in ``windowed`` sees only the last ``windowed[head]`` tokens and the first
    ``sinks``; with ``mass`` set it adds, per (layer, kv head), the weighted attention mass beyond
    the last ``window`` tokens and the sinks."""

    def __init__(self, window: int, sinks: int):
        self.window, self.sinks = window, sinks
        self.windowed: dict[Head, int] = {}
        self.weights: torch.Tensor | None = None  # [T] of the row running, for ``mass``
        self.mass: dict[Head, float] | None = None
        self.calls = 0

    def __call__(self, module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        self.calls += 1
        layer, (_, heads, length, dim) = module.layer_idx, query.shape
        kv_heads = key.shape[1]
        group = heads // kv_heads
        i = torch.arange(length, device=query.device)[:, None]
        j = torch.arange(length, device=query.device)[None, :]
        causal = j <= i
        stream = causal & ((i - j < self.window) | (j < self.sinks))
        windows = torch.tensor([self.windowed.get((layer, h // group), length) for h in range(heads)], device=query.device)
        allowed = causal & ((i - j < windows[:, None, None]) | (j < self.sinks))
        scores = (query.float() @ key.float().repeat_interleave(group, 1).transpose(-1, -2)) * (scaling or dim**-0.5)
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        if self.mass is not None:
            beyond = (p * (causal & ~stream)).sum(-1)  # [B, H, T]
            per_head = (beyond * self.weights).sum(-1).sum(0).reshape(kv_heads, group).mean(-1) / self.weights.sum()
            for h in range(kv_heads):
                self.mass[(layer, h)] = self.mass.get((layer, h), 0.0) + float(per_head[h])
        out = p @ value.float().repeat_interleave(group, 1)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


@contextmanager
def _probed(source: torch.nn.Module, probe: _Probe) -> Iterator[_Probe]:
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE, probe)
    before = source.config._attn_implementation
    try:
        source.set_attn_implementation(_PROBE)
    except (ValueError, AttributeError) as exc:
        raise RnnifyError(f"--to auto needs a model whose attention uses transformers' attention interface ({exc})") from exc
    try:
        yield probe
    finally:
        source.set_attn_implementation(before)


def _logits(source: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return source(input_ids=ids.to(next(source.parameters()).device), use_cache=False).logits[0].float()


def _kl(want: torch.Tensor, got: torch.Tensor, weights: torch.Tensor) -> float:
    """Weighted mean over positions of KL(want || got)."""
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(want, -1), log_target=True, reduction="none").sum(-1)
    return float((kl * weights.to(kl.device)).sum() / weights.sum())


def _mean_by_kind(values: list[float], kinds: list[str]) -> float:
    """Mean over text rows plus mean over pass-key rows (each kind counts once however many rows)."""
    return sum(sum(v for v, k in zip(values, kinds) if k == kind) / kinds.count(kind) for kind in set(kinds))


def _decoder_layers(source: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder layers in call order (``model.layers`` of Llama-like models), or None."""
    layers = getattr(getattr(source, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


@contextmanager
def _recorded(layers: torch.nn.ModuleList | None, outputs: list) -> Iterator[None]:
    """Append each decoder layer's output to ``outputs`` while the block runs."""
    handles = [layer.register_forward_hook(lambda m, a, out: outputs.append(out)) for layer in layers or ()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _replayed(layers: torch.nn.ModuleList | None, outputs: list, count: int) -> Iterator[None]:
    """The first ``count`` decoder layers return their recorded ``outputs`` instead of computing
    them: windowing a head of layer l changes nothing before it, so a pass need only run from l."""
    if layers is None or len(outputs) != len(layers):
        yield
        return
    for layer, out in zip(list(layers)[:count], outputs):
        layer.forward = lambda *args, _out=out, **kwargs: _out
    try:
        yield
    finally:
        for layer in list(layers)[:count]:
            del layer.forward


@torch.no_grad()
def score_heads(source: torch.nn.Module, calibration: Calibration, window: int, sinks: int, scores=SCORES,
                progress: Callable[[int], None] | None = None) -> tuple[dict[str, dict[Head, float]], list[torch.Tensor]]:
    """Per kv head, each score in ``scores``; and the original's logits per row (for ``measure_kl``).
    ``progress(n)`` is told of each forward pass."""
    step = progress or (lambda n: None)
    probe = _Probe(window, sinks)
    out: dict[str, dict[Head, float]] = {}
    layers = _decoder_layers(source)
    with _probed(source, probe):
        originals, masses, recorded = [], [], []
        for ids, weights in zip(calibration.rows, calibration.weights):
            probe.weights, probe.mass = weights, {}
            recorded.append([])
            with _recorded(layers if "kl" in scores else None, recorded[-1]):
                originals.append(_logits(source, ids))
            masses.append(probe.mass)
            step(1)
        if probe.calls == 0:
            raise RnnifyError("--to auto: this model's attention does not use transformers' attention interface")
        heads = sorted(masses[0])
        probe.mass = None
        if "mass" in scores:
            out["mass"] = {h: _mean_by_kind([m[h] for m in masses], calibration.kinds) for h in heads}
        if "kl" in scores:
            out["kl"] = {}
            for head in heads:
                probe.windowed = {head: window}
                kls = []
                for ids, w, want, before in zip(calibration.rows, calibration.weights, originals, recorded):
                    with _replayed(layers, before, head[0]):
                        kls.append(_kl(want, _logits(source, ids), w))
                out["kl"][head] = _mean_by_kind(kls, calibration.kinds)
                step(len(calibration.rows))
    return out, originals


@torch.no_grad()
def measure_kl(source: torch.nn.Module, calibration: Calibration, originals: list[torch.Tensor],
               windowed: dict[Head, int], sinks: int) -> float:
    """The calibration KL (text mean plus pass-key mean) with each head in ``windowed`` windowed
    to its number of tokens (and the sinks)."""
    probe = _Probe(0, sinks)
    probe.windowed = dict(windowed)
    with _probed(source, probe):
        kls = [_kl(want, _logits(source, ids), w) for ids, w, want in zip(calibration.rows, calibration.weights, originals)]
    return _mean_by_kind(kls, calibration.kinds)


# -- the choice ---------------------------------------------------------------------------


def layer_specs(source: torch.nn.Module) -> list[CellSpec]:
    """The attention shape of each layer, from the model's config (enough for state sizes)."""
    config = source.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = getattr(config, "sliding_window", None)
    return [CellSpec(heads, kv_heads, dim, dim, dim**-0.5, window, config.hidden_size)  # the width: delta memories read x
            for _ in range(config.num_hidden_layers)]


def retrieval_target(retrieval_window: int | None) -> str:
    """The target text of a retrieval head: ``exact``, or a window of ``retrieval_window`` tokens."""
    return "exact" if retrieval_window is None else f"window(window={retrieval_window})"


def layers_spec(specs: list[CellSpec], retrieval: set[Head], retrieval_window: int | None = None) -> str | None:
    """``--layers`` rules that give the heads in ``retrieval`` their ``retrieval_target`` (the rest
    take the ``window`` target)."""
    rules, target = [], retrieval_target(retrieval_window)
    for layer, spec in enumerate(specs):
        heads = sorted(h for lay, h in retrieval if lay == layer)
        if len(heads) == spec.num_kv_heads:
            rules.append(f"{layer}:{target}")
        elif heads:
            rules.append(f"{layer}:heads({','.join(map(str, heads))}={target})")
    return ",".join(rules) or None


def _plan_options(every_head: bool, window: int, sinks: int, retrieval_window: int | None,
                  memory: str | None = None, memory_options: Options = None) -> tuple[str, dict[str, Any]]:
    """The ``--to`` target and options of a choice: the streaming heads' target (``window``, or
    ``hybrid`` with ``memory``) unless every head is exact."""
    if retrieval_window is None and every_head:
        return "exact", {}
    return streaming_target(window, sinks, memory, memory_options)


def streaming_target(window: int, sinks: int, memory: str | None = None,
                     memory_options: Options = None) -> tuple[str, dict[str, Any]]:
    """The target of the heads that stream: a window with sinks, or with ``memory`` a hybrid whose
    memory (gated off at first, unless ``memory_options`` open it: training-free it is that window)
    keeps what leaves the window, with ``memory_options`` its other cell options."""
    if memory is None:
        return "window", {"window": window, "sinks": sinks}
    return "hybrid", {**(memory_options or {}), "window": window, "sinks": sinks, "memory": memory}


def head_costs(specs: list[CellSpec], retrieval: set[Head], context: int, window: int, sinks: int,
               dtype: torch.dtype, retrieval_window: int | None = None, memory: str | None = None,
               memory_options: Options = None) -> int:
    """State bytes per sequence at ``context`` tokens with the heads in ``retrieval`` exact (or
    windowed to ``retrieval_window``), the rest streaming (``streaming_target``): the cells' own
    ``state_nbytes`` (plus the positions), as ``RecurrentModel.state_nbytes`` counts."""
    from rnnify.plan import make_plan

    every_head = len(retrieval) == sum(s.num_kv_heads for s in specs)
    target, options = _plan_options(every_head, window, sinks, retrieval_window, memory, memory_options)
    plan = make_plan(target, layers_spec(specs, retrieval, retrieval_window), **options)
    total = sum(plan.cell_for(layer, spec).state_nbytes(context, 1, dtype) for layer, spec in enumerate(specs))
    return total + torch.empty((), dtype=torch.long).element_size()


def kv_cache_bytes(specs: list[CellSpec], context: int, dtype: torch.dtype) -> int:
    """The original's KV cache per sequence at ``context`` tokens (keys and values of every kv head)."""
    return sum(s.num_kv_heads * (s.head_dim + s.value_dim) for s in specs) * context * dtype.itemsize


@dataclass
class HeadReport:
    """What ``--to auto`` measured and chose; saved as ``head_map.json`` beside the model."""

    score: str
    window: int
    sinks: int
    retrieval_window: int | None  # the retrieval heads' window, or None: they are exact
    context: int
    budget: int | None
    max_kl: float | None
    retrieval: list[Head]  # the heads chosen: exact, or windowed to retrieval_window
    layers: str | None  # the --layers spec that rebuilds the choice (with --to window, or hybrid --memory, --window --sinks)
    scores: dict[str, dict[str, float]]  # score -> "layer.head" -> value
    head_bytes: dict[str, int]  # "retrieval"/"streaming": one kv head's state at `context`
    state_bytes: int  # the chosen model's state per sequence at `context`
    kv_cache_bytes: int  # the original's KV cache at `context`
    calibration_kl: float  # measured with the choice, on the calibration rows
    calibration: dict[str, Any] = field(default_factory=dict)
    memory: str | None = None  # the streaming heads' hybrid memory, or None: they are windows
    memory_options: dict[str, Any] = field(default_factory=dict)  # those hybrids' other cell options

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(json.dumps(self.to_json(), indent=2) + "\n")


def one_head_bytes(spec: CellSpec, window: int | None, sinks: int, context: int, dtype: torch.dtype,
                   memory: str | None = None, memory_options: Options = None) -> int:
    """One kv head's state (with its query group) at ``context`` tokens: exact (``window`` None) or
    ``streaming_target``."""
    from rnnify.cells import build_cell
    from rnnify.cells.heads import part_spec

    target, options = ("exact", {}) if window is None else streaming_target(window, sinks, memory, memory_options)
    return build_cell(target, part_spec(spec, 1), options).state_nbytes(context, 1, dtype)


def choose(scores: dict[Head, float], specs: list[CellSpec], *, context: int, window: int, sinks: int,
           dtype: torch.dtype, budget: int | None = None, kl_of: Callable[[set[Head]], float] | None = None,
           max_kl: float | None = None, units: list[list[Head]] | None = None,
           retrieval_window: int | None = None, memory: str | None = None,
           memory_options: Options = None) -> set[Head]:
    """The retrieval heads: exact, or windowed to ``retrieval_window``; the rest stream. ``units``
    (default: each head alone) are chosen whole, e.g. all heads of a layer for a per-layer choice;
    a unit's score is the sum of its heads'.

    With ``budget``: greedily by score per byte, every unit that still fits; a budget below the
    all-windowed state is an error naming that state. With ``max_kl`` (and ``kl_of``, the measured
    KL of an assignment): the fewest best-scored units whose KL is at most ``max_kl``."""
    units = units or [[h] for h in sorted(scores)]
    unit_score = [sum(scores[h] for h in unit) for unit in units]
    if budget is not None:
        cost = lambda heads: head_costs(specs, heads, context, window, sinks, dtype, retrieval_window,  # noqa: E731
                                        memory, memory_options)
        smallest = cost(set())
        if budget < smallest:
            raise RnnifyError(f"--state-budget {budget:,} bytes cannot be met at {context:,} tokens: the smallest state "
                              f"(every head a {window}-token {'window' if memory is None else memory + ' hybrid'} "
                              f"with {sinks} sinks) is {smallest:,} bytes; give at least that")
        extra = [cost(set(u)) - smallest for u in units]
        order = sorted(range(len(units)), key=lambda i: -unit_score[i] / max(extra[i], 1))
        chosen: set[Head] = set()
        for i in order:
            if cost(chosen | set(units[i])) <= budget:
                chosen |= set(units[i])
        return chosen
    if max_kl is None or kl_of is None:
        raise RnnifyError("--to auto needs --state-budget BYTES (with --at-context N) or --max-kl X")
    order = sorted(range(len(units)), key=lambda i: -unit_score[i])
    first = lambda k: {h for i in order[:k] for h in units[i]}  # noqa: E731
    low, high = 0, len(units)  # KL(first(high)) <= max_kl: every head exact is the original
    if kl_of(first(0)) <= max_kl:
        return set()
    if retrieval_window is not None and (best := kl_of(first(high))) > max_kl:
        raise RnnifyError(f"--max-kl {max_kl:g} cannot be met with --retrieval-window {retrieval_window}: with every "
                          f"head at that window the calibration KL is {best:.4g}; give a longer window or a higher --max-kl")
    while high - low > 1:
        middle = (low + high) // 2
        if kl_of(first(middle)) <= max_kl:
            high = middle
        else:
            low = middle
    return first(high)


def parse_bytes(text: str, kv_cache: Callable[[], int]) -> int:
    """``"250000"``, ``"1.5MB"``, ``"2MiB"`` or ``"30%"`` (of the original's KV cache) -> bytes."""
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    clean = text.strip().upper().replace(" ", "")
    try:
        if clean.endswith("%"):
            return int(float(clean[:-1]) / 100 * kv_cache())
        number = clean.rstrip("KMGIB")
        value = float(number) * units[clean[len(number):]]
    except (ValueError, KeyError):
        raise RnnifyError(f"--state-budget {text!r}: expected bytes, e.g. 2000000, 2MB, 1.5MiB or 30% (of the "
                          "original's KV cache at --at-context)") from None
    if not math.isfinite(value) or value <= 0:
        raise RnnifyError(f"--state-budget {text!r} must be a positive size")
    return int(value)


class HeadScorer:
    """The kv heads of ``model`` (a Hugging Face directory or loaded model) scored once on ``data``
    (what ``rnnify.data.token_batches`` reads) and ``passkey`` pass-key prompts; ``choose`` then
    picks for any budget or bound. ``score="kl"`` computes the mass score too (it is free)."""

    def __init__(self, model: Any, data: Any, *, score: str = DEFAULT_SCORE, window: int = WINDOW, sinks: int = SINKS,
                 calib_len: int = 1024, calib_rows: int = 2, passkey: int = 2, dtype: str = "float32",
                 tokenizer: Any = None, seed: int = 0, progress: bool = False,
                 scores_from: str | os.PathLike | None = None):
        from tqdm import tqdm

        from rnnify.capture import load_source
        from rnnify.convert import resolve_dtype
        from rnnify.data import load_tokenizer

        if score not in SCORES:
            raise RnnifyError(f"unknown score {score!r}; choose from: {', '.join(SCORES)}")
        for name, value, low in (("--window", window, 1), ("--sinks", sinks, 0), ("--calib-len", calib_len, 16),
                                 ("--calib-rows", calib_rows, 0), ("--calib-passkey", passkey, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RnnifyError(f"{name} must be an integer >= {low}, got {value!r}")
        if calib_rows + passkey == 0:
            raise RnnifyError("--to auto needs calibration rows: --calib-rows or --calib-passkey above 0")
        self.score, self.window, self.sinks, self.dtype = score, window, sinks, resolve_dtype(dtype)
        self.source = load_source(model, self.dtype)
        self.specs = layer_specs(self.source)
        config = self.source.config
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if limit is not None and calib_len > limit:
            raise RnnifyError(f"--calib-len {calib_len} is past the model's {limit} positions; use at most {limit}")
        if tokenizer is None and (passkey or isinstance(data, (str, os.PathLike))):
            tokenizer = load_tokenizer(model)
        self.calibration = calibration_rows(tokenizer, data, calib_len, calib_rows, passkey, seed)
        rows = len(self.calibration.rows)
        saved = None if scores_from is None else read_scores(scores_from, score, window, sinks)
        wanted = () if saved else (score, "mass") if score == "kl" else (score,)
        passes = rows * (1 + (sum(s.num_kv_heads for s in self.specs) if "kl" in wanted else 0))
        with tqdm(total=passes, unit="pass", desc="scoring heads", disable=None if progress else True, leave=False) as bar:
            self.scores, self.originals = score_heads(self.source, self.calibration, window, sinks, wanted,
                                                      progress=bar.update)
        if saved:
            model_heads = {(layer, h) for layer, spec in enumerate(self.specs) for h in range(spec.num_kv_heads)}
            if set(saved[score]) != model_heads:
                raise RnnifyError(f"{scores_from}: its scores name {len(saved[score])} kv heads, this model has "
                                  f"{len(model_heads)}: they were measured on another model")
            self.scores = saved
        self.heads = sorted(self.scores[score])
        self.about = {"scores_from": None if scores_from is None else str(scores_from),
                      "data": str(data) if isinstance(data, (str, os.PathLike)) else "(token ids)",
                      "rows": self.calibration.kinds.count("text"), "passkey": self.calibration.kinds.count("passkey"),
                      "tokens": calib_len, "seed": seed}

    def kl(self, retrieval: set[Head], retrieval_window: int | None = None) -> float:
        """The calibration KL with the heads in ``retrieval`` exact (or windowed to
        ``retrieval_window``), the rest windowed."""
        windowed = {h: self.window for h in self.heads if h not in retrieval}
        if retrieval_window is not None:
            windowed |= {h: retrieval_window for h in retrieval}
        return measure_kl(self.source, self.calibration, self.originals, windowed, self.sinks)

    def choose(self, budget: str | int | None = None, context: int = 4096, max_kl: float | None = None,
               per_layer: bool = False, score: str | None = None, retrieval_window: int | None = None,
               memory: str | None = None, memory_options: Options = None) -> HeadReport:
        """The retrieval heads (``choose``) by ``score`` (default: the one scored for): under ``budget``
        (bytes or a ``parse_bytes`` text) at ``context`` tokens, or at most ``max_kl``; whole layers
        with ``per_layer``. They stay exact, or with ``retrieval_window`` keep a window of that many
        tokens, so the state stops growing there. With ``memory`` the other heads are hybrids with
        that memory and ``memory_options`` (``streaming_target``), whose bytes the budget counts;
        the scores and the calibration KL are the windows' (the memories gated off, as they start
        unless ``memory_init`` opens them)."""
        score = score or self.score
        if score not in self.scores:
            raise RnnifyError(f"score {score!r} was not measured (scored for {self.score!r})")
        if (budget is None) == (max_kl is None):
            raise RnnifyError("--to auto needs one of --state-budget BYTES (with --at-context N) or --max-kl X")
        if max_kl is not None and not max_kl >= 0:
            raise RnnifyError(f"--max-kl must be >= 0, got {max_kl}")
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise RnnifyError(f"--at-context must be a positive token count, got {context!r}")
        if retrieval_window is not None and (isinstance(retrieval_window, bool) or not isinstance(retrieval_window, int)
                                             or retrieval_window <= self.window):
            raise RnnifyError(f"--retrieval-window must be a token count above --window ({self.window}), "
                              f"got {retrieval_window!r}")
        check_memory(memory, memory_options)
        specs, window, sinks, dtype, long = self.specs, self.window, self.sinks, self.dtype, retrieval_window
        if isinstance(budget, str):
            budget = parse_bytes(budget, lambda: kv_cache_bytes(specs, context, dtype))
        units = [[h for h in self.heads if h[0] == layer] for layer in range(len(specs))] if per_layer else None
        chosen = choose(self.scores[score], specs, context=context, window=window, sinks=sinks, dtype=dtype,
                        budget=budget, kl_of=lambda heads: self.kl(heads, long), max_kl=max_kl, units=units,
                        retrieval_window=long, memory=memory, memory_options=memory_options)
        if len(chosen) == len(self.heads):  # no head streams: no memory anywhere
            memory, memory_options = None, None
        return HeadReport(
            score=score, window=window, sinks=sinks, retrieval_window=long, context=context, budget=budget,
            max_kl=max_kl, retrieval=sorted(chosen), layers=layers_spec(specs, chosen, long),
            scores={name: {f"{lay}.{h}": v for (lay, h), v in values.items()} for name, values in self.scores.items()},
            head_bytes={"retrieval": one_head_bytes(specs[0], long, sinks, context, dtype),
                        "streaming": one_head_bytes(specs[0], window, sinks, context, dtype, memory, memory_options)},
            state_bytes=head_costs(specs, chosen, context, window, sinks, dtype, long, memory, memory_options),
            kv_cache_bytes=kv_cache_bytes(specs, context, dtype),
            calibration_kl=self.kl(chosen, long),
            calibration={**self.about, "per_layer": per_layer}, memory=memory,
            memory_options=dict(memory_options or {}),
        )


def read_scores(path: str | os.PathLike, score: str, window: int, sinks: int) -> dict[str, dict[Head, float]]:
    """The head scores of an earlier choice (``head_map.json``, or a ``benchmarks/per_head.py``
    result), checked against the ``score``, ``window`` and ``sinks`` they are to choose with."""
    try:
        saved = json.loads(Path(path).read_text())
        scores = {name: {(int(k.split(".")[0]), int(k.split(".")[1])): float(v) for k, v in values.items()}
                  for name, values in saved["scores"].items()}
        measured = (saved["window"], saved["sinks"])
    except OSError as exc:
        raise RnnifyError(f"--scores-from {path}: cannot read it ({exc.strerror})") from exc
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        raise RnnifyError(f"--scores-from {path}: not a head_map.json (expected its scores, window and sinks)") from None
    if score not in scores:
        raise RnnifyError(f"--scores-from {path} holds the {', '.join(scores)} score(s), not {score!r}: pass --score "
                          f"{next(iter(scores))}")
    if measured != (window, sinks):
        raise RnnifyError(f"--scores-from {path}: its scores were measured with a {measured[0]}-token window and "
                          f"{measured[1]} sinks; pass --window {measured[0]} --sinks {measured[1]}")
    return scores


def check_memory(memory: str | None, memory_options: Options = None) -> None:
    """``memory`` is None or one of the hybrid's memories, and ``memory_options`` (which need one)
    are options of the hybrid: checked before any model loads."""
    from rnnify.cells import build_cell
    from rnnify.cells.hybrid import MEMORIES
    from rnnify.plan import make_plan

    if memory is not None and memory not in MEMORIES:
        raise RnnifyError(f"--memory {memory!r} is not a memory; choose one of {', '.join(MEMORIES)}")
    if memory_options:
        if memory is None:
            raise RnnifyError(f"cell option(s) {', '.join(sorted(memory_options))} apply to the streaming heads' "
                              f"hybrids: give --memory too ({', '.join(MEMORIES)})")
        reserved = sorted(set(memory_options) & {"window", "sinks", "memory"})
        if reserved:
            raise RnnifyError(f"give {', '.join(reserved)} as their own arguments, not among the memory's options")
        target, options = streaming_target(WINDOW, SINKS, memory, memory_options)
        make_plan(target, **options)  # their names
        build_cell(target, CellSpec(2, 1, 64, 64, 0.125, hidden_size=64), options)  # their values, on a stand-in head


def choose_heads(model: Any, data: Any, *, budget: str | int | None = None, context: int = 4096,
                 max_kl: float | None = None, per_layer: bool = False, retrieval_window: int | None = None,
                 memory: str | None = None, memory_options: Options = None, **scoring: Any) -> HeadReport:
    """``HeadScorer(model, data, **scoring).choose(...)``: the retrieval heads ``--to auto`` keeps,
    with the report."""
    if (budget is None) == (max_kl is None):  # before any model loads
        raise RnnifyError("--to auto needs one of --state-budget BYTES (with --at-context N) or --max-kl X")
    check_memory(memory, memory_options)
    return HeadScorer(model, data, **scoring).choose(budget, context, max_kl, per_layer, retrieval_window=retrieval_window,
                                                     memory=memory, memory_options=memory_options)


REPORT_FILE = "head_map.json"  # saved beside a model converted with --to auto


def convert_chosen(model: Any, report: HeadReport, dtype: str = "float32", kernels: str = "auto"):
    """``model`` converted with the retrieval heads ``report`` chose, the rest streaming (windows, or
    hybrids with ``report.memory`` and its options); the report is saved beside it as ``head_map.json``."""
    from rnnify.convert import convert

    every_head = len(report.retrieval) == len(report.scores[report.score])
    target, options = _plan_options(every_head, report.window, report.sinks, report.retrieval_window, report.memory,
                                    report.memory_options)
    converted = convert(model, to=target, layers=report.layers, dtype=dtype, kernels=kernels, **options)
    converted.files[REPORT_FILE] = (json.dumps(report.to_json(), indent=2) + "\n").encode()
    return converted


def auto_convert(model: Any, data: Any, *, dtype: str = "float32", kernels: str = "auto", **options: Any):
    """``choose_heads`` then ``convert_chosen``: returns ``(RecurrentModel, HeadReport)``."""
    report = choose_heads(model, data, dtype=dtype, **options)
    return convert_chosen(model, report, dtype, kernels), report
