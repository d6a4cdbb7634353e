"""Qwen4-Exp's QSA indexer (``Qwen4ExpTextQSAIndexer._select_tokens``) as one op, ``rnnify::block_index_select``.

The source selects each query's keys in a Python loop over the rows and the queries, branching on
how many keys each sees (docs/math.md §Indexer selection, block form): torch.export cannot capture
it. During capture, ``block_selections`` gives every such indexer a ``_select_tokens`` that calls
one op with what the selection reads: the index queries, each token's raw index key beside its
rotary table (``[raw, cos, sin]``, the cell's index keys), the keys each query may see, and the
block keys' norm weight and eps. ``find_selection`` reads the op where the layer ands its result
into the attention's mask, and the site's exact cell computes the same selection over its cache
(``rnnify.cells.index_select.BlockRanking``). The op itself runs the source's loop
(``naive_block_selection``), so the captured graph computes what the source computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from rnnify.cells.index_select import naive_block_selection
from rnnify.errors import UnsupportedModelError

__all__ = ["BLOCK_SELECT", "block_selections"]

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


def _select_tokens(indexer, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask, **kwargs):
    """The source's ``_select_tokens`` as one op: ``[B, 1, T, N]``, True where a query reads a key."""
    norm = indexer.k_layernorm
    if not type(norm).__name__.endswith("RMSNorm") or getattr(norm, "group_size", None) is not None:
        raise UnsupportedModelError(
            f"{type(indexer).__name__}: its block keys are normed by {type(norm).__name__}, which no rnnify cell computes"
        )
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


@contextlib.contextmanager
def block_selections(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every QSA indexer class among ``model``'s modules selects through the op."""
    classes = {type(m) for m in model.modules() if type(m).__name__.endswith(_INDEXER)}
    with contextlib.ExitStack() as stack:
        for cls in classes:
            if callable(getattr(cls, "_select_tokens", None)):
                stack.enter_context(mock.patch.object(cls, "_select_tokens", _select_tokens))
        yield
