"""Thread the cells' state through the graph: the prefill graph becomes a step function.

    (input_ids [B, T], position_ids [B, T], attention_mask [B, T], *state) -> (logits, *new_state)

Every cell call (an attention site's, or a model's own layer's from ``rewrite_convolutions``,
``rewrite_scans`` or ``rewrite_token_shifts``) gains the ``attention_mask`` placeholder and one placeholder per state tensor (named
``state_<i>_<name>`` for the cell ``cells.<i>``), and its new state is appended to the outputs, in
graph order, which is the manifest's order of cells. The same graph
serves a T-token prefill and a 1-token decode step. (The model's own mask construction lost its
last user when ``rewrite_attention`` removed the SDPA calls; dead-code elimination removed it.)
"""

from __future__ import annotations

import operator

import torch.fx

from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.rewrite_attention import cell_calls

MASK_INPUT = "attention_mask"


def thread_state(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]):
        mask = graph.placeholder(MASK_INPUT)
    last = mask
    new_state: list[torch.fx.Node] = []
    for call in cell_calls(gm):
        cell = gm.get_submodule(call.target)
        inputs = []
        for name in cell.state_names:
            with graph.inserting_after(last):
                last = graph.placeholder(f"state_{call.target.split('.')[-1]}_{name}")
            inputs.append(last)
        call.args = (*call.args, mask, *inputs)
        anchor = call
        for i in range(len(inputs)):
            with graph.inserting_after(anchor):
                anchor = graph.call_function(operator.getitem, (call, i + 1))
            new_state.append(anchor)
    output = graph.output_node()
    (logits,) = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    output.args = ((logits, *new_state),)
    return gm
