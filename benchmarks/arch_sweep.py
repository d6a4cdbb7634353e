"""Convert a tiny random model of every causal-LM architecture; record outcomes and step-graph ops.

    python benchmarks/arch_sweep.py [--only llama,gpt2,llama:linear] [--timeout 120] [--workers 2]
        [-o benchmarks/results/arch_sweep.json]

A job per ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` entry: a model of 2 layers, 64 wide, from the config
class with every size-like attribute shrunk, ``rnnify.convert(model, to="exact")``, then prefill
(SEQ tokens) and prefill + STEPS steps against the original's forward (max abs diff / max abs of the
reference). Status: exact (both within ``rnnify.verify.tolerance``), mismatch, refused (an
``RnnifyError``), crash (any other exception), config (no tiny model builds or runs), timeout. Jobs
``ARCH:TARGET[@DTYPE]`` convert the tiny llama and gpt2 of examples/make_tiny_model.py to each target
of ``rnnify.cells.CELLS``, through ``--to auto``, and in half precision (``approx``: not exact cells).
Per converted model: its call_function targets as graph.json names them, with the types of their
constant arguments and their str constants (the JSON holds the union), and ``serialize_error`` where
the working tree's ``graph_to_json`` refuses the graph. Each job runs in its own process.
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
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging

import rnnify
from rnnify.auto import auto_convert
from rnnify.cells import CELLS
from rnnify.errors import RnnifyError, first_line
from rnnify.runtime.serialize import graph_to_json
from rnnify.verify import tolerance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from make_tiny_model import make_tiny_model, tiny_config  # noqa: E402

SEQ, STEPS, BATCH, VOCAB = 16, 8, 2, 256

# --------------------------------------------------------------------------- tiny configs
# attribute -> value, set wherever a config (or sub-config) has it as an int
SIZES = {
    **dict.fromkeys(("vocab_size",), VOCAB),
    **dict.fromkeys(
        (
            "hidden_size",
            "d_model",
            "n_embd",
            "embed_dim",
            "dim",
            "model_dim",
            "word_embed_proj_dim",
            "hidden_size_global",
            "lru_width",
            "emb_dim",
        ),
        64,
    ),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "decoder_attention_heads",
            "attention_heads",
            "swa_num_attention_heads",
        ),
        4,
    ),
    **dict.fromkeys(
        (
            "num_key_value_heads",
            "num_kv_heads",
            "n_kv_heads",
            "kv_n_heads",
            "multi_query_group_num",
            "num_query_groups",
            "swa_num_key_value_heads",
        ),
        2,
    ),
    **dict.fromkeys(
        (
            "head_dim",
            "d_head",
            "attention_head_dim",
            "dim_head",
            "kv_channels",
            "attention_head_size",
            "swa_head_dim",
            "d_kv",
            "v_head_dim",
            "qk_head_dim",
            "index_head_dim",
        ),
        16,
    ),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "decoder_ffn_dim",
            "ffn_hidden_size",
            "d_ff",
            "dff",
            "intermediate_size_mlp",
            "dense_intermediate_size",
            "first_dense_intermediate_size",
            "mlp_dim",
            "feed_forward_size",
            "dim_ff",
            "d_inner",
        ),
        128,
    ),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "expert_ffn_hidden_size",
            "shared_experts_intermediate_size",
            "mlp_only_intermediate_size",
        ),
        32,
    ),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_top_k", "moe_topk"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "rotary_dim": 8,
    "index_n_heads": 2,
    "index_num_heads": 2,
    **dict.fromkeys(("linear_num_key_heads", "linear_num_heads"), 2),
    "linear_num_value_heads": 4,
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), 16),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 8),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 4),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 32),
    **dict.fromkeys(("n_groups", "mamba_n_groups", "mamba_ngroups"), 1),
    "mamba_d_ssm": 128,
    **dict.fromkeys(
        (
            "unpadded_vocab_size",
            "vocab_size_per_layer_input",
            "encoder_hash_byte_group_vocab",
            "decoder_vocab_size",
            "pronunciation_vocab_size",
            "shape_vocab_size",
        ),
        VOCAB,
    ),
    **dict.fromkeys(("pronunciation_embed_dim", "shape_embed_dim"), 16),
}
# set even where the default is None (a None that the model code divides by or indexes with)
SET_NONE = {"head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "n_shared_experts"}
CAPS = {  # attribute -> upper bound, applied only where the default is larger
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_seq_len"), 128),
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "attention_chunk_size"), 8),
    "hidden_size_per_layer_input": 16,
}
# lists of layer indices (remapped to the layers kept; the others dropped), and per-layer lists whose values are indices
INDEX_LISTS = {"index_layers", "mlp_only_layers", "moe_layers", "cross_attention_layers", "full_attn_idxs"}
INDEX_VALUED = {"kv_source_layers"}
# targets given a window (shorter than the 24 tokens compared) where they need one or have a longer default
TARGET_OPTIONS = {target: {"window": 8} for target in ("window", "hybrid", "select", "lola")}
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# per model type, set after the generic rules (the names listed in a layer-types list are kept too)
SPECIAL: dict[str, dict] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "zamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
    },
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "dots3_note_text": {"num_key_value_heads": 4, "head_dim": 16},
    "dots3_note": {"num_key_value_heads": 4, "head_dim": 16, "adapter_in_dim": 64, "adapter_input_size": 64},
    **dict.fromkeys(("musicgen", "musicgen_melody"), {"num_codebooks": 1}),
    "mamba2": {"head_dim": 32},
    "zaya": {"num_experts_per_tok": 1},
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    **dict.fromkeys(
        ("gemma4_assistant", "gemma4_unified_assistant"),
        {  # its defaults fail its own checks
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": 2,
        },
    ),
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
}


def _keep_layers(types: list) -> list[int]:
    """Indices of the layers kept: the first of each distinct type (at most 4), then the first ones, 2 at least."""
    keep = sorted({str(t): i for i, t in reversed(list(enumerate(types)))}.values())[:4]
    keep += [i for i in range(len(types)) if i not in keep][: max(0, 2 - len(keep))]
    return sorted(keep)


def _tiny(values: dict, mla: bool) -> dict:
    """One layer's ``per_layer_config`` entry with its sizes shrunk."""
    out = {k: SIZES[k] if k in SIZES and isinstance(v, int) else v for k, v in values.items()}
    if mla and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out.get("num_attention_heads", SIZES["num_attention_heads"])
    return out


