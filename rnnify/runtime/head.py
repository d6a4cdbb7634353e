"""The step graph cut at its language-model head: the hidden state of each position, and the head apart.

Decoding reads the logits of a prompt's last position only, and a serving engine (vLLM) asks for
logits only where it samples; the head is a vocabulary-sized linear layer, a large share of a
short prompt's arithmetic and of its memory (``length x vocab`` floats). ``split_head`` finds the
head of an exported graph: the ``linear`` of a stored weight (and bias) whose output reaches the
graph's logits through position-wise ops only (dtype casts, aliases, a softcap's division, tanh
and multiplication by constants), each used once. It returns two graphs over the same module:
the *body*, whose first output is the head's input instead of the logits, and the *head*, which
maps such hidden states to logits. A graph whose head does not have that shape is not split
(``None``): its callers then compute every position's logits, as before.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

__all__ = ["head_input_size", "split_head"]

aten = torch.ops.aten

# ops that act on each position alone; any argument but the chain's own must be a constant
POSITIONWISE = {
    aten.alias.default,
    aten.clone.default,
    aten.to.dtype,
    aten._to_copy.default,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.tanh.default,
}


def _head_chain(graph: torch.fx.Graph) -> list[torch.fx.Node] | None:
    """The nodes from the head's ``linear`` to the logits, in graph order, or None."""
    output = graph.output_node()
    outputs = output.args[0]
    if not isinstance(outputs, (tuple, list)) or not outputs or not isinstance(outputs[0], torch.fx.Node):
        return None
    node, chain = outputs[0], []
    if sum(1 for item in outputs if item is node) != 1:
        return None
    while True:
        if node.op != "call_function" or len(node.users) != 1:
            return None
        inputs = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
        chain.append(node)
        if node.target is aten.linear.default:
            weights = node.args[1:]
            if node.kwargs or not all(isinstance(w, torch.fx.Node) and w.op == "get_attr" for w in weights):
                return None
            return chain[::-1]
        if node.target not in POSITIONWISE or len(inputs) != 1 or inputs[0] is not node.args[0]:
            return None
        node = inputs[0]


def split_head(graph: torch.fx.Graph) -> tuple[torch.fx.Graph, torch.fx.Graph] | None:
    """``(body, head)`` copies of ``graph``, or None when its head is not recognised.

    ``body`` takes the graph's inputs and returns ``(hidden, *state)``; ``head`` takes ``hidden``
    (``[..., hidden_size]``, any leading shape) and returns what the graph's logits would be.
    Both read their weights from the graph's module by name (``get_attr``).
    """
    chain = _head_chain(graph)
    if chain is None:
        return None
    hidden = chain[0].args[0]

    body = torch.fx.Graph()
    values: dict[torch.fx.Node, torch.fx.Node] = {}
    outputs = body.graph_copy(graph, values)
    body.output((values[hidden], *outputs[1:]))
    for node in reversed(chain):
        body.erase_node(values[node])

    head = torch.fx.Graph()
    inputs = {hidden: head.placeholder("hidden")}
    for node in chain:
        for arg in node.args:
            if isinstance(arg, torch.fx.Node) and arg not in inputs:
                inputs[arg] = head.get_attr(arg.target)
        inputs[node] = head.node_copy(node, lambda n: inputs[n])
    head.output(inputs[chain[-1]])
    return body, head


def head_input_size(gm: torch.fx.GraphModule) -> int | None:
    """Width of the head's input (its weight's second dimension), or None when the head is not recognised."""
    chain = _head_chain(gm.graph)
    if chain is None:
        return None
    return int(operator.attrgetter(chain[0].args[1].target)(gm).shape[1])
