"""How good is each target? Perplexity, KL, top-1 agreement, pass-key recall and state size.

    python benchmarks/fidelity.py                      # every variant on the bundled model; writes docs/fidelity.md
    python benchmarks/fidelity.py --variants hybrid-hedgehog linear-hedgehog --distill-tokens 1000000
    python benchmarks/fidelity.py --model models/smollm2 --data data/pydocs --seq-len 2048 \
        --eval-rows 4 --passkey 512,1024,2048 --batch-size 1 --no-distill \
        --variants exact linear-hedgehog --row hybrid-w256=hybrid,window=256,feature_map=hedgehog

By default on the bundled model (``examples/models/stdlib-llama``, trained by ``examples/train_tiny_lm.py``)
and its held-out files (``examples/stdlib_corpus.py``); ``--model`` and ``--data`` (a folder with
``train/`` and ``heldout/``, e.g. from ``examples/python_docs_corpus.py``) point it at another.
Each row (a named target and its cell options) is converted, evaluated training-free, distilled
on the training files (``rnnify.distill``: attention transfer, then LoRA fine-tuning; skipped with
``--no-distill``) and evaluated again. ``--passkey`` adds pass-key recall (``rnnify.passkey``) at
those prompt lengths, with the original's beside it. Every finished step is written to ``--json``
at once, and a rerun with the same settings takes a row's finished steps from there instead of
running them again, so a killed run loses at most the step it was in. The script prints a
markdown table, and writes a plot of quality against state size (``--png``) and, for the bundled
model, ``docs/fidelity.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import stdlib_corpus  # noqa: E402

import rnnify  # noqa: E402
from rnnify.distillation.train import SCHEDULES, STAGES, TRAIN  # noqa: E402
from rnnify.eval import write_json  # noqa: E402
from rnnify.passkey import evaluate_passkey, original_generator, passkey_trials, usable_probes  # noqa: E402
from rnnify.probes import prompts  # noqa: E402

BUNDLED = ROOT / "examples/models/stdlib-llama"

WINDOW = 64  # the window variants' default (--window)
HEDGEHOG_32 = {"feature_map": "hedgehog", "feature_options": {"feature_dim": 32}}


def variants(window: int = WINDOW) -> dict[str, tuple[str, dict]]:
    """The named rows: name -> (target, cell options); the hybrids' sinks pinned at 0, the default
    when their tables were measured."""
    return {
        "exact": ("exact", {}),
        "window": ("window", {"window": window}),
        "window-sinks": ("window", {"window": window, "sinks": 4}),
        **{
            f"linear-{m}": ("linear", {"feature_map": m})
            for m in ("elu", "relu", "performer", "taylor", "hedgehog", "t2r")
        },
        **{f"gated-{g}": ("gated", {"gate": g, "feature_map": "hedgehog"}) for g in ("retnet", "gla", "gateloop")},
        "aaren": ("aaren", {}),
        "hybrid-hedgehog": ("hybrid", {"window": window, "sinks": 0, "feature_map": "hedgehog"}),
        "delta": ("delta", {}),
        "gated-delta": ("gated-delta", {}),
        # the hybrid's memories at equal state bytes: a 32 x 32 delta state per kv head, 32 hedgehog
        # features for linear and GLA (kv [32, 32] plus k_sum [32]: 1.6% more than delta's)
        **{
            f"hybrid-{m}": ("hybrid", {"window": window, "sinks": 0, "memory": m, **HEDGEHOG_32})
            for m in ("linear", "gla")
        },
        **{f"hybrid-{m}": ("hybrid", {"window": window, "sinks": 0, "memory": m}) for m in ("delta", "gated-delta")},
    }


VARIANTS = variants()
GOALS = {"hybrid-hedgehog": 1.05, "linear-hedgehog": 1.15}  # perplexity ratio to the original (issue 5)


def parse_row(text: str) -> dict:
    """``NAME=TARGET[,KEY=VALUE...]`` -> a row; values are JSON where they parse (numbers, true), else text."""
    name, sep, rest = text.partition("=")
    target, *pairs = rest.split(",")
    options = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"--row {text!r}: options are KEY=VALUE, e.g. hybrid-w256=hybrid,window=256")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    if not sep or not name or not target:
        raise ValueError(f"--row {text!r}: expected NAME=TARGET[,KEY=VALUE...], e.g. hybrid-w256=hybrid,window=256")
    return {"variant": name, "target": target, "options": options}


def read_rows(path: Path) -> list[dict]:
    """A JSON list of ``{"variant": NAME, "target": TARGET, "options": {...}}`` rows."""
    rows = json.loads(path.read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"variant", "target"} <= set(r) for r in rows):
        raise ValueError(
            f'--rows {path}: expected a JSON list of {{"variant": ..., "target": ..., "options": {{...}}}}'
        )
    return [{"variant": r["variant"], "target": r["target"], "options": r.get("options", {})} for r in rows]


def measure(model, heldout: Path, args) -> dict:
    """Training-free or distilled: ``rnnify.evaluate`` against the original, and pass-key recall."""
    result = rnnify.evaluate(
        model,
        heldout,
        against=args.teacher,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_tokens=args.eval_tokens,
    ).to_json()
    if args.passkey:
        result["passkey"] = evaluate_passkey(
            model, args.passkey, trials=args.passkey_trials, seed=args.seed, original=False
        ).to_json()
    return result


def settings(spec: dict, args) -> dict:
    """What a row's training-free numbers depend on: a cached row is reused only when these match."""
    return {
        "target": spec["target"],
        "options": spec["options"],
        "model": str(args.model),
        "data": args.data_name,
        **({"training_free": False} if args.distilled_only else {}),
        "seq_len": args.seq_len,
        "eval_tokens": args.eval_tokens,
        "passkey": args.passkey,
        "passkey_trials": args.passkey_trials,
        "seed": args.seed,
    }


