"""Decode and prefill of converted models against their original, side by side in one run.

    python benchmarks/speed.py ORIGINAL CONVERTED [CONVERTED ...] [--contexts 256,1024] [--batch 1,8]
        [--prefill 256,1024,2048,4096] [--repeats 3] [--steps 8] [--kernels none,reference] [--compile]
        [--aot] [--row-major] [--breakdown]
        [--json benchmarks/results/speed-NAME.json]

One thread (``torch.set_num_threads(1)``), CPU. Contexts are reached as ``rnnify bench`` reaches
them (``rnnify.bench.fill_state`` and ``kv_cache``). Every time is the minimum over ``--repeats``
rounds, and in each round every model (the original first, then last, in turn) runs ``--steps``
decode steps, so all models see the same machine load; a ratio is the original's time over the
converted model's (> 1: the converted model is faster). On a shared machine, compare these
ratios, not absolute times across runs.

``--kernels none,reference`` adds each converted model loaded with those kernels too (named
``NAME[none]``...): the cells' own PyTorch forms, and the kernel ops' PyTorch references, against
the default ``auto``. ``--compile`` adds each converted model with its step compiled (``RecurrentModel.compile_step``),
and records how long the first compiled step took. ``--aot`` adds each with the step compiled ahead
of time (``rnnify compile``: compiled into this machine's step cache if it holds none for the model,
and how long that took is recorded); the plain rows always decode eagerly. ``--row-major`` adds each with its
weights laid out as checkpoints hold them (``NAME[row-major]``; a head is otherwise column-major on
a CPU, ``rnnify.runtime.weight_layout``). ``--breakdown`` adds, per converted model at
batch 1 and the first context, where a step's time goes: the whole ``step`` call, the step graph
alone, the time inside the cells, the aten ops dispatched in and out of the cells, and the time
reading every weight once takes (``RecurrentModel.weight_nbytes_per_token`` over the measured bandwidth).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import rnnify
from rnnify.bench import OpCount, fill_state, kv_cache, machine
from rnnify.runtime.step_cache import cached, compile_into_cache
from rnnify.runtime.weight_layout import lay_out_linear_weights

STEP_VARIANTS = ("+compile", "+aot")  # rows that differ from their model in the decode step only
ORIGINAL_INFERENCE = "original[inference_mode]"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _min_ms(fn, steps: int) -> float:
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def breakdown(model, context: int, steps: int, limit_ms: float) -> dict:
    """Where a batch-1 step's time goes (see the module docstring)."""
    state = fill_state(model, context, 1, 256)
    token = torch.tensor([[5]], device=model.device)
    inputs = (token, state.positions[:, None], torch.ones_like(token, dtype=torch.bool), *state.tensors)
    spent = [0.0]
    ops = OpCount()

    def enter(*_):
        ops.inside = True
        spent.append(time.perf_counter())

    def leave(*_):
        ops.inside = False
        spent[0] += time.perf_counter() - spent.pop()

    handles = [
        h for cell in model.cells for h in (cell.register_forward_pre_hook(enter), cell.register_forward_hook(leave))
    ]
    with torch.no_grad():
        step_ms = _min_ms(lambda: model.step(token, state), steps)
        graph_ms = _min_ms(lambda: model.graph(*inputs), steps)
        cells_ms = float("inf")
        for _ in range(steps):
            spent[0] = 0.0
            model.graph(*inputs)
            cells_ms = min(cells_ms, spent[0] * 1e3)
        with ops:
            model.graph(*inputs)
    for handle in handles:
        handle.remove()
    return {
        "step_ms": step_ms,
        "graph_ms": graph_ms,
        "cells_ms": cells_ms,
        "ops_total": ops.ops,
        "ops_in_cells": ops.inside_ops,
        "weight_read_ms": limit_ms,
    }


def original_ops(hf, context: int) -> int:
    cache = kv_cache(hf, context, 1)
    ops = OpCount()
    with torch.no_grad(), ops:
        hf(input_ids=torch.tensor([[5]]), cache=cache, position_ids=torch.tensor([[context]]), use_cache=True)
    return ops.ops


def _order(runs: dict, round_: int) -> list:
    """The models in order, reversed every other round: none always runs right after the same one."""
    items = list(runs.items())
    return items[::-1] if round_ % 2 else items


def original_step(hf, token: torch.Tensor, context: int, inference: bool = False):
    """One decode step of the original with its KV cache, as transformers' ``generate`` runs it
    (``torch.no_grad``, the caller's), or under ``torch.inference_mode``, as rnnify's ``step`` runs."""
    cache, position = kv_cache(hf, context, token.shape[0]), [context]

    def step():
        # not inference_mode(False): that turns autograd back on inside the caller's no_grad
        with torch.inference_mode() if inference else contextlib.nullcontext():
            hf(input_ids=token, cache=cache, position_ids=torch.full_like(token, position[0]), use_cache=True)
        position[0] += 1

    return step


def decode(
    hf,
    models: dict,
    contexts: list[int],
    batches: list[int],
    repeats: int,
    steps: int,
    original_inference: bool = False,
) -> list[dict]:
    rows = []
    for batch in batches:
        for context in contexts:
            token = torch.full((batch, 1), 5)
            runs = {"original": original_step(hf, token, context)}
            if original_inference:
                runs[ORIGINAL_INFERENCE] = original_step(hf, token, context, inference=True)
            for name, model in models.items():
                holder = [fill_state(model, context, batch, 256)]

                def step(model=model, holder=holder):
                    _, holder[0] = model.step(token, holder[0])

                runs[name] = step
            best = dict.fromkeys(runs, float("inf"))
            compile_s = {}
            with torch.no_grad():
                for name, run in runs.items():  # warm up (a compiled step compiles here, once per batch size)
                    start = time.perf_counter()
                    run()
                    compile_s[name] = time.perf_counter() - start
                    run()
                for round_ in tqdm(range(repeats), desc=f"decode batch {batch} @ {context}", leave=False):
                    for name, run in _order(runs, round_):
                        best[name] = min(best[name], _min_ms(run, steps))
            for name in runs:
                if name == "original":
                    continue
                rows.append(
                    {
                        "model": name,
                        "batch": batch,
                        "context": context,
                        "ms": best[name],
                        "original_ms": best["original"],
                        "ratio": best["original"] / best[name],
                        "first_step_s": compile_s[name],
                    }
                )
    return rows


