"""Public names that import on first use, so that importing a package does not import what they need.

``rnnify`` and ``rnnify.distillation`` take their module ``__getattr__`` and ``__dir__`` from
``lazy_attributes``: ``import rnnify`` and the command line's ``--help`` do not pay for torch and
transformers, and the command line can import ``rnnify.distillation.options`` without torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, lazy: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for ``lazy``: public name -> the
    module that defines it. A name is imported at its first use and kept in the package from then on."""

    def __getattr__(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(lazy[name]), name)
        setattr(sys.modules[package], name, value)  # found directly from now on
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *lazy})

    return __getattr__, __dir__
