"""Convert a tiny random model of every causal-LM architecture; record outcomes and step-graph ops.

    python benchmarks/arch_sweep.py [--only llama,gpt2,llama:linear] [--timeout 120] [--workers 2]
        [--dtype float32] [-o benchmarks/results/arch_sweep.json]

A job per ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` entry and per composite (``COMPOSITES``: a vision- or
audio-language model type without a causal LM class, whose language model rnnify converts, compared
with the whole on text): a model of 2 layers, 64 wide, from the config
class with every size-like attribute shrunk (``arch_configs.build``), ``rnnify.convert(model, to="exact")``, then prefill
(SEQ tokens) and prefill + STEPS steps against the original's forward (max abs diff / max abs of the
reference), and a batch whose second row is cut short and left-padded against each row alone.
Jobs ``MODEL_TYPE@VARIANT`` build that model type in the layout of a released
checkpoint its defaults do not build (``VARIANTS``: ``falcon@alibi``, Falcon-RW). Status: exact (each
within ``rnnify.verify.tolerance``), rounding (``--dtype bfloat16`` only: over it, but within it of the
original decoding the same rows, or apart only past a router's tie: ``sweep_checks.py``),
mismatch, refused (an ``RnnifyError``), crash (any other
exception), config (no tiny model builds), timeout; a model that builds but names no vocabulary or
fails on token ids alone (it needs images, audio or another model's cache) is handed to rnnify all
the same, for its answer.
Jobs ``ARCH:TARGET[@DTYPE]`` convert the tiny llama and gpt2 of examples/make_tiny_model.py to each
target of ``rnnify.cells.CELLS``, through ``--to auto``, and in half precision (``approx``: not exact cells).
Per converted model: its call_function targets as graph.json names them, with the types of their
constant arguments and their str constants (the JSON holds the union), ``serialize_error`` where
the working tree's ``graph_to_json`` refuses the graph, and ``load_error`` where ``rnnify.load``
refuses the saved model (its checks: docs/security.md) or its logits differ from the converted
one's. Each job runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import operator
import sys
import sysconfig
import tempfile
import time
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
)
from transformers.utils import logging

import rnnify
from rnnify.auto import Calibration, auto_convert, score_heads
from rnnify.auto.graph_probe import probe_runner
from rnnify.cells import CELLS
from rnnify.cells.base import SCORE_TERMS
from rnnify.compiler.composite import is_composite
from rnnify.errors import RnnifyError, RnnifyWarning, first_line
from rnnify.runtime.serialize import graph_to_json
from rnnify.verify import tolerance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from make_tiny_model import make_tiny_model  # noqa: E402

# vision- and audio-language model types that transformers has no causal LM class for
COMPOSITES = [name for name in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES if name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]

from arch_configs import TARGET_OPTIONS, VARIANTS, build, tiny_example  # noqa: E402
from sweep_checks import BATCH, SEQ, STEPS, judge_rounding, left_padded_error, random_ids, relative_error  # noqa: E402


# --------------------------------------------------------------------------- ops of a saved graph
# Named as graph.json names them (rnnify/runtime/serialize.py at 63805d8), walked on the fx graph itself so that
# the sweep sees every op, including those a (changing) vocabulary in serialize would refuse.
def _function_names() -> dict[int, str]:
    table = {
        f"operator.{n}": getattr(operator, n)
        for n in dir(operator)
        if isinstance(getattr(operator, n), types.BuiltinFunctionType) and not n.startswith("__") and n != "call"
    }
    table.update(
        {f"math.{n}": getattr(math, n) for n in dir(math) if isinstance(getattr(math, n), types.BuiltinFunctionType)}
    )
    table.update(
        {
            f"torch.{n}": getattr(torch, n)
            for n in dir(torch)
            if n.startswith(("sym_", "_sym_"))
            and isinstance(getattr(torch, n), (types.FunctionType, types.BuiltinFunctionType))
        }
    )
    names: dict[int, str] = {}
    for key in sorted(table, key=lambda k: (k.split(".")[-1].startswith("_"), k)):  # public name first
        names.setdefault(id(table[key]), key)
    return names


def target_name(target, names: dict[int, str]) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return "torch.ops." + target._qualified_op_name.replace("::", ".")
    name = names.get(id(target))
    return name or f"UNSUPPORTED {getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _constants(value, entry: dict) -> None:
    """Add the types of the constants in one argument (graph.json's tag names; nodes skipped) to ``entry``."""
    if isinstance(value, torch.fx.Node):
        return
    if isinstance(value, (list, tuple)):  # fx's immutable_list is a list; a tuple is stored as {"tuple": ...}
        if type(value) is tuple:
            entry["types"].add("tuple")
        for item in value:
            _constants(item, entry)
    elif isinstance(value, dict):
        entry["types"].add("dict")
        _constants(list(value.values()), entry)
    elif isinstance(value, slice):
        entry["types"].add("slice")
        _constants([value.start, value.stop, value.step], entry)
    else:
        kinds = {
            torch.dtype: "dtype",
            torch.device: "device",
            torch.layout: "layout",
            torch.memory_format: "memory_format",
        }
        kind = next((k for cls, k in kinds.items() if isinstance(value, cls)), None)
        kind = kind or ("ellipsis" if value is Ellipsis else type(value).__name__)  # NoneType, bool, int, float, str
        entry["types"].add(kind)
        if isinstance(value, str):
            entry["strings"].add(value)
        elif isinstance(value, float) and not math.isfinite(value):  # stored as {"float": "-inf"}
            entry["nonfinite"].add(str(value))


CONSTANTS = ("types", "strings", "nonfinite")  # what graph_ops records of the constant arguments of each target


def graph_ops(graph) -> dict:
    """{stored target: {"types": [...], "strings": [...], "nonfinite": [...]}} of ``graph``'s call_function nodes."""
    names = _function_names()
    ops: dict[str, dict] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            entry = ops.setdefault(target_name(node.target, names), {key: set() for key in CONSTANTS})
            _constants([*node.args, *node.kwargs.values()], entry)
    return {k: {key: sorted(v[key]) for key in CONSTANTS} for k, v in sorted(ops.items())}


# --------------------------------------------------------------------------- one job, in a child process
def logits_of(model, ids):
    out = model(input_ids=ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0]


def _convert(name: str, dtype: torch.dtype = torch.float32):
    """(source model, its conversion (a callable), class name) for job ``name``: MODEL_TYPE[@VARIANT]
    (in ``dtype``) or ARCH:TARGET[@DTYPE]."""
    if ":" not in name:
        model, class_name = build(name)
        model = model.to(dtype)
        return model, lambda: rnnify.convert(model, to="exact"), class_name
    arch, target = name.split(":")
    target, _, precision = target.partition("@")  # e.g. exact@bfloat16
    if not target.startswith("auto"):
        model = tiny_example(arch).to(getattr(torch, precision or "float32"))
        return model, lambda: rnnify.convert(model, to=target, **TARGET_OPTIONS.get(target, {})), type(model).__name__
    model = tiny_example(arch)
    directory = make_tiny_model(tempfile.mkdtemp(prefix="arch-sweep-"), arch)
    data = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    memory = {"memory": "linear"} if target == "auto-memory" else {}
    # a budget of about half the state every head exact would need at 4,096 tokens: some heads each way
    return (
        model,
        lambda: auto_convert(
            directory,
            data,
            budget=300_000,
            context=4096,
            window=8,
            sinks=2,
            calib_len=64,
            calib_rows=2,
            passkey=0,
            **memory,
        )[0],
        type(model).__name__,
    )


SITE_FIELDS = ("num_heads", "num_kv_heads", "head_dim", "value_dim", "window", "chunk")


def auto_probe(model, ids, converted, tol: float) -> dict:
    """What ``--to auto`` makes of a model that converts exactly: ``scored`` when its probe (through
    transformers' attention interface, or through the model's exact conversion where the interface
    does not reach its attention: ``runner``) records the sites the compiler found (the attention
    layers, their shapes, windows and which score terms) and its pass with every head exact gives
    the original's logits; ``refused`` with the one line; ``mismatch`` or ``crash`` with what differs."""
    try:
        runner, specs = probe_runner(model, torch.float32, ids)
        calibration = Calibration([ids], [torch.ones(ids.shape[1])], ["text"])
        _, _, (probed,) = score_heads(runner, calibration, window=4, sinks=1, scores=("mass",))
    except RnnifyError as exc:
        return {"status": "refused", "message": first_line(exc)}
    except Exception as exc:  # noqa: BLE001  (a finding)
        return {"status": "crash", "message": first_line(exc, with_type=True)}
    sites = {entry.layer: entry.spec for entry in converted.manifest.cells if entry.target == "exact"}
    differ = [] if sorted(specs) == sorted(sites) else [f"layers {sorted(specs)}, the compiler's {sorted(sites)}"]
    for layer, spec in specs.items():
        site = sites.get(layer, {})
        differ += [f"layer {layer} {k}" for k in SITE_FIELDS if site and getattr(spec, k) != site.get(k)]
        differ += [
            f"layer {layer} {k}" for k in SCORE_TERMS if site and (getattr(spec, k) is None) != (site.get(k) is None)
        ]
    error = relative_error(probed, logits_of(model, ids)[0])
    if error is None or error > tol:
        differ.append(f"logits: relative error {error}")
    if differ:
        return {"status": "mismatch", "message": "; ".join(differ)}
    return {"status": "scored", "error": error, "runner": type(runner).__name__}


def run_job(name: str, dtype: torch.dtype = torch.float32) -> dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    result: dict = {"status": None, "class": None, "stage": "config"}
    try:
        model, convert, result["class"] = _convert(name, dtype)
        result["params"] = sum(p.numel() for p in model.parameters())
        result["stage"] = "source"
        vocab = model.config.get_text_config().vocab_size
        ids = random_ids(vocab)
        with torch.no_grad():
            want_prefill, want_full = logits_of(model, ids[:, :SEQ]), logits_of(model, ids)
        result["stage"] = "convert"
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", RnnifyWarning)
            converted = convert()
        padding = [str(w.message) for w in said if "padding id" in str(w.message)]
        if padding:
            result["padding"] = padding[0]
        result["cells"] = sorted({type(cell).__name__ for cell in converted.cells})
        result["positions"] = converted.manifest.positions
        if is_composite(model.config):
            result["language_model"] = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model.config.get_text_config().model_type)
        result["ops"] = graph_ops(converted.graph.graph)
        result["stage"] = "compare"
        got, state = converted.prefill(ids[:, :SEQ])
        steps = [got]
        for t in range(SEQ, SEQ + STEPS):
            out, state = converted.step(ids[:, t : t + 1], state)
            steps.append(out)
        result["errors"] = {
            "prefill": relative_error(got, want_prefill),
            "prefill+steps": relative_error(torch.cat(steps, 1), want_full),
            "left-padded": left_padded_error(converted, ids),
        }
        judged = all(cell.exact for cell in converted.cells)
        tol = tolerance(next(model.parameters()).dtype)  # rnnify verify's: 1e-4, 2e-2 in half precision
        ok = all(e is not None and e <= tol for e in result["errors"].values())
        result["status"] = ("exact" if ok else "mismatch") if judged else "approx"
        if result["status"] == "mismatch" and dtype != torch.float32:
            result.update(judge_rounding(model, converted, ids, result["errors"], tol))
        if result["status"] == "exact" and ":" not in name and dtype == torch.float32:
            result["auto"] = auto_probe(model, ids[:1, :SEQ], converted, tol)
        result["stage"] = "save"
        graph_to_json(converted.graph.graph)  # what saving would do with today's serialize
        result["stage"] = "load"
        with tempfile.TemporaryDirectory(prefix="arch-sweep-load-") as saved:  # what a load's checks say of it
            loaded = rnnify.load(converted.save(Path(saved) / "model"), aot_step=False)
            if not relative_error(loaded.prefill(ids[:, :SEQ])[0], got) <= tol:
                raise RnnifyError("the loaded model's logits differ from the converted model's")
        result["stage"] = "done"
    except Exception as exc:  # noqa: BLE001  (every failure is a finding)
        if result["stage"] == "source":  # it does not run on text alone: what does rnnify say of it?
            return {**result, **_unrunnable(convert, exc)}
        if result["stage"] == "config":
            result["status"] = "config"
        elif result["stage"] == "save":  # converted, but graph.json cannot hold it: save would fail
            result["serialize_error"] = first_line(exc, with_type=True)
            return result
        elif result["stage"] == "load":  # saved, but rnnify.load refuses it (or computes otherwise)
            result["load_error"] = first_line(exc, with_type=True)
            return result
        else:
            result["status"] = "refused" if isinstance(exc, RnnifyError) else "crash"
        result["message"] = first_line(exc, with_type=not isinstance(exc, RnnifyError))
    return result


