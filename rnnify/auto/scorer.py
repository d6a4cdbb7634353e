"""``HeadScorer``: the kv heads scored once, then chosen for any budget or bound, and converted."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rnnify.auto.calibration import calibration_rows
from rnnify.auto.choice import (
    Head,
    HeadReport,
    Options,
    Specs,
    choose,
    head_costs,
    kv_cache_bytes,
    layers_spec,
    one_head_bytes,
    parse_bytes,
    plan_options,
    streaming_target,
)
from rnnify.auto.graph_probe import probe_runner
from rnnify.auto.levels import Level, parse_levels, retrieval_level
from rnnify.auto.probe import MASS_KINDS, measure_kl, score_heads
from rnnify.cells import CellSpec
from rnnify.choices import (
    AUTO_CONTEXT,
    AUTO_SINKS,
    AUTO_WINDOW,
    CALIB_LEN,
    CALIB_PASSKEY,
    CALIB_ROWS,
    DEFAULT_DTYPE,
    DEFAULT_KERNELS,
    DEFAULT_SCORE,
    SCORES,
)
from rnnify.errors import RnnifyError


class HeadScorer:
    """The kv heads of ``model`` (a Hugging Face directory or loaded model) scored once on ``data``
    (what ``rnnify.data.token_batches`` reads) and ``passkey`` pass-key prompts, streaming and as
    each kind of ``levels`` (``--levels`` text); ``choose`` then picks for any budget or bound.
    ``score="kl"`` computes the mass score too (it is free)."""

    def __init__(
        self,
        model: Any,
        data: Any,
        *,
        score: str = DEFAULT_SCORE,
        levels: str | None = None,
        window: int = AUTO_WINDOW,
        sinks: int = AUTO_SINKS,
        scores_from: str | os.PathLike | None = None,
        calib_len: int | None = None,
        calib_rows: int = CALIB_ROWS,
        passkey: int = CALIB_PASSKEY,
        tokenizer: Any = None,
        seed: int = 0,
        dtype: str = DEFAULT_DTYPE,
        progress: bool = False,
    ):
        from rnnify.compiler.capture import load_source
        from rnnify.compiler.convert import resolve_dtype
        from rnnify.data import load_tokenizer
        from rnnify.progress import bar

        if score not in SCORES:
            raise RnnifyError(f"unknown score {score!r}; choose from: {', '.join(SCORES)}")
        for name, value, low in (
            ("--window", window, 1),
            ("--sinks", sinks, 0),
            ("--calib-len", CALIB_LEN if calib_len is None else calib_len, 16),
            ("--calib-rows", calib_rows, 0),
            ("--calib-passkey", passkey, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RnnifyError(f"{name} must be an integer >= {low}, got {value!r}")
        if calib_rows + passkey == 0:
            raise RnnifyError("--to auto needs calibration rows: --calib-rows or --calib-passkey above 0")
        self.levels = [] if levels is None else parse_levels(levels, window)
        if score == "mass" and any(level.target not in MASS_KINDS for level in self.levels):
            raise RnnifyError(
                "--score mass counts the attention a kind does not read, and lola's memory reads every token "
                "(approximately): score lola kinds with --score kl"
            )
        self.score, self.window, self.sinks, self.dtype = score, window, sinks, resolve_dtype(dtype)
        self.source = load_source(model, self.dtype)
        config = self.source.config
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if calib_len is None:  # the default row, clamped as rnnify.data.row_length clamps evaluation rows
            calib_len = min(CALIB_LEN, limit or CALIB_LEN)
        if limit is not None and calib_len > limit:
            raise RnnifyError(f"--calib-len {calib_len} is past the model's {limit} positions; use at most {limit}")
        if tokenizer is None and (passkey or isinstance(data, (str, os.PathLike))):
            tokenizer = load_tokenizer(model)
        self.calibration = calibration_rows(tokenizer, data, calib_len, calib_rows, passkey, seed, limit=limit)
        self.runner, self.specs = probe_runner(self.source, self.dtype, self.calibration.rows[0][:, :_SPEC_TOKENS])
        self.sites = self.runner.sites  # attention sites per layer: each keeps its own state
        # chunked attention (Llama 4's): only exact computes it, and its state is bounded already; a
        # layer sliding over no more than the streaming window keeps its own (plan.within_own_window)
        self.exact_layers = {
            layer
            for layer, spec in self.specs.items()
            if spec.chunk is not None or (spec.window is not None and spec.window <= window)
        }
        check_kinds(self.specs, self.levels, window, sinks)
        rows = len(self.calibration.rows)
        saved = None if scores_from is None else read_scores(scores_from, score, window, sinks, self.levels)
        wanted = () if saved else (score, "mass") if score == "kl" else (score,)
        heads = sum(s.num_kv_heads for layer, s in self.specs.items() if layer not in self.exact_layers)
        kinds = 1 + sum(level.target != "exact" for level in self.levels)  # streaming and each kind that is not exact
        passes = rows * (1 + (heads * kinds if "kl" in wanted else 0))
        with bar(
            progress,
            total=passes,
            unit="pass",
            desc=f"scoring {heads} kv heads x {kinds} kind{'s' * (kinds > 1)}" if "kl" in wanted else "scoring heads",
            leave=False,
        ) as shown:
            self.scores, self.level_scores, self.originals = score_heads(
                self.runner,
                self.calibration,
                window,
                sinks,
                wanted,
                self.levels,
                progress=shown.update,
                exact_layers=self.exact_layers,
            )
        if saved:
            model_heads = {
                (layer, h)
                for layer, spec in self.specs.items()
                if layer not in self.exact_layers
                for h in range(spec.num_kv_heads)
            }
            if set(saved[0][score]) != model_heads:
                raise RnnifyError(
                    f"{scores_from}: its scores name {len(saved[0][score])} kv heads, this model has "
                    f"{len(model_heads)}: they were measured on another model"
                )
            self.scores, self.level_scores = saved
        self.heads = sorted(self.scores[score])
        self.about = {
            "scores_from": None if scores_from is None else str(scores_from),
            "data": str(data) if isinstance(data, (str, os.PathLike)) else "(token ids)",
            "rows": self.calibration.kinds.count("text"),
            "passkey": self.calibration.kinds.count("passkey"),
            "tokens": calib_len,
            "seed": seed,
        }

    def kl_of(self, kinds: Mapping[Head, Level]) -> float:
        """The calibration KL with the heads in ``kinds`` their kind, the rest streaming (as the
        window: a new hybrid's memory is gated off)."""
        streaming = Level("window", (("window", self.window),))
        every = {h: kinds.get(h, streaming) for h in self.heads}
        return measure_kl(self.runner, self.calibration, self.originals, every, self.sinks)

    def kl(self, retrieval: set[Head], retrieval_window: int | None = None, retrieval_keep: int | None = None) -> float:
        """The calibration KL with the heads in ``retrieval`` the kind of ``--retrieval-window`` and
        ``--retrieval-keep`` (``retrieval_level``: exact, a window, or a selection cache), the rest
        windowed."""
        return self.kl_of(dict.fromkeys(retrieval, retrieval_level(retrieval_window, retrieval_keep)))

    def choose(
        self,
        budget: str | int | None = None,
        context: int = AUTO_CONTEXT,
        max_kl: float | None = None,
        per_layer: bool = False,
        score: str | None = None,
        retrieval_window: int | None = None,
        memory: str | None = None,
        memory_options: Options = None,
        retrieval_keep: int | None = None,
    ) -> HeadReport:
        """Each head's kind (``choose``) by ``score`` (default: the one scored for): under ``budget``
        (bytes or a ``parse_bytes`` text) at ``context`` tokens, or at most ``max_kl``; whole layers
        with ``per_layer``. The kinds are the scorer's ``levels``, each by what it gains over
        streaming; without them one kind, ``exact``, or with ``retrieval_window`` a window of that
        many tokens (the state stops growing there), and with ``retrieval_keep`` as many tokens again
        that the attention chose (a ``select`` cell), which gains what streaming loses (its score,
        as the one-kind choice always counted it). With ``memory`` the streaming heads are hybrids
        with that memory and ``memory_options`` (``streaming_target``), whose bytes the budget
        counts; the scores and the calibration KL are the windows' (the memories gated off, as they
        start unless ``memory_init`` opens them)."""
        score = score or self.score
        if score not in self.scores:
            raise RnnifyError(f"score {score!r} was not measured (scored for {self.score!r})")
        _check_bound(budget, max_kl)
        if max_kl is not None and not max_kl >= 0:
            raise RnnifyError(f"--max-kl must be >= 0, got {max_kl}")
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise RnnifyError(f"--at-context must be a positive token count, got {context!r}")
        check_retrieval(self.levels, self.window, retrieval_window, retrieval_keep)
        check_memory(memory, memory_options)
        specs, dtype = self.specs, self.dtype
        if isinstance(budget, str):
            budget = parse_bytes(budget, lambda: kv_cache_bytes(specs, context, dtype, self.sites))
        # both scores are >= 0 (a KL, an attention mass): below that is rounding, which counts as 0
        streams = {h: max(value, 0.0) for h, value in self.scores[score].items()}
        if self.levels:
            lost = self.level_scores[score]
            levels = self.levels
            benefits = {h: [streams[h] - max(lost[level.text][h], 0.0) for level in levels] for h in self.heads}
            given = "--levels " + ",".join(level.text for level in levels)
        else:
            levels = [retrieval_level(retrieval_window, retrieval_keep)]
            benefits = {h: [streams[h]] for h in self.heads}
            given = f"--retrieval-window {retrieval_window}" + (
                f" --retrieval-keep {retrieval_keep}" if retrieval_keep else ""
            )
        check_kinds(specs, levels, self.window, self.sinks, memory, memory_options, given)
        costs = {"window": self.window, "sinks": self.sinks, "dtype": dtype}
        units = [[h for h in self.heads if h[0] == layer] for layer in specs if layer not in self.exact_layers]
        units = units if per_layer else None
        kinds = choose(
            benefits,
            levels,
            specs,
            context=context,
            budget=budget,
            kl_of=self.kl_of,
            max_kl=max_kl,
            units=units,
            memory=memory,
            memory_options=memory_options,
            given=given,
            sites=self.sites,
            **costs,
        )
        if len(kinds) == len(self.heads):  # no head streams: no memory anywhere
            memory, memory_options = None, None
        full = next((spec for spec in specs.values() if spec.keys_read is None), next(iter(specs.values())))
        by_bytes = sorted(levels, key=lambda level: one_head_bytes(full, level, context=context, **costs))
        head_bytes = {
            "streaming": one_head_bytes(
                full, None, context=context, memory=memory, memory_options=memory_options, **costs
            ),
            **{level.text: one_head_bytes(full, level, context=context, **costs) for level in by_bytes},
        }
        return HeadReport(
            score=score,
            window=self.window,
            sinks=self.sinks,
            retrieval_window=retrieval_window,
            context=context,
            budget=budget,
            max_kl=max_kl,
            retrieval=sorted(kinds),
            layers=layers_spec(specs, kinds),
            scores={name: _by_name(values) for name, values in self.scores.items()},
            head_bytes={**head_bytes, "retrieval": head_bytes[by_bytes[-1].text]},
            state_bytes=head_costs(
                specs, kinds, context, self.window, self.sinks, dtype, memory, memory_options, self.sites
            ),
            kv_cache_bytes=kv_cache_bytes(specs, context, dtype, self.sites),
            calibration_kl=self.kl_of(kinds),
            calibration={**self.about, "per_layer": per_layer},
            memory=memory,
            memory_options=dict(memory_options or {}),
            retrieval_keep=retrieval_keep,
            levels=[level.text for level in by_bytes],
            level_scores={
                name: {text: _by_name(values) for text, values in kinds_lost.items()}
                for name, kinds_lost in self.level_scores.items()
                if kinds_lost
            },
            kinds={f"{lay}.{h}": kinds[(lay, h)].text if (lay, h) in kinds else "streaming" for lay, h in self.heads},
        )


def _by_name(values: Mapping[Head, float]) -> dict[str, float]:
    """Per head values keyed ``"layer.head"``, as head_map.json keeps them."""
    return {f"{lay}.{h}": v for (lay, h), v in values.items()}


def check_retrieval(levels: list[Level], window: int, retrieval_window: int | None, retrieval_keep: int | None) -> None:
    """``--retrieval-window`` and ``--retrieval-keep`` are the one kind of a choice without
    ``--levels``: a window longer than the streaming one, and a positive count selected beside it."""
    if levels and (retrieval_window is not None or retrieval_keep is not None):
        raise RnnifyError(
            "--levels lists every kind a head may get: give the retrieval window and selection there "
            "(e.g. 'window(window=1024)', 'select(window=512,keep=512)'), not as --retrieval-window or "
            "--retrieval-keep"
        )
    if retrieval_window is not None and (
        isinstance(retrieval_window, bool) or not isinstance(retrieval_window, int) or retrieval_window <= window
    ):
        raise RnnifyError(
            f"--retrieval-window must be a token count above --window ({window}), got {retrieval_window!r}"
        )
    if retrieval_keep is not None and (
        isinstance(retrieval_keep, bool)
        or not isinstance(retrieval_keep, int)
        or retrieval_keep < 1
        or retrieval_window is None
    ):
        raise RnnifyError(
            f"--retrieval-keep must be a positive token count, with --retrieval-window (the "
            f"selection cache's recent window), got {retrieval_keep!r}"
        )


def read_scores(
    path: str | os.PathLike, score: str, window: int, sinks: int, levels: list[Level]
) -> tuple[dict[str, dict[Head, float]], dict[str, dict[str, dict[Head, float]]]]:
    """The head scores of an earlier choice (``head_map.json``, or a ``benchmarks/per_head.py``
    result), streaming and per kind, checked against the ``score``, ``window``, ``sinks`` and
    ``levels`` they are to choose with (a file from before ``--levels`` holds none per kind)."""

    def heads(values: Mapping[str, Any]) -> dict[Head, float]:
        return {(int(k.split(".")[0]), int(k.split(".")[1])): float(v) for k, v in values.items()}

    try:
        saved = json.loads(Path(path).read_text())
        scores = {name: heads(values) for name, values in saved["scores"].items()}
        lost = {
            name: {text: heads(values) for text, values in kinds.items()}
            for name, kinds in saved.get("level_scores", {}).items()
        }
        measured = (saved["window"], saved["sinks"])
    except OSError as exc:
        raise RnnifyError(f"--scores-from {path}: cannot read it ({exc.strerror})") from exc
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError, RecursionError):
        raise RnnifyError(
            f"--scores-from {path}: not a head_map.json (expected its scores, window and sinks)"
        ) from None
    if score not in scores:
        raise RnnifyError(
            f"--scores-from {path} holds the {', '.join(scores)} score(s), not {score!r}: pass --score "
            f"{next(iter(scores))}"
        )
    if measured != (window, sinks):
        raise RnnifyError(
            f"--scores-from {path}: its scores were measured with a {measured[0]}-token window and "
            f"{measured[1]} sinks, on a model of {len(scores[score])} kv heads; for that model, pass --window "
            f"{measured[0]} --sinks {measured[1]}"
        )
    missing = [level.text for level in levels if level.text not in lost.get(score, {})]
    if missing:
        raise RnnifyError(
            f"--scores-from {path} holds no {score} scores for {', '.join(missing)}: score again without "
            "--scores-from, or list only the kinds it was scored with"
        )
    return scores, {name: values for name, values in lost.items() if name in scores}


