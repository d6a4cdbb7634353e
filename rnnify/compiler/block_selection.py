"""Indexers that rank pools of keys, as one op each: Qwen4-Exp's QSA (``rnnify::block_index_select``)
and GLM-5-Next's k-pool indexer (``rnnify::pool_index_select``).

The source selects each query's keys in a Python loop over the rows and the queries, branching on
how many keys each sees (docs/math.md §Indexer selection, pooled forms): torch.export cannot capture
it. During capture, ``block_selections`` gives every such indexer a ``_select_tokens`` that calls
one op with what the selection reads: the index queries, each token's raw index key beside its
rotary table (``[raw, cos, sin]``, the cell's index keys), the keys each query may see, and the
block keys' norm weight and eps. ``find_selection`` reads the op where the layer ands its result
into the attention's mask, and the site's exact cell computes the same selection over its cache
(``rnnify.cells.index_select.BlockRanking``). The op itself runs the source's loop
(``naive_block_selection``), so the captured graph computes what the source computes.

GLM-5-Next's indexer (``Glm5NextTextIndexer.forward``) computes its selection without a loop, but
keeps the pools some row has whole, a size export cannot keep dynamic; its stand-in calls one op
with its index queries, keys beside their gate logits, head weights, the rows' real tokens and the
learned slot logits (``rnnify.cells.pool_select``), and gives the selection as a mask, not indices,
which the attention's ``build_attention_mask_from_topk`` stand-in passes on as its mask (a layer
that reuses an earlier layer's selection is handed the same mask).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.nn.functional as F

from rnnify.cells.index_select import key_norm, naive_block_selection
from rnnify.cells.pool_select import pooled_selection
from rnnify.errors import UnsupportedModelError

__all__ = ["BLOCK_SELECT", "POOL_SELECT", "block_selections"]

_INDEXER = "QSAIndexer"  # the class name's ending


@torch.library.custom_op("rnnify::block_index_select", mutates_args=())
def block_index_select(
    index_q: torch.Tensor,
    index_keys: torch.Tensor,
    visible: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    ratio: int,
    budget: int,
) -> torch.Tensor:
    """``[B, T, N]`` boolean: the keys each query reads (``naive_block_selection``)."""
    return naive_block_selection(index_q, index_keys, visible, norm_weight, eps, ratio, budget)


@block_index_select.register_fake
def _(index_q, index_keys, visible, norm_weight, eps, ratio, budget):
    return torch.empty_like(visible, dtype=torch.bool)


BLOCK_SELECT = torch.ops.rnnify.block_index_select.default


@torch.library.custom_op("rnnify::pool_index_select", mutates_args=())
def pool_index_select(
    index_q: torch.Tensor,
    index_keys: torch.Tensor,
    index_weights: torch.Tensor,
    valid: torch.Tensor,
    ape: torch.Tensor,
    scale: float,
    topk: int,
    pool: int,
) -> torch.Tensor:
    """``[B, T, T]`` boolean: the keys each token of a prompt reads (``pooled_selection``)."""
    return pooled_selection(index_q, index_keys, index_weights, valid, ape, scale, topk, pool)


@pool_index_select.register_fake
def _(index_q, index_keys, index_weights, valid, ape, scale, topk, pool):
    return valid.new_empty((valid.shape[0], valid.shape[1], valid.shape[1]), dtype=torch.bool)


POOL_SELECT = torch.ops.rnnify.pool_index_select.default


def _check_block_norm(indexer) -> None:
    """Refuse a QSA indexer whose block-key norm is not the one the cell computes (``key_norm``), by
    running both on a few random rows: a norm of another form would make the cell rank other blocks."""
    norm = indexer.k_layernorm
    weight = norm.weight.detach()
    x = torch.randn(4, weight.shape[-1], generator=torch.Generator().manual_seed(0)).to(weight)
    with torch.no_grad():
        same = torch.equal(norm(x), key_norm(x, weight, float(norm.eps)))
    if not same:
        raise UnsupportedModelError(
            f"{type(indexer).__name__}: its block keys are normed by {type(norm).__name__} otherwise than as an RMS "
            "norm with weight 1 + w, which no rnnify cell computes"
        )


def _select_tokens(indexer, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask, **kwargs):
    """The source's ``_select_tokens`` as one op: ``[B, 1, T, N]``, True where a query reads a key."""
    norm = indexer.k_layernorm
    if full_cos.dtype != raw_keys.dtype:  # the cell keeps the table beside the keys, in their dtype
        raise UnsupportedModelError(
            f"{type(indexer).__name__}: its rotary table ({full_cos.dtype}) and index keys ({raw_keys.dtype}) "
            "differ in dtype, which no rnnify cell keeps"
        )
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    batch = raw_keys.shape[0]
    index_keys = torch.cat([raw_keys, full_cos.expand(batch, -1, -1), full_sin.expand(batch, -1, -1)], dim=-1)
    selected = BLOCK_SELECT(
        q, index_keys, visible[:, 0], norm.weight, float(norm.eps), indexer.compress_ratio, indexer.token_budget
    )
    return selected.unsqueeze(1)


