"""Constant-state models against the original far into long contexts: KL by position.

    python benchmarks/fidelity.py --model models/smollm2 --data data/pydocs --seq-len 8192 --batch-size 1 \
        --eval-rows 2 --no-distill --dir NAME=DIR ... --json benchmarks/results/long-context-smollm2-8192.json
    python benchmarks/long_context.py benchmarks/results/long-context-smollm2-8192.json \
        --png benchmarks/results/long-context-smollm2-8192.png --doc docs/fidelity-smollm2.md

Reads ``benchmarks/fidelity.py`` results measured at one long ``--seq-len`` and prints one Markdown
table: each row's state at that length beside the original's KV cache there, its perplexity ratio,
KL and top-1 agreement over whole rows, then its KL over the positions of each doubling range from
1,024 tokens on (``rnnify.eval.position_ranges``, merged below 1,024), which shows whether a
model's error grows with the context it has read. The plot draws the KL of every range.
``--doc`` puts the table between the page's ``long-context`` markers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import PretrainedConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from retrieval_windows import write_doc  # noqa: E402

MARKERS = ("<!-- long-context: python benchmarks/long_context.py -->", "<!-- /long-context -->")
FIRST_EDGE = 1024  # the ranges before it are merged into one column
FLOOR = 1e-3  # the plot's lowest KL
SAME = ("model", "seq_len", "eval_tokens")  # what results read together must share


def kv_cache_bytes(model: str, seq_len: int) -> int | None:
    """The original's KV cache after ``seq_len`` tokens, fp32, from its config.json (None without one),
    for a model like the ones this page measures (SmolLM2's): every layer attention, no window."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    config = PretrainedConfig.from_json_file(path)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * kv_heads * 2 * dim * seq_len * torch.float32.itemsize


def columns(by_position: list[dict]) -> list[tuple[int, int, float]]:
    """(start, end, KL) per table column: positions before ``FIRST_EDGE`` merged, then each range."""
    groups: dict[tuple[int, int], list[float]] = {}
    for entry in by_position:
        key = (0, FIRST_EDGE) if entry["end"] <= FIRST_EDGE else (entry["start"], entry["end"])
        group = groups.setdefault(key, [0.0, 0.0])
        group[0] += entry["kl"] * entry["tokens"]
        group[1] += entry["tokens"]
    return [(start, end, kl / max(tokens, 1)) for (start, end), (kl, tokens) in groups.items()]


def result(row: dict) -> dict:
    return row.get("distilled") or row["training_free"]


def rows_of(paths: list[Path]) -> tuple[dict, list[dict]]:
    """The measured rows of every result, which must share the model, row length and held-out tokens."""
    record, rows = None, []
    for path in paths:
        this = json.loads(path.read_text())
        if record is not None and [this[k] for k in SAME] != [record[k] for k in SAME]:
            raise ValueError(f"{path}: measured with other {', '.join(SAME)} than {paths[0]}")
        record = record or this
        mine = [row for row in this["rows"] if row.get("training_free") or row.get("distilled")]
        if not mine:
            raise ValueError(f"{path}: no measured rows")
        for row in mine:
            if "kl_by_position" not in result(row):
                raise ValueError(
                    f"{path}: row {row['variant']} has no KL by position (measured by an older fidelity.py)"
                )
        rows += mine
    return record, rows


def table(record: dict, rows: list[dict]) -> str:
    seq_len = record["seq_len"]
    cache = kv_cache_bytes(record["model"], seq_len)
    ranges = [(start, end) for start, end, _ in columns(result(rows[0])["kl_by_position"])]
    head = " | ".join(f"{start:,}-{end - 1:,}" for start, end in ranges)
    lines = [
        f"State at {seq_len:,} tokens; {record['eval_tokens']:,} held-out tokens in rows of {seq_len:,}"
        + (f"; the original's KV cache there: {cache:,} bytes" if cache else "")
        + ".",
        "",
        f"| row | state bytes (share of KV cache) | perplexity ratio | KL | top-1 | KL at positions {head} |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(ranges),
    ]
    for row in sorted(rows, key=lambda r: (r["state_bytes"], result(r)["kl"])):
        res = result(row)
        share = f" ({row['state_bytes'] / cache:.1%})" if cache else ""
        kls = " | ".join(f"{kl:.4f}" for _, _, kl in columns(res["kl_by_position"]))
        distilled = f" (distilled, {row['distill_tokens']:,} tokens)" if row.get("distill_tokens") else ""
        lines.append(
            f"| `{row['variant']}`{distilled} | {row['state_bytes']:,}{share} | "
            f"{res['perplexity'] / res['teacher_perplexity']:.3f} | {res['kl']:.4f} | "
            f"{res['top1_agreement']:.1%} | {kls} |"
        )
    return "\n".join(lines)


def plot(record: dict, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row in sorted(rows, key=lambda r: r["state_bytes"]):
        ranges = result(row)["kl_by_position"]
        ax.plot(
            [(e["start"] + e["end"]) / 2 for e in ranges],
            [e["kl"] for e in ranges],
            "o-",
            ms=4,
            label=f"{row['variant']} ({row['state_bytes'] / 2**20:.1f} MiB)",
        )
    ax.set(
        yscale="log",
        xlabel="position in the row (middle of each range [2^k, 2^(k+1)))",
        ylabel="KL(original || converted), nats per token",
        title=f"{Path(record['model']).name}, rows of {record['seq_len']:,} tokens",
    )
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=FLOOR)  # a window is exact (KL ~1e-7, rounding) while it holds the whole row
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "results",
        type=Path,
        nargs="+",
        help="fidelity.py results measured at one long --seq-len on the same held-out rows",
    )
    parser.add_argument("--png", type=Path, default=None, help="write the plot here")
    parser.add_argument("--doc", type=Path, default=None, help="write the table into this page, between its markers")
    args = parser.parse_args(argv)
    try:
        record, rows = rows_of(args.results)
        text = table(record, rows)
        if args.doc:
            write_doc(args.doc, text, MARKERS)
    except (OSError, ValueError, KeyError) as exc:
        parser.exit(2, f"error: {exc}\n")
    if args.png:
        plot(record, rows, args.png)
    print(text)
    return text


if __name__ == "__main__":
    sys.exit(main() and 0)
