"""Find the indexer that chooses which keys an attention site reads (DeepSeek-V3.2's sparse attention).

DeepSeek-V3.2 and its kin (GLM-MoE-DSA, Mistral Large 4, HY-V4, AXK2, dots3) give an attention
layer an ``...Indexer``: a small scorer that ranks every earlier key for each query and returns the
top ``index_topk``, which the layer scatters into its attention mask. Up to that many keys the
selection keeps them all, so a probe and a short check see plain causal attention; past it, each
query reads only its selection. The captured graph shows the indexer whole, and this pass reads it
from the graph, not from the model's code: each site's mask terms are followed back to the
``aten.topk`` they come from, and that top-k's input must be the indexer's scores (docs/math.md
§Indexer selection),

    topk(mask(squeeze(unsqueeze(w, -2) @ relu((q @ k^T) [* c]), -2)), min(T, index_topk))

with q ``[B, T, Hi, d]`` the index queries, k ``[B, T, d]`` one index key a token and w ``[B, T, Hi]``
the head weights: the nodes the site's cell then takes, to rank its own cache of index keys. A
layer that reuses an earlier layer's selection (GLM-MoE-DSA's "shared" layers) finds that layer's
top-k, and its cell keeps its own copy of those index keys. An indexer that no site's selection
accounts for (another scoring rule, one that gathers keys rather than masking them) is refused by
name, never dropped: a conversion without it would be exact on short inputs and wrong on long ones.

Indexers that rank pools of keys (Qwen4-Exp's QSA, GLM-5-Next's) are one op each in the captured
graph (``rnnify.compiler.block_selection``); its result reaches the mask as the keys kept (``mask &
selected``, ``masked_fill(mask, ~selected, ...)``, or SDPA's mask itself), and the op's arguments
are the cell's.
"""

from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx

from rnnify.compiler.block_selection import BLOCK_SELECT, POOL_SELECT
from rnnify.errors import UnsupportedModelError

aten = torch.ops.aten
# ops that leave a value as it is for the ranking: layout, and casts that lose nothing (``_through``)
_PASS_THROUGH = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default}
_CASTS = {aten.to.dtype, aten._to_copy.default}
# ops the source's selection mask passes through on its way to the attention's mask (same values)
_BROADCASTS = {aten.unsqueeze.default, aten.expand.default, aten.view.default, *_PASS_THROUGH}
# ops that carry a boolean mask's values as they are (no cast: a mask cast to floats is a bias)
_BOOL_LAYOUT = {
    aten.unsqueeze.default,
    aten.expand.default,
    aten.view.default,
    aten.clone.default,
    aten.contiguous.default,
}
_LOWEST_FILL = -1e4  # a float mask's "not read": this or lower (the dtype's lowest, -inf)
_LOGICAL_AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
_MASKED_FILL = {aten.masked_fill.Scalar, aten.masked_fill.Tensor}
# ops that read a tensor's metadata (shape, dtype, device), not its values
_METADATA = {
    aten._assert_tensor_metadata.default, aten.new_ones.default, aten.new_zeros.default,
    aten.new_empty.default, aten.sym_size.int,
}  # fmt: skip
_SHAPE_ONLY = {
    *_METADATA, aten.new_full.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.empty_like.default,
}  # fmt: skip


@dataclass
class IndexSelection:
    """The indexer of one attention site: the nodes its cell takes and the constants of its scores."""

    query: torch.fx.Node  # index queries [B, T, Hi, d]
    key: torch.fx.Node  # index keys [B, T, d], one per token (a pooling indexer's: CellSpec.index_pool)
    weights: torch.fx.Node | None  # head weights [B, T, Hi] (None: QSA has none)
    topk: int  # keys a query reads (a pooling indexer: its budget, index_topk)
    scale: float | None  # c inside the relu (1.0 where the source folds it into the weights; None: QSA)
    indexer: str  # the indexer module's path
    block: int | None = None  # keys a pool, where the indexer ranks pools (CellSpec.index_block)
    pool: str | None = None  # how a pool's key is made (CellSpec.index_pool)
    eps: float | None = None  # QSA's pool-key norm eps
    pool_weight: torch.fx.Node | None = None  # QSA's pool-key norm weight [d], GLM-5-Next's slot logits [r, d]


