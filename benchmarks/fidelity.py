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
import sys
import tempfile
import time
from pathlib import Path

import torch
from fidelity_report import document, first_result, plot, table
from fidelity_rows import BUNDLED, GOALS, ROOT, VARIANTS, WINDOW, parse_dir_row, parse_row, read_rows, variants

sys.path.insert(0, str(ROOT / "examples"))
import stdlib_corpus  # noqa: E402

import rnnify  # noqa: E402
from rnnify.distillation.train import SCHEDULES, STAGES, TRAIN  # noqa: E402
from rnnify.eval import write_json  # noqa: E402
from rnnify.passkey import evaluate_passkey, original_generator, passkey_trials, usable_probes  # noqa: E402
from rnnify.probes import prompts  # noqa: E402


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
