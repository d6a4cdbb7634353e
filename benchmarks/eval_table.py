"""One Markdown table per row length, and a plot, from ``rnnify eval --json`` results.

    rnnify eval DIR --data data/pydocs/heldout --seq-len 8192 --batch-size 1 --max-tokens 16384 \
        --no-layer-errors [--passkey 2048,4096,8192] --json NAME-8192.json
    python benchmarks/eval_table.py window=win-8192.json select=sel-8192.json ... \
        --model models/smollm2 --png docs/plots/long-context.png --doc docs/fidelity-smollm2.md

Results are grouped by the row length they were measured at (``seq_len``); results of one length
must have read the same held-out tokens; a NAME given twice is one model whose pass keys were measured
in two runs (one row). Each row: the state per sequence at that length beside
the original's KV cache there (from ``--model``'s config.json), the perplexity ratio, KL and top-1
agreement over whole rows, the KL of each range of positions (those before 1,024 merged), and,
where the result has one, pass-key accuracy per prompt length (every probe pooled, with the
original's beside it). The plot draws the KL by position of the longest rows. ``--doc`` writes the
tables between the page's ``eval-table`` markers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context import FLOOR, columns, kv_cache_bytes  # noqa: E402
from retrieval_windows import write_doc  # noqa: E402

MARKERS = ("<!-- eval-table: python benchmarks/eval_table.py -->", "<!-- /eval-table -->")


def load(specs: list[str]) -> dict[int, list[tuple[str, dict]]]:
    """Row length -> (name, result) pairs, checked to have read the same tokens."""
    by_length: dict[int, list[tuple[str, dict]]] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        result = json.loads(Path(path).read_text())
        result["name"] = name or Path(path).stem
        group = by_length.setdefault(result["seq_len"], [])
        # the original's perplexity on them tells the tokens apart; float noise between machines does not
        if group and (
            result["tokens"] != group[0][1]["tokens"]
            or not math.isclose(result["teacher_perplexity"], group[0][1]["teacher_perplexity"], rel_tol=1e-6)
        ):
            raise ValueError(f"{path}: other held-out tokens than {group[0][0]} at {result['seq_len']} tokens")
        same = next((r for n, r in group if n == result["name"]), None)
        if same is None:
            group.append((result["name"], result))
        elif same["state_bytes"] != result["state_bytes"]:
            raise ValueError(f"{path}: another model than the earlier {result['name']!r} (its state differs)")
        else:  # one model's pass keys at another prompt length, from another run: one row
            _merge_passkey(same, result)
    return dict(sorted(by_length.items()))


def _merge_passkey(into: dict, other: dict) -> None:
    """Add ``other``'s pass-key accuracies (per prompt length, both models) to ``into``'s."""
    if not other.get("passkey"):
        return
    accuracy = into.setdefault("passkey", {}).setdefault("accuracy", {})
    for side, by_length in other["passkey"]["accuracy"].items():
        accuracy.setdefault(side, {}).update(by_length)


def passkey_lengths(results: list[dict]) -> list[int]:
    return sorted({int(n) for r in results if r.get("passkey") for n in r["passkey"]["accuracy"]["converted"]})


def table(seq_len: int, rows: list[tuple[str, dict]], model: str | None) -> str:
    cache = kv_cache_bytes(model, seq_len) if model else None
    ranges = [(start, end) for start, end, _ in columns(rows[0][1]["kl_by_position"])]
    lengths = passkey_lengths([r for _, r in rows])
    head = " | ".join(f"KL {start:,}-{end - 1:,}" for start, end in ranges)
    keys = "".join(f" pass key {n:,} |" for n in lengths)
    first = rows[0][1]
    there = f"; the original's KV cache there: {cache:,} bytes" if cache else ""
    lines = [
        f"Rows of {seq_len:,} tokens, {first['tokens']:,} held-out tokens (the original's perplexity "
        f"{first['teacher_perplexity']:.2f}){there}.",
        "",
        f"| model | state bytes (share of KV cache) | perplexity ratio | KL | top-1 | {head} |{keys}",
        "|---|---:|---:|---:|---:|" + "---:|" * (len(ranges) + len(lengths)),
    ]
    original = {
        n: a for _, r in rows if r.get("passkey") for n, a in r["passkey"]["accuracy"].get("original", {}).items()
    }
    if original and cache:
        accuracy = "".join(f" {original.get(str(n), float('nan')):.0%} |" for n in lengths)
        lines.append(f"| original (KV cache) | {cache:,} (100%) | 1.000 | 0 | 100% |" + " 0 |" * len(ranges) + accuracy)
    for name, res in sorted(rows, key=lambda item: (item[1]["state_bytes"], item[1]["kl"])):
        share = f" ({res['state_bytes'] / cache:.1%})" if cache else ""
        kls = " | ".join(f"{kl:.4f}" for _, _, kl in columns(res["kl_by_position"]))
        converted = res.get("passkey", {}).get("accuracy", {}).get("converted", {})
        accuracy = "".join(f" {converted[str(n)]:.0%} |" if str(n) in converted else " – |" for n in lengths)
        ratio = res["perplexity"] / res["teacher_perplexity"]
        lines.append(
            f"| `{name}` | {res['state_bytes']:,}{share} | {ratio:.3f} | {res['kl']:.4f} | "
            f"{res['top1_agreement']:.1%} | {kls} |{accuracy}"
        )
    return "\n".join(lines)


def plot(seq_len: int, rows: list[tuple[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, res in sorted(rows, key=lambda item: item[1]["state_bytes"]):
        ranges = res["kl_by_position"]
        ax.plot(
            [(e["start"] + e["end"]) / 2 for e in ranges],
            [max(e["kl"], FLOOR) for e in ranges],
            "o-",
            ms=4,
            label=f"{name} ({res['state_bytes'] / 2**20:.1f} MiB)",
        )
    ax.set(
        yscale="log",
        xlabel="position in the row (middle of each range [2^k, 2^(k+1)))",
        ylabel="KL(original || converted), nats per token",
        title=f"rows of {seq_len:,} tokens",
    )
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("results", nargs="+", metavar="NAME=FILE", help="rnnify eval --json results, named")
    parser.add_argument("--model", help="the original's directory, for its KV cache at each length")
    parser.add_argument("--png", type=Path, help="write the KL-by-position plot of the longest rows here")
    parser.add_argument("--doc", type=Path, help="write the tables into this page, between its markers")
    args = parser.parse_args(argv)
    try:
        groups = load(args.results)
        text = "\n\n".join(table(seq_len, rows, args.model) for seq_len, rows in groups.items())
        if args.doc:
            write_doc(args.doc, text, MARKERS)
    except (OSError, ValueError, KeyError) as exc:
        parser.exit(2, f"error: {exc}\n")
    if args.png:
        longest = max(groups)
        plot(longest, groups[longest], args.png)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
