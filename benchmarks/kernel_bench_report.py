"""What kernel_bench.py makes of its rows: the issue's goals (met, not met or not measured), how far
the rows are from the reference, the table printed and the time-vs-T plot."""

from __future__ import annotations

import collections
import math
import sys
from pathlib import Path

from kernel_bench_cases import IMPLS, OPS, VARIANTS, Case

COLORS = {"triton": "C0", "reference": "C1", "fla": "C2", "sdpa": "C3"}  # the same in every panel
GOAL_SHAPE = (1, 32, 128, 8192)  # B, H, D, T where chunk_linear_attn should match fla's chunk kernel
GOAL_SDPA_T, GOAL_SDPA_RATIO = 32768, 5.0
GOAL_DECODE_SPREAD = 1.25  # slowest / fastest decode step over the contexts still counts as "independent of T"
ERR_FLAG = 2e-2  # bf16 rows further than this from the reference are flagged


def order(r: dict) -> tuple:
    """Rows and panels in reading order: section, op, variant, mode, size."""
    op = OPS.index(r["op"]) if r["op"] in OPS else len(OPS)
    variant = VARIANTS.index(r["variant"]) if r["variant"] in VARIANTS else len(VARIANTS)
    return (r["section"] != "prefill", op, variant, r["mode"], r["B"], r["H"], r["D"], r["T"])


def row_label(r: dict) -> str:
    size = f"B={r['B']} H={r['H']} D={r['D']} T={r['T']}"
    return f"{r['section']} {r['op']}[{r['variant']}] {r['impl']} {r['mode']} {size}"


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['ms']:.3f}" if r["status"] == "ok" else r["status"]


def find(rows, **key) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in key.items())), None)


def goal_case(c: Case) -> bool:
    """Rows the goals read: run first, so a run cut short by its time budget still answers them."""
    if c.section == "decode":
        pairs = {("fused_recurrent_linear_attn", "plain"), ("sdpa", "kv-cache")}
        return (c.op, c.variant) in pairs and c.shape[:3] == GOAL_SHAPE[:3]
    plain = {("chunk_linear_attn", "plain"), ("chunk_linear_attn", "plain-tf32"), ("sdpa", "causal")}
    return (c.op, c.variant) in plain and (c.shape == GOAL_SHAPE or c.T == GOAL_SDPA_T)


def verdict(goal: str, met: bool | None, detail: str) -> dict:
    return {"goal": goal, "verdict": "not measured" if met is None else ("met" if met else "not met"), "detail": detail}


def missing(rows, why: dict, **key) -> str:
    """A row a goal reads: its time, its status and error, or why it never ran."""
    r, impl = find(rows, **key), key["impl"]
    if r is None:
        return f"{impl}: {why.get(impl, 'not run')}"
    return f"{impl}: " + (f"{r['ms']:.3f} ms" if r["status"] == "ok" else f"{r['status']} ({r.get('error', '')[:120]})")


def goal_fla(rows, why: dict, mode: str) -> dict:
    B, H, D, T = GOAL_SHAPE
    at = dict(section="prefill", op="chunk_linear_attn", variant="plain", mode=mode, B=B, H=H, D=D, T=T)
    goal = f"chunk_linear_attn {mode} at least as fast as fla's chunk kernel (B={B} H={H} D={D} T={T})"
    ours, fla = find(rows, impl="triton", **at), find(rows, impl="fla", **at)
    if not (ours and fla and ours["status"] == fla["status"] == "ok"):
        return verdict(goal, None, "; ".join(missing(rows, why, impl=i, **at) for i in ("triton", "fla")))
    tf32 = find(rows, impl="triton", **{**at, "variant": "plain-tf32"})
    extra = f"; with tf32 dots {tf32['ms']:.3f} ms" if tf32 and tf32["status"] == "ok" else ""
    return verdict(
        goal,
        ours["ms"] <= fla["ms"],
        f"rnnify {ours['ms']:.3f} ms, fla {fla['ms']:.3f} ms ({fla['ms'] / ours['ms']:.2f}x){extra}",
    )


