"""What should the finetune stage train? ``--train lora|attention|all`` on the bundled model, same budget.

    python benchmarks/distill_train_choice.py                       # 100k tokens each, hybrid-hedgehog
    python benchmarks/distill_train_choice.py --tokens 200000 --choices lora all

Converts ``examples/models/stdlib-llama`` to the hybrid (window 64, hedgehog), runs attention
transfer once on half the budget, then the finetune stage once per choice on the other half, with
the same data, learning rates and seed (training LoRA, the attention projections or every
weight; the same as one ``rnnify.distill`` of both stages with ``train=``), and evaluates
perplexity and KL to the original on the held-out files (``examples/stdlib_corpus.py``). Prints a
table and writes ``benchmarks/results/distill-train-choice.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import stdlib_corpus  # noqa: E402

import rnnify  # noqa: E402
from rnnify.distillation.train import TRAIN  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "examples/models/stdlib-llama")
    p.add_argument("--choices", nargs="+", default=list(TRAIN), choices=TRAIN)
    p.add_argument("--tokens", type=int, default=100_000, help="distillation tokens per choice, both stages together")
    p.add_argument("--lr", type=float, nargs=2, default=(1e-2, 1e-3), metavar=("TRANSFER", "FINETUNE"))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=32768)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/distill-train-choice.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    record = {
        "command": "python benchmarks/distill_train_choice.py " + " ".join(sys.argv[1:]),
        "model": str(args.model.relative_to(ROOT)) if args.model.is_relative_to(ROOT) else str(args.model),
        "tokens": args.tokens,
        "lr": list(args.lr),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "rows": [],
    }
    evaluate = dict(against=args.model, seq_len=args.seq_len, batch_size=args.batch_size, max_tokens=args.eval_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        train_dir, heldout = stdlib_corpus.write_split(tmp)
        base = rnnify.convert(args.model, to="hybrid", window=64, sinks=0, feature_map="hedgehog", progress=False)
        free = rnnify.evaluate(base, heldout, **evaluate).to_json()
        record["training_free"] = {
            "perplexity": free["perplexity"],
            "kl": free["kl"],
            "original_perplexity": free["teacher_perplexity"],
        }
        common = dict(teacher=args.model, max_tokens=args.tokens // 2, seq_len=args.seq_len, batch_size=args.batch_size)
        rnnify.distill(base, train_dir, stages=["transfer"], lr=args.lr[0], **common)
        base.save(Path(tmp) / "transferred")
        for choice in args.choices:
            model = rnnify.load(Path(tmp) / "transferred")
            start = time.time()
            rnnify.distill(model, train_dir, stages=["finetune"], lr=args.lr[1], train=choice, **common)
            seconds = time.time() - start
            result = rnnify.evaluate(model, heldout, **evaluate).to_json()
            row = {
                "train": choice,
                "perplexity": result["perplexity"],
                "kl": result["kl"],
                "seconds": round(seconds, 1),
                "trained": model.manifest.distill["trained"],
            }
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=2) + "\n")  # after every choice: a stop loses nothing
    show(record)


def show(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    free = record["training_free"]
    table = Table(
        title=f"finetune choices, {record['tokens']:,} tokens (original ppl {free['original_perplexity']:.2f}; "
        f"training-free ppl {free['perplexity']:.2f}, KL {free['kl']:.3f})"
    )
    for column in ("--train", "perplexity", "KL to the original", "finetune seconds"):
        table.add_column(column, justify="left" if column == "--train" else "right")
    for row in record["rows"]:
        table.add_row(row["train"], f"{row['perplexity']:.3f}", f"{row['kl']:.4f}", f"{row['seconds']:.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
