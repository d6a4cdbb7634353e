"""Carry the state of a model's own recurrent layers (Mamba-2's scan, ...) through the step.

Captured under ``own_recurrences`` (``rnnify.compiler.recurrences``), each such layer is one
``rnnify::`` op node that computes a whole sequence from the zero state. This pass replaces each
with a call to the cell its family names (``cells.<i>``, after the cells already there), whose
state is the layer's (docs/math.md §State space layers); ``thread_state`` threads it like an
attention cell's. The weights stay the source's, under their own names.
"""

from __future__ import annotations

import torch.fx

from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.own_layers import cell_placer, layer_site
from rnnify.compiler.recurrences import FAMILIES

_BY_OP = {family.op: family for family in FAMILIES}


def rewrite_scans(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    place = cell_placer(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _BY_OP:
            continue
        cell, inputs = _BY_OP[node.target].cell(node.args)
        place(cell, inputs, node, layer_site(node))
        gm.graph.erase_node(node)
    return gm
