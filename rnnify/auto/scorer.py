"""``HeadScorer``: the kv heads scored once, then chosen for any budget or bound, and converted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rnnify.auto.calibration import calibration_rows
from rnnify.auto.choice import (
    Head,
    HeadReport,
    Options,
    choose,
    head_costs,
    kv_cache_bytes,
    layer_specs,
    layers_spec,
    one_head_bytes,
    parse_bytes,
    plan_options,
    streaming_target,
)
from rnnify.auto.probe import measure_kl, score_heads
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
    (what ``rnnify.data.token_batches`` reads) and ``passkey`` pass-key prompts; ``choose`` then
    picks for any budget or bound. ``score="kl"`` computes the mass score too (it is free)."""

    def __init__(
        self,
        model: Any,
        data: Any,
        *,
        score: str = DEFAULT_SCORE,
        window: int = AUTO_WINDOW,
        sinks: int = AUTO_SINKS,
        calib_len: int = CALIB_LEN,
        calib_rows: int = CALIB_ROWS,
        passkey: int = CALIB_PASSKEY,
        dtype: str = DEFAULT_DTYPE,
        tokenizer: Any = None,
        seed: int = 0,
        progress: bool = False,
        scores_from: str | os.PathLike | None = None,
    ):
        from tqdm import tqdm

        from rnnify.compiler.capture import load_source
        from rnnify.compiler.convert import resolve_dtype
        from rnnify.data import load_tokenizer

        if score not in SCORES:
            raise RnnifyError(f"unknown score {score!r}; choose from: {', '.join(SCORES)}")
        for name, value, low in (
            ("--window", window, 1),
            ("--sinks", sinks, 0),
            ("--calib-len", calib_len, 16),
            ("--calib-rows", calib_rows, 0),
            ("--calib-passkey", passkey, 0),
        ):
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
        with tqdm(
            total=passes, unit="pass", desc="scoring heads", disable=None if progress else True, leave=False
        ) as bar:
            self.scores, self.originals = score_heads(
                self.source, self.calibration, window, sinks, wanted, progress=bar.update
            )
        if saved:
            model_heads = {(layer, h) for layer, spec in enumerate(self.specs) for h in range(spec.num_kv_heads)}
            if set(saved[score]) != model_heads:
                raise RnnifyError(
                    f"{scores_from}: its scores name {len(saved[score])} kv heads, this model has "
                    f"{len(model_heads)}: they were measured on another model"
                )
            self.scores = saved
        self.heads = sorted(self.scores[score])
        self.about = {
            "scores_from": None if scores_from is None else str(scores_from),
            "data": str(data) if isinstance(data, (str, os.PathLike)) else "(token ids)",
            "rows": self.calibration.kinds.count("text"),
            "passkey": self.calibration.kinds.count("passkey"),
            "tokens": calib_len,
            "seed": seed,
        }

    def kl(self, retrieval: set[Head], retrieval_window: int | None = None, retrieval_keep: int | None = None) -> float:
        """The calibration KL with the heads in ``retrieval`` their ``retrieval_target`` (exact, a
        window of ``retrieval_window`` tokens, or with ``retrieval_keep`` a selection cache), the
        rest windowed."""
        windowed = {h: self.window for h in self.heads if h not in retrieval}
        selecting = {}
        if retrieval_keep is not None:
            selecting = {
                h: {"window": retrieval_window, "sinks": self.sinks, "keep": retrieval_keep} for h in retrieval
            }
        elif retrieval_window is not None:
            windowed |= {h: retrieval_window for h in retrieval}
        return measure_kl(self.source, self.calibration, self.originals, windowed, self.sinks, selecting)

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
        """The retrieval heads (``choose``) by ``score`` (default: the one scored for): under ``budget``
        (bytes or a ``parse_bytes`` text) at ``context`` tokens, or at most ``max_kl``; whole layers
        with ``per_layer``. They stay exact, or with ``retrieval_window`` keep a window of that many
        tokens, so the state stops growing there, and with ``retrieval_keep`` as many tokens again
        that the attention chose (a ``select`` cell). With ``memory`` the other heads are hybrids with
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
        if retrieval_window is not None and (
            isinstance(retrieval_window, bool)
            or not isinstance(retrieval_window, int)
            or retrieval_window <= self.window
        ):
            raise RnnifyError(
                f"--retrieval-window must be a token count above --window ({self.window}), got {retrieval_window!r}"
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
        check_memory(memory, memory_options)
        specs, window, sinks, dtype, long, keep = (
            self.specs,
            self.window,
            self.sinks,
            self.dtype,
            retrieval_window,
            retrieval_keep,
        )
        if isinstance(budget, str):
            budget = parse_bytes(budget, lambda: kv_cache_bytes(specs, context, dtype))
        units = [[h for h in self.heads if h[0] == layer] for layer in range(len(specs))] if per_layer else None
        chosen = choose(
            self.scores[score],
            specs,
            context=context,
            window=window,
            sinks=sinks,
            dtype=dtype,
            budget=budget,
            kl_of=lambda heads: self.kl(heads, long, keep),
            max_kl=max_kl,
            units=units,
            retrieval_window=long,
            memory=memory,
            memory_options=memory_options,
            retrieval_keep=keep,
        )
        if len(chosen) == len(self.heads):  # no head streams: no memory anywhere
            memory, memory_options = None, None
        return HeadReport(
            score=score,
            window=window,
            sinks=sinks,
            retrieval_window=long,
            context=context,
            budget=budget,
            max_kl=max_kl,
            retrieval=sorted(chosen),
            layers=layers_spec(specs, chosen, long, keep),
            scores={name: {f"{lay}.{h}": v for (lay, h), v in values.items()} for name, values in self.scores.items()},
            head_bytes={
                "retrieval": one_head_bytes(specs[0], long, sinks, context, dtype, keep=keep),
                "streaming": one_head_bytes(specs[0], window, sinks, context, dtype, memory, memory_options),
            },
            state_bytes=head_costs(specs, chosen, context, window, sinks, dtype, long, memory, memory_options, keep),
            kv_cache_bytes=kv_cache_bytes(specs, context, dtype),
            calibration_kl=self.kl(chosen, long, keep),
            calibration={**self.about, "per_layer": per_layer},
            memory=memory,
            memory_options=dict(memory_options or {}),
            retrieval_keep=keep,
        )


def read_scores(path: str | os.PathLike, score: str, window: int, sinks: int) -> dict[str, dict[Head, float]]:
    """The head scores of an earlier choice (``head_map.json``, or a ``benchmarks/per_head.py``
    result), checked against the ``score``, ``window`` and ``sinks`` they are to choose with."""
    try:
        saved = json.loads(Path(path).read_text())
        scores = {
            name: {(int(k.split(".")[0]), int(k.split(".")[1])): float(v) for k, v in values.items()}
            for name, values in saved["scores"].items()
        }
        measured = (saved["window"], saved["sinks"])
    except OSError as exc:
        raise RnnifyError(f"--scores-from {path}: cannot read it ({exc.strerror})") from exc
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
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
            f"{measured[1]} sinks; pass --window {measured[0]} --sinks {measured[1]}"
        )
    return scores


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


def choose_heads(
    model: Any,
    data: Any,
    *,
    budget: str | int | None = None,
    context: int = AUTO_CONTEXT,
    max_kl: float | None = None,
    per_layer: bool = False,
    retrieval_window: int | None = None,
    memory: str | None = None,
    memory_options: Options = None,
    retrieval_keep: int | None = None,
    **scoring: Any,
) -> HeadReport:
    """``HeadScorer(model, data, **scoring).choose(...)``: the retrieval heads ``--to auto`` keeps,
    with the report."""
    if (budget is None) == (max_kl is None):  # before any model loads
        raise RnnifyError("--to auto needs one of --state-budget BYTES (with --at-context N) or --max-kl X")
    check_memory(memory, memory_options)
    return HeadScorer(model, data, **scoring).choose(
        budget,
        context,
        max_kl,
        per_layer,
        retrieval_window=retrieval_window,
        memory=memory,
        memory_options=memory_options,
        retrieval_keep=retrieval_keep,
    )


REPORT_FILE = "head_map.json"  # saved beside a model converted with --to auto


def convert_chosen(model: Any, report: HeadReport, dtype: str = DEFAULT_DTYPE, kernels: str = DEFAULT_KERNELS):
    """``model`` converted with the retrieval heads ``report`` chose, the rest streaming (windows, or
    hybrids with ``report.memory`` and its options); the report is saved beside it as ``head_map.json``."""
    from rnnify.compiler.convert import convert

    every_head = len(report.retrieval) == len(report.scores[report.score])
    target, options = plan_options(
        every_head, report.window, report.sinks, report.retrieval_window, report.memory, report.memory_options
    )
    converted = convert(model, to=target, layers=report.layers, dtype=dtype, kernels=kernels, **options)
    converted.files[REPORT_FILE] = (json.dumps(report.to_json(), indent=2) + "\n").encode()
    return converted


def auto_convert(model: Any, data: Any, *, dtype: str = DEFAULT_DTYPE, kernels: str = DEFAULT_KERNELS, **options: Any):
    """``choose_heads`` then ``convert_chosen``: returns ``(RecurrentModel, HeadReport)``."""
    report = choose_heads(model, data, dtype=dtype, **options)
    return convert_chosen(model, report, dtype, kernels), report