def distill_budget(spec: dict, args) -> int | None:
    """Distillation tokens for a row; None where it is not distilled."""
    if args.no_distill or spec["target"] == "exact":
        return None
    return args.goal_distill_tokens if spec["variant"] in GOALS else args.distill_tokens


def parse_dir_row(text: str) -> dict:
    """``NAME=DIR[,seconds=S]``: an rnnify directory converted or distilled elsewhere (e.g. with
    ``rnnify distill`` and its checkpoints, over several sessions); S is its distillation wall time."""
    name, sep, rest = text.partition("=")
    directory, _, seconds = rest.partition(",seconds=")
    if not sep or not name or not (Path(directory) / "rnnify.json").is_file():
        raise ValueError(f"--dir {text!r}: expected NAME=DIR[,seconds=S] with DIR an rnnify directory")
    return {"variant": name, "dir": directory, "seconds": float(seconds) if seconds else None}


def stage_tokens(record: dict) -> dict[str, int]:
    """Tokens per stage of a manifest's distillation record, with those of earlier distillations."""
    tokens = stage_tokens(record["earlier"]) if record.get("earlier") else {}
    for r in record["trained"]:
        tokens[r["stage"]] = tokens.get(r["stage"], 0) + r["tokens"]
    return tokens


def run_dir_row(spec: dict, heldout: Path, args, cached: dict | None, save) -> dict:
    """A row from a saved directory: its numbers count as distilled when its manifest records a
    distillation, else as training-free; reused from ``cached`` while the weights are the same."""
    model = rnnify.load(spec["dir"])
    manifest = model.manifest
    wanted = {
        **settings({"target": manifest.target, "options": manifest.options}, args),
        "dir": spec["dir"],
        "weights_sha256": manifest.files.get("model.safetensors"),
    }
    if cached is not None and cached.get("settings") == wanted:
        return cached
    print(f"== {spec['variant']}: {spec['dir']}", flush=True)
    row = {
        "variant": spec["variant"],
        "target": manifest.target,
        "options": manifest.options,
        "settings": wanted,
        "state_bytes": model.state_nbytes(args.seq_len),
    }
    result = measure(model, heldout, args)
    if manifest.distill is None:
        row["training_free"] = result
    else:
        stages = stage_tokens(manifest.distill)
        row.update(
            training_free=None,
            distilled=result,
            stage_tokens=stages,
            distill_tokens=sum(stages.values()),
            distill_seconds=spec["seconds"],
        )
    save(row)
    return row


def by_stage(pair, stages: list[str]) -> list[float]:
    """A (transfer, finetune) option's values for the stages that run."""
    return [dict(zip(STAGES, pair))[s] for s in stages]


