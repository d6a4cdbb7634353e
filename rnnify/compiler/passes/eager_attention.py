"""Find attention that a model computes op by op ("eager" attention) rather than through SDPA.

transformers' eager attention functions all compute, per head,

    scores = q @ k^T  ->  * scale  ->  [c tanh(scores / c)]  ->  [+ bias]  ->  + mask
           ->  softmax (optionally over [scores, sink logit], the sink's column dropped after)  ->  @ v

(Gemma 2's softcapping, Bloom's and MPT's ALiBi, gpt-oss's learned sinks; Bloom's q @ k^T is one
``baddbmm`` with its bias over ``[B H, T, d]`` views). Older models mask in other ways, each a mask
term here: GPT-Neo's ``where(mask, s, lowest)``, XLM's in-place ``masked_fill_``, OpenAI GPT's
multiplicative ``s * b + -1e4 * (1 - b)`` (b 0 or 1, and 0 only where the terms added after it
mask), and XGLM's ``max(s, lowest)`` after its mask, which changes only a masked score, so the chain
passes through it. ``eager_attention`` matches that chain
around every ``softmax`` whose output is multiplied into values, and returns what ``find_attention``
needs to describe the site as it does an SDPA call: q, k, v (4-D, ``[B, H, T, d]``), the scale, the
softcap, the sink logits' node, and the additive terms (biases and masks) with where they were
added, so that the probe run can read their values (``MaskTerm``). The model's own order of ops
is checked, not assumed: a softcap after a bias, a scale after a mask, or an op on the scores
that is none of the above is refused, naming the layer and the op.

A mask read from the top-left corner of a constant buffer (GPT-Neo's and OpenAI GPT's
``bias[:, :, :T, :T]``) is the same at every length up to the buffer's: ``buffered_masks`` reads the
whole buffer, so that a window it applies past the probe's length (GPT-Neo's local layers) is seen.
Two value-preserving rewrites let the chain die with its cell: an in-place ``masked_fill_`` of the
scores becomes ``masked_fill``, and a mask's ``expand_as(scores)`` is dropped (``masked_fill``
broadcasts it).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx

from rnnify.errors import UnsupportedModelError, is_number

aten = torch.ops.aten
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
_SCORES = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# ops that leave the scores' values as they are (dropout: the model is in eval mode)
_SAME = {
    aten.to.dtype,
    aten._to_copy.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.type_as.default,
    aten.dropout.default,
    *_VIEWS,
}
_TRANSPOSES = {aten.transpose.int, aten.permute.default, aten.t.default}
_MASKED_FILL = {aten.masked_fill.Scalar, aten.masked_fill_.Scalar}
_WHERE = {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf}
# ops that read a mask from its buffer, value for value (the buffer's corner: slices, casts)
_BUFFER_READS = {aten.slice.Tensor, aten.alias.default, aten.to.dtype, aten._to_copy.default, aten.clone.default}
# a masked_fill or where value at most this is a mask (-inf, or a dtype's lowest: float16's is -65504),
# as is -1e4 (OpenAI GPT's) as the model's dtype rounds it: -9984 in bfloat16
MASK_FILL = -1e4 * (1 - 2**-7)


@dataclass
class MaskTerm:
    """One term added to the scores: ``"add"`` (a bias or a float mask, times ``factor``), ``"fill"``
    (a boolean mask, True where a key is masked), ``"keep"`` (a boolean mask, True where a key may be
    attended: the others get a mask's value), ``"multiply"`` (a factor on the scores that must be 0
    or 1, and 0 only where the terms after it mask) or ``"sdpa"`` (SDPA's ``attn_mask``: boolean, True
    where a key may be attended, or float, added), added at node ``at`` (whose rank says how the
    value broadcasts: ``[B H, T, S]`` or ``[B, H, T, S]``)."""

    kind: str
    value: torch.fx.Node
    at: torch.fx.Node
    factor: float = 1.0


@dataclass
class EagerAttention:
    """One eager attention chain: ``output`` (p @ v) is what the cell's output replaces."""

    output: torch.fx.Node  # [B, H, T, d_v], or [B H, T, d_v] when ``flat``
    flat: bool
    query: torch.fx.Node  # [B, H, T, d]
    key: torch.fx.Node  # [B, H_k, S, d] (maybe a repeat_kv's output)
    value: torch.fx.Node  # [B, H_k, S, d_v]
    scale: float
    softcap: float | None
    sinks: MaskTerm | None  # kind "sinks": a logit per head, broadcast as ``at`` ([B, H, T, 1] or [B, H, T])
    terms: list[MaskTerm] = field(default_factory=list)
    nodes: set[torch.fx.Node] = field(default_factory=set)  # every node of the chain, q @ k^T to the output


