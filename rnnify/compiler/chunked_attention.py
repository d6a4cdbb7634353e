"""Chunked attention (Llama 4's ``attention_chunk_size``), refused before capture.

Llama 4's layers with RoPE attend in chunks (``layer_types`` names them ``chunked_attention``): a
token sees the earlier tokens of its own chunk of ``attention_chunk_size`` and none before it, so
the keys it sees grow within a chunk and fall to one at each chunk boundary. That is not a sliding
window (the last W tokens, at every position), and no rnnify cell computes it. A probe shorter
than a chunk sees plain causal attention, so the captured graph cannot show it: the config does.
"""

from __future__ import annotations

from typing import Any

from rnnify.errors import UnsupportedModelError

__all__ = ["refuse_chunked_attention"]


def refuse_chunked_attention(name: str, config: Any) -> None:
    """Raise for a model ``name`` whose ``config`` gives layers chunked attention (module docstring)."""
    chunk = getattr(config, "attention_chunk_size", None)
    layers = [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind == "chunked_attention"]
    if chunk and layers:
        raise UnsupportedModelError(
            f"{name}: chunked attention (attention_chunk_size {chunk}) in {len(layers)} of its "
            f"{len(config.layer_types)} layers, from layer {layers[0]}: a token attends only to the earlier tokens "
            f"of its own chunk of {chunk}, which is not a sliding window; rnnify has no recurrent form of it"
        )