def goal_sdpa(rows, mode: str) -> dict:
    goal = f"chunk_linear_attn {mode} at least {GOAL_SDPA_RATIO:g}x faster than SDPA at T={GOAL_SDPA_T}"
    ratios = []
    for ours in rows:
        if (ours["op"], ours["variant"], ours["impl"], ours["mode"], ours["T"], ours["status"]) == (
            "chunk_linear_attn",
            "plain",
            "triton",
            mode,
            GOAL_SDPA_T,
            "ok",
        ):
            sdpa = find(
                rows, op="sdpa", section="prefill", mode=mode, status="ok", **{k: ours[k] for k in ("B", "H", "D", "T")}
            )
            if sdpa:
                ratios.append(
                    (
                        sdpa["ms"] / ours["ms"],
                        f"B={ours['B']} H={ours['H']} D={ours['D']}: "
                        f"{ours['ms']:.2f} vs {sdpa['ms']:.2f} ms ({sdpa['ms'] / ours['ms']:.2f}x)",
                    )
                )
    if not ratios:
        return verdict(goal, None, f"no size at T={GOAL_SDPA_T} with both a Triton and an SDPA {mode} row")
    return verdict(goal, min(r for r, _ in ratios) >= GOAL_SDPA_RATIO, "; ".join(d for _, d in ratios))


def goal_decode(rows) -> dict:
    goal = f"fused_recurrent_linear_attn decode step independent of T (spread <= {GOAL_DECODE_SPREAD:g}x)"
    steps = collections.defaultdict(dict)
    for r in rows:
        if (r["op"], r["variant"], r["impl"], r["status"]) == ("fused_recurrent_linear_attn", "plain", "triton", "ok"):
            steps[r["B"], r["H"], r["D"]][r["T"]] = r["ms"]
    spreads = []
    for (B, H, D), t in steps.items():
        lo, hi = min(t.values()), max(t.values())
        if len(t) > 1:
            spreads.append(
                (hi / lo, f"B={B} H={H} D={D}: {lo:.4f}..{hi:.4f} ms over T={min(t)}..{max(t)} ({hi / lo:.2f}x)")
            )
    if not spreads:
        return verdict(goal, None, "no Triton decode rows at two or more context lengths")
    return verdict(goal, max(s for s, _ in spreads) <= GOAL_DECODE_SPREAD, "; ".join(d for _, d in spreads))


def goals(doc: dict) -> list[dict]:
    """The issue's goals, each met, not met or not measured (with what was missing)."""
    rows, m = doc["rows"], doc["machine"]
    why = {
        "triton": "not run" if m["device"] == "cuda" else "no Triton rows without CUDA",
        "fla": "not run" if m["device"] == "cuda" else "no fla rows without CUDA",
    }
    if m["fla"].startswith("not installed"):
        why["fla"] = f"fla {m['fla']}"
    return [
        goal_fla(rows, why, "fwd"),
        goal_fla(rows, why, "fwd+bwd"),
        goal_sdpa(rows, "fwd"),
        goal_sdpa(rows, "fwd+bwd"),
        goal_decode(rows),
    ]


def checks(rows) -> dict:
    """How far the Triton and fla rows are from the reference at the same sizes."""
    errs = [r for r in rows if "err_vs_reference" in r]
    flagged = [
        f"{row_label(r)}: {r['err_vs_reference']}"
        for r in errs
        if isinstance(r["err_vs_reference"], str) or r["err_vs_reference"] > ERR_FLAG
    ]
    worst = max((r["err_vs_reference"] for r in errs if not isinstance(r["err_vs_reference"], str)), default=None)
    return {"compared": len(errs), "max_err": worst, "threshold": ERR_FLAG, "flagged": flagged}