def normalises_scores(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` normalises anything as attention does: a softmax, a logsumexp (Reformer's) or a
    fused attention call. A graph without one mixes its tokens in recurrences of its own (RWKV's);
    one with one may not (a router's softmax), so only its absence tells."""
    normalising = {
        *SOFTMAX, aten._log_softmax.default, aten.log_softmax.int, aten.logsumexp.default,
        aten.scaled_dot_product_attention.default, torch.ops.higher_order.flex_attention,
    }  # fmt: skip
    return any(node.op == "call_function" and node.target in normalising for node in gm.graph.nodes)


def eager_attention(gm: torch.fx.GraphModule, where: Callable[[torch.fx.Node], str]) -> list[EagerAttention]:
    """Every eager attention chain of ``gm``, in graph order. A softmax of anything but q @ k^T (a
    router's) is not attention and is left alone; one of q @ k^T that is not multiplied straight
    into values is refused: kept, it would read only the tokens of each call."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SOFTMAX and _reaches_scores(node.args[0]):
            output, flat, dropped_column = _values_side(node)
            if output is None:
                raise _refuse(where(node), "whose probabilities are not multiplied into values as p @ v")
            site = _scores_side(gm, node, output, flat, dropped_column, where(node))
            _sink_scaling(site, node.args[0], where(node))
            _check_readers(site, where(node))
            for op in site.nodes:  # nothing else reads the scores: filling them in place or not is the same
                if op.target == aten.masked_fill_.Scalar:
                    op.target = aten.masked_fill.Scalar
            found.append(site)
    return found


def buffered_masks(gm: torch.fx.GraphModule, terms: list[MaskTerm]) -> list[torch.Tensor]:
    """For each of ``terms`` whose value is the top-left corner of a constant buffer, the same for
    every head, the keys it allows at every length up to the buffer's, ``[N, N]`` (True where a key
    may be attended)."""
    masks = []
    for term in terms:
        node = term.value
        while node.op == "call_function" and node.target in _BUFFER_READS and _keeps_the_corner(node):
            node = node.args[0]
        if node.op != "get_attr":
            continue
        buffer = _attribute(gm, node.target)
        if buffer.dim() < 2 or any(size != 1 for size in buffer.shape[:-2]):
            continue
        size = min(buffer.shape[-2:])
        corner = buffer.reshape(buffer.shape[-2:])[:size, :size].to(term.value.meta["val"].dtype)
        if term.kind == "fill":
            masks.append(~corner.bool())
        elif term.kind in ("keep", "multiply") or corner.dtype == torch.bool:
            masks.append(corner.bool())
        else:
            masks.append(corner.double() * term.factor > torch.finfo(corner.dtype).min / 2)
    return masks


def _keeps_the_corner(node: torch.fx.Node) -> bool:
    """``node`` keeps its input's top-left corner: a slice from 0 on one of the last two dimensions or a
    whole one of the others, or a cast."""
    if node.target != aten.slice.Tensor:
        return True
    size = node.args[0].meta["val"].shape
    dim, start = (list(node.args[1:3]) + [0, None])[:2]
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if start not in (0, None) or step != 1:
        return False
    return dim % len(size) >= len(size) - 2 or end is None or (type(end) is type(size[dim]) is int and end >= size[dim])


def _attribute(gm: torch.fx.GraphModule, target: str) -> torch.Tensor:
    return functools.reduce(getattr, target.split("."), gm)


def _constant(gm: torch.fx.GraphModule, value, depth: int = 8):
    """The value of ``value`` when it is a number or a node that reads no input (a lifted tensor
    constant, a ``full``), computed on copies; None otherwise."""
    if not isinstance(value, torch.fx.Node):
        return value if is_number(value) else None
    if value.op == "get_attr":
        return _attribute(gm, value.target).detach().clone()
    if value.op != "call_function" or depth == 0 or not isinstance(value.target, torch._ops.OpOverload):
        return None
    inputs = {n: _constant(gm, n, depth - 1) for n in value.all_input_nodes}
    if any(v is None for v in inputs.values()):
        return None
    args, kwargs = torch.fx.node.map_arg((value.args, value.kwargs), inputs.__getitem__)
    with torch.no_grad():
        return value.target(*args, **kwargs)


def _at_most(gm: torch.fx.GraphModule, value, limit: float) -> bool:
    """``value`` is a constant whose every element is at most ``limit``."""
    constant = _constant(gm, value)
    if constant is None:
        return False
    return bool((torch.as_tensor(constant).double() <= limit).all())


def _shape(node: torch.fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def _rank(node: torch.fx.Node) -> int:
    return len(_shape(node))


def _softmax_dim_is_last(node: torch.fx.Node) -> bool:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return dim in (-1, _rank(node) - 1)


def _values_side(softmax: torch.fx.Node) -> tuple[torch.fx.Node | None, bool, bool]:
    """From the softmax forward to ``p @ v``: (that node or None, whether it is 3-D, whether the
    sink's last column was dropped on the way)."""
    if not _softmax_dim_is_last(softmax):
        return None, False, False
    node, dropped = softmax, False
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_function":
            return None, False, False
        if user.target in (aten.matmul.default, aten.bmm.default) and user.args[0] is node:
            return user, user.target == aten.bmm.default, dropped
        if user.target in _SAME:
            node = user
        elif user.target == aten.slice.Tensor and _drops_last_column(user) and not dropped:
            node, dropped = user, True
        else:
            return None, False, False
    return None, False, False


def _drops_last_column(node: torch.fx.Node) -> bool:
    """``x[..., :-1]``."""
    dim, start, end = (list(node.args[1:4]) + [0, None, None])[:3]
    step = node.args[4] if len(node.args) > 4 else 1
    return dim in (-1, _rank(node) - 1) and start in (0, None) and end == -1 and step == 1


def _refuse(where: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{where}: attention computed op by op, {what}; rnnify matches q @ k^T, scale, softcap, "
        "bias, mask, softmax (with sinks) and @ v"
    )


def _op_name(node: torch.fx.Node) -> str:
    return str(getattr(node.target, "__name__", node.target))


def _scores_side(
    gm: torch.fx.GraphModule,
    softmax: torch.fx.Node,
    output: torch.fx.Node,
    flat: bool,
    dropped_column: bool,
    where: str,
) -> EagerAttention:
    """From the softmax back to q @ k^T, collecting the scale, softcap, additive terms and sinks."""
    chain: list[tuple[torch.fx.Node, torch.fx.Node]] = []  # (op on the scores, its scores input), last first
    node, sinks, passed = softmax.args[0], None, {softmax, output}
    while not _is_scores(node):
        if node.op != "call_function":
            raise _refuse(where, f"whose scores come from {node.op} {node.name}")
        passed.add(node)
        # the sinks' column and each row's max (which softmax does not see) only right before the softmax
        last = all(op.target in _SAME for op, _ in chain)
        if node.target == aten.cat.default and sinks is None and dropped_column and last:
            parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
            if len(parts) != 2 or dim not in (-1, _rank(node) - 1):
                raise _refuse(where, "with a concatenation that is not [scores, sink logits]")
            node, sinks = parts[0], MaskTerm("sinks", parts[1], parts[1])
        elif node.target == aten.sub.Tensor and _is_row_max_of(node.args[1], node.args[0]) and last:
            passed |= {node.args[1], node.args[1].args[0]}  # the max (and its getitem)
            node = node.args[0]
        else:
            operand = _scores_operand(node, where)
            chain.append((node, operand))
            node = operand
    if dropped_column and sinks is None:
        raise _refuse(where, "with a column dropped after the softmax but no sink logits before it")
    site = EagerAttention(output, flat, *_qkv(node, output, where), scale=1.0, softcap=None, sinks=sinks)
    site.nodes = passed | {node} | _forward(softmax, output)
    _read_chain(gm, site, node, list(reversed(chain)), where)
    return site


def _forward(start: torch.fx.Node, stop: torch.fx.Node) -> set[torch.fx.Node]:
    """The single-user chain from ``start`` to ``stop``."""
    nodes, node = {start}, start
    while node is not stop:
        (node,) = node.users
        nodes.add(node)
    return nodes


def _sink_scaling(site: EagerAttention, scores: torch.fx.Node, where: str) -> None:
    """Granite's form of sinks, ``(p @ v) * sigmoid(logsumexp(scores) - sink)``: that is
    sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)), the sink in the denominator. Where the scores
    fed to the softmax also feed a logsumexp, this must be that product, and the site ends at it."""
    lse = [u for u in scores.users if u.op == "call_function" and u.target == aten.logsumexp.default]
    if not lse:
        return
    lse = lse[0]
    if site.sinks is not None or list(lse.args[1]) not in ([-1], [_rank(scores) - 1]) or len(lse.users) != 1:
        raise _refuse(where, f"reading a logsumexp of the scores ({lse.name}) other than as a sink scale")
    (sub,) = lse.users
    if sub.target != aten.sub.Tensor or sub.args[0] is not lse or not isinstance(sub.args[1], torch.fx.Node):
        raise _refuse(where, f"reading a logsumexp of the scores ({lse.name}) other than as a sink scale")
    nodes, node, sigmoid = {lse}, sub, False
    while len(node.users) == 1:
        nodes.add(node)
        (user,) = node.users
        if user.target == aten.mul.Tensor and sigmoid:
            other = user.args[1] if user.args[0] is node else user.args[0]
            between = _same_back_to(other, site.output)
            if between is None:
                break
            site.sinks, site.output = MaskTerm("sinks", sub.args[1], lse), user
            site.nodes |= nodes | between | {user}
            return
        if user.target == aten.sigmoid.default and not sigmoid:
            sigmoid = True
        elif user.target not in _SAME and user.target != aten.unsqueeze.default:
            break
        node = user
    raise _refuse(where, f"with a scale from the scores' logsumexp it does not match ({node.name})")


def _same_back_to(node, target: torch.fx.Node) -> set[torch.fx.Node] | None:
    """The ops that keep values (``_SAME``) from ``target`` to ``node``, or None if ``node`` is not
    ``target`` through such ops."""
    nodes = set()
    while isinstance(node, torch.fx.Node) and node is not target:
        if node.op != "call_function" or node.target not in _SAME or len(node.users) != 1:
            return None
        nodes.add(node)
        node = node.args[0]
    return nodes if node is target else None


def _check_readers(site: EagerAttention, where: str) -> None:
    """Nothing outside the chain may read the scores or the probabilities: the cell replaces them."""
    for node in site.nodes - {site.output}:
        outside = [u.name for u in node.users if u not in site.nodes and u.users]  # dead readers read nothing
        if outside:
            raise _refuse(where, f"whose {node.name} is also read by {', '.join(outside)}")


def _is_scores(node: torch.fx.Node) -> bool:
    """A product of two activations over tokens, ``[..., T, S]`` (both sizes symbolic): q @ k^T, not a
    projection (whose last size is a width)."""
    if node.op != "call_function" or node.target not in _SCORES:
        return False
    return all(isinstance(size, torch.SymInt) for size in _shape(node)[-2:])


def _is_row_max_of(candidate, scores: torch.fx.Node) -> bool:
    """``candidate`` is ``scores.max(-1, keepdim=True).values`` or ``scores.amax(-1, keepdim=True)``."""
    if not isinstance(candidate, torch.fx.Node) or candidate.op != "call_function":
        return False
    if candidate.target is operator.getitem and candidate.args[1] == 0:
        candidate = candidate.args[0]
        return candidate.target == aten.max.dim and candidate.args[0] is scores
    return candidate.target == aten.amax.default and candidate.args[0] is scores


def _scores_operand(node: torch.fx.Node, where: str) -> torch.fx.Node:
    """The input of ``node`` that carries the scores (the one that depends on q @ k^T)."""
    inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if node.target in _MASKED_FILL and _reaches_scores(node.args[0]):  # its mask may be expand_as(scores)
        return node.args[0]
    if node.target in _SAME or node.target in (aten.tanh.default, aten.mul.Tensor, aten.div.Tensor):
        if len(inputs) == 1:
            return inputs[0]
    if node.target in {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.max.other, *_MASKED_FILL, *_WHERE}:
        candidates = [a for a in inputs if _reaches_scores(a)]
        if len(candidates) == 1:
            return candidates[0]
    raise _refuse(where, f"with an op on the scores it does not match ({_op_name(node)} {node.name})")


def _reaches_scores(node: torch.fx.Node, depth: int = 16) -> bool:
    """Does ``node`` depend on a q @ k^T within ``depth`` ops (a mask's or a bias's node does not)?"""
    frontier, seen = [node], set()
    for _ in range(depth):
        following = []
        for n in frontier:
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if _is_scores(n):
                return True
            following += n.all_input_nodes
        frontier = following
    return False


def _read_chain(
    gm: torch.fx.GraphModule,
    site: EagerAttention,
    root: torch.fx.Node,
    chain: list[tuple[torch.fx.Node, torch.fx.Node]],
    where: str,
) -> None:
    """Fold the ops from q @ k^T to the softmax (first to last) into scale, softcap and terms."""
    before_tanh, after_tanh, tanh = 1.0, 1.0, False
    if root.target == aten.baddbmm.default:  # beta * bias + alpha * q @ k^T
        before_tanh = float(root.kwargs.get("alpha", root.args[4] if len(root.args) > 4 else 1))
        beta = float(root.kwargs.get("beta", root.args[3] if len(root.args) > 3 else 1))
        site.terms.append(MaskTerm("add", root.args[0], root, beta))
    for node, operand in chain:
        if node.target in _SAME:
            continue
        constant = next((a for a in node.args if is_number(a)), None)
        if node.target in (aten.mul.Tensor, aten.div.Tensor) and constant is not None and not site.terms:
            factor = constant if node.target == aten.mul.Tensor else 1.0 / constant
            if tanh:
                after_tanh *= factor
            else:
                before_tanh *= factor
        elif node.target == aten.tanh.default and not tanh and not site.terms:
            tanh = True
        elif node.target in (aten.add.Tensor, aten.sub.Tensor) and node.kwargs.get("alpha", 1) == 1:
            other = node.args[1] if node.args[0] is operand else node.args[0]
            if not isinstance(other, torch.fx.Node) or (node.target == aten.sub.Tensor and other is node.args[0]):
                raise _refuse(where, f"with {_op_name(node)} ({node.name}) of a constant or of the negated scores")
            site.terms.append(MaskTerm("add", other, node, -1.0 if node.target == aten.sub.Tensor else 1.0))
        elif node.target in _MASKED_FILL and node.args[0] is operand and node.args[2] <= MASK_FILL:
            site.terms.append(MaskTerm("fill", _without_expand_as(node, operand), node))
        elif node.target in _WHERE and operand in node.args[1:3] and node.args[0] is not operand:
            kind, fill = ("keep", node.args[2]) if node.args[1] is operand else ("fill", node.args[1])
            if not _at_most(gm, fill, MASK_FILL):
                raise _refuse(where, f"with {_op_name(node)} ({node.name}) putting a value that is no mask's")
            site.terms.append(MaskTerm(kind, node.args[0], node))
        elif node.target == aten.mul.Tensor and constant is None:  # s * b (+ the mask where b is 0)
            site.terms.append(MaskTerm("multiply", node.args[1] if node.args[0] is operand else node.args[0], node))
        elif node.target == aten.max.other:  # max(s, lowest) changes only a masked score
            other = node.args[1] if node.args[0] is operand else node.args[0]
            if not _at_most(gm, other, torch.finfo(node.meta["val"].dtype).min / 2):
                raise _refuse(
                    where, f"with {_op_name(node)} ({node.name}) of the scores and more than the lowest value"
                )
        else:
            raise _refuse(where, f"with {_op_name(node)} ({node.name}) where scale, softcap or mask were expected")
    if tanh:
        site.softcap, site.scale = after_tanh, before_tanh * after_tanh  # c tanh(scale s / c)
    else:
        site.scale = before_tanh * after_tanh
    if not (site.scale > 0 and (site.softcap is None or site.softcap > 0)):
        raise _refuse(where, f"with scale {site.scale:g} and softcap {site.softcap}")


def _without_expand_as(fill: torch.fx.Node, scores: torch.fx.Node) -> torch.fx.Node:
    """The mask ``masked_fill`` ``fill`` reads, put in its place if it was ``expand_as(scores)`` (the
    fill broadcasts it: that way nothing but the chain reads the scores)."""
    mask = fill.args[1]
    if mask.op == "call_function" and mask.target == aten.expand_as.default and mask.args[1] is scores:
        fill.update_arg(1, mask.args[0])
        return mask.args[0]
    return mask


def _undo_transpose(node: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` of ``x.transpose(-1, -2)`` (k^T), or None."""
    if node.op != "call_function" or node.target not in _TRANSPOSES:
        return None
    rank = _rank(node)
    if node.target == aten.t.default:
        return node.args[0]
    if node.target == aten.transpose.int:
        dims = {d % rank for d in node.args[1:3]}
        return node.args[0] if dims == {rank - 2, rank - 1} else None
    order = [d % rank for d in node.args[1]]
    return node.args[0] if order == [*range(rank - 2), rank - 1, rank - 2] else None


def _split_permute(node: torch.fx.Node) -> torch.fx.Node | None:
    """k of a k^T that one permute makes of a ``[B, T, H, d]`` tensor (OpenAI GPT's ``permute(0, 2, 3,
    1)``): the permute is split in two, to k ``[B, H, T, d]`` and its transpose, so that the cell has a
    k to read. None for any other node."""
    if node.op != "call_function" or node.target != aten.permute.default or _rank(node) != 4:
        return None
    order = [d % 4 for d in node.args[1]]
    to_key = [*order[:2], order[3], order[2]]
    if to_key[0] != 0 or len(node.users) != 1:
        return None
    graph, source = node.graph, node.args[0]
    with graph.inserting_before(node):
        key = graph.call_function(aten.permute.default, (source, to_key))
    key.meta = {**node.meta, "val": source.meta["val"].permute(to_key)}
    node.target, node.args = aten.transpose.int, (key, 2, 3)
    return key


def _heads_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The 4-D ``[B, H, T, d]`` tensor behind ``node``: itself, or what a ``[B H, T, d]`` view reads."""
    node = _without_empty_parts(node)
    if _rank(node) == 4:
        return node
    source = node
    while source.op == "call_function" and source.target in (_VIEWS | {aten.contiguous.default, aten.clone.default}):
        source = source.args[0]
        if _rank(source) == 4:
            return source
    return None


def _without_empty_parts(node: torch.fx.Node) -> torch.fx.Node:
    """``x`` of ``cat([empty, x])`` (XLM's keys and values joined to an empty cache), else ``node``."""
    if node.op != "call_function" or node.target != aten.cat.default:
        return node
    parts = [
        part for part in node.args[0] if not any(size == 0 for size in part.meta["val"].shape if type(size) is int)
    ]
    return parts[0] if len(parts) == 1 else node


def _qkv(root: torch.fx.Node, output: torch.fx.Node, where: str) -> tuple[torch.fx.Node, ...]:
    q_arg, k_arg = (root.args[1], root.args[2]) if root.target == aten.baddbmm.default else root.args[:2]
    v_arg = output.args[1]
    key_t = _undo_transpose(k_arg) or _split_permute(k_arg)
    query, key = _heads_of(q_arg), None if key_t is None else _heads_of(key_t)
    value = _heads_of(v_arg)
    if query is None or key is None or value is None:
        raise _refuse(where, f"whose q, k^T or v is not a [batch, heads, tokens, dim] tensor ({root.name})")
    return query, key, value
