"""Linear attention, optionally gated (scalar g: RetNet / GateLoop; per-channel gk: GLA)."""

from rnnify.kernels.linear_attn.chunk import chunk_linear_attn
from rnnify.kernels.linear_attn.fused_recurrent import fused_recurrent_linear_attn
from rnnify.kernels.linear_attn.naive import naive_recurrent_linear_attn

__all__ = ["chunk_linear_attn", "fused_recurrent_linear_attn", "naive_recurrent_linear_attn"]
