"""Capture a model's own recurrent layers (Mamba-2's scan, ...) as one op each, for ``rewrite_scans``.

transformers writes a hybrid's recurrent layers as module-level functions its mixers call, e.g.
``mamba2_scan_forward(mixer, x, B, C, dt, cache)`` (or as a layer's method: RecurrentGemma's
``RecurrentGemmaRglru._rnn_scan``, MiniMax's whole ``MiniMaxLightningAttention.forward``):
functions that ``kernels`` may replace by a runtime that keeps the recurrent state itself, which
is what rnnify does. Exported as they are,
their chunked forms pad the tokens to a multiple of a chunk size, which torch.export cannot keep
dynamic. During capture, ``own_recurrences`` swaps each such function, in the model's own
modeling module (or on its layer class), for a stand-in that calls one ``rnnify::`` op with the mixer's weights: one node
that says what the layer computes, which ``rewrite_scans`` turns into the cell that carries its
state. One module per family (``mamba2``, ...) declares its ``OwnRecurrence``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from unittest import mock

import torch

from rnnify.compiler.recurrences.family import OwnRecurrence
from rnnify.compiler.recurrences.gated_delta import GATED_DELTA
from rnnify.compiler.recurrences.kda import KDA
from rnnify.compiler.recurrences.lightning import LIGHTNING
from rnnify.compiler.recurrences.mamba import MAMBA_SCAN_FORWARD, MAMBA_SELECTIVE_SCAN
from rnnify.compiler.recurrences.mamba2 import MAMBA2
from rnnify.compiler.recurrences.rg_lru import RG_LRU

__all__ = ["FAMILIES", "OWN_LAYER_OPS", "OwnRecurrence", "own_recurrences"]

FAMILIES: tuple[OwnRecurrence, ...] = (
    MAMBA2,
    GATED_DELTA,
    KDA,
    MAMBA_SCAN_FORWARD,
    MAMBA_SELECTIVE_SCAN,
    RG_LRU,
    LIGHTNING,
)
OWN_LAYER_OPS = frozenset(family.op for family in FAMILIES)


@contextlib.contextmanager
def own_recurrences(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the modeling modules of ``model``'s layers call the stand-ins for their
    recurrent layers: every module a layer's class comes from, not only the model's own (a composite's
    text path, ``TextPath``, is rnnify's class around the whole's decoder)."""
    modules = {sys.modules.get(type(layer).__module__) for layer in model.modules()} - {None}
    with contextlib.ExitStack() as stack:
        for module in modules:
            for family in FAMILIES:
                *owner, name = family.function.split(".")
                holder = module
                for part in owner:  # a layer class, for a method
                    holder = getattr(holder, part, None)
                if holder is not None and callable(getattr(holder, name, None)):
                    stack.enter_context(mock.patch.object(holder, name, family.stand_in))
        yield
