"""The original model with some heads' attention changed: what ``--to auto`` scores and measures.

A probe replaces the model's attention through transformers' ``AttentionInterface``: each kv head
runs plain softmax, a window with sinks, or a ``select`` cell (sinks, window and selected tokens,
``rnnify.cells.select``), so one forward pass of the original says what a mix of cells would cost
it, before anything is converted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from rnnify.auto.calibration import Calibration
from rnnify.choices import SCORES
from rnnify.errors import RnnifyError

Head = tuple[int, int]  # (layer, kv head)
_PROBE = "rnnify_head_probe"


class _Probe:
    """An attention function for transformers' ``AttentionInterface``: softmax attention in which
    each kv head in ``windowed`` sees only the last ``windowed[head]`` tokens and the first
    ``sinks``, and each in ``selecting`` is the ``select`` cell with those options (its window, the
    sinks and the tokens it selects, computed by the cell itself); with ``mass`` set it adds, per (layer, kv head), the weighted attention mass beyond
    the last ``window`` tokens and the sinks."""

    def __init__(self, window: int, sinks: int):
        self.window, self.sinks = window, sinks
        self.windowed: dict[Head, int] = {}
        self.selecting: dict[Head, dict] = {}
        self.weights: torch.Tensor | None = None  # [T] of the row running, for ``mass``
        self.mass: dict[Head, float] | None = None
        self.calls = 0

    def __call__(self, module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        self.calls += 1
        layer, (_, heads, length, dim) = module.layer_idx, query.shape
        kv_heads = key.shape[1]
        group = heads // kv_heads
        i = torch.arange(length, device=query.device)[:, None]
        j = torch.arange(length, device=query.device)[None, :]
        causal = j <= i
        stream = causal & ((i - j < self.window) | (j < self.sinks))
        windows = torch.tensor(
            [self.windowed.get((layer, h // group), length) for h in range(heads)], device=query.device
        )
        allowed = causal & ((i - j < windows[:, None, None]) | (j < self.sinks))
        scores = (query.float() @ key.float().repeat_interleave(group, 1).transpose(-1, -2)) * (scaling or dim**-0.5)
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        if self.mass is not None:
            beyond = (p * (causal & ~stream)).sum(-1)  # [B, H, T]
            per_head = (beyond * self.weights).sum(-1).sum(0).reshape(kv_heads, group).mean(-1) / self.weights.sum()
            for h in range(kv_heads):
                self.mass[(layer, h)] = self.mass.get((layer, h), 0.0) + float(per_head[h])
        out = p @ value.float().repeat_interleave(group, 1)
        for (at, h), options in self.selecting.items():
            if at == layer:
                heads_of = slice(h * group, (h + 1) * group)
                out[:, heads_of] = _select_head(
                    query[:, heads_of], key[:, h : h + 1], value[:, h : h + 1], scaling or dim**-0.5, options
                )
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _select_head(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, options: dict
) -> torch.Tensor:
    """One kv head (its query group ``[B, G, T, d]``, ``key``/``value [B, 1, T, d]``) through a fresh
    ``select`` cell with ``options``: what that head computes once converted."""
    from rnnify.cells import CellSpec, build_cell

    batch, group, length, dim = query.shape
    cell = build_cell("select", CellSpec(group, 1, dim, value.shape[-1], scale), options)
    mask = torch.ones(batch, length, dtype=torch.bool, device=query.device)
    out, *_ = cell(query, key, value, mask, *cell.init_state(batch, query.device, key.dtype))
    return out.float()


@contextmanager
def _probed(source: torch.nn.Module, probe: _Probe) -> Iterator[_Probe]:
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE, probe)
    before = source.config._attn_implementation
    try:
        source.set_attn_implementation(_PROBE)
    except (ValueError, AttributeError) as exc:
        raise RnnifyError(
            f"--to auto needs a model whose attention uses transformers' attention interface ({exc})"
        ) from exc
    try:
        yield probe
    finally:
        source.set_attn_implementation(before)


def _logits(source: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return source(input_ids=ids.to(next(source.parameters()).device), use_cache=False).logits[0].float()


def _kl(want: torch.Tensor, got: torch.Tensor, weights: torch.Tensor) -> float:
    """Weighted mean over positions of KL(want || got)."""
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(want, -1), log_target=True, reduction="none").sum(-1)
    return float((kl * weights.to(kl.device)).sum() / weights.sum())


def _mean_by_kind(values: list[float], kinds: list[str]) -> float:
    """Mean over text rows plus mean over pass-key rows (each kind counts once however many rows)."""
    return sum(sum(v for v, k in zip(values, kinds) if k == kind) / kinds.count(kind) for kind in set(kinds))


def _decoder_layers(source: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder layers in call order (``model.layers`` of Llama-like models), or None."""
    layers = getattr(getattr(source, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


@contextmanager
def _recorded(layers: torch.nn.ModuleList | None, outputs: list) -> Iterator[None]:
    """Append each decoder layer's output to ``outputs`` while the block runs."""
    handles = [layer.register_forward_hook(lambda m, a, out: outputs.append(out)) for layer in layers or ()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _replayed(layers: torch.nn.ModuleList | None, outputs: list, count: int) -> Iterator[None]:
    """The first ``count`` decoder layers return their recorded ``outputs`` instead of computing
    them: windowing a head of layer l changes nothing before it, so a pass need only run from l."""
    if layers is None or len(outputs) != len(layers):
        yield
        return
    for layer, out in zip(list(layers)[:count], outputs):
        layer.forward = lambda *args, _out=out, **kwargs: _out
    try:
        yield
    finally:
        for layer in list(layers)[:count]:
            del layer.forward


@torch.no_grad()
def score_heads(
    source: torch.nn.Module,
    calibration: Calibration,
    window: int,
    sinks: int,
    scores=SCORES,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, dict[Head, float]], list[torch.Tensor]]:
    """Per kv head, each score in ``scores``; and the original's logits per row (for ``measure_kl``).
    ``progress(n)`` is told of each forward pass."""
    step = progress or (lambda n: None)
    probe = _Probe(window, sinks)
    out: dict[str, dict[Head, float]] = {}
    layers = _decoder_layers(source)
    with _probed(source, probe):
        originals, masses, recorded = [], [], []
        for ids, weights in zip(calibration.rows, calibration.weights):
            probe.weights, probe.mass = weights, {}
            recorded.append([])
            with _recorded(layers if "kl" in scores else None, recorded[-1]):
                originals.append(_logits(source, ids))
            masses.append(probe.mass)
            step(1)
        if probe.calls == 0:
            raise RnnifyError("--to auto: this model's attention does not use transformers' attention interface")
        heads = sorted(masses[0])
        probe.mass = None
        if "mass" in scores:
            out["mass"] = {h: _mean_by_kind([m[h] for m in masses], calibration.kinds) for h in heads}
        if "kl" in scores:
            out["kl"] = {}
            for head in heads:
                probe.windowed = {head: window}
                kls = []
                for ids, w, want, before in zip(calibration.rows, calibration.weights, originals, recorded):
                    with _replayed(layers, before, head[0]):
                        kls.append(_kl(want, _logits(source, ids), w))
                out["kl"][head] = _mean_by_kind(kls, calibration.kinds)
                step(len(calibration.rows))
    return out, originals


@torch.no_grad()
def measure_kl(
    source: torch.nn.Module,
    calibration: Calibration,
    originals: list[torch.Tensor],
    windowed: dict[Head, int],
    sinks: int,
    selecting: dict[Head, dict] | None = None,
) -> float:
    """The calibration KL (text mean plus pass-key mean) with each head in ``windowed`` windowed
    to its number of tokens (and the sinks), and each in ``selecting`` the ``select`` cell with
    those options."""
    probe = _Probe(0, sinks)
    probe.windowed = dict(windowed)
    probe.selecting = dict(selecting or {})
    with _probed(source, probe):
        kls = [
            _kl(want, _logits(source, ids), w) for ids, w, want in zip(calibration.rows, calibration.weights, originals)
        ]
    return _mean_by_kind(kls, calibration.kinds)