def _unrunnable(convert, source_error: Exception) -> dict:
    """The outcome for a model that builds but names no vocabulary or fails on token ids alone (it
    needs images, audio or a second model's cache): ``refused`` with rnnify's line, ``crash`` where
    rnnify fails otherwise, else ``config`` with the model's own error (nothing to compare with)."""
    try:
        convert()
    except RnnifyError as exc:
        return {"status": "refused", "message": first_line(exc)}
    except Exception as exc:  # noqa: BLE001  (a finding)
        return {"status": "crash", "message": first_line(exc, with_type=True)}
    return {"status": "config", "message": first_line(source_error, with_type=True)}


def _child(name: str, dtype: torch.dtype, conn) -> None:
    conn.send(run_job(name, dtype))
    conn.close()


def run_isolated(name: str, timeout: float, dtype: torch.dtype = torch.float32) -> dict:
    ctx = mp.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, dtype, send), daemon=True)
    start = time.perf_counter()
    proc.start()
    send.close()
    try:
        result = receive.recv() if receive.poll(timeout) else None
    except EOFError:  # it died without a word
        result = None
    proc.join(5)
    proc.kill()  # a no-op when it has exited
    proc.join()
    seconds = round(time.perf_counter() - start, 1)
    if result is None and seconds >= timeout:
        result = {"status": "timeout", "message": f"no result after {timeout:g} s"}
    elif result is None:
        result = {"status": "crash", "message": f"process died (exit code {proc.exitcode})"}
    return {**result, "seconds": seconds}