def find_selection(
    site: torch.fx.Node, terms: list[torch.fx.Node], stop: set[torch.fx.Node], where: str
) -> IndexSelection | None:
    """The indexer behind the mask nodes ``terms`` of the attention node ``site``, or None if no
    top-k shapes them. ``stop``: the site's q, k and v, whose history is the layer's input, not its
    mask's."""
    found = _topks_behind(terms, stop, _layer_path(site))
    if not found:
        return None
    if len(found) > 1:
        raise UnsupportedModelError(f"{where}: its mask is shaped by {len(found)} top-k selections; one is understood")
    (topk,) = found
    name = _indexer_path(topk) or topk.name
    if topk.target in (BLOCK_SELECT, POOL_SELECT):
        if not _kept_where_selected(topk):
            raise UnsupportedModelError(
                f"{where}: sparse attention ({_clean(name)}): its mask uses the pool selection otherwise than by "
                "keeping the selected keys alone, which no rnnify cell computes"
            )
        path = _indexer_path(topk) or ""
        if topk.target == BLOCK_SELECT:
            query, keys, _, norm, eps, ratio, budget = topk.args
            return IndexSelection(query, keys, None, budget, None, path, ratio, "mean", eps, norm)
        query, keys, weights, _, ape, scale, budget, pool = topk.args
        return IndexSelection(query, keys, weights, budget, scale, path, pool, "gated", None, ape)
    if not _only_selected_kept(topk):
        raise UnsupportedModelError(
            f"{where}: sparse attention ({_clean(name)}): its mask uses a top-k otherwise than by keeping the "
            "selected keys alone, which no rnnify cell computes"
        )
    selection = _read_indexer(topk)
    if selection is None:
        raise UnsupportedModelError(
            f"{where}: sparse attention ({_clean(name)}): its mask keeps the top-k keys of a score that is not "
            "an indexer's sum_h w_h relu(c q_h . k), which no rnnify cell computes"
        )
    return selection


def check_indexers_read(gm: torch.fx.GraphModule, selections: list[IndexSelection]) -> None:
    """Refuse a graph holding an indexer module that no site's selection accounts for (module docstring)."""
    read = {s.indexer for s in selections}
    for node in gm.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            if _is_indexer(_type_name(kind)) and _inside_attention(path) and path not in read:
                raise UnsupportedModelError(
                    f"sparse attention ({_clean(path)}, {_type_name(kind)}): its indexer selects the keys each "
                    "query reads in a way no rnnify cell computes"
                )


def indexer_modules(model: torch.nn.Module) -> list[str]:
    """The paths of ``model``'s attention indexers (``model.layers.0.self_attn.indexer``)."""
    return [
        name for name, module in model.named_modules() if _is_indexer(type(module).__name__) and _inside_attention(name)
    ]


def _topks_behind(terms: list[torch.fx.Node], stop: set[torch.fx.Node], layer: str | None) -> list[torch.fx.Node]:
    """The ``aten.topk`` nodes (and pooling indexers' ops) the mask nodes depend on, the walk ending at each top-k, at ``stop``,
    at values that are not tensors (sizes), at ops that read only a shape and at floating-point
    values computed in another decoder layer than the site's (``layer``, its module path): a
    selection reaches a mask as integers and booleans from any layer (a shared layer's from the one
    it shares), through float masks of its own layer or the model's; an activation from an earlier
    layer leads to that layer's top-k, an expert router's among them (a position bias made from
    the queries, say)."""
    seen, found, todo = set(stop), [], list(terms)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and node.target in (aten.topk.default, BLOCK_SELECT, POOL_SELECT):
            found.append(node)
            continue
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            todo.append(node.args[0])  # a tuple's element (the top-k's indices)
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or (node.op == "call_function" and node.target in _SHAPE_ONLY):
            continue
        if value.is_floating_point() and _in_other_layer(node, layer):
            continue
        todo.extend(n for n in node.all_input_nodes if n not in seen)
    return found


def _layer_path(node: torch.fx.Node) -> str | None:
    """The module path of the decoder layer ``node`` ran in: the innermost path of its module stack
    that ends in an index (``model.layers.3``); None outside any."""
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        if re.search(r"\.\d+$", path):
            return path
    return None


def _in_other_layer(node: torch.fx.Node, layer: str | None) -> bool:
    """Whether ``node`` ran in a decoder layer beside ``layer`` (the same container, another index)."""
    if layer is None:
        return False
    container = layer.rsplit(".", 1)[0]
    return any(
        path != layer and re.fullmatch(re.escape(container) + r"\.\d+", path)
        for path, _ in (node.meta.get("nn_module_stack") or {}).values()
    )