def print_report(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    rows = doc["rows"]
    table = Table(title=f"rnnify.kernels on {doc['machine']['device_name']} ({doc['config']['dtype']}), ms")
    for name in (
        "section",
        "op",
        "variant",
        "mode",
        "B",
        "H",
        "D",
        "T",
        "triton",
        "reference",
        "fla",
        "sdpa",
        "fla/ours",
        "sdpa/ours",
        "err",
    ):
        table.add_column(name, justify="right" if name not in ("section", "op", "variant", "mode") else "left")
    by_key = collections.defaultdict(dict)
    for r in sorted(rows, key=order):
        by_key[tuple(r[k] for k in ("section", "op", "variant", "mode", "B", "H", "D", "T"))][r["impl"]] = r
    for key, impls in by_key.items():
        if key[1] == "sdpa":
            continue
        sdpa = find(rows, op="sdpa", section=key[0], mode=key[3], B=key[4], H=key[5], D=key[6], T=key[7])
        ours = impls.get("triton") or impls.get("reference")
        errs = " ".join(
            f"{i} {e if isinstance(e, str) else f'{e:.1e}'}"
            for i, r in impls.items()
            if (e := r.get("err_vs_reference")) is not None
        )
        table.add_row(
            *map(str, key),
            cell(impls.get("triton")),
            cell(impls.get("reference")),
            cell(impls.get("fla")),
            cell(sdpa),
            ratio(impls.get("fla"), ours),
            ratio(sdpa, ours),
            errs,
        )
    console.print(table)
    console.print("[bold]Goals[/bold]")
    for g in doc["goals"]:
        console.print(f"  {g['verdict']:>12}  {g['goal']}\n                {g['detail']}")
    c = doc["checks"]
    console.print(
        f"Checks: {c['compared']} rows compared with the reference at the same size, max err {c['max_err']}; "
        f"{len(c['flagged'])} over {c['threshold']}" + "".join(f"\n  {f}" for f in c["flagged"])
    )


def ratio(other: dict | None, ours: dict | None) -> str:
    if not (other and ours and other["status"] == ours["status"] == "ok"):
        return "-"
    return f"{other['ms'] / ours['ms']:.2f}"


def plot(doc: dict, path: Path) -> None:
    """Time vs T, log-log, one panel per op/variant/mode, at the (B, H, D) with the most rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in doc["rows"] if r["status"] == "ok"]
    size = collections.Counter((r["B"], r["H"], r["D"]) for r in ok).most_common(1)
    ok = [r for r in ok if size and (r["B"], r["H"], r["D"]) == size[0][0]]
    panels = list(
        dict.fromkeys(
            (r["section"], r["op"], r["variant"], r["mode"]) for r in sorted(ok, key=order) if r["op"] != "sdpa"
        )
    )
    cols = min(4, max(1, len(panels)))
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, (section, op, variant, mode) in zip(axes.flat, panels):
        for impl in IMPLS:
            pts = sorted(
                (r["T"], r["ms"])
                for r in ok
                if (r["section"], r["mode"], r["impl"]) == (section, mode, impl)
                and ((r["op"], r["variant"]) == (op, variant) or impl == "sdpa")
            )
            if pts:
                ax.loglog(
                    *zip(*pts),
                    marker="o",
                    ms=3,
                    label=impl,
                    color=COLORS[impl],
                    linestyle="--" if impl == "sdpa" else "-",
                )
        lengths = sorted({r["T"] for r in ok})
        ax.set_xticks(lengths, [f"{t // 1024}k" if t >= 1024 else str(t) for t in lengths], fontsize=7)
        ax.minorticks_off()
        ax.set_title(f"{op}[{variant}] {mode}", fontsize=9)
        ax.set_xlabel("context T" if section == "decode" else "T", fontsize=8)
        ax.set_ylabel("ms", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if not panels:
        axes.flat[0].text(0.5, 0.5, "no measurements", ha="center", va="center")
    m = doc["machine"]
    where = f"B={size[0][0][0]} H={size[0][0][1]} D={size[0][0][2]}" if size else ""
    fig.suptitle(
        f"rnnify.kernels on {m['device_name']} {doc['config']['dtype']} {where} | torch {m['torch']} "
        f"triton {m['triton']} fla {m['fla'].split(' (')[0]}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
    plt.close(fig)