# --------------------------------------------------------------------------- the sweep
def all_jobs() -> list[str]:
    targets = [*CELLS, "auto", "auto-memory", "exact@bfloat16", "exact@float16"]
    extra = [f"{arch}:{target}" for arch in ("llama", "gpt2") for target in targets]
    return [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *COMPOSITES, *VARIANTS, *extra]


def union(results: dict) -> dict:
    ops: dict[str, dict] = {}
    for name, result in sorted(results.items()):
        for target, entry in (result.get("ops") or {}).items():
            into = ops.setdefault(target, {**{key: set() for key in CONSTANTS}, "used_by": []})
            for key in CONSTANTS:
                into[key].update(entry.get(key, ()))
            into["used_by"].append(name)
    return {
        k: {**{key: sorted(v[key]) for key in CONSTANTS}, "count": len(v["used_by"]), "used_by": v["used_by"]}
        for k, v in sorted(ops.items())
    }


STATUSES = ("exact", "approx", "rounding", "mismatch", "refused", "crash", "config", "timeout")


def summary(results: dict, ops: dict) -> None:
    table = Table("status", "n", "jobs", title=f"arch sweep: {len(results)} jobs, {len(ops)} call_function targets")
    for status in STATUSES:
        names = sorted(n for n, r in results.items() if r.get("status") == status)
        if names:
            table.add_row(status, str(len(names)), ", ".join(names))
    console = Console()
    console.print(table)
    for name, r in sorted(results.items()):
        if r.get("status") in ("rounding", "mismatch", "crash", "timeout"):
            original = f"; against the original decoding the same rows: {r['original']}" if "original" in r else ""
            original += f"; expert routing flips: {r['flip']}" if r.get("flip") else ""
            console.print(
                f"{name} {r['status']}: {r.get('errors') or ''}{original} {r.get('message', '')}", markup=False
            )
    for name, r in sorted(results.items()):
        if r.get("auto", {}).get("status") in ("mismatch", "crash"):
            console.print(f"{name} --to auto {r['auto']['status']}: {r['auto']['message']}", markup=False)
    for key, words in (
        ("serialize_error", "graph_to_json refuses the graph"),
        ("load_error", "rnnify.load refuses it"),
    ):
        refused = sorted(n for n, r in results.items() if key in r)
        console.print(f"converted, but {words}: {len(refused)} ({', '.join(refused)})", markup=False)


