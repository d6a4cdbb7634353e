"""Find a relative position bias that each query brings (Inkling's) in an attention site's mask.

Inkling's attention layers add to each score a bias its query computes for itself: from the query
token's hidden state, a row r_i of E numbers, one per backward distance d = i - j, gathered into the
``[T, T]`` bias and 0 at distances of E or more (E: ``rel_extent``, or the window on sliding
layers), on some layers times a factor per query (log scaling, tau_i; docs/math.md §Score terms):

    bias_ij = tau_i r_i[i - j]   for 0 <= i - j < E,   0 otherwise.

The bias depends on the query token, so no probe reads it as a constant: the pass finds it in the
graph. Followed back from the site's mask along the values it adds (through ``where``, additions,
casts, a product and a fill), one ``aten.gather`` along the last dimension of a ``[B, H, T, E]``
tensor R must lead to it, filled with 0 where the distance leaves [0, E) and multiplied by at most
one factor per query row (``[..., T, 1]``). The gather's index and the fill's condition are run
alone at E + 1 positions and must be clamp(i - j, 0, E - 1) and "i - j outside [0, E)". The cell
takes R times that factor (``relative``, ``[B, H, T, E]``) and computes the bias itself, counting
distances in real tokens as ALiBi's are (the source counts cache positions, so left padding, which
the source's distance includes, shifts nothing here); the probe then checks that what the site adds
to its scores is this bias (and ALiBi's, or nothing more).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from rnnify.errors import UnsupportedModelError, is_number

aten = torch.ops.aten
_GATHER = aten.gather.default
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.contiguous.default}
_FILLS = {aten.masked_fill.Scalar, aten.masked_fill.Tensor}
_WHERES = {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}
_SUMS = {aten.add.Tensor, aten.sub.Tensor}
_MUL = aten.mul.Tensor


@dataclass
class RelativeBias:
    """A site's relative bias per query: the table r ``[B, H, T, E]``, the factor per query it is
    multiplied by (None: 1) and E."""

    table: torch.fx.Node
    factor: torch.fx.Node | None
    extent: int

    @property
    def nodes(self) -> set[torch.fx.Node]:
        return {self.table} | ({self.factor} if self.factor is not None else set())

    def logits(self, gm: torch.fx.GraphModule, before: torch.fx.Node) -> torch.fx.Node:
        """A node before ``before`` that computes what the cell takes, r times the factor in fp32."""
        with gm.graph.inserting_before(before):
            logits = gm.graph.call_function(aten.to.dtype, (self.table, torch.float32))
            if self.factor is not None:
                logits = gm.graph.call_function(_MUL, (logits, self.factor))
        return logits

    def bias(self, values: dict[torch.fx.Node, torch.Tensor]) -> torch.Tensor:
        """``[H, T, T]`` float64: what the probe's one row (``values`` of ``nodes``) adds to the scores at
        query i and key j, r_i[i - j] where 0 <= i - j < E, else 0."""
        logits = values[self.table].double()
        if self.factor is not None:
            logits = logits * values[self.factor].double()
        length = logits.shape[2]
        back = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        index = back.clamp(0, self.extent - 1).expand(logits.shape[1], -1, -1)
        return logits[0].gather(-1, index).masked_fill((back < 0) | (back >= self.extent), 0.0)


def find_relative_bias(
    gm: torch.fx.GraphModule, terms: list[torch.fx.Node], heads: int, where: str
) -> RelativeBias | None:
    """The relative bias per query behind the mask nodes ``terms`` of an attention site of ``heads``
    query heads, or None if no gather leads to them. Between the gather and the mask only what keeps
    the bias as it is may stand: casts, one fill with 0 past the table's width (checked with the
    index), masking (a fill or a ``where`` whose other value is a mask's lowest), at most one factor
    per query, and sums with terms that do not read the gather."""
    paths = [path for term in terms for path in _paths_to_gathers(term)]
    if not paths:
        return None
    if len(paths) > 1:
        raise UnsupportedModelError(
            f"{where}: its mask reaches a gathered table along {len(paths)} paths; one relative bias is understood"
        )
    (path,) = paths
    gather = path[-1]
    table, dim, index = gather.args[:3]
    shape = table.meta["val"].shape
    if len(shape) != 4 or dim not in (-1, 3) or not isinstance(shape[-1], int) or str(shape[1]) != str(heads):
        raise UnsupportedModelError(
            f"{where}: its mask gathers scores from a table of shape {tuple(shape)} (dimension {dim}); a relative "
            f"bias per query is gathered along the last dimension of [batch, {heads} heads, queries, distances]"
        )
    extent = int(shape[-1])
    fills, factors, sums = [], [], []  # path positions: the mask's end first
    for position, (node, operand) in enumerate(zip(path, path[1:])):
        if node.target in _FILLS and node.args[2] == 0:
            fills.append(node)
        elif node.target is _MUL:
            factors.append((position, _factor(node, operand, gather)))
        elif node.target in _SUMS and _adds(node, operand, gather):
            sums.append(position)
        elif not (node.target in _CASTS or _masks_the_rest(node, operand)):
            fills.append(None)  # anything else changes the bias
    factor_first = all(position > max(sums, default=-1) for position, _ in factors)  # it scales the bias alone
    if fills != path[-2:-1] or len(factors) > 1 or any(f is None for _, f in factors) or not factor_first:
        raise UnsupportedModelError(
            f"{where}: its mask adds a table gathered by distance otherwise than as a relative bias per query "
            "(the table's entry at each distance below its width, 0 beyond, times at most a factor per query)"
        )
    _check_distances(gm, index, fills[0].args[1], extent, where)
    return RelativeBias(table, factors[0][1] if factors else None, extent)


def _adds(node: torch.fx.Node, operand: torch.fx.Node, gather: torch.fx.Node) -> bool:
    """Whether the sum ``node`` adds ``operand`` as it is (no ``alpha``, not subtracted) to a term
    that does not read the gather."""
    other = node.args[1] if node.args[0] is operand else node.args[0]
    unscaled = node.kwargs.get("alpha", 1) == 1 and (node.target is aten.add.Tensor or node.args[0] is operand)
    return unscaled and not (isinstance(other, torch.fx.Node) and reads(other, gather))


def _masks_the_rest(node: torch.fx.Node, operand: torch.fx.Node) -> bool:
    """Whether ``node`` keeps ``operand`` where it keeps anything and masks the other entries: a fill
    or a ``where`` whose other value is a mask's (-inf, or a dtype's lowest)."""
    if node.target in _FILLS:
        other = node.args[2]
    elif node.target in _WHERES and operand in node.args[1:3]:
        other = node.args[2] if node.args[1] is operand else node.args[1]
    else:
        return False
    lowest = torch.finfo(node.meta["val"].dtype).min
    return is_number(other) and other <= lowest / 2


def _paths_to_gathers(term: torch.fx.Node) -> list[list[torch.fx.Node]]:
    """Each chain of nodes from ``term`` back to a gather, along the values that add up to it (the
    branches of a ``where``, the operands of a sum or product, a fill's input, casts)."""
    found, stack = [], [[term]]
    while stack:
        path = stack.pop()
        node = path[-1]
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            continue
        if node.target is _GATHER:
            found.append(path)
            continue
        if node.target in _WHERES:
            operands = node.args[1:3]
        elif node.target in _SUMS or node.target is _MUL:
            operands = node.args[:2]
        elif node.target in _FILLS or node.target in _CASTS:
            operands = node.args[:1]
        else:
            continue
        stack += [[*path, operand] for operand in operands if isinstance(operand, torch.fx.Node)]
    return found


def _factor(mul: torch.fx.Node, operand: torch.fx.Node, gather: torch.fx.Node) -> torch.fx.Node | None:
    """The factor ``mul`` multiplies the gathered bias (``operand``) by, where it is one per query
    row (its last dimension 1) and does not read the gather; else None."""
    other = mul.args[1] if mul.args[0] is operand else mul.args[0]
    if not isinstance(other, torch.fx.Node) or reads(other, gather):
        return None
    shape = other.meta["val"].shape
    return other if 2 <= len(shape) <= 4 and shape[-1] == 1 else None


def reads(node: torch.fx.Node, ancestor: torch.fx.Node) -> bool:
    """Whether ``node``'s values are computed from ``ancestor``'s (reading only its shape does not count)."""
    seen, stack = set(), [node]
    while stack:
        node = stack.pop()
        if node is ancestor:
            return True
        if node not in seen and node.target is not aten.sym_size.int:
            seen.add(node)
            stack += node.all_input_nodes
    return False


def _check_distances(
    gm: torch.fx.GraphModule, index: torch.fx.Node, outside: torch.fx.Node, extent: int, where: str
) -> None:
    """The gather's ``index`` is clamp(i - j, 0, E - 1) and the fill's condition ``outside`` is
    "i - j outside [0, E)", on one row of E + 1 tokens (past the table's width)."""
    length = extent + 1
    index_value, outside_value = _run_alone(gm, [index, outside], length)
    back = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    index_ok = bool((index_value == back.clamp(0, extent - 1)).all())  # every row and head
    outside_ok = bool((outside_value == ((back < 0) | (back >= extent))).all())
    if not (index_ok and outside_ok):
        raise UnsupportedModelError(
            f"{where}: its mask gathers a table by something other than the distance i - j of query and key "
            "(clamped to the table's width, 0 beyond it): not a relative bias rnnify reads"
        )


def _run_alone(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], length: int) -> list[torch.Tensor]:
    """The values of ``nodes`` when only they (and what they read) run, on one row of ``length`` tokens
    at positions 0..length-1, each as ``[-1, length, length]``."""
    needed: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack += node.all_input_nodes
    graph, copies = torch.fx.Graph(), {}
    for node in gm.graph.nodes:
        if node in needed or node.op == "placeholder":
            copies[node] = graph.node_copy(node, lambda n: copies[n])
    graph.output(tuple(copies[n] for n in nodes))
    device = next((n.meta["val"].device for n in gm.graph.nodes if n.op == "placeholder" and "val" in n.meta), None)
    input_ids = torch.zeros(1, length, dtype=torch.long, device=device)
    position_ids = torch.arange(length, device=device)[None]
    with torch.no_grad():
        values = torch.fx.GraphModule(gm, graph)(input_ids, position_ids)
    return [torch.broadcast_to(v, (*v.shape[:-2], length, length)).reshape(-1, length, length).cpu() for v in values]
