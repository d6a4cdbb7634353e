"""Griffin's RG-LRU (``RecurrentGemmaRglru._rnn_scan``: RecurrentGemma) as ``rnnify::rg_lru``, carried
by ``RGLRUCell``.

transformers writes this recurrence as a method of the layer, a loop over the tokens that export
unrolls for the example's length; the stand-in hands the op the decay with the source's reset
applied (a = 0 where the position is 0) and the normalised input, which the rest of the layer
computes in the graph.
"""

from __future__ import annotations

import torch

from rnnify.cells.rg_lru import RGLRUCell
from rnnify.compiler.recurrences.family import OwnRecurrence, from_zero_state, shape
from rnnify.errors import UnsupportedModelError


@torch.library.custom_op("rnnify::rg_lru", mutates_args=())
def rg_lru(u: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """A whole sequence from the zero state, every token real (the captured graph's own meaning)."""
    return from_zero_state(RGLRUCell(RGLRUCell.spec_for(u.shape[-1])), u, a)


@rg_lru.register_fake
def _(u, a):
    return torch.empty_like(u)


def _stand_in(layer, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
    """``_rnn_scan`` without a cache: the states of every token, and no final state to keep."""
    if recurrent_states is not None:
        raise UnsupportedModelError("an RG-LRU layer was called with a cache during capture")
    return torch.ops.rnnify.rg_lru(hidden_states, recurrent_gate * ~reset), None


def _cell(args):
    u, a = args
    return RGLRUCell(RGLRUCell.spec_for(shape(u)[-1])), (u, a)


RG_LRU = OwnRecurrence("RecurrentGemmaRglru._rnn_scan", _stand_in, torch.ops.rnnify.rg_lru.default, _cell)
