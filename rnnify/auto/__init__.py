"""``convert --to auto``: which kind each kv head gets, under a memory budget or a quality bound.

The idea: docs/math.md §Retrieval and streaming heads. Most heads lose almost nothing as a window
with sinks ("streaming"); a few read far back ("retrieval") and must stay ``exact``, or keep a long
window, or a selection cache. Each kv head is scored on calibration rows (real text, plus pass-key
prompts made here with their answers appended) with the original model, its attention replaced by
a probe that can run any head as a window or a ``select`` cell:

- ``mass``: the attention its query heads put outside what the head keeps (one forward pass);
- ``kl``: KL(original || this head alone changed) per scored token (one pass per kv head and kind).

Text scores every token; a pass-key prompt scores only the positions that predict its key. A
head's score is the mean over text plus the mean over pass-key answers: what it loses streaming,
and with ``levels`` (``--levels``, ``rnnify.auto.levels``) what it loses as each kind listed. A
kind's gain is the first minus the second. ``choose`` then starts from every head streaming and
moves heads up their ladder of kinds (``rnnify.auto.levels``: the multiple-choice knapsack's
greedy, by gain per byte) while the state at ``context`` tokens fits the budget, or, for
``max_kl``, takes the shortest prefix of the same moves whose measured KL is at most the bound.

Without ``levels`` there is one kind: ``exact``, or with ``retrieval_window`` a long window
(``retrieval_window`` tokens and the sinks; the state stops growing there, so the model decodes in
constant memory), and with ``retrieval_keep`` a ``select`` cell that also keeps that many tokens
chosen by attention. Its gain is what the head loses streaming, as the one-kind choice has always
counted it.

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
    layers_spec,
    parse_bytes,
)
from rnnify.auto.graph_probe import attention_specs, probe_runner
from rnnify.auto.levels import Level, parse_levels
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
    "Level",
    "attention_specs",
    "auto_convert",
    "calibration_rows",
    "check_memory",
    "choose",
    "choose_heads",
    "convert_chosen",
    "head_costs",
    "kv_cache_bytes",
    "layers_spec",
    "measure_kl",
    "parse_bytes",
    "parse_levels",
    "probe_runner",
    "read_scores",
    "score_heads",
]
