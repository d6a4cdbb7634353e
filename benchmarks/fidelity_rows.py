"""The rows ``fidelity.py`` measures: the bundled model's named variants and their goals, and the
rows named on its command line (``--row``, ``--rows``, ``--dir``)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def parse_dir_row(text: str) -> dict:
    """``NAME=DIR[,seconds=S]``: an rnnify directory converted or distilled elsewhere (e.g. with
    ``rnnify distill`` and its checkpoints, over several sessions); S is its distillation wall time."""
    name, sep, rest = text.partition("=")
    directory, _, seconds = rest.partition(",seconds=")
    if not sep or not name or not (Path(directory) / "rnnify.json").is_file():
        raise ValueError(f"--dir {text!r}: expected NAME=DIR[,seconds=S] with DIR an rnnify directory")
    return {"variant": name, "dir": directory, "seconds": float(seconds) if seconds else None}
