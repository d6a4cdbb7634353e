"""Kimi Delta Attention (``chunk_kimi_delta_attention``: Kimi-Linear, Bailing-hybrid) as ``rnnify::kda``,
carried by ``KimiDeltaAttentionCell``."""

from __future__ import annotations

from rnnify.cells.kda import KimiDeltaAttentionCell
from rnnify.compiler.recurrences.gated_delta import delta_rule_family


def _cell_for(query_shape, value_shape, l2norm: bool) -> KimiDeltaAttentionCell:
    """The cell of queries/keys ``[B, T, H, d_k]`` and values ``[B, T, H, d_v]``."""
    (*_, key_dim), (*_, heads, value_dim) = query_shape, value_shape
    return KimiDeltaAttentionCell(KimiDeltaAttentionCell.spec_for(heads, key_dim, value_dim), l2norm)


KDA = delta_rule_family("chunk_kimi_delta_attention", "kda", _cell_for, "Kimi Delta Attention")
