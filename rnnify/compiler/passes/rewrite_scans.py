"""Carry the state of a model's own recurrent layers (Mamba-2's scan, ...) through the step.

Captured under ``own_recurrences`` (``rnnify.compiler.recurrences``), each such layer is one
``rnnify::`` op node that computes a whole sequence from the zero state. This pass replaces each
with a call to the cell its family names (``cells.<i>``, after the cells already there), whose
state is the layer's (docs/math.md §State space layers); ``thread_state`` threads it like an
attention cell's. The weights stay the source's, under their own names.
"""

from __future__ import annotations

import itertools
import operator

import torch.fx

from rnnify.compiler.passes.context import PassContext
from rnnify.compiler.passes.find_attention import SITE_KEY, _layer_index, _module_path
from rnnify.compiler.passes.rewrite_attention import CELL_KEY, cell_calls
from rnnify.compiler.passes.rewrite_convolutions import LayerSite
from rnnify.compiler.recurrences import FAMILIES

_BY_OP = {family.op: family for family in FAMILIES}


def rewrite_scans(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    taken = {call.target for call in cell_calls(gm)}
    names = (f"cells.{i}" for i in itertools.count() if f"cells.{i}" not in taken)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _BY_OP:
            continue
        cell, inputs = _BY_OP[node.target].cell(node.args)
        name = next(names)
        gm.add_submodule(name, cell)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(name, inputs)
            out = gm.graph.call_function(operator.getitem, (call, 0))
        path = _module_path(node)
        call.meta[SITE_KEY] = LayerSite(_layer_index(path, -1), path)
        call.meta[CELL_KEY] = True
        out.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    return gm
