"""Exact attention through vLLM's paged KV cache: what lets vLLM host a state that grows.

An ``exact`` cell's state is every past key and value, which no fixed-size state-cache slot can
hold. vLLM keeps such caches in pages: blocks of ``block_size`` tokens, handed to each sequence
by its scheduler as the sequence grows, counted against the KV cache budget, and freed when it
ends or is preempted. Here every exact site of a converted model (a whole layer, or the exact
group of a head split) becomes one such paged layer (``ExactKVLayer``, with a ``FullAttentionSpec``
vLLM allocates from, or a ``SlidingWindowSpec`` where the model has its own sliding window there:
vLLM then frees the blocks that fall out of it, and the state stops growing), and the cell in the graph is swapped for ``PagedExactCell``: its own state is
empty, and each call

1. writes the new keys and values of its rows into their pages (vLLM's ``slot_mapping``), then
2. reads each row's whole context back through its block table and attends over it with the exact
   cell's own form (``sdpa_softmax_attn``, or ``scored_softmax_attn`` for score terms), so vLLM's
   tokens are those ``rnnify generate`` gives.

The model runs decodes as one batched step and each prompt as its own prefill (``model``): before
each such call ``PagedBatch.select`` says which of vLLM's scheduled sequences the rows are.

Every paged layer declares the model's kv-head count and head size (those vLLM sizes the pages
of hybrid models from); a head split's exact group of fewer kv heads fills the first of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from rnnify.cells.exact import ExactCell, scored_softmax_attn, sdpa_softmax_attn
from rnnify.errors import RnnifyError

__all__ = ["ExactKVLayer", "PagedBatch", "PagedExactBackend", "PagedExactCell", "PagedExactMetadata", "page_exact"]

LAYER_NAME = "rnnify.layers.{index}.attn"  # vLLM finds a layer's index in its name: exactly one integer


@dataclass
class PagedExactMetadata:
    """What the paged layers read of one model step: per scheduled sequence, in vLLM's order, where
    its tokens start in the flat batch (``query_start_loc``, one more than sequences), its length
    with them (``seq_lens``), its pages (``block_table``); per token, its cache slot."""

    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class PagedExactMetadataBuilder(AttentionMetadataBuilder[PagedExactMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> PagedExactMetadata:
        common = common_attn_metadata
        num_reqs = common.num_reqs
        return PagedExactMetadata(
            query_start_loc=common.query_start_loc_cpu[: num_reqs + 1].tolist(),
            seq_lens=common.seq_lens[:num_reqs].tolist(),
            block_table=common.block_table_tensor[:num_reqs],
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].to(torch.long),
        )


class PagedExactBackend(AttentionBackend):
    """vLLM's view of the paged layers: pages of any block size, metadata from ``PagedExactMetadataBuilder``;
    the attention itself runs in ``PagedExactCell`` (no vLLM kernel)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "RNNIFY_PAGED_EXACT"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("rnnify's exact cells compute their attention themselves")

    @staticmethod
    def get_builder_cls() -> type[PagedExactMetadataBuilder]:
        return PagedExactMetadataBuilder


