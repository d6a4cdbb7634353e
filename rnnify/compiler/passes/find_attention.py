"""Find every attention site and decide what it is, before anything is rewritten.

A site is an ``aten.scaled_dot_product_attention`` call, or attention computed op by op (q @ k^T,
scale, softcap, bias, mask, softmax with sinks, @ v: ``eager_attention``). Its output node gets an
``AttentionSite`` in ``node.meta["rnnify_site"]``: its layer, the q/k/v nodes (k/v taken from
before a materialised ``repeat_kv`` so recurrent state stays per kv head), heads, scale, where
causality comes from, and the terms its scores carry (softcap, ALiBi slopes, sink logits). Masks
and biases are not guessed from flags alone: the graph is run once on a short probe and what each
site actually adds to its scores is read per head, which keys it allows (causal, or the config's
sliding window or chunks; a window or chunk longer than the probe is the config's, as the probe
cannot show it) and, where it adds a float bias, that bias, which must be ALiBi's slope_h (j - i)
(docs/math.md §Score terms). A mask read from a constant buffer is read whole as well, since a
window it applies may be wider than the probe (GPT-Neo's local layers). Sites that cannot become recurrent are
rejected with an error naming the layer and the reason; a bias is never dropped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.eager_attention import MASK_FILL, EagerAttention, MaskTerm, buffered_masks, eager_attention
from rnnify.compiler.passes.find_relative import RelativeBias, find_relative_bias, reads
from rnnify.compiler.passes.find_selection import IndexSelection, check_indexers_read, find_selection
from rnnify.compiler.recurrences import OWN_LAYER_OPS
from rnnify.errors import UnsupportedModelError

SDPA = torch.ops.aten.scaled_dot_product_attention.default
SITE_KEY = "rnnify_site"
_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
_PROBE_LENGTH = 8  # tokens in the probe run; longer when needed to see a small sliding window
_MAX_PROBE_LENGTH = 64
# A bias is ALiBi's when slope_h (j - i) plus a constant per query row gives it within this share of
# its largest change along a row (what softmax sees of it): float32 products of a slope and an
# integer, or bfloat16 ones (Falcon rounds them so) pass; a bias of any other shape (relative
# buckets, a learned table) is far off.
_ALIBI_TOLERANCE = 1e-2


@dataclass
class AttentionSite:
    """One attention call, as the later passes need it."""

    index: int  # order of the site in the graph
    layer: int  # decoder layer, from nn_module_stack
    module_path: str
    query: torch.fx.Node  # [B, num_heads, T, head_dim]
    key: torch.fx.Node  # [B, num_kv_heads, T, head_dim], before any repeat_kv
    value: torch.fx.Node  # [B, num_kv_heads, T, value_dim]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    scale: float
    gqa: str  # "none", "enable_gqa" or "repeat_kv"
    mask_source: str  # "is_causal" or the name of the mask node
    window: int | None  # sliding window (keys per query, self included): config, checked by the probe
    hidden: torch.fx.Node | None  # the layer input [B, T, C] that v is projected from, if found
    softcap: float | None = None  # scores become c tanh(s / c)
    alibi_slopes: tuple[float, ...] | None = None  # per query head: + slope_h (j - i), read by the probe
    sink_logits: tuple[float, ...] | None = None  # per query head: + exp(sink_h) in each denominator
    flat_output: bool = False  # the node replaced is [B H, T, d_v] (Bloom's bmm), not [B, H, T, d_v]
    chunk: int | None = None  # chunked attention (keys of the query's own chunk): config, checked by the probe
    selection: IndexSelection | None = None  # the indexer that chooses the keys (sparse attention)
    relative: RelativeBias | None = None  # a relative bias each query brings (Inkling's)
    query_sinks: torch.fx.Node | None = None  # sink logits each query brings [B, H, T(, 1)] (Inkling 2's)

    @property
    def where(self) -> str:
        return f"layer {self.layer} ({self.module_path})"


@dataclass
class _Found:
    """An attention call before it is described: the node its cell replaces, what it adds to its scores
    (to read on the probe), its sink logits' node and, for eager attention, the matched chain."""

    node: torch.fx.Node
    terms: list[MaskTerm]
    sinks: MaskTerm | None = None
    eager: EagerAttention | None = None