def overrides(config, model_type: str) -> dict:
    """Constructor arguments that make ``config`` (and its sub-configs) tiny: every size-like attribute set
    (``SIZES``, ``CAPS``), per-layer lists cut to the layers kept, then ``SPECIAL[model_type]``."""
    layers_before = next(
        (
            getattr(config, k)
            for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
            if isinstance(getattr(config, k, None), int)
        ),
        0,
    )
    lists = [k for k, v in vars(config).items() if isinstance(v, list) and len(v) == layers_before > 2]
    typed = next(
        (k for k in ("layer_types", "layers_block_type", "block_types", "attention_types") if k in lists),
        lists[0] if lists else None,
    )
    keep = _keep_layers(getattr(config, typed)) if typed else None
    out: dict = {}
    for key, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            out[key] = {**value.to_diff_dict(), **overrides(value, model_type), "model_type": value.model_type}
        elif isinstance(value, bool) or key.startswith("_"):
            continue
        elif key in SIZES and (isinstance(value, int) or (value is None and key in SET_NONE)):
            out[key] = SIZES[key]
        elif key in CAPS and isinstance(value, int) and value > CAPS[key]:
            out[key] = CAPS[key]
        elif key in SPECIAL_TOKENS and isinstance(value, (int, list)):
            out[key] = SPECIAL_TOKENS[key]
    mla = isinstance(out.get("kv_lora_rank"), int)
    if mla:  # multi-head latent attention: head_dim is the rotary part, a kv head per head
        out.update(head_dim=out.get("qk_rope_head_dim", 8), num_key_value_heads=out.get("num_attention_heads", 4))
    if keep is not None:
        new = {old: i for i, old in enumerate(keep)}
        out.update({key: [getattr(config, key)[i] for i in keep] for key in lists})
        out.update({k: [new[i] for i in out[k] if i in new] for k in INDEX_VALUED if k in out})
        out.update({k: len(keep) for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in out})
        for key, value in vars(config).items():
            if key in INDEX_LISTS and isinstance(value, list):
                out[key] = [new[i] for i in value if i in new]
        per_layer = config.to_dict().get("per_layer_config")  # {"05": {"head_dim": 512}, ...}: layers unlike the rest
        if isinstance(per_layer, dict):
            out["per_layer_config"] = {new[int(k)]: _tiny(v, mla) for k, v in per_layer.items() if int(k) in new}
    if hasattr(config, "is_decoder"):
        out["is_decoder"] = True  # an encoder family's *ForCausalLM: what its own docs ask for, causal attention
    return {**out, **SPECIAL.get(config.model_type, {}), **SPECIAL.get(model_type, {})}