def _cell_class(name: str):
    """The rnnify cell class a result names (``SSDCell``), or None."""
    return getattr(rnnify.cells, name, None)


def _counts(results: dict) -> str:
    counts = {s: sum(r.get("status") == s for r in results.values()) for s in STATUSES}
    classes = {r["class"] for r in results.values() if r.get("status") == "exact" and r.get("class")}
    return ", ".join(f"{s}: {n}" for s, n in counts.items() if n) + f" ({len(classes)} distinct classes exact)."


def _rows(results: dict) -> list[str]:
    lines = ["| model type | class | status | `--to auto` | why |", "|---|---|---|---|---|"]
    for name, r in sorted(results.items()):
        why = (r.get("message") or r.get("serialize_error") or "").replace("|", "\\|")
        if r.get("status") == "mismatch":
            why = f"relative error {r.get('errors')}"
        own = sorted({cell.target for cell in map(_cell_class, r.get("cells", [])) if cell and cell.own_layer})
        if r.get("status") == "exact" and own:
            why = f"keeps its own {', '.join(own)} layers" + (f"; {why}" if why else "")
        if r.get("status") == "exact" and r.get("padding"):
            why = "convert warns: a row holding its padding id as a token differs" + (f"; {why}" if why else "")
        if r.get("status") == "exact" and r.get("language_model"):
            why = f"its language model, {r['language_model']}" + (f"; {why}" if why else "")
        probe = r.get("auto", {})
        if probe.get("status") in ("mismatch", "crash", "refused"):
            said = probe["message"] if probe["message"].startswith("--to auto") else f"--to auto: {probe['message']}"
            why = said + (f"; {why}" if why else "")
        shown = probe.get("status", "") + ("*" if probe.get("runner") == "GraphRunner" else "")
        lines.append(f"| `{name}` | {r.get('class') or ''} | {r.get('status')} | {shown} | {why[:220]} |")
    return lines