def run_row(spec: dict, heldout: Path, train: Path, args, cached: dict | None, save) -> dict:
    """One row: training-free, then distilled; each step reused from ``cached`` when its settings match,
    else run and handed to ``save`` as soon as it is done."""
    if "dir" in spec:
        return run_dir_row(spec, heldout, args, cached, save)
    model = None
    row = cached if cached is not None and cached.get("settings") == settings(spec, args) else None
    if row is None:
        print(f"== {spec['variant']}: {'converting' if args.distilled_only else 'training-free'}", flush=True)
        model = rnnify.convert(args.model, to=spec["target"], progress=False, **spec["options"])
        row = {
            **spec,
            "settings": settings(spec, args),
            "state_bytes": model.state_nbytes(args.seq_len),
            "training_free": None if args.distilled_only else measure(model, heldout, args),
        }
        if not args.distilled_only:  # a row is saved once it has a measurement
            save(row)
    tokens = distill_budget(spec, args)
    gate_scales = by_stage(args.gate_lr_scale, args.stages)
    wanted = (
        None
        if tokens is None
        else {
            "tokens": tokens,
            "lr": list(args.lr),
            "seed": args.seed,
            "seq_len": args.distill_seq_len,
            "batch_size": args.distill_batch_size,
            "train": args.train,
            "schedule": args.schedule,
            **({} if args.stages == list(STAGES) else {"stages": args.stages}),
            **({} if gate_scales == [1.0] * len(args.stages) else {"gate_lr_scale": gate_scales}),
        }
    )
    if wanted is None or (row.get("distill_settings") == wanted and "distilled" in row):
        if wanted is None:
            row = {
                k: v
                for k, v in row.items()
                if k not in ("distilled", "distill_settings", "distill_seconds", "distill_tokens", "stage_tokens")
            }
        return row
    print(f"== {spec['variant']}: distilling {tokens:,} tokens", flush=True)
    model = model or rnnify.convert(args.model, to=spec["target"], progress=False, **spec["options"])
    start = time.time()
    model = rnnify.distill(
        model,
        train,
        teacher=args.teacher,
        max_tokens=tokens,
        seq_len=args.distill_seq_len,
        batch_size=args.distill_batch_size,
        lr=by_stage(args.lr, args.stages),
        train=args.train,
        schedule=args.schedule,
        seed=args.seed,
        stages=args.stages,
        gate_lr_scale=gate_scales,
        # with --checkpoint-dir a killed distillation continues where it stopped when rerun
        checkpoint_dir=None if args.checkpoint_dir is None else args.checkpoint_dir / spec["variant"],
        checkpoint_every=args.checkpoint_every,
        resume=args.checkpoint_dir is not None,
    )
    row = {
        **row,
        "distill_settings": wanted,
        "distill_seconds": round(time.time() - start, 1),
        "distill_tokens": tokens,
        # the budget is split between the stages that ran (transfer is skipped when the cells have
        # nothing to train): the tokens each stage read
        "stage_tokens": stage_tokens(model.manifest.distill),
    }
    row["distilled"] = measure(model, heldout, args)
    if args.save is not None:  # for --dir rows at another length, e.g. --seq-len 2048
        model.save(args.save / spec["variant"])
    save(row)
    return row


def original_passkey(args, cached: dict | None) -> dict | None:
    """The original model's pass-key accuracy (length -> share), on the prompts every row gets."""
    if not args.passkey:
        return None
    wanted = {
        "model": str(args.model),
        "lengths": args.passkey,
        "trials": args.passkey_trials,
        "seed": args.seed,
        "probes": "evaluation",
    }  # rnnify.passkey.usable_probes, as evaluate_passkey's default
    if cached is not None and cached.get("settings") == wanted:
        return cached
    from rnnify.compiler.capture import load_source
    from rnnify.data import load_tokenizer

    print("== original: pass key", flush=True)
    tokenizer = load_tokenizer(args.model)
    trials = passkey_trials(
        {"original": original_generator(load_source(args.model))},
        tokenizer,
        prompts(tokenizer, args.passkey, args.passkey_trials, args.seed, usable_probes(tokenizer)),
    )
    accuracy = rnnify.PasskeyResult(str(args.model), None, args.seed, trials).to_json()["accuracy"]["original"]
    return {"settings": wanted, "accuracy": accuracy}


def _passkey_cell(result: dict | None) -> str:
    if result is None:
        return "–"
    return " / ".join(f"{a:.0%}" for a in result.values())


