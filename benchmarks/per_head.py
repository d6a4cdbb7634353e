"""Per-head targets under a memory budget: state bytes against quality, per head against per layer.

    python benchmarks/per_head.py          # the bundled model, a few minutes on one thread; updates docs/fidelity.md
    python benchmarks/per_head.py --model models/smollm2 --data data/pydocs --seq-len 2048 \
        --eval-rows 2 --calib-len 1024 --calib-rows 1 --calib-passkey 2 --passkey 1024 --passkey-trials 4

The kv heads are scored once (``rnnify.auto.HeadScorer``: calibration rows from the training
text plus pass-key prompts) and the choice is made at every budget in ``--budgets`` (shares of
the original's KV cache at ``--at-context`` tokens): per head by each score in ``--scores``
(``auto-kl``: KL when the head alone is windowed, what ``--to auto`` does by default, one pass per
kv head; ``auto-mass``: attention beyond the window, one pass), and per layer by
the first score (``layers-<score>``: whole layers exact, the others windowed). Beside them, the
per-layer targets without a choice (``--fixed``: every layer ``window`` with sinks, without
them) and the original (its KV cache). With ``--retrieval-window N`` the heads chosen keep an
N-token window instead of staying exact, so every row's state is constant past N tokens. Every model is converted and
measured as ``benchmarks/fidelity.py`` measures a row (``rnnify.evaluate`` on the held-out text
against the original, ``--passkey``: pass-key recall); rows with the same exact heads are measured
once. Writes ``--json``, a plot (``--png``) and, for the bundled model, the per-head section of
``docs/fidelity.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import fidelity  # noqa: E402
import stdlib_corpus  # noqa: E402
from fidelity_report import passkey_cell  # noqa: E402

import rnnify  # noqa: E402
from rnnify.auto import HeadScorer, convert_chosen, kv_cache_bytes  # noqa: E402
from rnnify.eval import write_json  # noqa: E402

SECTION_START, SECTION_END = fidelity.KEPT  # benchmarks/fidelity.py keeps the section when it rewrites the page
LABELS = {
    "auto-kl": "per head, KL score (--to auto's default)",
    "auto-mass": "per head, attention-mass score",
    "layers-kl": "per layer, KL score",
    "layers-mass": "per layer, attention-mass score",
}
STYLES = {"auto-kl": "o-", "auto-mass": "s--", "layers-kl": "^:", "layers-mass": "v:"}
FIXED = {"window-sinks": True, "window": False}  # per-layer rows without a choice: name -> with sinks


def choices(scores: list[str]) -> dict[str, tuple[str, bool]]:
    """Row kind -> (score, per layer): per head by every score, per layer by the first."""
    return {**{f"auto-{s}": (s, False) for s in scores}, f"layers-{scores[0]}": (scores[0], True)}


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two score lists (ties broken by position)."""
    ranks = [torch.tensor(x).argsort().argsort().double() for x in (a, b)]
    return float(torch.corrcoef(torch.stack(ranks))[0, 1])


