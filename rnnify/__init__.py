"""rnnify: compile attention-based Hugging Face Transformers into recurrent models.

    model = rnnify.convert("path/to/hf-model", to="exact")   # or "linear"
    logits, state = model.prefill(input_ids)
    logits, state = model.step(next_ids, state)              # one token, carried state
    model.save("out/"); model = rnnify.load("out/")
"""

__version__ = "0.1.0"

from rnnify.convert import convert
from rnnify import distill
from rnnify.errors import RnnifyError
from rnnify.eval import EvalResult, evaluate
from rnnify.passkey import PasskeyResult, evaluate_passkey
from rnnify.runtime.model import RecurrentModel
from rnnify.runtime.state import RecurrentState
from rnnify.runtime.storage import load

__all__ = ["convert", "distill", "load", "evaluate", "EvalResult", "evaluate_passkey", "PasskeyResult", "RecurrentModel", "RecurrentState", "RnnifyError", "__version__"]
