"""rnnify: compile attention-based Hugging Face Transformers into recurrent models.

    model = rnnify.convert("path/to/hf-model", to="exact")   # or "linear"
    logits, state = model.prefill(input_ids)
    logits, state = model.step(next_ids, state)              # one token, carried state
    model.save("out/"); model = rnnify.load("out/")
    text = model.generate("def main(", max_new_tokens=40)     # text in, text out (its tokenizer)

The names below import on first use (module ``__getattr__``), so ``import rnnify`` and the
command line's ``--help`` do not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from rnnify.errors import RnnifyError

__version__ = "0.1.0"

# public name -> module that defines it; "distill" is the callable package itself
_LAZY = {
    "convert": "rnnify.convert",
    "distill": "rnnify.distill",
    "load": "rnnify.runtime.storage",
    "evaluate": "rnnify.eval",
    "EvalResult": "rnnify.eval",
    "evaluate_passkey": "rnnify.passkey",
    "PasskeyResult": "rnnify.passkey",
    "benchmark": "rnnify.bench",
    "RecurrentModel": "rnnify.runtime.model",
    "RecurrentState": "rnnify.runtime.state",
}

__all__ = [*_LAZY, "RnnifyError", "__version__"]

if TYPE_CHECKING:
    from rnnify import distill
    from rnnify.bench import benchmark
    from rnnify.convert import convert
    from rnnify.eval import EvalResult, evaluate
    from rnnify.passkey import PasskeyResult, evaluate_passkey
    from rnnify.runtime.model import RecurrentModel
    from rnnify.runtime.state import RecurrentState
    from rnnify.runtime.storage import load


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'rnnify' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if name == "distill" else getattr(module, name)
    globals()[name] = value  # found directly from now on
    return value


class _Package(types.ModuleType):
    """Keeps ``rnnify.convert`` the function when the submodule of that name is imported first
    (the import system binds a submodule to its parent's attribute of the same name)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and name != "distill" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


sys.modules[__name__].__class__ = _Package