def check_memory(memory: str | None, memory_options: Options = None) -> None:
    """``memory`` is None or one of the hybrid's memories, and ``memory_options`` (which need one)
    are options of the hybrid: checked before any model loads."""
    from rnnify.cells import build_cell
    from rnnify.cells.hybrid import MEMORIES
    from rnnify.compiler.plan import make_plan

    if memory is not None and memory not in MEMORIES:
        raise RnnifyError(f"--memory {memory!r} is not a memory; choose one of {', '.join(MEMORIES)}")
    if memory_options:
        if memory is None:
            raise RnnifyError(
                f"cell option(s) {', '.join(sorted(memory_options))} apply to the streaming heads' "
                f"hybrids: give --memory too ({', '.join(MEMORIES)})"
            )
        reserved = sorted(set(memory_options) & {"window", "sinks", "memory"})
        if reserved:
            raise RnnifyError(f"give {', '.join(reserved)} as their own arguments, not among the memory's options")
        target, options = streaming_target(AUTO_WINDOW, AUTO_SINKS, memory, memory_options)
        make_plan(target, **options)  # their names
        build_cell(target, CellSpec(2, 1, 64, 64, 0.125, hidden_size=64), options)  # their values, on a stand-in head


_SPEC_TOKENS = 32  # the pass that records each layer's site (ALiBi's slopes need two keys)


