"""What the passes that keep a model's own recurrent layers share: where such a layer is, and how its
cell takes the place of the captured nodes (``rewrite_convolutions``, ``rewrite_scans``,
``rewrite_token_shifts``)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

from rnnify.cells.base import Cell
from rnnify.compiler.passes.find_attention import SITE_KEY, _layer_index, _module_path
from rnnify.compiler.passes.rewrite_attention import CELL_KEY, cell_calls


@dataclass
class LayerSite:
    """Where a model's own recurrent layer (a short convolution, a scan, a token shift) was, as
    ``convert`` records it in the manifest (as for an ``AttentionSite``)."""

    layer: int
    module_path: str

    @property
    def where(self) -> str:
        return f"layer {self.layer} ({self.module_path})"


def layer_site(node: torch.fx.Node) -> LayerSite:
    """The layer of the module that computed ``node``."""
    path = _module_path(node)
    return LayerSite(_layer_index(path, -1), path)


def cell_placer(gm: torch.fx.GraphModule) -> Callable[[Cell, Sequence[Any], torch.fx.Node, LayerSite], None]:
    """``place(cell, inputs, replaced, site)``: add ``cell`` to ``gm`` as the next free ``cells.<i>``
    (after the cells already there), call it on ``inputs`` just before ``replaced`` and hand its
    output to ``replaced``'s users; ``thread_state`` then threads the call's state."""
    taken = {call.target for call in cell_calls(gm)}
    names = (f"cells.{i}" for i in itertools.count() if f"cells.{i}" not in taken)

    def place(cell: Cell, inputs: Sequence[Any], replaced: torch.fx.Node, site: LayerSite) -> None:
        name = next(names)
        gm.add_submodule(name, cell)
        with gm.graph.inserting_before(replaced):
            call = gm.graph.call_module(name, tuple(inputs))
            out = gm.graph.call_function(operator.getitem, (call, 0))
        call.meta[SITE_KEY] = site
        call.meta[CELL_KEY] = True
        out.meta["val"] = replaced.meta.get("val")
        replaced.replace_all_uses_with(out)

    return place