def find_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    found = [_Found(n, _sdpa_terms(n)) for n in gm.graph.nodes if n.op == "call_function" and n.target == SDPA]
    found += [_Found(e.output, e.terms, e.sinks, e) for e in eager_attention(gm, lambda n: _where(n, len(found)))]
    if not found:
        if any(n.op == "call_function" and n.target in OWN_LAYER_OPS for n in gm.graph.nodes):
            raise UnsupportedModelError(
                "no attention found: the model mixes tokens only in recurrent layers of its own (as Mamba "
                "does), which need no conversion; rnnify converts a model's attention"
            )
        raise UnsupportedModelError(
            "no attention found: the graph has no scaled_dot_product_attention call and no softmax of "
            "q @ k^T multiplied into values; rnnify converts attention-based causal LMs"
        )
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    found.sort(key=lambda f: order[f.node])
    described = [_describe(f.node, index, ctx.config, f.eager) for index, f in enumerate(found)]
    for f, site in zip(found, described):
        for allowed in buffered_masks(gm, f.terms):
            site.window = _window_of_buffer(site, allowed)
        terms = [t.value for t in f.terms]
        site.selection = find_selection(f.node, terms, {site.query, site.key, site.value}, site.where)
        site.relative = find_relative_bias(gm, terms, site.num_heads, site.where)
    check_indexers_read(gm, [site.selection for site in described if site.selection is not None])
    bounds = [s.chunk or s.window for s in described]  # a site has one or neither
    length = max([_PROBE_LENGTH] + [b + 1 for b in bounds if b is not None and b <= _MAX_PROBE_LENGTH])
    for site in described:  # the probe must see every key kept, the causal mask the selection narrows
        if site.selection is not None and site.selection.topk < length:
            raise UnsupportedModelError(
                f"{site.where}: its indexer keeps {site.selection.topk} keys a query, fewer than the "
                f"{length} tokens rnnify reads the model's masks on"
            )
    watched = {t.value for f in found for t in [*f.terms, *([f.sinks] if f.sinks else [])]}
    values = _probe(gm, watched.union(*(s.relative.nodes for s in described if s.relative is not None)), length)
    for f, site in zip(found, described):
        allowed, bias = _read_terms(site, f.terms, values, length)
        if site.relative is not None:  # what is left must be ALiBi's, or nothing
            bias = bias - torch.where(allowed, site.relative.bias(values), 0.0)
        if f.eager is None and _sdpa_arguments(f.node).get("is_causal"):
            allowed &= torch.ones(allowed.shape, dtype=torch.bool).tril()
        if site.chunk is not None and not torch.equal(allowed, _chunked(length, site.chunk)):
            site.chunk = None  # the graph is the truth: it does not apply its config's chunks
        if site.chunk is None:  # else: its config's chunks (a probe within one chunk shows plain causal)
            site.window = _check_causal(site, allowed)
        elif site.window is not None:
            raise UnsupportedModelError(f"{site.where}: a sliding window and chunked attention at once")
        site.alibi_slopes = _alibi_slopes(site, bias, allowed)
        if f.sinks is not None:
            site.sink_logits = _sink_logits(site, f.sinks, values[f.sinks.value], length)
            site.query_sinks = f.sinks.value if site.sink_logits is None else None
        f.node.meta[SITE_KEY] = site
    return gm


def sites(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, AttentionSite]]:
    """The annotated attention nodes in graph order."""
    return [(n, n.meta[SITE_KEY]) for n in gm.graph.nodes if SITE_KEY in n.meta]


def _sdpa_arguments(node: torch.fx.Node) -> dict:
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs)


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "?"
    path = list(stack.values())[-1][0]
    return re.sub(r"^(L__self__\.)?model\.", "", path)


def _layer_index(path: str, fallback: int) -> int:
    numbers = [int(p) for p in path.split(".") if p.isdigit()]
    return numbers[0] if numbers else fallback


# ``layer_types`` entries of layers over the config's ``sliding_window`` (``hybrid_sliding``: the
# sliding layers of hybrids that compute more than attention in them, as ZAYA's)
_SLIDING_LAYER_TYPES = ("sliding_attention", "hybrid_sliding")


def _config_window(config, layer: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer < len(layer_types):
        return int(window) if layer_types[layer] in _SLIDING_LAYER_TYPES else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def config_chunk(config, layer: int) -> int | None:
    """The chunk of a layer the config gives chunked attention (Llama 4's ``attention_chunk_size`` on
    the layers its ``layer_types`` names ``chunked_attention``)."""
    chunk, layer_types = getattr(config, "attention_chunk_size", None), getattr(config, "layer_types", None)
    if not chunk or layer_types is None or layer >= len(layer_types):
        return None
    return int(chunk) if layer_types[layer] == "chunked_attention" else None


def _chunked(length: int, chunk: int) -> torch.Tensor:
    """``[T, T]``: causal attention within chunks of ``chunk`` tokens."""
    position = torch.arange(length)
    same = position[:, None] // chunk == position[None, :] // chunk
    return same & torch.ones(length, length, dtype=torch.bool).tril()


_SAME_DTYPE_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default}


