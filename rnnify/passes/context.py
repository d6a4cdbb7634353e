"""What the passes know about the conversion besides the graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PassContext:
    """Settings shared by the passes.

    ``config`` is the source model's Hugging Face config (sliding windows, positions);
    ``target`` and ``options`` choose the cell each attention site becomes; ``positions`` is
    filled by ``find_positions``.
    """

    config: Any = None
    target: str = "exact"
    options: dict[str, Any] = field(default_factory=dict)
    positions: dict[str, Any] = field(default_factory=dict)
