"""MiniMax's lightning attention (``MiniMaxLightningAttention.forward``) as ``rnnify::lightning_attention``,
carried by ``LightningAttentionCell``.

transformers writes the recurrence inside the layer's forward, a loop over blocks of
``block_size`` tokens that export unrolls for the example's length, so the stand-in is the whole
forward without a cache: the projections, the output norm and gate as the source computes them,
and one op for the recurrence. The source zeroes the padded tokens' q, k and v but still decays
its state across them (invisible from the zero state of a left-padded prompt); the cell keeps
padding out of its state altogether (§Padding: a padded token decays nothing either), so the
stand-in leaves the mask to it.
"""

from __future__ import annotations

import torch

from rnnify.cells.lightning import LightningAttentionCell
from rnnify.compiler.recurrences.family import OwnRecurrence, from_zero_state, shape
from rnnify.errors import UnsupportedModelError


@torch.library.custom_op("rnnify::lightning_attention", mutates_args=())
def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor) -> torch.Tensor:
    """A whole sequence from the zero state, every token real (the captured graph's own meaning);
    q, k, v ``[B, T, H, D]``."""
    cell = LightningAttentionCell(LightningAttentionCell.spec_for(*q.shape[2:]))
    return from_zero_state(cell, q, k, v, slope).contiguous()  # the fake's layout


@lightning_attention.register_fake
def _(q, k, v, slope):
    return torch.empty_like(q)


def _stand_in(
    layer, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None, **kwargs
):
    """``MiniMaxLightningAttention.forward`` without a cache (``past_key_values`` before transformers
    renamed it ``cache``): its output, and no state to keep."""
    if cache is not None or past_key_values is not None:
        raise UnsupportedModelError("a lightning attention layer was called with a cache during capture")
    batch, length, _ = hidden_states.shape
    heads, head_dim = layer.num_attention_heads, layer.head_dim
    qkv = layer.act_fn(layer.qkv_proj(hidden_states)).reshape(batch, length, heads, 3 * head_dim)
    q, k, v = torch.split(qkv, head_dim, dim=3)
    out = torch.ops.rnnify.lightning_attention(q, k, v, layer.slope_rate)
    out = layer.norm(out.reshape(batch, length, heads * head_dim))
    return layer.out_proj(torch.sigmoid(layer.output_gate(hidden_states)) * out), None


def _cell(args):
    q, k, v, slope = args
    return LightningAttentionCell(LightningAttentionCell.spec_for(*shape(q)[2:])), (q, k, v, slope)


LIGHTNING = OwnRecurrence(
    "MiniMaxLightningAttention.forward", _stand_in, torch.ops.rnnify.lightning_attention.default, _cell
)
