"""Sparse attention by a learned selection (an indexer), refused before capture.

DeepSeek-V3.2's sparse attention and its kin (GLM-MoE-DSA, HY-V4, AXK2, dots3, Kolibri, MiniMax-M3's
sparse layers, Qwen4-Exp) give an attention layer an ``...Indexer`` module: a small scorer that
picks, for each query, the keys (or blocks of keys) it may read, the top ``index_topk`` of them. Up
to that many keys the selection keeps them all and the layer is plain causal attention, so the
captured graph, a probe and a short check all see softmax attention; past it, each query reads only
the keys its indexer chose. No rnnify cell computes that selection, and a conversion that dropped
it would be exact on short inputs and wrong on long ones, so the module, not the graph, decides.
"""

from __future__ import annotations

import torch

from rnnify.errors import UnsupportedModelError

__all__ = ["refuse_sparse_attention"]

_SELECTION_NAMES = ("index_topk", "index_topk_blocks", "indexer_budget")  # config fields that size the selection


def refuse_sparse_attention(model: torch.nn.Module) -> None:
    """Raise for a model whose attention layers hold an indexer (module docstring)."""
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Indexer") and _inside_attention(name):
            config = getattr(model, "config", None)
            size = next(
                (f", {field} {getattr(config, field)}" for field in _SELECTION_NAMES if hasattr(config, field)), ""
            )
            raise UnsupportedModelError(
                f"{type(model).__name__}: sparse attention ({name}, {type(module).__name__}{size}): each "
                "query reads only the keys its indexer selects, which no rnnify cell computes"
            )


def _inside_attention(name: str) -> bool:
    """Whether the module path ``name`` runs through an attention module (``model.layers.0.self_attn.indexer``)."""
    return any("attn" in part.lower() or "attention" in part.lower() for part in name.split(".")[:-1])
