"""The delta rule (DeltaNet) and its gated form (Gated DeltaNet): chunked prefill and fused step."""

from rnnify.kernels.delta_rule.chunk import chunk_delta_rule
from rnnify.kernels.delta_rule.fused_recurrent import fused_recurrent_delta_rule
from rnnify.kernels.delta_rule.naive import chunk_delta_rule_reference, naive_recurrent_delta_rule

__all__ = ["chunk_delta_rule", "chunk_delta_rule_reference", "fused_recurrent_delta_rule", "naive_recurrent_delta_rule"]
