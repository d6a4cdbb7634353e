"""The original model with some heads' attention changed: what ``--to auto`` scores and measures.

A probe replaces the model's attention through transformers' ``AttentionInterface``
(``InterfaceRunner``; ``rnnify.auto.graph_probe`` where the interface does not reach it): each kv
head runs the model's own attention (its mask and window, softcap, ALiBi, sink logits), a window
with sinks, or a ``select`` or ``lola`` cell, so one forward pass of the original says what a mix
of cells would cost it, before anything is converted. The kinds are those of ``rnnify.auto.levels``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F

from rnnify.auto.calibration import Calibration
from rnnify.auto.levels import KEPT_KINDS, Level
from rnnify.cells.base import CellSpec
from rnnify.choices import SCORES
from rnnify.compiler.plan import within_own_window
from rnnify.errors import RnnifyError

Head = tuple[int, int]  # (layer, kv head)
_PROBE = "rnnify_head_probe"
_NO_INTERFACE = (
    "this model's attention does not go through transformers' attention interface: probe it through "
    "its exact conversion (rnnify.auto.graph_probe.probe_runner, as --to auto does)"
)
MASS_KINDS = ("exact", "window", "select")  # kinds the mass score covers (``reads``): a memory reads every token


class _Probe:
    """An attention function for transformers' ``AttentionInterface`` that computes the model's own
    attention (its mask, sliding windows included; a float mask's bias, ALiBi's; the ``softcap``
    and the ``s_aux`` sink logits transformers passes), except that each kv head in ``windowed``
    reads only the last ``windowed[head]`` tokens and the first ``sinks``, as a window cell does,
    and each in ``celled`` is the cell of its kind (``select`` or ``lola``) with those options,
    computed by the cell itself. It records each layer's ``CellSpec`` (``specs``) on its first
    call. With ``mass`` set it adds, per kind of ``kept`` that ``reads`` can replay (its text) and
    (layer, kv head), the weighted attention mass that kind does not read."""

    def __init__(self, sinks: int, kept: Sequence[Level] = ()):
        self.sinks, self.kept = sinks, [level for level in kept if level.target in MASS_KINDS]
        self.windowed: dict[Head, int] = {}
        self.celled: dict[Head, tuple[str, dict]] = {}
        self.specs: dict[int, CellSpec] = {}
        self.weights: torch.Tensor | None = None  # [T] of the row running, for ``mass``
        self.mass: dict[str, dict[Head, float]] | None = None
        self.calls = 0
        self.running: list[int] = []  # indices of the list elements (decoder layers) running, outermost first
        self.called: list[tuple[int, tuple[int, ...]]] = []  # each call's layer and shape, in order

    def set_kinds(self, kinds: Mapping[Head, Level]) -> None:
        """Each head in ``kinds`` runs as its kind, the rest exact."""
        self.windowed = {h: level.window for h, level in kinds.items() if level.target == "window"}
        self.celled = {
            h: (level.target, level.cell_options(self.sinks))
            for h, level in kinds.items()
            if level.target in KEPT_KINDS
        }

    def layer_of(self, module) -> int:
        """The layer the compiler numbers this attention by: the first number of its module path as
        called, the index of the outermost list element running (a decoder layer; the layer that
        calls a block shared by several, as Zamba's), else the module's own ``layer_idx``."""
        if self.running:
            return self.running[0]
        if isinstance(getattr(module, "layer_idx", None), int):
            return module.layer_idx
        raise RnnifyError(
            "--to auto: cannot tell which layer an attention call belongs to; choose targets with --layers"
        )

    def __call__(
        self,
        module,
        query,
        key,
        value,
        attention_mask=None,
        scaling=None,
        dropout=0.0,
        softcap=None,
        s_aux=None,
        sliding_window=None,
        **kwargs,
    ):
        layer, (_, heads, length, dim) = self.layer_of(module), query.shape
        self.called.append((layer, (heads, key.shape[1], dim, value.shape[-1])))
        scale = scaling or dim**-0.5
        allowed, bias = _model_mask(attention_mask, length, query.device)
        brought = [name for name in ("position_bias", "sinks") if kwargs.get(name) is not None]
        if brought:  # transformers' names for what a layer's tokens add to its scores (Inkling's, Inkling 2's)
            raise RnnifyError(
                f"--to auto: layer {layer} adds to its scores what its tokens compute ({brought[0]}), which no "
                "kind --to auto chooses carries; convert with --to exact, which checks itself against the original"
            )
        if layer not in self.specs:
            try:
                slopes = None if bias is None else _alibi_slopes(bias, allowed, heads)
            except ValueError:
                raise RnnifyError(
                    f"--to auto: layer {layer} adds a bias to its scores that is not ALiBi's (a slope times "
                    "the distance), which no rnnify cell carries; convert with --to exact, which checks "
                    "itself against the original"
                ) from None
            self.specs[layer] = _site_spec(query, key, value, scale, sliding_window, softcap, slopes, s_aux)
        out = self.attend(layer, query, key, value, allowed, bias, scale, softcap, s_aux, sliding_window)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    def attend(
        self, layer, query, key, value, allowed, bias, scale, softcap, sink_logits, own_window=None
    ) -> torch.Tensor:
        """``[B, H, T, d_v]`` (float32): the attention of ``layer`` over ``query [B, H, T, d]`` and
        ``key``/``value [B, Hkv, T, ·]`` where each query may read the keys ``allowed`` (the model's
        own pattern, sliding over ``own_window`` tokens where it has such a window) with ``bias``
        added to its scores after the ``softcap``, and the ``sink_logits`` in each denominator, each
        head as its kind. A kind that would read past the layer's own window computes the original
        there, as the converted model does (``plan.within_own_window``)."""
        self.calls += 1
        (_, heads, length, _), kv_heads = query.shape, key.shape[1]
        group = heads // kv_heads
        windowed = [self.windowed.get((layer, h // group)) for h in range(heads)]
        windowed = [
            None if w is None or within_own_window(own_window, "window", {"window": w, "sinks": self.sinks}) else w
            for w in windowed
        ]
        if any(w is not None for w in windowed):  # a window cell reads its ring and the sinks, nothing else
            i = torch.arange(length, device=query.device)[:, None]
            j = torch.arange(length, device=query.device)[None, :]
            windows = torch.tensor([length if w is None else w for w in windowed], device=query.device)
            read = (j <= i) & ((i - j < windows[:, None, None]) | (j < self.sinks))
            is_windowed = torch.tensor([w is not None for w in windowed], device=query.device)[:, None, None]
            allowed = torch.where(is_windowed, read, allowed)
        scores = (query.float() @ key.float().repeat_interleave(group, 1).transpose(-1, -2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if bias is not None:
            scores = scores + bias
        p = _softmax(scores.masked_fill(~allowed, float("-inf")), sink_logits)
        if self.mass is not None:
            grouped = p.reshape(p.shape[0], kv_heads, group, length, length)
            for level in self.kept:
                unread = ~reads(p, self.sinks, level, group)[:, :, None]
                lost = (grouped * unread).sum(-1).reshape(p.shape[:3])  # [B, H, T]
                per_head = (lost * self.weights).sum(-1).sum(0).reshape(kv_heads, group).mean(-1) / self.weights.sum()
                into = self.mass.setdefault(level.text, {})
                for h in range(kv_heads):
                    into[(layer, h)] = into.get((layer, h), 0.0) + float(per_head[h])
        out = p @ value.float().repeat_interleave(group, 1)
        for (at, h), (target, options) in self.celled.items():
            if at == layer and not within_own_window(own_window, target, options):
                heads_of = slice(h * group, (h + 1) * group)
                out[:, heads_of] = _cell_head(
                    target, query[:, heads_of], key[:, h : h + 1], value[:, h : h + 1], scale, options
                )
        return out


def _model_mask(mask: torch.Tensor | None, length: int, device: torch.device):
    """The keys each query may read (``[B or 1, H or 1, T, T]`` bool) and the float bias a float
    mask adds to the scores (ALiBi's, or None): from the model's mask, causal where it gives none."""
    if mask is None:
        return torch.ones(length, length, dtype=torch.bool, device=device).tril(), None
    if mask.dtype == torch.bool:
        return mask, None
    allowed = mask > torch.finfo(mask.dtype).min / 2
    bias = mask.float().masked_fill(~allowed, 0.0)
    return allowed, (bias if bool(bias.any()) else None)


def _softmax(scores: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the keys, with ``exp(sink_h)`` in each denominator where the model has sink logits
    (gpt-oss): the attention a query puts on no token."""
    if sink_logits is None:
        return torch.softmax(scores, dim=-1)
    sink = sink_logits.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _alibi_slopes(bias: torch.Tensor, allowed: torch.Tensor, heads: int) -> tuple[float, ...] | None:
    """Per head, the slope of a float mask's bias that is ALiBi's, ``slope_h (j - i)`` plus a constant
    per query (which the softmax ignores), or None where it is constant; ``ValueError`` for any other
    bias (one that depends on the tokens, as Doge's), which no cell carries."""
    length = bias.shape[-1]
    if length < 2:
        return None
    slopes = bias[0, :, -1, -1] - bias[0, :, -1, -2]  # [H or 1]: the step between the last two keys
    distance = torch.arange(length, device=bias.device)[None, :] - torch.arange(length, device=bias.device)[:, None]
    own = bias.diagonal(dim1=-2, dim2=-1)[..., None]  # each query's bias on itself: distance 0
    fitted = own + slopes[None, :, None, None] * distance
    residual = (bias - fitted).abs().masked_fill(~allowed, 0.0)
    if float(residual.max()) > 1e-4 * (1.0 + float(bias.abs().max())):
        raise ValueError("not ALiBi")
    return tuple(slopes.expand(heads).tolist()) if bool(slopes.any()) else None


def _site_spec(query, key, value, scale, window, softcap, slopes, sink_logits) -> CellSpec:
    """The ``CellSpec`` of the attention a probe call computes, as the compiler finds it at that site:
    its shape, its own sliding window and the terms its scores carry (``slopes``: ALiBi's)."""
    heads, dim = query.shape[1], query.shape[-1]
    return CellSpec(
        heads,
        key.shape[1],
        dim,
        value.shape[-1],
        float(scale),
        window,
        None,
        None if softcap is None else float(softcap),
        slopes,
        None if sink_logits is None else tuple(sink_logits.float().tolist()),
    )


def reads(p: torch.Tensor, sinks: int, level: Level, group: int) -> torch.Tensor:
    """``[B, Hkv, T, T]`` (or ``[1, 1, T, T]`` for a window): which keys each query of a kv head
    reads as ``level`` (a window or a ``select`` cell), given its query heads' attention ``p [B, H,
    T, T]`` (``group`` per kv head, causal softmax). For ``select`` this replays the cell's own rule
    (``rnnify.cells.select``): per chunk its queries read the sinks, the recent tokens and the set
    chosen at the chunk's boundary; each adds its softmax over what it reads to the scores, and at
    each boundary the tokens leaving the window compete with that set for the ``keep`` slots by
    their pooled score, newer first on ties. Those scores come from the original's queries and keys
    of the layer, which the converted cell also reads while the earlier layers are unchanged."""
    from rnnify.cells import CellSpec, build_cell

    length = p.shape[-1]
    i = torch.arange(length, device=p.device)[:, None]
    j = torch.arange(length, device=p.device)
    if level.target == "window":
        return ((j <= i) & ((i - j < level.window) | (j < sinks)))[None, None]
    rule = build_cell("select", CellSpec(group, 1, 1, 1, 1.0), level.cell_options(sinks)).rule
    batch, kv_heads = p.shape[0], p.shape[1] // group
    grouped = p.reshape(batch, kv_heads, group, length, length)
    read = torch.zeros(batch, kv_heads, length, length, dtype=torch.bool, device=p.device)
    selected = torch.zeros(batch, kv_heads, length, dtype=torch.bool, device=p.device)
    score = p.new_zeros(batch, kv_heads, length)
    for start in range(0, length, rule.chunk):
        if start and rule.keep:
            recent = (j >= sinks) & (j > start - rule.ring - 1) & (j < start)  # the ring's tokens but the sinks
            candidates = selected | (recent & (j <= start - rule.window))
            merit = _pooled(score, selected | recent, rule).masked_fill(~candidates, float("-inf"))
            newest_first = merit.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., : rule.keep]
            best = torch.zeros_like(selected).scatter_(-1, length - 1 - newest_first, True)
            selected = best & candidates
            if rule.policy == "snapkv":
                score.zero_()
        stop = min(start + rule.chunk, length)
        queries = i[start:stop]
        read[:, :, start:stop] = (j <= queries) & ((j < sinks) | (j > start - rule.window) | selected[:, :, None])
        kept = grouped[:, :, :, start:stop] * read[:, :, None, start:stop]
        softmax = kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)  # the cell's own attention
        observes = (queries[:, 0] % rule.chunk >= rule.chunk - rule.observation).to(p.dtype)
        score += (softmax * observes[:, None]).sum((2, 3))
    return read