def build(model_type: str):
    """(tiny random model in eval mode, its class name) for ``model_type``."""
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    model_class = getattr(transformers, class_name)
    try:
        default = config_class()
    except Exception:  # noqa: BLE001  (a default that fails its own checks: the special values may mend it)
        text = {"model_type": "gemma4_text", **SPECIAL[model_type]} if "assistant" in model_type else None
        default = config_class(**({"text_config": text} if text else {}))
    config = config_class(**overrides(default, model_type))
    if not isinstance(config, model_class.config_class):  # e.g. Llama4ForCausalLM takes the text config
        config = next((v for v in vars(config).values() if isinstance(v, model_class.config_class)), config)
    torch.manual_seed(0)
    model = model_class(config).eval()
    if hasattr(model, "set_default_language"):  # X-MOD
        model.set_default_language("en_XX")
    return model, class_name


def tiny_example(arch: str):
    """Tiny ``arch`` (llama or gpt2) of ``examples/make_tiny_model.py``."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch)).eval()


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
def _rel(got, want) -> float | None:
    diff = float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-30)
    return diff if math.isfinite(diff) else None  # NaN/inf: reported as null, judged a mismatch


def _logits(model, ids):
    out = model(input_ids=ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0]


def _convert(name: str):
    """(source model, its conversion (a callable), class name) for job ``name``: MODEL_TYPE or ARCH:TARGET[@DTYPE]."""
    if ":" not in name:
        model, class_name = build(name)
        return model, lambda: rnnify.convert(model, to="exact"), class_name
    arch, target = name.split(":")
    target, _, dtype = target.partition("@")  # e.g. exact@bfloat16
    if not target.startswith("auto"):
        model = tiny_example(arch).to(getattr(torch, dtype or "float32"))
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


def run_job(name: str) -> dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    result: dict = {"status": None, "class": None, "stage": "config"}
    try:
        model, convert, result["class"] = _convert(name)
        result["params"] = sum(p.numel() for p in model.parameters())
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(3, vocab, (BATCH, SEQ + STEPS), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want_prefill, want_full = _logits(model, ids[:, :SEQ]), _logits(model, ids)
        result["stage"] = "convert"
        converted = convert()
        result["cells"] = sorted({type(cell).__name__ for cell in converted.cells})
        result["ops"] = graph_ops(converted.graph.graph)
        result["stage"] = "compare"
        got, state = converted.prefill(ids[:, :SEQ])
        steps = [got]
        for t in range(SEQ, SEQ + STEPS):
            out, state = converted.step(ids[:, t : t + 1], state)
            steps.append(out)
        result["errors"] = {"prefill": _rel(got, want_prefill), "prefill+steps": _rel(torch.cat(steps, 1), want_full)}
        judged = all(cell.exact for cell in converted.cells)
        tol = tolerance(next(model.parameters()).dtype)  # rnnify verify's: 1e-4, 2e-2 in half precision
        ok = all(e is not None and e <= tol for e in result["errors"].values())
        result["status"] = ("exact" if ok else "mismatch") if judged else "approx"
        result["stage"] = "save"
        graph_to_json(converted.graph.graph)  # what saving would do with today's serialize
        result["stage"] = "done"
    except Exception as exc:  # noqa: BLE001  (every failure is a finding)
        if result["stage"] == "config":
            result["status"] = "config"
        elif result["stage"] == "save":  # converted, but graph.json cannot hold it: save would fail
            result["serialize_error"] = first_line(exc, with_type=True)
            return result
        else:
            result["status"] = "refused" if isinstance(exc, RnnifyError) else "crash"
        result["message"] = first_line(exc, with_type=not isinstance(exc, RnnifyError))
    return result


def _child(name: str, conn) -> None:
    conn.send(run_job(name))
    conn.close()


def run_isolated(name: str, timeout: float) -> dict:
    ctx = mp.get_context("forkserver")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, send), daemon=True)
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
    return [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *extra]


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


STATUSES = ("exact", "approx", "mismatch", "refused", "crash", "config", "timeout")


def summary(results: dict, ops: dict) -> None:
    table = Table("status", "n", "jobs", title=f"arch sweep: {len(results)} jobs, {len(ops)} call_function targets")
    for status in STATUSES:
        names = sorted(n for n, r in results.items() if r.get("status") == status)
        if names:
            table.add_row(status, str(len(names)), ", ".join(names))
    console = Console()
    console.print(table)
    for name, r in sorted(results.items()):
        if r.get("status") in ("mismatch", "crash", "timeout"):
            console.print(f"{name} {r['status']}: {r.get('errors') or ''} {r.get('message', '')}", markup=False)
    refused = sorted(n for n, r in results.items() if "serialize_error" in r)
    console.print(
        f"converted, but graph_to_json refuses the graph: {len(refused)} ({', '.join(refused)})", markup=False
    )


def markdown(sweep: dict) -> str:
    """The architectures page: one row per ``*ForCausalLM`` of transformers, its status and why."""
    results = {k: r for k, r in sweep["results"].items() if ":" not in k}
    counts = {s: sum(r.get("status") == s for r in results.values()) for s in STATUSES}
    classes = {r["class"] for r in results.values() if r.get("status") == "exact" and r.get("class")}
    run = sweep["runs"][-1]
    lines = [
        "# Architectures",
        "",
        "Every causal language model class of transformers "
        f"{run['transformers']}, as a tiny random model (2 layers, 64 wide), converted with "
        '`rnnify.convert(model, to="exact")` and compared with the original, prefill and prefill + '
        f"{sweep['steps']} steps (exact: within {sweep['tolerance']}). A refusal is one line saying why; "
        "nothing converts silently wrong. Written by `python benchmarks/arch_sweep.py` (the sweep, "
        "about 15 minutes) and `python benchmarks/arch_sweep.py --markdown docs/architectures.md` "
        "(this page, from `benchmarks/results/arch_sweep.json`).",
        "",
        ", ".join(f"{s}: {n}" for s, n in counts.items() if n) + f" ({len(classes)} distinct classes exact).",
        "",
        "| model type | class | status | why |",
        "|---|---|---|---|",
    ]
    for name, r in sorted(results.items()):
        why = (r.get("message") or r.get("serialize_error") or "").replace("|", "\\|")
        if r.get("status") == "mismatch":
            why = f"relative error {r.get('errors')}"
        lines.append(f"| `{name}` | {r.get('class') or ''} | {r.get('status')} | {why[:220]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated jobs (model types, or ARCH:TARGET) to (re)run, merged into -o")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per job (default: 120)")
    parser.add_argument("--workers", type=int, default=2, choices=(1, 2), help="jobs at once (default: 2)")
    parser.add_argument("-o", "--output", default=str(ROOT / "benchmarks/results/arch_sweep.json"))
    parser.add_argument(
        "--markdown",
        metavar="FILE",
        help="only write the architectures table of -o's results to FILE (docs/architectures.md), run nothing",
    )
    args = parser.parse_args()
    if args.markdown:
        sweep = json.loads(Path(args.output).read_text())
        Path(args.markdown).write_text(markdown(sweep))
        print(f"wrote {args.markdown}")
        return
    mp.set_forkserver_preload(
        ["torch", "transformers", "rnnify.compiler.convert", "rnnify.auto", "rnnify.runtime.serialize"]
    )
    jobs = all_jobs()
    if args.only:
        wanted = args.only.split(",")
        unknown = [n for n in wanted if n not in jobs]
        if unknown:
            parser.error(f"unknown jobs: {', '.join(unknown)}")
        jobs = wanted
    output = Path(args.output)
    previous = json.loads(output.read_text()) if args.only and output.is_file() else {"results": {}, "runs": []}
    results: dict = {}

    def one(name: str) -> None:
        results[name] = result = run_isolated(name, args.timeout)
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