def prefill(hf, models: dict, lengths: list[int], repeats: int) -> list[dict]:
    rows = []
    vocab = hf.config.get_text_config().vocab_size
    runs = {"original": lambda ids: hf(input_ids=ids, use_cache=False)}
    runs.update({name: model.prefill for name, model in models.items() if not name.endswith(STEP_VARIANTS)})
    with torch.no_grad():
        for name, run in runs.items():
            run(torch.randint(0, vocab, (1, 16)))
        for length in lengths:
            ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length))
            best = dict.fromkeys(runs, float("inf"))
            for round_ in tqdm(range(repeats), desc=f"prefill {length}", leave=False):
                for name, run in _order(runs, round_):
                    best[name] = min(best[name], _min_ms(lambda: run(ids), 1))
            for name in runs:
                if name != "original":
                    rows.append(
                        {
                            "model": name,
                            "length": length,
                            "ms": best[name],
                            "original_ms": best["original"],
                            "ratio": best["original"] / best[name],
                        }
                    )
    return rows


def row_major(model):
    """``model`` with its linear weights row-major, as checkpoints hold them (ties kept)."""
    lay_out_linear_weights(model.graph, layout=torch.Tensor.contiguous)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("original", help="the original Hugging Face model directory")
    parser.add_argument("converted", nargs="+", help="converted model directories")
    parser.add_argument("--contexts", type=_ints, default=[256, 1024])
    parser.add_argument("--batch", type=_ints, default=[1, 8])
    parser.add_argument("--prefill", type=_ints, default=[256, 1024, 2048, 4096], help="prompt lengths ('' for none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="also time every model with its step compiled")
    parser.add_argument("--aot", action="store_true", help="also time every model with its step compiled ahead of time")
    parser.add_argument(
        "--kernels",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="also time every model loaded with these kernels, e.g. none,reference",
    )
    parser.add_argument(
        "--row-major",
        action="store_true",
        help="also time every model with every linear weight row-major, as checkpoints hold them "
        "(not as rnnify.runtime.weight_layout keeps them)",
    )
    parser.add_argument("--breakdown", action="store_true", help="where a batch-1 step's time goes")
    parser.add_argument(
        "--original-inference-mode",
        action="store_true",
        help=f"also time the original's decode under torch.inference_mode, as rnnify's step runs "
        f"(row {ORIGINAL_INFERENCE!r}; the original row runs as transformers' generate does, "
        f"under torch.no_grad)",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.original).eval()
    models, aot_compile_s = {}, {}
    for path in args.converted:
        name = Path(path).name
        models[name] = rnnify.load(path, aot_step=False)
        for kernels in args.kernels:
            models[f"{name}[{kernels}]"] = rnnify.load(path, kernels=kernels, aot_step=False)
        if args.row_major:
            models[name + "[row-major]"] = row_major(rnnify.load(path, aot_step=False))
        if args.compile:
            models[name + "+compile"] = rnnify.load(path, aot_step=False).compile_step()
        if args.aot:
            if cached(models[name]) is None:
                start = time.perf_counter()
                compile_into_cache(models[name])
                aot_compile_s[name] = time.perf_counter() - start
            models[name + "+aot"] = rnnify.load(path)
            if models[name + "+aot"].step_package is None:  # warned why: this row would be eager
                raise SystemExit(f"{path}: the compiled step in this machine's cache could not be loaded")
    info = machine(torch.device("cpu"))
    limit_ms = next(iter(models.values())).weight_nbytes_per_token() / (info.bandwidth_gb_s * 1e9) * 1e3
    out = {
        "command": " ".join(["python", *sys.argv]),
        "machine": dataclasses.asdict(info),
        "threads": torch.get_num_threads(),
        "aot_compile_s": aot_compile_s,
        "weight_read_ms": limit_ms,
        "decode": decode(hf, models, args.contexts, args.batch, args.repeats, args.steps, args.original_inference_mode),
        "prefill": prefill(hf, models, args.prefill, args.repeats),
    }
    if args.breakdown:
        out["breakdown"] = {
            name: breakdown(model, args.contexts[0], 3 * args.steps, limit_ms)
            for name, model in models.items()
            if "[" not in name and not name.endswith(STEP_VARIANTS)
        }
        out["breakdown"]["original"] = {"ops_total": original_ops(hf, args.contexts[0])}
    for row in out["decode"]:
        print(
            f"decode  {row['model']:22s} batch {row['batch']} @ {row['context']:5d}: {row['ms']:8.2f} ms, "
            f"original {row['original_ms']:8.2f} ms, ratio {row['ratio']:.2f}"
        )
    for row in out["prefill"]:
        print(
            f"prefill {row['model']:22s} {row['length']:5d} tokens: {row['ms']:9.1f} ms, "
            f"original {row['original_ms']:9.1f} ms, ratio {row['ratio']:.2f}"
        )
    for name, row in out.get("breakdown", {}).items():
        print(
            f"breakdown {name}: "
            + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
