"""Find every attention site and decide what it is, before anything is rewritten.

Each ``aten.scaled_dot_product_attention`` node gets an ``AttentionSite`` in
``node.meta["rnnify_site"]``: its layer, the q/k/v nodes (k/v taken from before a materialised
``repeat_kv`` so recurrent state stays per kv head), heads, scale, and where causality comes from.
Causality is not guessed from flags alone: the graph is run once on a short probe and the mask
each site actually receives is inspected. Sites that cannot become recurrent are rejected with
an error naming the layer and the reason.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from rnnify.compiler.passes.context import PassContext
from rnnify.errors import UnsupportedModelError

SDPA = torch.ops.aten.scaled_dot_product_attention.default
SITE_KEY = "rnnify_site"
_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
_PROBE_LENGTH = 8  # tokens in the probe run; longer when needed to see a small sliding window
_MAX_PROBE_LENGTH = 64


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

    @property
    def where(self) -> str:
        return f"layer {self.layer} ({self.module_path})"


def find_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == SDPA]
    if not nodes:
        raise UnsupportedModelError(
            "no attention found: the graph has no scaled_dot_product_attention call; rnnify converts "
            "models whose attention runs through SDPA (load them with attn_implementation='sdpa')"
        )
    described = [_describe(node, index, ctx.config) for index, node in enumerate(nodes)]
    windows = [s.window for s in described if s.window is not None and s.window <= _MAX_PROBE_LENGTH]
    masks = _probe_masks(gm, nodes, max([_PROBE_LENGTH] + [w + 1 for w in windows]))
    for node, site in zip(nodes, described):
        site.window = _check_causal(site, masks[node.name])
        node.meta[SITE_KEY] = site
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


def _config_window(config, layer: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer < len(layer_types):
        return int(window) if layer_types[layer] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


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
    """Undo ``x[:, :, None].expand(B, Hkv, g, T, d).reshape(B, Hkv*g, T, d)`` if present."""
    if node.op != "call_function" or node.target not in _RESHAPES:
        return node
    expand = node.args[0]
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


def _describe(node: torch.fx.Node, index: int, config) -> AttentionSite:
    args = _sdpa_arguments(node)
    query, key, value = args["query"], args["key"], args["value"]
    path = _module_path(node)
    layer = _layer_index(path, index)
    where = f"layer {layer} ({path})"
    q_shape, k_shape = _shape(query), _shape(key)
    if str(q_shape[2]) != str(k_shape[2]):
        raise UnsupportedModelError(
            f"{where}: cross-attention (queries and keys come from sequences of different length); "
            "only causal self-attention has a recurrent form"
        )
    gqa = "enable_gqa" if args.get("enable_gqa") else "none"
    key_source, value_source = _before_repeat_kv(key), _before_repeat_kv(value)
    if key_source is not key and value_source is not value:
        key, value, gqa = key_source, value_source, "repeat_kv"
    num_heads, head_dim = int(q_shape[1]), int(q_shape[3])
    num_kv_heads, value_dim = int(_shape(key)[1]), int(_shape(value)[3])
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"{where}: {num_heads} query heads do not group over {num_kv_heads} kv heads")
    scale = args.get("scale")
    mask = args.get("attn_mask")
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
        mask_source=mask.name
        if isinstance(mask, torch.fx.Node)
        else ("is_causal" if args.get("is_causal") else "none"),
        window=_config_window(config, layer),
        hidden=_layer_input(value),
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


class _MaskRecorder(torch.fx.Interpreter):
    """Runs the graph and keeps, per SDPA node, which (query, key) pairs may attend."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]):
        super().__init__(gm)
        self.watch = {n.name for n in nodes}
        self.allowed: dict[str, torch.Tensor] = {}

    def run_node(self, n: torch.fx.Node):
        result = super().run_node(n)
        if n.name in self.watch:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            normalized = normalize_function(n.target, args, kwargs, normalize_to_only_use_kwargs=True).kwargs
            q, k, mask = normalized["query"], normalized["key"], normalized.get("attn_mask")
            t, s = q.shape[-2], k.shape[-2]
            allowed = torch.ones(t, s, dtype=torch.bool)
            if mask is not None:
                mask = mask.detach().cpu()
                mask = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
                allowed = mask.expand(*mask.shape[:-2], t, s).reshape(-1, t, s)[0].clone()
            if normalized.get("is_causal"):
                allowed &= torch.ones(t, s, dtype=torch.bool).tril()
            self.allowed[n.name] = allowed
        return result


def _probe_masks(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], length: int) -> dict[str, torch.Tensor]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example = placeholders[0].meta.get("val")
    device = example.device if example is not None else torch.device("cpu")
    input_ids = torch.zeros(1, length, dtype=torch.long, device=device)
    position_ids = torch.arange(length, device=device)[None]
    recorder = _MaskRecorder(gm, nodes)
    with torch.no_grad():
        recorder.run(input_ids, position_ids)
    return recorder.allowed


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