def measure(model, heldout: Path, args) -> dict:
    return fidelity.measure(model, heldout, args)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": "python benchmarks/per_head.py " + shlex.join(args.argv),
        "model": str(args.model.relative_to(ROOT)) if args.model.is_relative_to(ROOT) else str(args.model),
        "data": args.data_name,
        "seq_len": args.seq_len,
        "eval_tokens": args.eval_tokens,
        "context": args.at_context,
        "window": args.window,
        "sinks": args.sinks,
        "retrieval_window": args.retrieval_window,
        "threads": args.threads,
        "torch": torch.__version__,
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        train, heldout = (args.data / "train", args.data / "heldout") if args.data else stdlib_corpus.write_split(tmp)
        start = time.time()
        scorer = HeadScorer(
            args.model,
            train,
            score="kl" if "kl" in args.scores else "mass",
            window=args.window,
            sinks=args.sinks,
            calib_len=args.calib_len,
            calib_rows=args.calib_rows,
            passkey=args.calib_passkey,
            seed=args.seed,
            progress=True,
            scores_from=args.scores_from,
        )
        record["scoring_seconds"] = round(time.time() - start, 1)
        record["scores"] = {
            name: {f"{lay}.{h}": v for (lay, h), v in values.items()} for name, values in scorer.scores.items()
        }
        heads = scorer.heads
        if len(scorer.scores) == 2:
            record["score_rank_correlation"] = spearman(
                [scorer.scores["kl"][h] for h in heads], [scorer.scores["mass"][h] for h in heads]
            )
        record["calibration"] = scorer.about
        if args.calibration_only:  # each choice's KL on the calibration rows, nothing converted
            record["calibration_choices"] = [
                {
                    "budget": b,
                    "kind": name,
                    "retrieval": len(r.retrieval),
                    "state_bytes": r.state_bytes,
                    "kv_cache_bytes": r.kv_cache_bytes,
                    "calibration_kl": r.calibration_kl,
                }
                for b in args.budgets
                for name, (score, per_layer) in choices(args.scores).items()
                for r in [
                    scorer.choose(
                        f"{b * 100:g}%",
                        args.at_context,
                        per_layer=per_layer,
                        score=score,
                        retrieval_window=args.retrieval_window,
                    )
                ]
            ]
            record["calibration_kl_all_windowed"] = scorer.kl(set())
            write_json(args.json, record)
            return record
        record["original_passkey"] = fidelity.original_passkey(args, None)
        record["kv_cache_bytes"] = kv_cache_bytes(scorer.specs, args.at_context, scorer.dtype, scorer.sites)
        measured: dict[str, dict] = {}  # layers spec -> result: the same choice is measured once

        def add(name: str, kind: str, budget: float | None, model, retrieval: list | None, state: int) -> None:
            key = json.dumps([model.manifest.target, model.manifest.layers, model.cells[0].options()])
            if key not in measured:
                print(f"== {name}", flush=True)
                measured[key] = measure(model, heldout, args)
            record["rows"].append(
                {
                    "variant": name,
                    "kind": kind,
                    "budget": budget,
                    "retrieval": retrieval,
                    "state_bytes": state,
                    "training_free": measured[key],
                }
            )
            write_json(args.json, record)

        for name in args.fixed:
            options = {"window": args.window, **({"sinks": args.sinks} if FIXED[name] else {})}
            model = rnnify.convert(args.model, to="window", **options)
            add(name, "per layer", None, model, None, model.state_nbytes(args.at_context))
        for budget in args.budgets:
            for name, (score, per_layer) in choices(args.scores).items():
                report = scorer.choose(
                    f"{budget * 100:g}%",
                    args.at_context,
                    per_layer=per_layer,
                    score=score,
                    retrieval_window=args.retrieval_window,
                )
                model = convert_chosen(args.model, report)
                assert model.state_nbytes(args.at_context) == report.state_bytes
                add(f"{name}-{budget:g}", name, budget, model, [list(h) for h in report.retrieval], report.state_bytes)
    record["original_perplexity"] = record["rows"][0]["training_free"]["teacher_perplexity"]
    write_json(args.json, record)
    return record


def table(record: dict) -> str:
    original, kv = record["original_perplexity"], record["kv_cache_bytes"]
    passkey = record.get("original_passkey")
    lines = [
        f"| row | {retrieval_name(record)} kv heads | state at {record['context']:,} tokens (share of KV cache) | "
        "ppl ratio | KL | pass key |",
        "|---|---:|---:|---:|---:|---:|",
        f"| original (KV cache) | all | {kv:,} (100%) | 1.000 | 0 | {passkey_cell(passkey and passkey['accuracy'])} |",
    ]
    for row in record["rows"]:
        result = row["training_free"]
        chosen = row["retrieval"]
        chosen = "–" if chosen is None else str(len(chosen))
        key = result.get("passkey", {}).get("accuracy", {}).get("converted")
        lines.append(
            f"| `{row['variant']}` | {chosen} | {row['state_bytes']:,} ({row['state_bytes'] / kv:.1%}) | "
            f"{result['perplexity'] / original:.3f} | {result['kl']:.4f} | {passkey_cell(key)} |"
        )
    return "\n".join(lines)