def _keeps_dtype(node: torch.fx.Node) -> bool:
    source = node.args[0]
    return isinstance(source, torch.fx.Node) and source.meta["val"].dtype == node.meta["val"].dtype


def _shape(node: torch.fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _is_full_slice(node: torch.fx.Node) -> bool:
    if node.target != torch.ops.aten.slice.Tensor:
        return False
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (0, None) and (end is None or end >= 2**62) and step == 1


def _before_repeat_kv(node: torch.fx.Node) -> torch.fx.Node:
    """Undo ``x[:, :, None].expand(B, Hkv, g, T, d).reshape(B, Hkv*g, T, d)`` if present, and a cast
    after it that keeps the dtype (Flint's ``key_states.float()`` in a float32 model)."""
    repeated = node
    while repeated.op == "call_function" and repeated.target in _SAME_DTYPE_CASTS and _keeps_dtype(repeated):
        repeated = repeated.args[0]
    if repeated.op != "call_function" or repeated.target not in _RESHAPES:
        return node
    expand = repeated.args[0]
    while isinstance(expand, torch.fx.Node) and _is_full_slice(expand):
        expand = expand.args[0]
    if not (isinstance(expand, torch.fx.Node) and expand.target == torch.ops.aten.expand.default):
        return node
    unsqueeze = expand.args[0]
    while isinstance(unsqueeze, torch.fx.Node) and _is_full_slice(unsqueeze):
        unsqueeze = unsqueeze.args[0]
    if not (isinstance(unsqueeze, torch.fx.Node) and unsqueeze.target == torch.ops.aten.unsqueeze.default):
        return node
    if unsqueeze.args[1] != 2:
        return node
    source = unsqueeze.args[0]
    while isinstance(source, torch.fx.Node) and _is_full_slice(source):
        source = source.args[0]
    return source


def _where(node: torch.fx.Node, index: int) -> str:
    path = _module_path(node)
    return f"layer {_layer_index(path, index)} ({path})"


def _sdpa_terms(node: torch.fx.Node) -> list[MaskTerm]:
    """What an SDPA call adds to its scores: its ``attn_mask`` (boolean: the keys allowed; float: added)."""
    mask = _sdpa_arguments(node).get("attn_mask")
    return [MaskTerm("sdpa", mask, node)] if isinstance(mask, torch.fx.Node) else []


def _describe(node: torch.fx.Node, index: int, config, eager: EagerAttention | None) -> AttentionSite:
    if eager is None:
        args = _sdpa_arguments(node)
        query, key, value = args["query"], args["key"], args["value"]
        scale, softcap, gqa = args.get("scale"), None, "enable_gqa" if args.get("enable_gqa") else "none"
        mask = args.get("attn_mask")
        mask_source = (
            mask.name if isinstance(mask, torch.fx.Node) else ("is_causal" if args.get("is_causal") else "none")
        )
    else:
        query, key, value, scale, softcap, gqa = eager.query, eager.key, eager.value, eager.scale, eager.softcap, "none"
        mask_source = eager.terms[-1].value.name if eager.terms else "none"
    path = _module_path(node)
    layer = _layer_index(path, index)
    where = f"layer {layer} ({path})"
    q_shape, k_shape = _shape(query), _shape(key)
    if str(q_shape[2]) != str(k_shape[2]):
        raise UnsupportedModelError(
            f"{where}: cross-attention (queries and keys come from sequences of different length); "
            "only causal self-attention has a recurrent form"
        )
    key_source, value_source = _before_repeat_kv(key), _before_repeat_kv(value)
    if key_source is not key and value_source is not value:
        key, value, gqa = key_source, value_source, "repeat_kv"
    num_heads, head_dim = int(q_shape[1]), int(q_shape[3])
    num_kv_heads, value_dim = int(_shape(key)[1]), int(_shape(value)[3])
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"{where}: {num_heads} query heads do not group over {num_kv_heads} kv heads")
    return AttentionSite(
        index=index,
        layer=layer,
        module_path=path,
        query=query,
        key=key,
        value=value,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        value_dim=value_dim,
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
        gqa=gqa,
        mask_source=mask_source,
        window=_config_window(config, layer),
        chunk=config_chunk(config, layer),
        hidden=_layer_input(value),
        softcap=softcap,
        flat_output=eager is not None and eager.flat,
    )


