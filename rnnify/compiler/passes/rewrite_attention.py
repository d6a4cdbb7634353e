"""Replace each attention site with a call to its recurrent cell.

The cell becomes a submodule ``cells.<i>`` of the graph module, so its parameters are in the state
dict. The call takes the site's q and its k/v from before any ``repeat_kv``; ``thread_state``
adds the mask and state arguments. The cell returns ``(out, *state)``; ``out`` replaces the SDPA
result (or eager attention's p @ v, flattened to ``[B H, T, d_v]`` where that was) for every user.
The site's score terms (softcap, ALiBi slopes, sink logits) and its indexer go into the cell's
``CellSpec``; a target that cannot compute them is refused, naming the layer. An indexer's q, k and
head weights are the call's ``index_q``, ``index_k`` and ``index_weights`` (a pooling indexer's
learned tensor its ``pool_weight``); what each query brings, a relative bias and sink logits, its
``relative`` and ``sinks``.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx

from rnnify.cells import CellSpec
from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.find_attention import SITE_KEY, sites
from rnnify.errors import RnnifyError, RnnifyWarning, UnsupportedModelError

CELL_KEY = "rnnify_cell"


def rewrite_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    text = ctx.config.get_text_config() if hasattr(ctx.config, "get_text_config") else ctx.config
    ctx.plan.check(
        {site.layer: site.num_kv_heads for _, site in sites(gm)},
        (site.layer for _, site in sites(gm) if site.chunk),
        getattr(text, "num_hidden_layers", None),
    )
    specs: dict[int, CellSpec] = {}  # by site index
    for node, site in sites(gm):
        spec = specs[site.index] = _cell_spec(site)
        name = f"cells.{site.index}"
        try:
            cell = ctx.plan.cell_for(site.layer, spec)
        except RnnifyError as exc:
            raise type(exc)(f"{site.where}: {exc}") from exc
        gm.add_submodule(name, cell)
        kwargs = {}
        if cell.needs_input:
            if site.hidden is None:
                raise UnsupportedModelError(f"{site.where}: target {cell.target!r} needs the layer input, not found")
            kwargs["x"] = site.hidden
        if site.selection is not None:
            selection = site.selection
            kwargs.update(index_q=selection.query, index_k=selection.key)
            if selection.weights is not None:
                kwargs["index_weights"] = selection.weights
            if selection.pool_weight is not None:
                kwargs["pool_weight"] = selection.pool_weight
        if site.relative is not None:
            kwargs["relative"] = site.relative.logits(gm, node)
        if site.query_sinks is not None:
            kwargs["sinks"] = site.query_sinks
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, (site.query, site.key, site.value), kwargs)
            out = gm.graph.call_function(operator.getitem, (call, 0))
            if site.flat_output:
                out = gm.graph.call_function(torch.ops.aten.flatten.using_ints, (out, 0, 1))
        call.meta[SITE_KEY] = site
        call.meta[CELL_KEY] = True
        out.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    _erase_unused_dropout(gm)
    _warn_unplanned(gm, ctx, specs)
    return gm


def _cell_spec(site) -> CellSpec:
    """The shape and score terms of ``site``'s attention, as its cell takes them."""
    hidden_size = int(site.hidden.meta["val"].shape[-1]) if site.hidden is not None else None
    return CellSpec(
        site.num_heads,
        site.num_kv_heads,
        site.head_dim,
        site.value_dim,
        site.scale,
        site.window,
        hidden_size,
        softcap=site.softcap,
        alibi_slopes=site.alibi_slopes,
        sink_logits=site.sink_logits,
        chunk=site.chunk,
        relative_extent=None if site.relative is None else site.relative.extent,
        query_sinks=site.query_sinks is not None or None,
        **_index_fields(site),
    )


def _index_fields(site) -> dict:
    """The spec's fields for ``site``'s indexer (none without one)."""
    selection = site.selection
    if selection is None:
        return {}
    index_dim = int(selection.key.meta["val"].shape[-1])
    fields = {"index_topk": selection.topk, "index_dim": index_dim, "index_scale": selection.scale}
    if selection.block is not None:
        fields.update(index_block=selection.block, index_pool=selection.pool, index_eps=selection.eps)
    return fields


def _warn_unplanned(gm: torch.fx.GraphModule, ctx: PassContext, specs: dict[int, CellSpec]) -> None:
    """One warning line per reason a layer does not get the target the plan names: its own chunks
    (kept exact), or its own sliding window, which the target would read past (``plan.within_own_window``)."""
    chunked, windowed = set(), {}
    for _, site in sites(gm):
        if site.chunk is not None and ctx.plan.rule_for(site.layer) is None and ctx.plan.default != "exact":
            chunked.add(site.layer)
        elif ctx.plan.keeps_own_window(site.layer, specs[site.index]):
            windowed[site.layer] = site.window
    if chunked:
        warnings.warn(
            f"{_layers(chunked)} attend{'s' * (len(chunked) == 1)} in chunks (the model's own chunked "
            "attention): kept exact, their state bounded by the chunk",
            RnnifyWarning,
            stacklevel=3,
        )
    if windowed:
        widths = ", ".join(f"{w}" for w in sorted(set(windowed.values())))
        warnings.warn(
            f"{_layers(windowed)} slide{'s' * (len(windowed) == 1)} over {'its' if len(windowed) == 1 else 'their'} "
            f"own window ({widths} tokens), which the target would read past: kept as that window, the original",
            RnnifyWarning,
            stacklevel=3,
        )


def _layers(layers) -> str:
    return f"layer{'s' * (len(layers) > 1)} {', '.join(map(str, sorted(layers)))}"


def _erase_unused_dropout(gm: torch.fx.GraphModule) -> None:
    """Erase the dropouts (identities: the model is in eval mode) that nothing reads any more, such as
    eager attention's on its probabilities: dead-code elimination keeps random ops, and through them
    the scores and the mask construction, which the cells replaced."""
    for node in reversed(list(gm.graph.nodes)):  # users first, so a dead chain goes in one pass
        if node.op == "call_function" and not node.users:
            if node.target == torch.ops.aten.dropout.default or not node.is_impure():
                gm.graph.erase_node(node)


def cell_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The cell call nodes in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_module" and n.meta.get(CELL_KEY)]