def table(record: dict) -> str:
    """The markdown table: one line per row, the original first."""
    rows, original_ppl = record["rows"], record["original_perplexity"]
    passkey = record.get("original_passkey")
    lengths = "/".join(passkey["accuracy"]) if passkey else None
    pk_head = [f"pass key {lengths}"] if passkey else []
    head = [
        "variant",
        "state bytes / sequence",
        "training-free ppl (ratio)",
        "KL",
        "top-1",
        *pk_head,
        "distilled ppl (ratio)",
        "KL",
        "top-1",
        *pk_head,
        "tokens: transfer + finetune",
        "distill time",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def quality(result: dict | None) -> list[str]:
        if result is None:
            return ["–"] * (3 + bool(passkey))
        cells = [
            f"{result['perplexity']:.2f} ({result['perplexity'] / original_ppl:.3f})",
            f"{result['kl']:.4f}",
            f"{result.get('top1_agreement', float('nan')):.1%}",
        ]
        return cells + (
            [_passkey_cell(result.get("passkey", {}).get("accuracy", {}).get("converted"))] if passkey else []
        )

    first = ["original", "–", f"{original_ppl:.2f} (1.000)", "0", "100%"] + (
        [_passkey_cell(passkey["accuracy"])] if passkey else []
    )
    lines.append("| " + " | ".join(first + ["–"] * (len(head) - len(first))) + " |")
    for row in rows:
        cells = [
            f"`{row['variant']}`",
            f"{row['state_bytes']:,}",
            *quality(row.get("training_free")),
            *quality(row.get("distilled")),
        ]
        if "distilled" in row:
            stages = row["stage_tokens"]
            seconds = row.get("distill_seconds")
            cells += [
                f"{stages.get('transfer', 0):,} + {stages.get('finetune', 0):,}",
                "–" if seconds is None else f"{seconds:.0f} s",
            ]
        else:
            cells += ["–", "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def further_results(json_path: Path) -> list[tuple[str, dict, dict]]:
    """Distilled rows of single-variant runs with other budgets on the bundled model, kept beside
    the main JSON as fidelity-*.json: (file name, record, row)."""
    found = []
    for path in sorted(json_path.parent.glob(f"{json_path.stem}-*.json")):
        extra = json.loads(path.read_text())
        if extra["model"] != str(BUNDLED.relative_to(ROOT)):  # e.g. fidelity-smollm2-hf-2048.json: another page's
            continue
        found += [(path.name, extra, row) for row in extra["rows"] if "distilled" in row]
    return found


def further_runs(json_path: Path) -> str:
    """The further runs as a list, with their commands."""
    lines = []
    for name, extra, row in further_results(json_path):
        ratio = row["distilled"]["perplexity"] / extra["original_perplexity"]
        settings = row.get("distill_settings", {})
        recipe = ", ".join(f"{k} {settings[k]}" for k in ("train", "schedule") if k in settings)
        lines.append(
            f"- `{row['variant']}` with {row['distill_tokens']:,} tokens{f' ({recipe})' if recipe else ''}: "
            f"perplexity {ratio:.3f}x the original (`{name}`; `{extra['command']}`)"
        )
    return "\n".join(lines) if lines else "- none"


MEMORY_RUNS = ("memories-stdlib-llama-256.json", "memories-stdlib-llama-2048.json")  # in benchmarks/results


def memories_section(json_path: Path) -> str:
    """The delta-rule targets and the hybrid's memories at equal state bytes, from their own runs
    (a budget and held-out sample of their own, and the same models again at 2,048 tokens), with
    the issue-12 goals read off them and the further runs beside ``json_path``."""
    results = json_path.parent
    records = [json.loads((results / name).read_text()) for name in MEMORY_RUNS if (results / name).is_file()]
    if not records:
        return "(not run)"
    parts = []
    for record in records:
        first = first_result(record["rows"][0])
        parts.append(
            f"{first['tokens']:,} held-out tokens in rows of {first['seq_len']:,}; "
            f"`{record['command']}`:\n\n{table(record)}"
        )
    goals = []
    for record in records:
        seq_len, rows = first_result(record["rows"][0])["seq_len"], {r["variant"]: r for r in record["rows"]}
        ratio = {
            n: r["distilled"]["perplexity"] / record["original_perplexity"]
            for n, r in rows.items()
            if r.get("distilled")
        }
        kl = {n: r["distilled"]["kl"] for n, r in rows.items() if r.get("distilled")}
        if "gated-delta" in ratio and record is records[0]:  # the goal is at the length the model was trained on
            # the best within the goal's budget, here or in a further run at this length
            best = (ratio["gated-delta"], f"{rows['gated-delta']['distill_tokens']:,} tokens, this table")
            for name, extra, row in further_results(json_path):
                if (
                    row["variant"] == "gated-delta"
                    and row["distill_tokens"] <= 1_000_000
                    and first_result(row)["seq_len"] == seq_len
                ):
                    best = min(
                        best,
                        (
                            row["distilled"]["perplexity"] / extra["original_perplexity"],
                            f"{row['distill_tokens']:,} tokens, `{name}`",
                        ),
                    )
            goals.append(
                f"- {seq_len:,} tokens: `gated-delta` distilled {best[0]:.3f}x the original ({best[1]}; "
                f"goal: at most 1.20x with at most 1M tokens) — {'met' if best[0] <= 1.2 else 'not met'}"
            )
        for memory in ("delta", "gated-delta"):
            if f"hybrid-{memory}" in kl and "hybrid-linear" in kl:
                a, b = kl[f"hybrid-{memory}"], kl["hybrid-linear"]
                goals.append(
                    f"- {seq_len:,} tokens: `hybrid-{memory}` KL {a:.4f} against `hybrid-linear` {b:.4f} "
                    f"({'as good or better' if a <= b else 'worse'})"
                )
    return "\n\n".join(parts) + "\n\nGoals (issue 12):\n\n" + "\n".join(goals) + transfer_rates(results)


def transfer_rates(results: Path) -> str:
    """The delta and linear memories again with other attention-transfer learning rates
    (``memories-stdlib-llama-256-transfer-lr*.json``): is the delta memory's gap one of training speed?"""
    lines = []
    for path in sorted(results.glob("memories-stdlib-llama-256-transfer-lr*.json")):
        record = json.loads(path.read_text())
        kl = {row["variant"]: row["distilled"]["kl"] for row in record["rows"] if row.get("distilled")}
        lines.append(
            f"- transfer learning rate {record['lr'][0]:g}: KL `hybrid-delta` {kl['hybrid-delta']:.4f}, "
            f"`hybrid-linear` {kl['hybrid-linear']:.4f} (`{path.name}`; `{record['command']}`)"
        )
    if not lines:
        return ""
    return (
        "\n\nThe same 256-token runs with other attention-transfer learning rates (the table's is 0.01), "
        "both memories:\n\n" + "\n".join(lines)
    )


def document(record: dict, png: Path, json_path: Path, memory_notes: str = "") -> str:
    """docs/fidelity.md: what was measured, how to rerun it, the table, the goals and the plot;
    ``memory_notes``, the page's kept ``MEMORY_NOTES`` section, after the memories' tables."""
    rows, original, window = record["rows"], record["original_perplexity"], record.get("window", WINDOW)
    first = first_result(rows[0])
    free = [
        r["training_free"]["perplexity"] / original
        for r in rows
        if r["target"] in ("linear", "gated", "aaren") and r.get("training_free")
    ]
    spread = f"{min(free):.1f}-{max(free):.1f}" if free else "(not run)"
    goals = []
    for name, limit in GOALS.items():
        row = next((r for r in rows if r["variant"] == name and "distilled" in r), None)
        if row:
            ratio = row["distilled"]["perplexity"] / original
            goals.append(
                f"- `{name}` distilled: perplexity {ratio:.3f}x the original (goal: within "
                f"{limit - 1:.0%}) — {'met' if ratio <= limit else 'not met'}"
            )
    # rows without "settings" predate the recorded settings, and a hybrid among them the memory gate
    gate_note = (
        " The `hybrid-hedgehog` row was measured before the hybrid's memory gate existed, with LoLCATs' plain "
        "sum (today `--option memory_init=1`); a hybrid converted now starts as its window (training-free, "
        "about the `window` row)."
        if any(r["variant"] == "hybrid-hedgehog" and "settings" not in r for r in rows)
        else ""
    )
    # rows distilled before --schedule existed ran at a constant rate
    used = sorted({r.get("distill_settings", {}).get("schedule", "constant") for r in rows if r.get("distilled")})
    schedules = " or ".join(f"{s} schedule" for s in used) if used else "no distillation"
    return f"""# Fidelity: what each target costs on real text

A real pretrained model at a long context (SmolLM2-135M-Instruct, 2,048-token rows, pass-key
recall): [fidelity-smollm2.md](fidelity-smollm2.md). This page is the bundled model's.

Generated by `benchmarks/fidelity.py`; rerun with

    {record["command"]}

Model: `{record["model"]}`, the bundled Llama trained by `examples/train_tiny_lm.py`. Evaluation:
`rnnify.evaluate` on the held-out standard-library files (`examples/stdlib_corpus.py`, never seen in
training), {first["tokens"]:,} tokens in rows of {first["seq_len"]} tokens. Original perplexity:
**{original:.3f}**. Distillation: `rnnify.distill` on the training files, attention transfer then LoRA
fine-tuning (learning rates {record["lr"][0]:g} and {record["lr"][1]:g}, {schedules}); each variant's budget is split evenly
between the stages that run, and fine-tuning gets all of it where the cells have nothing to train. State
bytes: per sequence, after {first["seq_len"]} tokens (fp32). CPU ({record["threads"]} torch threads), torch
{record["torch"]}; `benchmarks/results/fidelity.json` holds every number, including per-layer errors.

{table(record)}

KL is KL(original || converted) in nats per token on the held-out text. Ratios are perplexity /
original perplexity.{gate_note} Distill times are wall times on a 2-core machine that other jobs shared for
part of the run: compare them loosely.

Reading the table: the model was trained on rows of {first["seq_len"]} tokens and is evaluated on rows
of that length, only {first["seq_len"] // window}x the {window}-token window, so the window targets lose little
here, and the hybrid's result owes much to its window half; longer contexts would separate them
more, but this model has never seen them. The constant-size linear, gated and Aaren states are
where distillation matters: training-free their perplexity is {spread}x the original's.

Goals (issue 5, at most 2M distillation tokens on a CPU):

{chr(10).join(goals) if goals else "- (the goal variants were not run)"}

Further runs, one variant with another budget:

{further_runs(json_path)}

## Delta-rule targets and the hybrid's memories

`delta` and `gated-delta`, and the hybrid (window 64) with each memory at equal state bytes: a
32 x 32 delta state per kv head against 32 hedgehog features for `linear` and `gla` (their
normaliser z makes theirs 1.6% larger). Distilled in their own run, on a held-out sample of their
own (ratios are to the original on that sample), then the same distilled models (`--save`, then
`--dir`) at 2,048 tokens, the bundled model's longest context (it was trained on 256), beside the
window alone. The hybrids are not measured training-free: with the memory gate at 0 they are their
window. Past 256 tokens the original itself degrades (it never saw those positions), so a ratio
below 1 at 2,048 means the converted model degrades less; KL still measures the distance to the
original. Distill times: one thread on a 2-core machine shared with other jobs (load 4-11).
The delta memories blend their readout with the window's output by a learned share, through a
learned key map ([targets.md](targets.md)); with the readout added instead, as before, the same
runs measured KL 0.0192 (`hybrid-delta`) and 0.0192 (`hybrid-gated-delta`) at 256 tokens and
1.663 / 1.662 at 2,048, no better than the window alone.

{memories_section(json_path)}
{memory_notes}
![quality against state size]({Path("..") / png.relative_to(ROOT) if png.is_relative_to(ROOT) else png})
"""


def first_result(row: dict) -> dict:
    """A row's first measurement: training-free, or distilled for a row read from a directory."""
    return row.get("training_free") or row["distilled"]


def plot(record: dict, path: Path) -> None:
    """Two panels against state bytes (log scales): every row's perplexity ratio, and the KL of the
    approximate rows within 2x of the original's perplexity, where the curve through the window rows
    shows what the same bytes buy as a longer window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows, original_ppl = record["rows"], record["original_perplexity"]
    seq_len = first_result(rows[0])["seq_len"]
    stages = (("training_free", "o", "training-free"), ("distilled", "s", "distilled"))
    # (state bytes, perplexity ratio, KL, row, stage) per row and stage measured
    points = [
        (r["state_bytes"], r[key]["perplexity"] / original_ppl, r[key]["kl"], r, key)
        for key, _, _ in stages
        for r in rows
        if r.get(key)
    ]
    close = [p for p in points if p[1] <= 2.0 and p[3]["target"] != "exact"]  # exact's KL is float rounding
    fig, (every, near) = plt.subplots(1, 2, figsize=(14, 5.5))
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")

    def scatter(ax, chosen: list, y: int) -> None:  # one series per stage, log y with plain labels
        for key, marker, label in stages:
            mine = [p for p in chosen if p[4] == key]
            if mine:
                ax.scatter([p[0] for p in mine], [p[y] for p in mine], marker=marker, label=label)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)

    def minor_labels(ax) -> None:  # minor labels help within a decade or two; over more they overprint each other
        low, high = ax.get_ylim()
        ax.yaxis.set_minor_formatter(plain if high / low < 100 else matplotlib.ticker.NullFormatter())

    scatter(every, points, 1)
    labels: dict[tuple[int, float], list] = {}  # rows on (almost) the same spot share one label
    for x, y, _, row, _ in points:
        if y > 2.0:  # the rest are labelled in the other panel
            labels.setdefault((x, round(math.log10(y), 1)), [y, []])[1].append(row["variant"])
    for (x, _), (y, names) in labels.items():
        every.annotate(", ".join(names), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    every.axhline(1.0, color="gray", lw=0.8)
    ratios = [p[1] for p in points]
    every.set_ylim(min(0.9, min(ratios) / 1.1), max(1.2, max(ratios) * 1.1))  # 1.0 always in view, never a sliver
    minor_labels(every)
    every.set_ylabel("perplexity / original perplexity (held-out)")
    every.set_title("every row (those within 2x of the original: right)")
    every.legend()
    windows = sorted((p[0], p[2]) for p in close if p[3]["target"] == "window" and p[4] == "training_free")
    if len(windows) > 1:
        near.plot(*zip(*windows), color="gray", lw=0.8, zorder=0, label="window target by size, training-free")
    best: dict[
        tuple[float, str], list
    ] = {}  # one label per state size (2 digits) and stage: its lowest KL, how many more
    for x, _, kl, row, key in close:
        best.setdefault((float(f"{x:.2g}"), key), []).append((kl, x, row["variant"]))
    for (_, key), found in best.items():
        kl, x, name = min(found)
        more = f" (+{len(found) - 1})" if len(found) > 1 else ""
        near.annotate(
            name + more, (x, kl), fontsize=7, xytext=(3, -9 if key == "distilled" else 3), textcoords="offset points"
        )
    if close:
        scatter(near, close, 2)
        minor_labels(near)
        near.legend()
    near.set_ylabel("KL(original || converted), nats per token")
    near.set_title("within 2x of the original's perplexity (lowest KL per state size labelled)")
    for ax in (every, near):
        ax.set_xscale("log")
        ax.set_xlabel(f"state bytes per sequence (after {seq_len:,} tokens)")
    fig.suptitle(f"rnnify targets on {Path(record['model']).name}, {seq_len:,}-token rows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--model", type=Path, default=BUNDLED, help="Hugging Face model directory (default: the bundled one)"
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder with train/ and heldout/ text (default: the stdlib split, written to a temp dir)",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=None,
        choices=list(VARIANTS),
        metavar="NAME",
        help=f"named rows (default: all, unless --row or --rows is given): {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--row",
        action="append",
        default=[],
        metavar="NAME=TARGET[,KEY=VALUE...]",
        help="a row of your own: a name, a target and its cell options, e.g. "
        "hybrid-w256=hybrid,window=256,feature_map=hedgehog (repeatable)",
    )
    parser.add_argument(
        "--rows",
        type=Path,
        default=None,
        metavar="FILE.json",
        help='rows from a JSON list of {"variant": NAME, "target": TARGET, "options": {...}}',
    )
    parser.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="NAME=DIR[,seconds=S]",
        help="a row from an rnnify directory converted or distilled elsewhere, e.g. with rnnify "
        "distill over several sessions; S: its distillation wall time (repeatable)",
    )
    parser.add_argument(
        "--window", type=int, default=WINDOW, help=f"window of the named window rows (default: {WINDOW})"
    )
    parser.add_argument("--no-distill", action="store_true", help="training-free numbers only")
    parser.add_argument(
        "--distilled-only",
        action="store_true",
        help="skip the training-free measurement (e.g. hybrids, whose memory gate starts at 0: "
        "training-free they are their window target)",
    )
    parser.add_argument("--distill-tokens", type=int, default=200_000, help="per row, both stages together")
    parser.add_argument(
        "--goal-distill-tokens", type=int, default=1_000_000, help="for the rows with a goal (%s)" % ", ".join(GOALS)
    )
    parser.add_argument(
        "--distill-seq-len",
        type=int,
        default=None,
        help="tokens per training row (default: --seq-len; shorter rows need less memory)",
    )
    parser.add_argument(
        "--distill-batch-size", type=int, default=None, help="training rows per step (default: --batch-size)"
    )
    parser.add_argument("--lr", type=float, nargs=2, default=(1e-2, 1e-3), metavar=("TRANSFER", "FINETUNE"))
    parser.add_argument(
        "--train",
        choices=TRAIN,
        default="lora",
        help="what finetune trains besides the cells (rnnify distill --train; default: lora, the recipe of the "
        "bundled table, whose finetune lr 1e-3 suits LoRA but pulls every weight away from the original)",
    )
    parser.add_argument(
        "--schedule", choices=SCHEDULES, default="cosine", help="learning-rate schedule (rnnify distill --schedule)"
    )
    parser.add_argument(
        "--gate-lr-scale",
        type=float,
        nargs=2,
        default=(1.0, 1.0),
        metavar=("TRANSFER", "FINETUNE"),
        help="the cells' gates train at these multiples of each stage's rate (rnnify distill --gate-lr-scale)",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        choices=STAGES,
        default=list(STAGES),
        help="distillation stages, in order (rnnify distill --stages; default: transfer finetune); "
        "the budget is split evenly between them",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens to evaluate (default: all)")
    group.add_argument("--eval-rows", type=int, default=None, help="held-out rows of --seq-len tokens to evaluate")
    parser.add_argument(
        "--passkey",
        default=None,
        metavar="LIST",
        help="pass-key recall at these prompt lengths, e.g. 512,1024,2048 (default: off)",
    )
    parser.add_argument("--passkey-trials", type=int, default=6, help="key depths per length (default: 6)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per row, for evaluation and distillation")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="results, also the cache a rerun reads (default: benchmarks/results/fidelity.json for "
        "the bundled model, else benchmarks/results/fidelity-MODEL-SEQLEN.json)",
    )
    parser.add_argument("--png", type=Path, default=None, help="the plot (default: --json with .png)")
    parser.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="write a markdown page (default: docs/fidelity.md for the bundled model on its own data)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="checkpoint each distillation in DIR/NAME; a rerun resumes a killed one from there",
    )
    parser.add_argument("--checkpoint-every", type=int, default=5, metavar="N", help="steps between checkpoints")
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        metavar="DIR",
        help="save each model distilled in this run to DIR/NAME, to measure it again as a --dir row",
    )
    parser.add_argument("--fresh", action="store_true", help="ignore rows already in --json: run every step again")
    parser.add_argument("--render", action="store_true", help="only rewrite --doc and --png from --json")
    args = parser.parse_args(argv)
    default = args.model == BUNDLED and args.data is None and args.json is None  # the page's own run
    if args.json is None:
        name = "fidelity" if default else f"fidelity-{args.model.name}-{args.seq_len}"
        args.json = ROOT / "benchmarks/results" / f"{name}.json"
    args.png = args.png or args.json.with_suffix(".png")
    args.doc_given = args.doc is not None
    if args.doc is None and default:
        args.doc = ROOT / "docs/fidelity.md"
    try:
        specs = [
            {"variant": n, "target": VARIANTS[n][0], "options": variants(args.window)[n][1]}
            for n in (
                args.variants if args.variants is not None else [] if args.row or args.rows or args.dir else VARIANTS
            )
        ]
        specs += [parse_row(text) for text in args.row] + (read_rows(args.rows) if args.rows else [])
        specs += [parse_dir_row(text) for text in args.dir]
        passkey_text = args.passkey
        if args.passkey:
            args.passkey = [int(n) for n in args.passkey.split(",")]
            if min(args.passkey) < 1:
                raise ValueError
    except (ValueError, OSError) as exc:
        parser.error(
            str(exc)
            if str(exc) and "int()" not in str(exc)
            else f"--passkey {passkey_text!r}: expected comma-separated positive token counts, e.g. 512,1024,2048"
        )
    names = [spec["variant"] for spec in specs]
    if len(set(names)) != len(names):
        parser.error(f"row names must differ: {names}")
    if args.data is not None and not all((args.data / part).is_dir() for part in ("train", "heldout")):
        parser.error(
            f"--data {args.data} needs train/ and heldout/ folders (examples/python_docs_corpus.py writes them)"
        )
    if not args.render and not specs:
        parser.error("no rows: give --variants, --row, --rows or --dir")
    args.distill_seq_len = args.distill_seq_len or args.seq_len
    args.distill_batch_size = args.distill_batch_size or args.batch_size
    if args.eval_rows is not None:
        args.eval_tokens = args.eval_rows * args.seq_len
    args.specs = specs
    args.data_name = "stdlib" if args.data is None else str(args.data)
    args.teacher = args.model
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.render:
        record = json.loads(args.json.read_text())
        if record["model"] != str(BUNDLED.relative_to(ROOT)) or record.get("data", "stdlib") != "stdlib":
            args.doc = args.doc if args.doc_given else None  # docs/fidelity.md is the bundled model's page
        render(record, args)
        return record
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cached = {} if args.fresh or not args.json.is_file() else json.loads(args.json.read_text())
    by_name = {row["variant"]: row for row in cached.get("rows", [])}
    record = {
        "command": "python benchmarks/fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": str(args.model.relative_to(ROOT)) if args.model.is_relative_to(ROOT) else str(args.model),
        "data": args.data_name,
        "seq_len": args.seq_len,
        "eval_tokens": args.eval_tokens,
        "window": args.window,
        "lr": list(args.lr),
        "threads": args.threads,
        "torch": torch.__version__,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    requested = [spec["variant"] for spec in args.specs]
    # the file keeps rows of other commands (after this command's rows): a rerun never loses results
    record["rows"] = [by_name.get(name) for name in requested] + [
        r for r in by_name.values() if r["variant"] not in requested
    ]
    record["original_passkey"] = original_passkey(args, cached.get("original_passkey"))
    if record["original_passkey"] is not None:  # kept for a rerun at once
        write_json(args.json, {**cached, **record, "rows": [r for r in record["rows"] if r is not None]})

    def save(position: int, row: dict) -> None:  # after every step: a run killed later loses nothing done
        record["rows"][position] = row
        record["original_perplexity"] = first_result(next(r for r in record["rows"] if r))["teacher_perplexity"]
        write_json(args.json, {**record, "rows": [r for r in record["rows"] if r is not None]})

    with tempfile.TemporaryDirectory() as tmp:
        train, heldout = (args.data / "train", args.data / "heldout") if args.data else stdlib_corpus.write_split(tmp)
        for position, spec in enumerate(args.specs):
            row = run_row(spec, heldout, train, args, by_name.get(spec["variant"]), lambda r: save(position, r))
            save(position, row)
    render(record, args)
    return record


# sections of the page that other scripts or runs wrote: kept, between their markers, when it is rewritten
KEPT = ("<!-- per-head: written by benchmarks/per_head.py -->", "<!-- /per-head -->")
MEMORY_NOTES = (
    "<!-- memories: further runs, each with its command; kept when fidelity.py rewrites the page -->",
    "<!-- /memories -->",
)


def kept_section(doc: Path, markers: tuple[str, str] = KEPT) -> str:
    page = doc.read_text() if doc.is_file() else ""
    if markers[0] not in page:
        return ""
    return "\n" + markers[0] + page.split(markers[0], 1)[1].split(markers[1], 1)[0] + markers[1] + "\n"


def render(record: dict, args) -> None:
    plot(record, args.png)
    if args.doc is not None:
        page = document(record, args.png, args.json, kept_section(args.doc, MEMORY_NOTES))
        args.doc.write_text(page + kept_section(args.doc))
    print(table(record))


if __name__ == "__main__":
    try:
        main()
    except rnnify.RnnifyError as exc:  # a bad target, option or model: one line, as the CLI does
        sys.exit(f"error: {exc}")