def check_kinds(
    specs: Specs,
    levels: list[Level],
    window: int,
    sinks: int,
    memory: str | None = None,
    memory_options: Options = None,
    given: str | None = None,
) -> None:
    """Each kind of ``levels``, and the streaming heads' hybrid with ``memory``, computes what the
    scores of every attention layer carry (a softcap, ALiBi, sink logits): one that cannot is
    refused before any head is scored (or chosen), naming the flags that asked for it (``given``,
    or the kind's ``--levels`` text) and the cells that can."""
    from rnnify.cells import build_cell
    from rnnify.cells.heads import part_spec

    cells = [(given or f"--levels {level.text}", level.target, level.cell_options(sinks)) for level in levels]
    if memory is not None:
        cells.append((f"--memory {memory}", *streaming_target(window, sinks, memory, memory_options)))
    for layer, spec in specs.items():
        for given, target, options in cells:
            try:
                build_cell(target, part_spec(spec, [0]), options)
            except (ValueError, RnnifyError) as exc:
                raise RnnifyError(f"{given}: layer {layer}'s attention: {exc}") from None


# the keywords of ``HeadScorer.choose`` that ``choose_heads`` passes it (``score`` goes to the scorer)
_CHOICE = set(inspect.signature(HeadScorer.choose).parameters) - {"self", "score"}