def _only_selected_kept(topk: torch.fx.Node) -> bool:
    """Whether the top-k reaches the mask as the source's selection: its values unused, its indices
    scattered as False into ones (True: not selected), which then masks the scores
    (``mask & ~unselected`` or ``masked_fill(scores, unselected, ...)``)."""
    items = {user.args[1]: user for user in topk.users if user.target is operator.getitem}
    used = {index for index, item in items.items() if item.users}
    if len(items) != len(topk.users) or used != {1}:
        return False
    scatters = _reached(items[1], _PASS_THROUGH)
    return bool(scatters) and all(_unselected_mask(value, user) for value, user in scatters)


def _kept_where_selected(selected: torch.fx.Node) -> bool:
    """Whether the pool selection (True: read) reaches the attention only as a boolean mask of the keys
    read: through layout ops, and-ed with other masks, as SDPA's mask itself, or negated into a
    ``masked_fill``'s mask that fills the keys not read with the lowest value (a float mask)."""
    users = [user for user in selected.users if not (user.op == "call_function" and user.target in _METADATA)]
    for user in users:
        if user.op != "call_function":
            return False
        if (user.target in _BOOL_LAYOUT and user.args[0] is selected) or user.target in _LOGICAL_AND:
            if not _kept_where_selected(user):
                return False
        elif user.target == aten.scaled_dot_product_attention.default:
            if selected is not (user.args[3] if len(user.args) > 3 else user.kwargs.get("attn_mask")):
                return False
        elif user.target != aten.bitwise_not.default or not _fills_unread(user):
            return False
    return bool(users)


def _fills_unread(unread: torch.fx.Node) -> bool:
    """Whether ``unread`` (True: not read) only chooses where a ``masked_fill`` writes the lowest value."""
    reached = _reached(unread, _BOOL_LAYOUT)
    for value, user in reached:
        fill = user.args[2] if len(user.args) > 2 else None
        if user.target not in _MASKED_FILL or user.args[1] is not value or user.args[0] is value:
            return False
        if not (isinstance(fill, (int, float)) and fill <= _LOWEST_FILL):
            return False
    return bool(reached)


def _unselected_mask(indices: torch.fx.Node, scatter: torch.fx.Node) -> bool:
    """Whether ``scatter`` writes False at ``indices`` into ones along the last dim, and what it
    gives only masks (module docstring of ``_only_selected_kept``)."""
    if scatter.target != aten.scatter.value or scatter.args[2] is not indices or scatter.args[3] not in (False, 0):
        return False
    if _call(scatter.args[0], aten.new_ones.default) is None or scatter.args[1] not in (-1, _rank(scatter) - 1):
        return False
    for value, user in _reached(scatter, _BROADCASTS):
        if user.target in _MASKED_FILL:
            if len(user.args) < 2 or user.args[1] is not value or user.args[0] is value:
                return False
        elif user.target == aten.bitwise_not.default:
            if not all(use.target in _LOGICAL_AND for _, use in _reached(user, _BROADCASTS)):
                return False
        else:
            return False
    return True


def _reached(node: torch.fx.Node, through: set) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(value, user)``: the ops that read ``node``'s values, past the ops in ``through``."""
    out = []
    for user in node.users:
        if user.op == "call_function" and user.target in _METADATA:
            continue
        if user.op == "call_function" and user.target in through and user.args[0] is node:
            out += _reached(user, through)
        else:
            out.append((node, user))
    return out


def _read_indexer(topk: torch.fx.Node) -> IndexSelection | None:
    """The indexer's nodes and constants from the top-k over its scores (module docstring); None when
    the scores have another form."""
    scores, k, *options = topk.args
    limit = _topk_limit(k)
    dim = options[0] if options else topk.kwargs.get("dim", -1)
    largest = options[1] if len(options) > 1 else topk.kwargs.get("largest", True)
    if limit is None or dim not in (-1, _rank(scores) - 1) or largest is not True:
        return None
    scores = _unmasked(scores)
    squeezed = _call(scores, aten.squeeze.dim)
    product = _call(squeezed.args[0], aten.matmul.default) if squeezed else None
    if product is None:
        return None
    weights, relu = _call(product.args[0], aten.unsqueeze.default), _call(product.args[1], aten.relu.default)
    if weights is None or relu is None:
        return None
    scale, dots = 1.0, relu.args[0]
    scaled = _call(dots, aten.mul.Tensor)
    if scaled is not None and isinstance(scaled.args[1], (int, float)) and scaled.args[1] > 0:
        scale, dots = float(scaled.args[1]), scaled.args[0]
    dots = _call(dots, aten.matmul.default)
    if dots is None:
        return None
    query, keys_t = _through(dots.args[0]), _call(_through(dots.args[1]), aten.unsqueeze.default)
    transposed = _call(_through(keys_t.args[0]), aten.transpose.int) if keys_t is not None else None
    if transposed is None:
        return None
    key, weights = _through(transposed.args[0]), weights.args[0]
    if not _shapes_fit(query, key, weights):
        return None
    return IndexSelection(query, key, weights, limit, scale, _indexer_path(topk) or "")


