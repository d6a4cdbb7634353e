"""Retrieval heads with a long window against plain windows, at equal state bytes.

    python benchmarks/retrieval_windows.py benchmarks/results/per-head-smollm2-hf-rw1024-w*.json \
        --windows benchmarks/results/fidelity-smollm2-hf-2048.json --png benchmarks/results/retrieval-windows-smollm2.png \
        --doc docs/fidelity-smollm2.md

Reads ``benchmarks/per_head.py`` results made with ``--retrieval-window`` (every kv head a short
window with sinks, the chosen ones a long window: a constant state) and the training-free
``window`` rows of a ``benchmarks/fidelity.py`` table measured on the same held-out rows, prints
one Markdown table of them by state size and plots the KL against the state bytes, each point
filled where the pass key at 1,024 tokens was recalled at least half the time. Rows of heads chosen
per layer (``layers-*``) are left out unless ``--per-layer``. ``--doc`` puts the table between the
page's ``retrieval-windows`` markers, indented as the first marker is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PASSKEY_AT = "1024"  # the length whose recall the plot marks
WINDOWS = "window, every head"  # the series of plain windows, drawn last
START, END = "<!-- retrieval-windows: python benchmarks/retrieval_windows.py -->", "<!-- /retrieval-windows -->"


def per_head_rows(path: Path, per_layer: bool) -> list[dict]:
    record = json.loads(path.read_text())
    if record.get("retrieval_window") is None:
        raise ValueError(f"{path}: not a per_head.py run with --retrieval-window")
    kind = {"auto-kl": "per head", "auto-mass": "per head, mass score"}
    if per_layer:
        kind |= {"layers-kl": "per layer", "layers-mass": "per layer, mass score"}
    return [
        {
            "name": f"window {record['window']} + {len(row['retrieval'])} heads at {record['retrieval_window']:,} "
            f"({kind[row['kind']]})",
            "series": f"window {record['window']} + retrieval heads at {record['retrieval_window']:,}, {kind[row['kind']]}",
            "window": record["window"],
            "bytes": row["state_bytes"],
            "result": row["training_free"],
            "source": path.name,
        }
        for row in record["rows"]
        if row["kind"] in kind
    ]


def window_rows(path: Path) -> list[dict]:
    record = json.loads(path.read_text())
    return [
        {
            "name": f"window {row['options']['window']} (every head)",
            "series": WINDOWS,
            "bytes": row["state_bytes"],
            "result": row["training_free"],
            "source": path.name,
        }
        for row in record["rows"]
        if row["target"] == "window"
        and row.get("training_free")
        and row["options"].get("sinks") == 4
        and set(row["options"]) <= {"window", "sinks"}
    ]


def passkey(result: dict) -> dict[str, float]:
    return result.get("passkey", {}).get("accuracy", {}).get("converted", {})


def table(rows: list[dict]) -> str:
    lengths = sorted({n for r in rows for n in passkey(r["result"])}, key=int)
    lines = [
        f"| row | state bytes | perplexity (ratio) | KL | pass key {' / '.join(f'{int(n):,}' for n in lengths)} |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in sorted(rows, key=lambda r: (r["bytes"], r["result"]["kl"])):
        result, keys = row["result"], passkey(row["result"])
        ratio = result["perplexity"] / result["teacher_perplexity"]
        recall = " / ".join(f"{keys[n]:.0%}" if n in keys else "–" for n in lengths)
        lines.append(f"| {row['name']} | {row['bytes']:,} | {ratio:.3f} | {result['kl']:.4f} | {recall} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ordered = sorted(rows, key=lambda r: (r["series"] == WINDOWS, r.get("window", 0)))  # plain windows last
    for i, series in enumerate(dict.fromkeys(r["series"] for r in ordered)):
        mine = sorted((r for r in rows if r["series"] == series), key=lambda r: r["bytes"])
        color = f"C{i}"
        ax.plot([r["bytes"] for r in mine], [r["result"]["kl"] for r in mine], "-", color=color, lw=0.8, label=series)
        for row in mine:
            recalled = passkey(row["result"]).get(PASSKEY_AT, 0) >= 0.5
            ax.scatter(
                [row["bytes"]],
                [row["result"]["kl"]],
                marker="o",
                s=36,
                color=color if recalled else "white",
                edgecolors=color,
                zorder=3,
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("state bytes per sequence (constant)")
    ax.set_ylabel("KL(original || converted), nats per token")
    ax.set_title(f"filled: pass key at {int(PASSKEY_AT):,} tokens recalled >= 50%")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_doc(doc: Path, text: str, markers: tuple[str, str] = (START, END)) -> None:
    """Put ``text`` between the page's ``markers``, each line indented as the first marker is."""
    start, end = markers
    page = doc.read_text()
    if start not in page or end not in page:
        raise ValueError(f"{doc}: no {start} ... {end} markers to write the table between")
    before, rest = page.split(start, 1)
    indent = before[before.rfind("\n") + 1 :]
    body = "".join(f"{indent}{line}\n" if line else "\n" for line in text.splitlines())
    doc.write_text(before + start + "\n" + body + indent + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("per_head", nargs="+", type=Path, help="per_head.py results made with --retrieval-window")
    parser.add_argument("--windows", type=Path, default=None, help="a fidelity.py table whose window rows to add")
    parser.add_argument("--png", type=Path, default=None, help="write the plot here")
    parser.add_argument("--doc", type=Path, default=None, help="write the table into this page, between its markers")
    parser.add_argument("--per-layer", action="store_true", help="add the rows of heads chosen per layer")
    args = parser.parse_args(argv)
    try:
        rows = [row for path in args.per_head for row in per_head_rows(path, args.per_layer)]
        rows += window_rows(args.windows) if args.windows else []
        text = table(rows)
        if args.doc:
            write_doc(args.doc, text)
    except (OSError, ValueError, KeyError) as exc:
        parser.exit(2, f"error: {exc}\n")
    if args.png:
        plot(rows, args.png)
    print(text)
    return text


if __name__ == "__main__":
    sys.exit(main() and 0)