def _pooled(score: torch.Tensor, held: torch.Tensor, rule) -> torch.Tensor:
    """Each token's score pooled over the held tokens within ``rule.pool // 2`` positions: their mean
    over ``pool`` positions (those not held count 0) or their max; ``pool=1``: the score itself."""
    if rule.pool == 1:
        return score
    flat = score.reshape(-1, 1, score.shape[-1])
    if rule.pooling == "avg":
        kept = (flat * held.reshape(flat.shape)).float()
        pooled = F.avg_pool1d(kept, rule.pool, 1, rule.pool // 2, count_include_pad=True)
    else:
        kept = flat.float().masked_fill(~held.reshape(flat.shape), float("-inf"))
        pooled = F.max_pool1d(kept, rule.pool, 1, rule.pool // 2)
    return pooled.reshape(score.shape).to(score.dtype)


def _cell_head(
    target: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, options: dict
) -> torch.Tensor:
    """One kv head (its query group ``[B, G, T, d]``, ``key``/``value [B, 1, T, d]``) through a fresh
    ``target`` cell with ``options``: what that head computes once converted."""
    from rnnify.cells import CellSpec, build_cell

    batch, group, length, dim = query.shape
    cell = build_cell(target, CellSpec(group, 1, dim, value.shape[-1], scale), options).to(query.device)
    mask = torch.ones(batch, length, dtype=torch.bool, device=query.device)
    out, *_ = cell(query, key, value, mask, *cell.init_state(batch, query.device, key.dtype))
    return out.float()


def _materialized_mask(*args, **kwargs) -> torch.Tensor:
    """The model's boolean mask, built even where SDPA would be told ``is_causal`` instead: the probe
    needs every layer's own pattern (a sliding window), and ALiBi models add their bias onto it."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


class InterfaceRunner:
    """Runs a Hugging Face model with a probe as its attention, through transformers' attention
    interface (the fast path: the decoder layers before a windowed head are replayed, ``layers``)."""

    def __init__(self, source: torch.nn.Module):
        self.source, self.layers = source, _decoder_layers(source)
        self.hidden_size = getattr(source.config, "hidden_size", None)
        self.sites: dict[int, int] = {}  # attention sites per layer, once ``specs`` has run

    @contextmanager
    def probed(self, probe: _Probe) -> Iterator[_Probe]:
        """The model computing its attention with ``probe``, which is told the index of each list
        element (decoder layer) running, by hooks removed on the way out."""
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        source = self.source
        AttentionInterface.register(_PROBE, probe)
        AttentionMaskInterface.register(_PROBE, _materialized_mask)
        before = source.config._attn_implementation
        try:
            source.set_attn_implementation(_PROBE)
        except (ValueError, AttributeError):
            raise NoInterfaceError(_NO_INTERFACE) from None

        def enter(index: int) -> Callable:
            return lambda module, args: probe.running.append(index)  # None: the arguments stay

        def leave(module, args, out) -> None:  # None: the output stays
            probe.running.pop()

        handles = []
        for listed in source.modules():
            if isinstance(listed, torch.nn.ModuleList):
                for index, child in enumerate(listed):
                    handles += [child.register_forward_pre_hook(enter(index)), child.register_forward_hook(leave)]
        try:
            yield probe
        finally:
            for handle in handles:
                handle.remove()
            probe.running.clear()
            source.set_attn_implementation(before)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        source = self.source
        return source(input_ids=ids.to(next(source.parameters()).device), use_cache=False).logits[0].float()

    @torch.no_grad()
    def specs(self, ids: torch.Tensor) -> dict[int, CellSpec]:
        """Each attention layer's site, recorded by a probe on one forward pass of ``ids``."""
        probe = _Probe(0)
        with self.probed(probe):
            self.logits(ids)
        if not probe.specs:
            raise NoInterfaceError(_NO_INTERFACE)
        self.sites = sites_per_layer(probe.called)
        return {layer: replace(spec, hidden_size=self.hidden_size) for layer, spec in sorted(probe.specs.items())}


class NoInterfaceError(RnnifyError):
    """The model's attention does not go through transformers' attention interface."""


def sites_per_layer(sites: list[tuple[int, tuple[int, ...]]]) -> dict[int, int]:
    """How many attention sites each layer has, from each site's (or each call's in one pass) layer
    and shape (heads, kv heads, key and value widths). A choice is per layer and kv head and
    ``--layers`` rules cannot tell two sites of one layer apart, so a layer's sites (DiffLlama's two
    maps, a layer a model runs several times) all get its heads' kinds: they must have one shape.
    Each site keeps its own state, so the choice's costs count every one."""
    shapes: dict[int, set[tuple[int, ...]]] = {}
    counts: dict[int, int] = {}
    for layer, shape in sites:
        shapes.setdefault(layer, set()).add(shape)
        counts[layer] = counts.get(layer, 0) + 1
    for layer, found in sorted(shapes.items()):
        if len(found) > 1:
            raise RnnifyError(
                f"--to auto chooses a kind per layer and kv head, and layer {layer} computes attention at sites "
                "of different shapes; choose its targets by hand with --layers"
            )
    return counts


def runner_of(source):
    """``source`` itself if it is a runner (``InterfaceRunner``, ``rnnify.auto.graph_probe.GraphRunner``),
    else a Hugging Face model run through the attention interface (``graph_probe.probe_runner``
    chooses between the two)."""
    return source if hasattr(source, "probed") else InterfaceRunner(source)


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
    source,
    calibration: Calibration,
    window: int,
    sinks: int,
    scores=SCORES,
    levels: Sequence[Level] = (),
    progress: Callable[[int], None] | None = None,
    exact_layers: Collection[int] = (),
) -> tuple[dict[str, dict[Head, float]], dict[str, dict[str, dict[Head, float]]], list[torch.Tensor]]:
    """Per kv head, each score in ``scores``: what it loses streaming (a ``window``-token window
    and the sinks); per kind of ``levels``, what it loses as that kind (``exact``: nothing); and the
    original's logits per row (for ``measure_kl``). ``progress(n)`` is told of each forward pass:
    one per row, and for ``kl`` one per row, kv head and kind that is not exact, streaming included.
    The heads of ``exact_layers`` stay exact and get no scores. ``source``: a Hugging Face model or a
    runner (``runner_of``)."""
    run = runner_of(source)
    step = progress or (lambda n: None)
    measured = [level for level in levels if level.target != "exact"]
    streaming = Level("window", (("window", window),))
    probe = _Probe(sinks, [streaming, *measured])  # mass: of the kinds ``reads`` replays
    out: dict[str, dict[Head, float]] = {}
    lost: dict[str, dict[str, dict[Head, float]]] = {}
    layers = run.layers
    with run.probed(probe):
        originals, masses, recorded = [], [], []
        for ids, weights in zip(calibration.rows, calibration.weights):
            probe.weights, probe.mass = weights, {}
            recorded.append([])
            with _recorded(layers if "kl" in scores else None, recorded[-1]):
                originals.append(run.logits(ids))
            masses.append(probe.mass)
            step(1)
        if probe.calls == 0:
            raise NoInterfaceError(_NO_INTERFACE)
        heads = sorted(head for head in masses[0][streaming.text] if head[0] not in exact_layers)
        probe.mass = None
        for name in scores:
            scored = [level for level in levels if name != "mass" or level.target in MASS_KINDS]
            lost[name] = {level.text: dict.fromkeys(heads, 0.0) for level in scored}
        if "mass" in scores:
            out["mass"] = {}
            for level in [streaming, *(level for level in measured if level.target in MASS_KINDS)]:
                into = out["mass"] if level is streaming else lost["mass"][level.text]
                into.update({h: _mean_by_kind([m[level.text][h] for m in masses], calibration.kinds) for h in heads})
        if "kl" in scores:
            out["kl"] = {}
            for head in heads:
                for level in [streaming, *measured]:
                    probe.set_kinds({head: level})
                    kls = []
                    for ids, w, want, before in zip(calibration.rows, calibration.weights, originals, recorded):
                        with _replayed(layers, before, head[0]):
                            kls.append(_kl(want, run.logits(ids), w))
                    into = out["kl"] if level is streaming else lost["kl"][level.text]
                    into[head] = _mean_by_kind(kls, calibration.kinds)
                    step(len(calibration.rows))
    return out, lost, originals


@torch.no_grad()
def measure_kl(
    source,
    calibration: Calibration,
    originals: list[torch.Tensor],
    kinds: Mapping[Head, Level],
    sinks: int,
) -> float:
    """The calibration KL (text mean plus pass-key mean) with each head in ``kinds`` its kind (a
    window with the sinks, or a ``select`` or ``lola`` cell), the rest exact."""
    run = runner_of(source)
    probe = _Probe(sinks)
    probe.set_kinds(kinds)
    with run.probed(probe):
        kls = [_kl(want, run.logits(ids), w) for ids, w, want in zip(calibration.rows, calibration.weights, originals)]
    return _mean_by_kind(kls, calibration.kinds)
