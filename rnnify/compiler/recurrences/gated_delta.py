"""The gated delta rule (``torch_chunk_gated_delta_rule``: Qwen3-Next, Qwen3.5, OLMo-hybrid, Lara-mini)
as ``rnnify::gated_delta_rule``, carried by ``GatedDeltaRuleCell``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from rnnify.cells.base import Cell
from rnnify.cells.gated_delta import GatedDeltaRuleCell
from rnnify.compiler.recurrences.family import OwnRecurrence, from_zero_state, shape, whole_sequence
from rnnify.errors import UnsupportedModelError


def delta_rule_op(name: str, cell_for: Callable[..., Cell]) -> torch._ops.OpOverload:
    """Register ``rnnify::<name>(query, key, value, g, beta, l2norm)``, a delta-rule layer over whole
    sequences from the zero state (the captured graph's own meaning), computed by the cell
    ``cell_for(query.shape, value.shape, l2norm)``; its output is the values' shape in the queries' dtype."""

    @torch.library.custom_op(f"rnnify::{name}", mutates_args=())
    def op(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, l2norm: bool
    ) -> torch.Tensor:
        return from_zero_state(cell_for(query.shape, value.shape, l2norm), query, key, value, g, beta)

    @op.register_fake
    def _(query, key, value, g, beta, l2norm):
        return value.new_empty(value.shape, dtype=query.dtype)

    return getattr(torch.ops.rnnify, name).default


def _cell_for(query_shape, value_shape, l2norm: bool) -> GatedDeltaRuleCell:
    """The cell of queries/keys ``[B, T, H_k, d_k]`` and values ``[B, T, H_v, d_v]``."""
    (*_, key_heads, key_dim), (*_, value_heads, value_dim) = query_shape, value_shape
    return GatedDeltaRuleCell(GatedDeltaRuleCell.spec_for(value_heads, key_dim, value_dim), key_heads, l2norm)


def delta_rule_family(function: str, name: str, cell_for: Callable[..., Cell], layer: str) -> OwnRecurrence:
    """The ``OwnRecurrence`` of a delta-rule layer whose modeling module's ``function`` has the
    signature of transformers' ``torch_chunk_gated_delta_rule`` (``chunk_size`` only splits the
    source's computation, never changes its result), as ``rnnify::<name>`` computed by
    ``cell_for`` (``delta_rule_op``); ``layer`` names the layer in messages."""
    op = delta_rule_op(name, cell_for)

    def stand_in(
        query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, **kwargs,
    ):  # fmt: skip
        if initial_state is not None or output_final_state:
            raise UnsupportedModelError(f"a {layer} layer was called with a cache during capture")
        return op(query, key, value, g, beta, use_qk_l2norm_in_kernel), None

    def cell(args):
        *tensors, l2norm = args
        query, key, value, g, beta = (whole_sequence(node) for node in tensors)
        return cell_for(shape(query), shape(value), l2norm), (query, key, value, g, beta)

    return OwnRecurrence(function, stand_in, op, cell)


GATED_DELTA = delta_rule_family("torch_chunk_gated_delta_rule", "gated_delta_rule", _cell_for, "gated delta rule")
