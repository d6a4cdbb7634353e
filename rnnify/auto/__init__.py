"""``convert --to auto``: which kv heads keep softmax, under a memory budget or a quality bound.

The idea: docs/math.md §Retrieval and streaming heads. Most heads lose almost nothing as a window
with sinks ("streaming"); a few read far back ("retrieval") and must stay ``exact``. Each kv head
is scored on calibration rows (real text, plus pass-key prompts made here with their answers
appended) with the original model, its attention replaced by a probe that can window any heads:

- ``mass``: the attention its query heads put beyond the window and sinks (one forward pass);
- ``kl``: KL(original || this head alone windowed) per scored token (one pass per kv head).

Text scores every token; a pass-key prompt scores only the positions that predict its key. A
head's score is the mean over text plus the mean over pass-key answers. ``choose`` then starts
from every head windowed and makes heads exact by score per byte while the state at ``context``
tokens fits the budget, or, for ``max_kl``, makes the best-scored heads exact until the measured
KL of the whole assignment is at most the bound (a bisection on their number).

With ``retrieval_window`` the heads chosen keep a long window (``retrieval_window`` tokens and the
sinks) instead of the whole context: the state stops growing at that window, so the model decodes in
constant memory, and a head's cost is counted at ``min(context, retrieval_window)`` tokens. The
scores stay those of the short window (what a head loses when it streams).

With ``memory`` the streaming heads are hybrids: the window and a memory of what left it
(``cells.hybrid``), gated off at first, so the scores and the choice are those of the window and
distillation then trains the memories (docs/fidelity-smollm2.md's per-head hybrid). ``memory_options``
are those hybrids' other cell options (a feature map, ``share``, ``anneal``, ``memory_init``...): the
budget counts the state they make, and the choice is still scored on the windows.
"""

from rnnify.auto.calibration import Calibration, calibration_rows
from rnnify.auto.choice import (
    HeadReport,
    choose,
    head_costs,
    kv_cache_bytes,
    layer_specs,
    layers_spec,
    parse_bytes,
)
from rnnify.auto.probe import measure_kl, score_heads
from rnnify.auto.scorer import (
    REPORT_FILE,
    HeadScorer,
    auto_convert,
    check_memory,
    choose_heads,
    convert_chosen,
    read_scores,
)
from rnnify.choices import SCORES

__all__ = [
    "REPORT_FILE",
    "SCORES",
    "Calibration",
    "HeadReport",
    "HeadScorer",
    "auto_convert",
    "calibration_rows",
    "check_memory",
    "choose",
    "choose_heads",
    "convert_chosen",
    "head_costs",
    "kv_cache_bytes",
    "layer_specs",
    "layers_spec",
    "measure_kl",
    "parse_bytes",
    "read_scores",
    "score_heads",
]