def _pooled_indexer(indexer, hidden_states, q_resid, attention_mask, cache=None, past_key_values=None):
    """GLM-5-Next's ``Glm5NextTextIndexer.forward`` without a cache: its selection as a mask ``[B, T, T]``."""
    if cache is not None or past_key_values is not None:
        raise UnsupportedModelError("a pooling indexer was called with a cache during capture")
    if not indexer.index_kpool_always_select_tail:
        raise UnsupportedModelError(
            f"{type(indexer).__name__}: its queries read their unfinished pool only when chosen "
            "(index_kpool_always_select_tail false), which no rnnify cell computes"
        )
    batch, length = hidden_states.shape[:2]
    q = indexer.wq_b(q_resid).view(batch, length, -1, indexer.head_dim)
    keys = indexer.k_norm(indexer.wk(hidden_states))
    gates = F.linear(hidden_states, indexer.index_kpool_compress_gate)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return POOL_SELECT(
        q, torch.cat([keys, gates], dim=-1), weights * indexer.n_heads**-0.5, attention_mask,
        indexer.index_kpool_compress_ape, float(indexer.softmax_scale), indexer.index_topk, indexer.index_kpool,
    )  # fmt: skip


def _selection_mask(attention, topk_indices, query_states, kv_length):
    """``build_attention_mask_from_topk`` for the stand-in's mask: SDPA's boolean mask, or eager's float one."""
    selected = topk_indices.unsqueeze(1)
    if attention.config._attn_implementation == "sdpa":
        return selected
    zeros = torch.zeros(selected.shape, dtype=query_states.dtype, device=selected.device)
    return zeros.masked_fill(~selected, torch.finfo(query_states.dtype).min)


@contextlib.contextmanager
def block_selections(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every pooling indexer among ``model``'s modules selects through its op."""
    for module in model.modules():
        if type(module).__name__.endswith(_INDEXER) and callable(getattr(module, "_select_tokens", None)):
            _check_block_norm(module)
    classes = {type(m) for m in model.modules()}
    pooling = {cls for cls in classes if hasattr(cls, "get_pooled_states") and hasattr(cls, "append_visible_tail")}
    with contextlib.ExitStack() as stack:
        for cls in classes:
            if cls.__name__.endswith(_INDEXER) and callable(getattr(cls, "_select_tokens", None)):
                stack.enter_context(mock.patch.object(cls, "_select_tokens", _select_tokens))
            if cls in pooling:  # GLM-5-Next's, and its attention's mask from the selection
                stack.enter_context(mock.patch.object(cls, "forward", _pooled_indexer))
            elif pooling and callable(getattr(cls, "build_attention_mask_from_topk", None)):
                stack.enter_context(mock.patch.object(cls, "build_attention_mask_from_topk", _selection_mask))
        yield
