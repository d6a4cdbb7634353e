"""What the passes know about the conversion besides the graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rnnify.compiler.plan import ConversionPlan


@dataclass
class PassContext:
    """Settings shared by the passes.

    ``config`` is the source model's Hugging Face config (sliding windows, positions); ``plan``
    chooses the cell each attention site becomes; ``positions`` is filled by ``find_positions``;
    ``kernels`` is the backend of the fused ops (``fuse_kernels``; ``"none"``: the cells' own PyTorch forms).
    """

    config: Any = None
    plan: ConversionPlan = field(default_factory=lambda: ConversionPlan("exact"))
    positions: dict[str, Any] = field(default_factory=dict)
    kernels: str = "auto"