def retrieval_name(record: dict) -> str:
    """What the retrieval heads are in ``record``: "exact" or "N-token window"."""
    long = record.get("retrieval_window")
    return "exact" if long is None else f"{long}-token window"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    original, kv = record["original_perplexity"], record["kv_cache_bytes"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, marker in STYLES.items():
        rows = sorted((r for r in record["rows"] if r["kind"] == kind), key=lambda r: r["state_bytes"])
        if rows:
            ax.plot(
                [r["state_bytes"] for r in rows],
                [r["training_free"]["perplexity"] / original for r in rows],
                marker,
                label=LABELS[kind],
            )
    for row in (r for r in record["rows"] if r["kind"] == "per layer"):
        ratio = row["training_free"]["perplexity"] / original
        ax.scatter([row["state_bytes"]], [ratio], marker="x", color="black")
        ax.annotate(row["variant"], (row["state_bytes"], ratio), fontsize=8, xytext=(3, 3), textcoords="offset points")
    ax.scatter([kv], [1.0], marker="*", s=120, color="black")
    ax.annotate("original (KV cache)", (kv, 1.0), fontsize=8, xytext=(-40, 8), textcoords="offset points")
    ax.axvline(0.3 * kv, color="gray", lw=0.8, ls="--")
    ax.annotate("30% of the KV cache", (0.3 * kv, ax.get_ylim()[1]), fontsize=7, rotation=90, va="top", ha="right")
    ax.set_xscale("log")
    ax.set_xlabel(f"state bytes per sequence at {record['context']:,} tokens")
    ax.set_ylabel(f"perplexity / original ({record['seq_len']:,}-token held-out rows)")
    ax.set_title(
        f"per-head targets on {Path(record['model']).name}: window {record['window']}, {record['sinks']} sinks"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def relative(path: Path) -> Path:
    """``path`` as docs/ links it."""
    return Path("..") / path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def section(record: dict, png: Path, json_path: Path) -> str:
    """The per-head section of docs/fidelity.md (kept there when benchmarks/fidelity.py rewrites the page)."""
    rows = record["rows"]
    first = rows[0]["training_free"]

    def at(kind: str, budget: float) -> dict | None:
        return next((r for r in rows if r["kind"] == kind and r["budget"] == budget), None)

    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    kinds = [k for k in STYLES if any(r["kind"] == k for r in rows)]
    comparison, wins = [], {"kl": 0, "mass": 0, "tie": 0}
    for budget in budgets:
        comparison.append(
            f"{budget:.0%}: "
            + ", ".join(f"{at(k, budget)['training_free']['kl']:.4f} ({LABELS[k].split(' (')[0]})" for k in kinds)
        )
        if "auto-kl" in kinds and "auto-mass" in kinds:
            a, b = (at(k, budget)["training_free"]["kl"] for k in ("auto-kl", "auto-mass"))
            wins["tie" if abs(a - b) <= 1e-4 else "kl" if a < b else "mass"] += 1
    verdict = ""
    if "score_rank_correlation" in record and {"auto-kl", "auto-mass"} <= set(kinds):
        verdict = (
            f" The mass score chose better at {wins['mass']} of {len(budgets)} budgets, the KL score at "
            f"{wins['kl']}, the same (within 1e-4) at {wins['tie']}; the two scores' rank correlation over the kv "
            f"heads is {record['score_rank_correlation']:.2f}. Mass costs one forward pass per calibration row, "
            "KL one per kv head and row."
        )
    goals = goal_lines(record)
    others = ""
    for path in sorted(json_path.parent.glob("per-head-*-calibration.json")):  # --calibration-only runs
        other = json.loads(path.read_text())
        calib = other["calibration"]
        others += (
            f"\n\nThe scores on {Path(other['model']).name}, choices compared on their calibration rows only "
            f"({calib['rows']} text row(s) of {calib['tokens']} tokens and {calib['passkey']} pass-key prompts; "
            f"scoring took {other['scoring_seconds']:g} s on {other['threads']} thread(s); `{relative(path)}`; "
            "calibration KL: mean per text token plus mean per pass-key answer token), by\n\n"
            f"    {other['command']}\n\n"
            f"{calibration_table(other)}"
        )
    ranked = sorted(record["scores"]["mass"], key=lambda h: -record["scores"]["mass"][h])
    reading = (
        f"The kv heads (layer.head) by mass score, highest first: {', '.join(ranked[:8])}"
        f"{', ...' if len(ranked) > 8 else ''}."
    )
    if record["seq_len"] < record["context"]:
        reading += (
            f" States are counted at {record['context']:,} tokens, quality on rows of {record['seq_len']:,} "
            f"({record['seq_len'] / record['window']:g}x the {record['window']}-token window)."
        )
    return f"""{SECTION_START}
## Per-head targets: retrieval heads {retrieval_name(record)}, the rest windowed

Generated by `benchmarks/per_head.py`; rerun with

    {record["command"]}

`rnnify convert --to auto` scores every kv head on calibration rows ({record["calibration"]["rows"]} text rows of
{record["calibration"]["tokens"]} tokens from the training files and {record["calibration"]["passkey"]} pass-key prompts), then gives
the heads worth most per byte under a budget {kept_as(record)}; the rest become a {record["window"]}-token window with
{record["sinks"]} sinks. Budgets are shares of the original's KV cache at {record["context"]:,} tokens; quality is
`rnnify.evaluate` on the held-out files, {first["tokens"]:,} tokens in rows of {first["seq_len"]} tokens
(original perplexity {record["original_perplexity"]:.3f}). {scoring(record)} `{relative(json_path)}` holds every number and score.

{table(record)}

Held-out KL at equal budgets (lower is better): {"; ".join(comparison)}.{verdict}{others}

{reading}

Goals (issue 13, budgets at {record["context"]:,} tokens), for the best per-head row within 30% of the KV cache:

{goals}

![state against quality, per head and per layer]({relative(png)})
{SECTION_END}"""


def scoring(record: dict) -> str:
    source = record["calibration"].get("scores_from")
    if source:
        return f"The scores are those of `{source}`, not measured again."
    return f"Scoring took {record['scoring_seconds']:g} s on\n{record['threads']} thread(s) of a shared 2-core CPU."


def kept_as(record: dict) -> str:
    long = record.get("retrieval_window")
    return "all their tokens (exact)" if long is None else f"a {long:,}-token window (`--retrieval-window {long}`)"


def goal_lines(record: dict) -> str:
    """The issue's goals, judged on the best per-head row whose state is at most 30% of the KV cache."""
    kv, original = record["kv_cache_bytes"], record["original_perplexity"]
    fits = [r for r in record["rows"] if r["kind"].startswith("auto-") and r["state_bytes"] <= 0.3 * kv]
    if not fits:
        return "- (no per-head row within 30% of the KV cache was run)"
    best = min(fits, key=lambda r: r["training_free"]["perplexity"])
    ratio = best["training_free"]["perplexity"] / original
    lines = [
        f"- state at most 30% of the KV cache, perplexity within 2% (rows of {record['seq_len']:,} tokens): "
        f"`{best['variant']}` holds {best['state_bytes'] / kv:.1%} at ratio {ratio:.3f} — "
        f"{'met' if ratio <= 1.02 else 'not met'}"
    ]
    key = best["training_free"].get("passkey", {}).get("accuracy", {}).get("converted")
    want = (record.get("original_passkey") or {}).get("accuracy")
    if key and want:
        same = all(key.get(n) == a for n, a in want.items())
        lines.append(
            f"- pass-key accuracy equal to the original's: {passkey_cell(key)} against "
            f"{passkey_cell(want)} ({', '.join(want)} tokens) — {'met' if same else 'not met'}"
        )
    else:
        lines.append("- pass-key accuracy: not measured in this run (`--passkey`)")
    return "\n".join(lines)


def write_section(doc: Path, text: str) -> None:
    """Put ``text`` in place of the page's per-head section, or at its end."""
    page = doc.read_text() if doc.is_file() else ""
    if SECTION_START in page:
        before, rest = page.split(SECTION_START, 1)
        page = before + text + rest.split(SECTION_END, 1)[1]
    else:
        page = (page.rstrip("\n") + "\n\n" if page.strip() else "") + text + "\n"
    doc.write_text(page)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--model", type=Path, default=fidelity.BUNDLED, help="Hugging Face model directory (default: the bundled one)"
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder with train/ and heldout/ text (default: the stdlib split, written to a temp dir)",
    )
    parser.add_argument(
        "--budgets",
        default="0.15,0.3,0.45,0.6",
        help="shares of the original's KV cache (default: 0.15,0.3,0.45,0.6: 1-4 exact heads of the bundled model's 8)",
    )
    parser.add_argument("--at-context", type=int, default=4096, help="context of the budgets (default: 4096)")
    parser.add_argument(
        "--scores",
        default="kl,mass",
        help="scores to choose by, per head (default: kl,mass; on a large model mass alone: kl takes "
        "one forward pass per kv head and calibration row)",
    )
    parser.add_argument(
        "--fixed",
        default="window-sinks,window",
        help=f"per-layer rows without a choice, from {', '.join(FIXED)} (default: both)",
    )
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument(
        "--scores-from",
        type=Path,
        default=None,
        metavar="JSON",
        help="the scores of an earlier run (its --json, or a head_map.json) instead of scoring again",
    )
    parser.add_argument(
        "--retrieval-window",
        type=int,
        default=None,
        metavar="N",
        help="the chosen heads keep an N-token window instead of staying exact (default: exact)",
    )
    parser.add_argument("--calib-len", type=int, default=256, help="tokens per calibration row and pass-key prompt")
    parser.add_argument("--calib-rows", type=int, default=4)
    parser.add_argument("--calib-passkey", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per held-out row")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--eval-tokens", type=int, default=16_384, help="held-out tokens to evaluate (default: 16,384)")
    group.add_argument("--eval-rows", type=int, default=None, help="held-out rows of --seq-len tokens to evaluate")
    parser.add_argument("--passkey", default=None, metavar="LIST", help="pass-key recall at these lengths, e.g. 1024")
    parser.add_argument("--passkey-trials", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="results (default: benchmarks/results/per-head.json for the bundled model, else per-head-MODEL.json)",
    )
    parser.add_argument("--png", type=Path, default=None, help="the plot (default: --json with .png)")
    parser.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="the page whose per-head section to write (default: docs/fidelity.md for the bundled model)",
    )
    parser.add_argument("--render", action="store_true", help="only rewrite the plot and the section from --json")
    parser.add_argument(
        "--calibration-only",
        action="store_true",
        help="score and choose only: each choice's KL on the calibration rows, nothing converted or "
        "evaluated (a quick comparison of the scores on a large model)",
    )
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    default = args.model == fidelity.BUNDLED and args.data is None
    stem = "per-head" if default else f"per-head-{args.model.name}"
    args.json = (
        args.json or ROOT / "benchmarks/results" / f"{stem}{'-calibration' if args.calibration_only else ''}.json"
    )
    args.png = args.png or args.json.with_suffix(".png")
    args.doc = args.doc or (ROOT / "docs/fidelity.md" if default else None)
    try:
        args.budgets = [float(b) for b in args.budgets.split(",")]
        args.scores = [x for x in args.scores.split(",") if x]
        args.fixed = [x for x in args.fixed.split(",") if x]
        if not args.scores or not set(args.scores) <= {"kl", "mass"} or not set(args.fixed) <= set(FIXED):
            raise ValueError
        args.passkey = [int(n) for n in args.passkey.split(",")] if args.passkey else None
    except ValueError:
        parser.error(
            "--budgets and --passkey are comma-separated numbers (0.1,0.2,0.3 and 1024), --scores from kl, mass, "
            f"--fixed from {', '.join(FIXED)}"
        )
    if args.data is not None and not all((args.data / part).is_dir() for part in ("train", "heldout")):
        parser.error(f"--data {args.data} needs train/ and heldout/ folders")
    if args.eval_rows is not None:
        args.eval_tokens = args.eval_rows * args.seq_len
    args.data_name = "stdlib" if args.data is None else str(args.data)
    args.teacher = args.model  # what fidelity.measure compares with
    return args


def calibration_table(record: dict) -> str:
    lines = [
        f"| choice | budget | {retrieval_name(record)} kv heads | state share | calibration KL |",
        "|---|---:|---:|---:|---:|",
        f"| every head windowed | – | 0 | – | {record['calibration_kl_all_windowed']:.4f} |",
    ]
    lines += [
        f"| `{c['kind']}` | {c['budget']:.0%} | {c['retrieval']} | {c['state_bytes'] / c['kv_cache_bytes']:.1%} | "
        f"{c['calibration_kl']:.4f} |"
        for c in record["calibration_choices"]
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    record = json.loads(args.json.read_text()) if args.render else run(args)
    if "calibration_choices" in record:
        print(calibration_table(record))
        return record
    plot(record, args.png)
    if args.doc is not None:
        write_section(args.doc, section(record, args.png, args.json))
    print(table(record))
    return record


if __name__ == "__main__":
    try:
        main()
    except rnnify.RnnifyError as exc:
        sys.exit(f"error: {exc}")
