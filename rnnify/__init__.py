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

from typing import TYPE_CHECKING

from rnnify.errors import RnnifyError, RnnifyWarning
from rnnify.lazy import lazy_attributes

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "convert": "rnnify.compiler.convert",
    "distill": "rnnify.distillation.train",
    "load": "rnnify.runtime.storage",
    "evaluate": "rnnify.eval",
    "EvalResult": "rnnify.eval",
    "evaluate_passkey": "rnnify.passkey",
    "PasskeyResult": "rnnify.passkey",
    "benchmark": "rnnify.bench",
    "RecurrentModel": "rnnify.runtime.model",
    "RecurrentState": "rnnify.runtime.state",
}

__all__ = [*_LAZY, "RnnifyError", "RnnifyWarning", "__version__"]

if TYPE_CHECKING:
    from rnnify.bench import benchmark
    from rnnify.compiler.convert import convert
    from rnnify.distillation.train import distill
    from rnnify.eval import EvalResult, evaluate
    from rnnify.passkey import PasskeyResult, evaluate_passkey
    from rnnify.runtime.model import RecurrentModel
    from rnnify.runtime.state import RecurrentState
    from rnnify.runtime.storage import load


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
