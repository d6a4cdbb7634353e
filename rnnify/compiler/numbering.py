"""Where the source's positions start, found by running it once before capture.

The captured graph takes explicit ``position_ids``, which the runtime counts from 0 over a row's
real tokens. Most models number positions that way themselves, but RoBERTa's family (roberta,
xlm-roberta, camembert, data2vec-text, xmod, ... run as decoders) follows fairseq: positions start
at ``padding_idx + 1`` (and a token that is the padding id gets ``padding_idx``). Handed 0-based
positions, such a model reads rows of its position table it was never trained on.

So the source runs on a short probe of tokens other than its padding id three ways: numbering its
positions itself, given positions from 0, and given positions from ``padding_idx + 1``. The first
start that gives the source's own logits is added to the runtime's positions in the captured
graph; a model that matches neither numbers its positions in a way rnnify does not know, and is
refused before capture rather than converted wrong.

A padding id read as a real token (tokenizers do not produce it from text; a model may generate
it) is numbered like any other token. The original gives it ``padding_idx``, and from there the two
differ; ``convert`` says so in a warning (``runtime.agreement``). The graph could set it apart too,
but a position that does not follow the one before it is how transformers' mask construction
recognises packed sequences, and the attention probe (``find_attention``) would then see a mask
that is not causal.
"""

from __future__ import annotations

import torch

from rnnify.errors import UnsupportedModelError, first_line
from rnnify.runtime.agreement import padding_id, relative_difference, tokens_but, tolerance

__all__ = ["first_position"]

_PROBE_BATCH, _PROBE_LENGTH = 2, 8


@torch.no_grad()
def first_position(model: torch.nn.Module, vocab_size: int) -> int:
    """The position ``model`` gives a row's first token (see the module docstring); refused when
    rnnify does not know its numbering, or when the model rejects token ids alone (it needs images,
    audio or another model's cache)."""
    device = next(model.parameters()).device
    padding = padding_id(model, vocab_size)
    ids = tokens_but(padding, vocab_size, (_PROBE_BATCH, _PROBE_LENGTH), seed=0).to(device)
    try:
        own = model(input_ids=ids, use_cache=False).logits
    except (ValueError, TypeError) as exc:  # how a model says it needs its images, audio or other inputs
        raise UnsupportedModelError(
            f"{type(model).__name__} fails when run on token ids alone ({first_line(exc, with_type=True)}); "
            "rnnify converts language models that read text"
        ) from exc
    except (torch.OutOfMemoryError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - the source's own failure (Inkling 2's head in bfloat16), in one line
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        attention = getattr(model.config, "_attn_implementation", None)
        raise UnsupportedModelError(
            f"{type(model).__name__} fails when run on token ids, in {dtype} with its {attention} attention, "
            f"before capture ({first_line(exc, with_type=True)})"
        ) from exc
    counted = torch.arange(_PROBE_LENGTH, device=device).expand(_PROBE_BATCH, -1)
    limit = tolerance(own.dtype)
    differences = []
    for first in [0] + ([padding + 1] if padding is not None else []):
        logits = model(input_ids=ids, position_ids=counted + first, use_cache=False).logits
        differences.append(relative_difference(logits, own))
        if differences[-1] <= limit:
            return first
    raise UnsupportedModelError(
        f"{type(model).__name__} numbers its positions in a way rnnify does not know: its logits differ "
        f"from those it gives with positions 0, 1, 2, ... (relative difference {differences[0]:.2g})"
        + (f" and from padding_idx + 1 = {padding + 1} on ({differences[1]:.2g})" if len(differences) > 1 else "")
    )