def _topk_limit(k) -> int | None:
    """``index_topk`` from the top-k's k: ``min(T, index_topk)`` (a constant, or ``sym_min`` of the length and it)."""
    if isinstance(k, int):
        return k
    if isinstance(k, torch.fx.Node) and getattr(k.target, "__name__", "") == "sym_min":
        constants = [a for a in k.args if isinstance(a, int)]
        return constants[0] if len(constants) == 1 else None
    return None


def _unmasked(node: torch.fx.Node) -> torch.fx.Node | None:
    """The scores before the mask the source applies (``masked_fill(~mask, -inf)`` or ``+ mask``, the
    mask computed without any of the model's weights: a learned bias is not a mask); None where
    something else is added."""
    if node.op != "call_function":
        return node
    if node.target in _MASKED_FILL:
        fill = node.args[2]
        return node.args[0] if isinstance(fill, float) and fill == float("-inf") and _weightless(node.args[1]) else None
    if node.target == aten.add.Tensor:
        return node.args[0] if _weightless(node.args[1]) else None
    return node


def _weightless(node) -> bool:
    """Whether ``node`` is computed without the model's parameters (a mask is made of positions and
    constants; a learned bias, or a mask gated by activations, is not). Ops that read only a shape
    are not followed."""
    module, seen, todo = None, set(), [node]
    while todo:
        current = todo.pop()
        if not isinstance(current, torch.fx.Node) or current in seen:
            continue
        seen.add(current)
        if current.op == "get_attr":
            module = module or current.graph.owning_module
            if isinstance(functools.reduce(getattr, current.target.split("."), module), torch.nn.Parameter):
                return False
        elif not (current.op == "call_function" and current.target in _SHAPE_ONLY):
            todo.extend(current.all_input_nodes)
    return True


def _call(node, target) -> torch.fx.Node | None:
    return node if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target else None


def _through(node):
    """``node`` before the copies and widening casts that leave its values as they are (a cast to a
    narrower dtype rounds: the ranking must see it, so the walk stops there)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _PASS_THROUGH:
        if node.target in _CASTS and not _widens(node.args[0], node):
            break
        node = node.args[0]
    return node


def _widens(source, cast: torch.fx.Node) -> bool:
    before, after = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (source, cast))
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    return before.dtype == after.dtype or torch.promote_types(before.dtype, after.dtype) == after.dtype


def _rank(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    return value.dim() if isinstance(value, torch.Tensor) else -1


def _shapes_fit(query, key, weights) -> bool:
    """q ``[B, T, Hi, d]``, k ``[B, T, d]`` (one key a token: the same T) and w ``[B, T, Hi]``."""
    values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (query, key, weights)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return False
    q, k, w = values
    if (q.dim(), k.dim(), w.dim()) != (4, 3, 3):
        return False
    same = [(q.shape[1], k.shape[1]), (q.shape[1], w.shape[1]), (q.shape[2], w.shape[2]), (q.shape[3], k.shape[2])]
    return all(str(a) == str(b) for a, b in same)


def _indexer_path(node: torch.fx.Node) -> str | None:
    """The path of the innermost module named ``...Indexer`` that ``node`` ran in."""
    for path, kind in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        if _is_indexer(_type_name(kind)):
            return path
    return None


def _type_name(kind) -> str:
    """A module's class name as ``nn_module_stack`` records it (a class or its qualified name)."""
    name = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
    return name.rsplit(".", 1)[-1]


def _is_indexer(class_name: str) -> bool:
    return class_name.endswith("Indexer")


def _inside_attention(path: str) -> bool:
    """Whether the module path runs through an attention module (``model.layers.0.self_attn.indexer``)."""
    return any("attn" in part.lower() or "attention" in part.lower() for part in _clean(path).split(".")[:-1])


def _clean(path: str) -> str:
    return path.removeprefix("L__self__.").removeprefix("model.")