class ExactKVLayer(nn.Module, AttentionLayerBase):
    """One exact site's pages: ``kv_cache`` (after ``bind_kv_cache``) is ``[blocks, kv heads,
    block_size, head_size + head_size]``, keys then values in the last dimension."""

    def __init__(self, vllm_config: VllmConfig, index: int, window: int | None = None):
        super().__init__()
        model_config = vllm_config.model_config
        self.prefix = LAYER_NAME.format(index=index)
        self.window = window  # the site's own sliding window: vLLM frees the blocks that fall out of it
        self.num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
        self.head_size = model_config.get_head_size()
        self.dtype = model_config.dtype
        self.kv_cache = torch.tensor([])
        context = vllm_config.compilation_config.static_forward_context
        if self.prefix in context:
            raise ValueError(f"Duplicate layer name: {self.prefix}")
        context[self.prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return PagedExactBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec | SlidingWindowSpec:
        shape = dict(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.head_size,
            dtype=self.dtype,
        )
        if self.window is None:
            return FullAttentionSpec(**shape)
        return SlidingWindowSpec(**shape, sliding_window=self.window)


class PagedBatch:
    """Which of the step's scheduled sequences the rows of the next model call are (``select``),
    shared by every ``PagedExactCell`` of the model; ``metadata`` is the step's, by layer name (vLLM
    may put the paged layers in different KV cache groups, each with its own pages)."""

    def __init__(self) -> None:
        self.metadata: dict[str, PagedExactMetadata] | None = None
        self.rows: list[int] = []

    def select(self, metadata: dict[str, PagedExactMetadata], rows: list[int]) -> None:
        self.metadata, self.rows = metadata, rows


class PagedExactCell(ExactCell):
    """An ``ExactCell`` whose keys and values live in ``layer``'s pages (module docstring).

    Same call as the cell's, ``(q, k, v, mask, keys, values, valid) -> (out, keys, values, valid)``,
    with an empty state in and out: rows are sequences without padding, as vLLM schedules them.
    """

    def __init__(self, cell: ExactCell, layer: ExactKVLayer, batch: PagedBatch):
        super().__init__(cell.spec, cell.block_size)
        self.__dict__["layer"] = layer  # vLLM's module, not a part of this one
        self.batch = batch

    def _contexts(self, metadata: PagedExactMetadata, rows: list[int], length: int):
        """What ``rows``' queries (their last ``length`` positions) may read of the pages, in one
        gather, left-padded to the longest: ``[rows, kv heads, longest, head_size * 2]``, and which
        positions are real ``[rows, longest]``. A window reads only its last ``window + length - 1``
        positions (the forms' masks and distances are relative, so the rest changes nothing)."""
        cache = self.__dict__["layer"].kv_cache
        block_size, window = cache.shape[2], self.spec.window
        ends = [metadata.seq_lens[r] for r in rows]
        firsts = [0 if window is None else max(0, end - (window + length - 1)) for end in ends]
        longest = max(end - first for first, end in zip(firsts, ends))
        device = metadata.block_table.device
        starts = torch.tensor([end - longest for end in ends], device=device)
        positions = starts[:, None] + torch.arange(longest, device=device)[None, :]  # [rows, longest]
        real = positions >= torch.tensor(firsts, device=device)[:, None]
        positions = positions.clamp_min(0)
        table = metadata.block_table[torch.tensor(rows, device=device)].to(torch.long)
        blocks = table.gather(1, positions // block_size)
        pages = cache[blocks, : self.spec.num_kv_heads, positions % block_size]  # [rows, longest, Hkv, C]
        return pages.transpose(1, 2), real

    def _attend(self, q, metadata: PagedExactMetadata, rows: list[int]) -> torch.Tensor:
        context, allowed = self._contexts(metadata, rows, q.shape[2])
        width = self.spec.head_dim
        keys, values = context[..., :width], context[..., width:]
        if self.terms is None:
            return sdpa_softmax_attn(q, keys, values, allowed, self.spec.scale, self.spec.window, self.block_size)
        return scored_softmax_attn(
            q, keys, values, allowed, self.spec.scale, self.terms, self.spec.window, self.block_size
        )

    def forward(self, q, k, v, mask, keys, values, valid):
        layer, rows = self.__dict__["layer"], self.batch.rows
        if self.batch.metadata is None:
            raise RnnifyError("rnnify's paged exact attention ran outside a vLLM model step")
        metadata, cache = self.batch.metadata[layer.prefix], layer.kv_cache
        length, width, num_kv_heads = q.shape[2], self.spec.head_dim, self.spec.num_kv_heads
        starts = torch.tensor([metadata.query_start_loc[r] for r in rows], device=metadata.slot_mapping.device)
        slots = metadata.slot_mapping[(starts[:, None] + torch.arange(length, device=starts.device)).flatten()]
        block_size = cache.shape[2]
        # the new keys and values, token by token in the order of ``slots``: [B * T, Hkv, 2d]
        new = torch.cat([k, v], dim=-1).to(cache.dtype).transpose(1, 2).reshape(-1, num_kv_heads, 2 * width)
        cache[slots // block_size, :num_kv_heads, slots % block_size] = new
        groups = _similar_lengths([metadata.seq_lens[r] for r in rows])
        if len(groups) == 1:
            return self._attend(q, metadata, rows), keys, values, valid
        out = q.new_empty(*q.shape[:-1], self.spec.value_dim)
        for group in groups:
            index = torch.tensor(group, device=q.device)
            out[index] = self._attend(q.index_select(0, index), metadata, [rows[i] for i in group])
        return out, keys, values, valid


def _similar_lengths(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` in groups that left-pad to at most twice their own total (shortest
    first), so a long sequence decoding beside short ones does not pad every one of them to its length."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and lengths[i] * (len(groups[-1]) + 1) <= 2 * (total + lengths[i]):
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


def page_exact(graph: nn.Module, vllm_config: VllmConfig, first_index: int) -> tuple[list[ExactKVLayer], PagedBatch]:
    """Swap every ``ExactCell`` in ``graph`` (whole cells and head-split groups) for a
    ``PagedExactCell`` over a new paged layer; the layers (indices from ``first_index``) and the
    batch they share."""
    batch, layers = PagedBatch(), []
    sites = [(name, module) for name, module in graph.named_modules() if isinstance(module, ExactCell)]
    for name, cell in sites:
        layer = ExactKVLayer(vllm_config, first_index + len(layers), cell.spec.window)
        layers.append(layer)
        graph.set_submodule(name, PagedExactCell(cell, layer, batch))
    return layers, batch


def page_metadata() -> dict[str, PagedExactMetadata] | None:
    """The step's metadata by layer name, or None in a profiling run."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    return metadata if isinstance(metadata, dict) else None