_PROJECTIONS = {torch.ops.aten.linear.default: 0, torch.ops.aten.addmm.default: 1, torch.ops.aten.mm.default: 0}


def _layer_input(value: torch.fx.Node) -> torch.fx.Node | None:
    """The activation the value projection reads (breadth-first back from v), as [B, T, C]."""
    frontier, seen = [value], set()
    while frontier:
        node = frontier.pop(0)
        if not isinstance(node, torch.fx.Node) or node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target in _PROJECTIONS:
            x = node.args[_PROJECTIONS[node.target]]
            while x.op == "call_function" and x.target in _RESHAPES and len(_shape(x)) != 3:
                x = x.args[0]
            return x if len(_shape(x)) == 3 else None
        frontier.extend(a for a in node.all_input_nodes)
    return None


class _Recorder(torch.fx.Interpreter):
    """Runs the graph and keeps the value of every watched node (on the CPU)."""

    def __init__(self, gm: torch.fx.GraphModule, watched: set[torch.fx.Node]):
        super().__init__(gm)
        self.watched = watched
        self.values: dict[torch.fx.Node, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node):
        result = super().run_node(n)
        if n in self.watched:
            self.values[n] = result.detach().cpu().clone()
        return result


def _probe(gm: torch.fx.GraphModule, watched: set[torch.fx.Node], length: int) -> dict[torch.fx.Node, torch.Tensor]:
    """The values of ``watched`` nodes on one row of ``length`` tokens at positions 0..length-1."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example = placeholders[0].meta.get("val")
    device = example.device if example is not None else torch.device("cpu")
    input_ids = torch.zeros(1, length, dtype=torch.long, device=device)
    position_ids = torch.arange(length, device=device)[None]
    recorder = _Recorder(gm, watched)
    with torch.no_grad():
        recorder.run(input_ids, position_ids)
    return recorder.values


def _per_head(value: torch.Tensor, term: MaskTerm, heads: int, length: int) -> torch.Tensor:
    """``value`` as the scores of the probe's one row see it, ``[heads, T, T]``: added to ``[B H, T, T]``
    scores (Bloom's baddbmm) or to ``[B, H, T, T]`` ones (B = 1)."""
    if len(_shape(term.at)) == 3:
        return torch.broadcast_to(value, (heads, length, length))
    return torch.broadcast_to(value, (1, heads, length, length))[0]


def _read_terms(
    site: AttentionSite, terms: list[MaskTerm], values: dict[torch.fx.Node, torch.Tensor], length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``terms`` add to the scores of the probe's ``length`` tokens: ``(allowed [T, T], bias [heads,
    T, T] float64, 0 where not allowed)``. Which keys are allowed must not differ between heads."""
    allowed = torch.ones(site.num_heads, length, length, dtype=torch.bool)
    bias = torch.zeros(site.num_heads, length, length, dtype=torch.float64)
    later = torch.zeros_like(bias)  # what the terms after the one read add to the scores, -inf where masked
    for term in reversed(terms):
        value = values[term.value]
        full = _per_head(value, term, site.num_heads, length)
        if term.kind == "multiply":
            if not ((full == 0) | (full == 1)).all():
                raise UnsupportedModelError(f"{site.where}: the attention multiplies its scores by a factor not 0 or 1")
            if not (later[full == 0] <= MASK_FILL).all():
                raise UnsupportedModelError(
                    f"{site.where}: the attention multiplies scores by 0 without masking them (a 0 is attended)"
                )
            masked = full == 0
        elif term.kind == "fill":
            masked = full.bool()
        elif term.kind == "keep" or value.dtype == torch.bool:  # True where a key may be attended
            masked = ~full.bool()
        else:
            added = full.double() * term.factor
            masked = added <= torch.finfo(value.dtype).min / 2  # -inf, or the dtype's lowest
            bias += torch.where(masked, 0.0, added)
            later += torch.where(masked, 0.0, added)
        allowed &= ~masked
        later.masked_fill_(masked, -math.inf)
    if not (allowed == allowed[:1]).all():
        raise UnsupportedModelError(f"{site.where}: the attention mask differs between heads")
    return allowed[0].clone(), torch.where(allowed, bias, 0.0)


def _alibi_slopes(site: AttentionSite, bias: torch.Tensor, allowed: torch.Tensor) -> tuple[float, ...] | None:
    """Per head, the slope of ``bias`` = slope_h (j - i) + c_i over the allowed (i, j); None where the
    bias is constant along every row (softmax does not see it). Any other bias is refused.

    The slope is read from two neighbouring keys where the bias is smallest (its products of slope and
    position there are exact, so the slope is the model's own), then checked on every allowed entry."""
    rows = allowed.sum(-1)
    if rows.max() < 2:
        return None  # every query reads one key: no bias changes a weight
    i = int(rows.argmax())
    keys = allowed[i].nonzero().flatten().tolist()
    distance = (torch.arange(bias.shape[-1])[None, :] - torch.arange(bias.shape[-2])[:, None]).double()

    def without_row_constants(x: torch.Tensor) -> torch.Tensor:
        return torch.where(allowed, x - x.sum(-1, keepdim=True) / rows.clamp_min(1)[:, None], 0.0)

    slopes = []
    for b in bias:
        j0 = min(keys, key=lambda j: abs(float(b[i, j])))
        j1 = min((j for j in keys if j != j0), key=lambda j: abs(j - j0))
        slope = float(b[i, j1] - b[i, j0]) / (j1 - j0)
        rest = without_row_constants(torch.where(allowed, b - slope * distance, 0.0))
        spread = without_row_constants(b)  # what softmax sees of the bias
        if float(rest.abs().max()) > _ALIBI_TOLERANCE * float(spread.abs().max()) + 1e-6:
            raise UnsupportedModelError(
                f"{site.where}: the attention adds a position bias that is not ALiBi's (a slope per head "
                "times the distance j - i); rnnify carries ALiBi biases only, and never drops one"
            )
        slopes.append(slope)
    return None if not any(slopes) else tuple(slopes)


def _sink_logits(site: AttentionSite, sinks: MaskTerm, value: torch.Tensor, length: int) -> tuple[float, ...] | None:
    """The sink logit per head from the probe's value, as the scores' ``[B, H, T, 1]`` column or per
    ``[B, H, T]`` row (``sinks.at``'s rank); None where each query brings its own (the sinks' node
    is laid out one a query and head, and changes with the token): the cell then takes that node."""
    rank = len(_shape(sinks.at))
    shape = (1, site.num_heads, length, 1)[:rank]
    column = torch.broadcast_to(value, shape).reshape(site.num_heads, length)
    if (column == column[:, :1]).all() and not _reads_tokens(sinks.value):
        return tuple(column[:, 0].double().tolist())
    batch, heads, tokens = (str(size) for size in _shape(site.query)[:3])
    if [str(size) for size in _shape(sinks.value)] == [batch, heads, tokens, "1"][:rank]:
        return None
    raise UnsupportedModelError(
        f"{site.where}: the attention's sink logits depend on the tokens, laid out otherwise than one a query and head"
    )


def _reads_tokens(node: torch.fx.Node) -> bool:
    """Whether ``node``'s values depend on the tokens (``input_ids``), not only on their count: the
    probe's row repeats one token, on which a first layer's per-token values look constant."""
    input_ids = next(n for n in node.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    return reads(node, input_ids)


def _window_of_buffer(site: AttentionSite, allowed: torch.Tensor) -> int | None:
    """The site's window once a mask from a buffer, ``allowed`` at every length up to the buffer's, is
    applied. Keys after the query are the other terms' to mask (GPT-Neo adds its causal mask too;
    the probe checks what they all allow); of the causal past, the buffer must allow the latest keys,
    a window (GPT-Neo's local layers, wider than the probe), which is the site's, or the config's
    where that is narrower."""
    allowed = allowed & torch.ones(allowed.shape, dtype=torch.bool).tril()
    keys = int(allowed.sum(-1).max())
    _check_causal(replace(site, window=keys or None), allowed)
    if keys >= allowed.shape[-1]:
        return site.window
    return keys if site.window is None else min(keys, site.window)


def _check_causal(site: AttentionSite, allowed: torch.Tensor) -> int | None:
    """Raise unless the probed mask is causal; return the sliding window the graph really applies.

    A config window shorter than the probe must show in the mask: if the graph attends to the
    full causal past anyway, the graph is the truth and the site gets no window.
    """
    t = allowed.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    if torch.equal(allowed, causal):
        return site.window if site.window is not None and site.window >= t else None
    offsets = torch.arange(t)[:, None] - torch.arange(t)[None, :]
    if site.window is not None and torch.equal(allowed, causal & (offsets < site.window)):
        return site.window
    if (allowed & ~causal).any():
        raise UnsupportedModelError(
            f"{site.where}: attention is not causal (tokens attend to later tokens); only causal "
            "self-attention has a recurrent form"
        )
    raise UnsupportedModelError(
        f"{site.where}: unsupported attention mask pattern (neither causal nor a sliding window given by the config)"
    )