def choose_heads(model: Any, data: Any, **options: Any) -> HeadReport:
    """``HeadScorer(model, data, **scoring).choose(**choice)``: the kind ``--to auto`` gives each head,
    with the report. ``options`` are both: ``choose``'s keywords (``_CHOICE``) and the scorer's; the
    bound and the memory are checked before any model loads."""
    choice = {name: options.pop(name) for name in _CHOICE & options.keys()}
    _check_bound(choice.get("budget"), choice.get("max_kl"))
    check_memory(choice.get("memory"), choice.get("memory_options"))
    return HeadScorer(model, data, **options).choose(**choice)


def _check_bound(budget: str | int | None, max_kl: float | None) -> None:
    if (budget is None) == (max_kl is None):
        raise RnnifyError(
            f"--to auto needs {'only one' if budget is not None else 'one'} of --state-budget BYTES (with --at-context N) "
            "or --max-kl X"
        )


REPORT_FILE = "head_map.json"  # saved beside a model converted with --to auto


def _check_sites(report: HeadReport, entries) -> None:
    """The conversion found the attention layers and kv heads the probe scored: a choice is made per
    (layer, kv head), and a site whose keys the compiler sees repeated per query head, or a layer
    numbered otherwise, would give the chosen kinds to other heads. Chunked layers, never scored,
    are exact whatever the choice (``ConversionPlan.cell_for``)."""
    from rnnify.cells import OWN_LAYERS

    scored: dict[int, int] = {}
    for head in report.kinds:
        layer = int(head.split(".")[0])
        scored[layer] = scored.get(layer, 0) + 1
    found = {
        entry.layer: entry.spec["num_kv_heads"]
        for entry in entries
        if entry.target not in OWN_LAYERS and entry.spec.get("chunk") is None
    }
    if found != scored:
        raise RnnifyError(
            f"--to auto scored kv heads per attention layer {scored}, but the conversion found {found}: "
            "their heads cannot be matched; choose each layer's target by hand with --layers"
        )


def convert_chosen(model: Any, report: HeadReport, dtype: str = DEFAULT_DTYPE, kernels: str = DEFAULT_KERNELS):
    """``model`` converted with the kinds ``report`` chose, the rest streaming (windows, or hybrids
    with ``report.memory`` and its options); the report is saved beside it as ``head_map.json``."""
    from rnnify.compiler.convert import convert

    kinds = {head: Level.from_text(text) for head, text in report.kinds.items() if text != "streaming"}
    target, options = plan_options(
        kinds, len(report.kinds), report.window, report.sinks, report.memory, report.memory_options
    )
    converted = convert(model, to=target, layers=report.layers, dtype=dtype, kernels=kernels, **options)
    _check_sites(report, converted.manifest.cells)
    converted.files[REPORT_FILE] = (json.dumps(report.to_json(), indent=2) + "\n").encode()
    return converted


def auto_convert(model: Any, data: Any, *, dtype: str = DEFAULT_DTYPE, kernels: str = DEFAULT_KERNELS, **options: Any):
    """``choose_heads`` then ``convert_chosen``: returns ``(RecurrentModel, HeadReport)``."""
    report = choose_heads(model, data, dtype=dtype, **options)
    return convert_chosen(model, report, dtype, kernels), report