def _half_precision(half: dict | None) -> list[str]:
    """The page's paragraph on the bfloat16 sweep, or nothing without one."""
    if half is None:
        return []
    return [
        "In bfloat16 (`python benchmarks/arch_sweep.py --dtype bfloat16`: every type above and below, the "
        "same checks within bfloat16's tolerance, 2e-2): " + _counts(half["results"]) + " `rounding` marks a "
        "difference over the tolerance in a comparison that computes two ways (a left-padded batch against "
        "its rows alone, a cached decode against one forward) where the conversion gives the logits of the "
        "original decoding the same rows, or where the conversion parts from the original only once a router "
        "met a tie, two experts' scores closer than rounding moves them (`benchmarks/sweep_checks.py`; "
        "`convert`'s own check draws other tokens then): rounding, which in a mixture of experts can send a "
        "token to other experts.",
        "",
    ]


def markdown(sweep: dict, half: dict | None = None) -> str:
    """The architectures page: one row per causal LM class of transformers and one per composite
    (vision- or audio-language) model class, its status and why; with ``half`` (the bfloat16 sweep)
    a paragraph of its counts."""
    results = {k: r for k, r in sweep["results"].items() if ":" not in k}
    composites = {k: r for k, r in results.items() if k.partition("@")[0] in COMPOSITES}
    causal = {k: r for k, r in results.items() if k not in composites}
    probed = [r["auto"]["status"] for r in results.values() if "auto" in r]
    auto = {status: probed.count(status) for status in sorted(set(probed), key=probed.count, reverse=True)}
    run = sweep["runs"][-1]
    lines = [
        "# Architectures",
        "",
        "Every causal language model class of transformers "
        f"{run['transformers']}, and below every vision- or audio-language model class it has no causal "
        "LM class for, as a tiny random model (2 layers, 64 wide), converted with "
        '`rnnify.convert(model, to="exact")` and compared with the original, prefill and prefill + '
        f"{sweep['steps']} steps, and a batch with a left-padded row with each row alone (exact: within "
        f"{sweep['tolerance']}); a row `TYPE@VARIANT` is that type in "
        "the layout of a released checkpoint its defaults do not build (`falcon@alibi`: Falcon-RW). "
        "A refusal is one line saying why; "
        "nothing converts silently wrong: where the original sets its padding id apart when a row holds it "
        "as a token (RoBERTa's family numbers positions past it), `convert` warns that such rows differ "
        "(rnnify pads with `attention_mask`). Written by `python benchmarks/arch_sweep.py` (the sweep, "
        "about 15 minutes) and `python benchmarks/arch_sweep.py --markdown docs/architectures.md` "
        "(this page, from `benchmarks/results/arch_sweep.json`). A hybrid's own recurrent layers "
        "(short convolutions, Mamba scans, gated delta rules, RG-LRUs, lightning attention, token shifts) stay as they are, their "
        "state carried with the cells' ([math.md](math.md#state-space-layers)); the last column names them.",
        "",
        _counts(causal),
        "",
        *_half_precision(half),
        "The `--to auto` column: what its probe makes of each model that converts exactly "
        "(`auto_probe`): `scored` where it records the sites the compiler found (layers, shapes, windows, "
        "score terms) and its pass with every head exact gives the original's logits (within the same "
        "tolerance), through transformers' attention interface or, where that does not reach the "
        "model's attention (`scored*`), through the model's exact conversion (a layer's several attention "
        "sites, as DiffLlama's two maps, share its heads' kinds); `refused` (the why column says why) where "
        "a layer's sites differ in shape, an indexer selects the keys (sparse attention) or the tokens add "
        "to the scores (Inkling's relative bias, Inkling 2's sinks): `--to exact` only. "
        + ", ".join(f"{s}: {n}" for s, n in auto.items())
        + ". The other sparse-attention models keep their configs' top-k (2,048 keys a query), more than the "
        "sweep's tokens, so their rows check the layer below its selection, where Qwen4-Exp's tiny config reads "
        "2 pools of 4 keys and its rows check past it; tests/test_sparse_attention.py and "
        "tests/test_pooled_selection.py check each past the selection.",
        "",
        *_rows(causal),
        "",
        "## Vision- and audio-language models",
        "",
        "A composite model (an image or audio encoder beside a text decoder, `...ForConditionalGeneration`) "
        "converts to its language model: its own decoder and output head, in the causal LM class "
        "transformers has for its text config or as the decoder followed by the head (`TextPath`, with the "
        "whole's scale and cap of the logits where its text config names them), whichever "
        "gives the whole model's logits on text, checked at load (`rnnify/compiler/composite.py`); the "
        "converted model reads text only. Compared here with the whole model on text; a whole that does "
        "not run on text alone (it needs its images, audio or another model's cache) is refused, and "
        "`config` marks a type no tiny model of which builds here. " + _counts(composites),
        "",
        *_rows(composites),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        help="comma-separated jobs (model types, MODEL_TYPE@VARIANT or ARCH:TARGET) to (re)run, merged into -o",
    )
    parser.add_argument("--timeout", type=float, default=120, help="seconds per job (default: 120)")
    parser.add_argument("--workers", type=int, default=2, choices=(1, 2), help="jobs at once (default: 2)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the model-type jobs' tiny models, each checked within its tolerance (default: float32; "
        "bfloat16 writes benchmarks/results/arch_sweep_bfloat16.json unless -o says otherwise)",
    )
    parser.add_argument("-o", "--output")
    parser.add_argument(
        "--markdown",
        metavar="FILE",
        help="only write the architectures table of -o's results to FILE (docs/architectures.md), run nothing",
    )
    args = parser.parse_args()
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    args.output = args.output or str(ROOT / f"benchmarks/results/arch_sweep{suffix}.json")
    if args.markdown:
        sweep = json.loads(Path(args.output).read_text())
        if sweep.get("dtype", "float32") != "float32":
            parser.error(f"{args.output} holds the {sweep['dtype']} sweep; the architectures page is the float32 one's")
        half = ROOT / "benchmarks/results/arch_sweep_bfloat16.json"
        Path(args.markdown).write_text(markdown(sweep, json.loads(half.read_text()) if half.is_file() else None))
        print(f"wrote {args.markdown}")
        return
    mp.set_forkserver_preload(
        ["torch", "transformers", "rnnify.compiler.convert", "rnnify.auto", "rnnify.runtime.serialize"]
    )
    jobs = all_jobs() if args.dtype == "float32" else [job for job in all_jobs() if ":" not in job]
    if args.only:
        wanted = args.only.split(",")
        unknown = [n for n in wanted if n not in jobs]
        if unknown:
            only = "" if args.dtype == "float32" else " (ARCH:TARGET jobs run in the float32 sweep, in their @DTYPE)"
            parser.error(f"unknown jobs{only}: {', '.join(unknown)}")
        jobs = wanted
    output = Path(args.output)
    previous = json.loads(output.read_text()) if args.only and output.is_file() else {"results": {}, "runs": []}
    if previous["results"] and previous.get("dtype", "float32") != args.dtype:
        parser.error(
            f"{output} holds a {previous.get('dtype', 'float32')} sweep; a {args.dtype} one goes to another -o"
        )
    results: dict = {}

    def one(name: str) -> None:
        results[name] = result = run_isolated(name, args.timeout, getattr(torch, args.dtype))
        errors = " ".join(f"{k} {'nan' if v is None else f'{v:.1e}'}" for k, v in (result.get("errors") or {}).items())
        print(
            f"[{len(results)}/{len(jobs)}] {name}: {result['status']} ({result['seconds']} s) {errors} "
            f"{result.get('message', '')}"[:300],
            flush=True,
        )

    start = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(one, jobs))
    merged = {**previous["results"], **results}
    run = {
        "command": " ".join(["python", "benchmarks/arch_sweep.py", *sys.argv[1:]]),
        "jobs": len(jobs),
        "seconds": round(time.perf_counter() - start),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    ops = union(merged)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "runs": [*previous.get("runs", []), run],
                "dtype": args.dtype,
                "seq": SEQ,
                "steps": STEPS,
                "batch": BATCH,
                "tolerance": "rnnify.verify.tolerance: 1e-4, 2e-2 in half precision",
                "counts": {s: sum(r.get("status") == s for r in merged.values()) for s in STATUSES},
                "results": dict(sorted(merged.items())),
                "ops": ops,
            },
            indent=1,
        )
        + "\n"
    )
    summary(merged, ops)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
