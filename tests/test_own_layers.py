"""What every family of a model's own recurrent layers does, one family at a time: its cell's fp32
forms (the chunked prefill, the step) equal its fp64 loop, a split prefill and steps equal one
prefill, and converted models equal the original ones, left padding included
(rnnify/compiler/passes/rewrite_scans.py).

Each family's test module (test_ssd_layers.py, test_selective_scan_layers.py,
test_gated_delta_layers.py, test_kda_layers.py, test_rg_lru_layers.py, test_lightning_layers.py)
holds what only it has, and what these tests take: ``CHUNK`` (its prefill's chunk), ``new_cell()``
(a cell of the module's sizes), ``reference_loop(*inputs, mask, state)`` (its fp64 loop),
``draw_inputs(gen, batch, length)`` (fp64 inputs and a state), ``MODELS`` and
``tiny_model(model_type)``, and where it has one, ``textbook(*inputs, mask, state)`` (its
equations written out per real token, fp64)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import test_gated_delta_layers
import test_kda_layers
import test_lightning_layers
import test_rg_lru_layers
import test_selective_scan_layers
import test_ssd_layers
import torch
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_outputs_and_state_close,
    assert_steps_and_split_prefill_match,
    decode,
    exact_conversions,
    original_logits,
    padding_mask,
    rel_diff,
)
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

import rnnify
from rnnify.cells import OWN_LAYERS, build_cell

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

FAMILIES = {
    "ssd": test_ssd_layers,
    "selective_scan": test_selective_scan_layers,
    "gated_delta_rule": test_gated_delta_layers,
    "kda": test_kda_layers,
    "rg_lru": test_rg_lru_layers,
    "lightning_attention": test_lightning_layers,
}
FAMILY_OF = {model: family for family, module in FAMILIES.items() for model in module.MODELS}
TRANSFORMERS_LOOPS = {"gated_delta_rule": torch_recurrent_gated_delta_rule, "kda": recurrent_kimi_delta_attention}
# a converted model's cells where not one each of its family's, short_conv and exact
CELLS = {
    "falcon_h1": {"ssd": 2, "short_conv": 2, "exact": 2},  # attention and Mamba in each layer
    "zamba": {"selective_scan": 4, "short_conv": 2, "exact": 2},  # one cell per Mamba head
    "recurrent_gemma": {"rg_lru": 2, "short_conv": 2, "exact": 1},  # two recurrent blocks, then attention
    "minimax": {"lightning_attention": 2, "exact": 1},  # no convolution
}
# the families whose tiny models are drawn so that their state moves the logits far past the tolerance
STATE_MOVES_LOGITS = {"selective_scan", "rg_lru", "lightning_attention"}
PROMPT = 70  # of 90 tokens: the prefill passes a chunk of every source's scan and cell's, then 20 steps


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("family", list(TRANSFORMERS_LOOPS))
def test_naive_loop_equals_transformers_loop(family, l2norm):
    """Against transformers' own token loop (fp32), from a nonzero state; a padded token takes no
    step: a row with padding, before and among its tokens, equals its real tokens alone."""
    module = FAMILIES[family]
    args, state = module.draw_inputs(torch.Generator().manual_seed(0), 2, 11)
    mask = padding_mask(11, [0, 3])
    mask[1, 6] = False
    out, got_state = module.reference_loop(*args, mask, state, l2norm=l2norm)
    for row in range(2):
        real = mask[row]
        want, want_state = TRANSFORMERS_LOOPS[family](
            *(a[row : row + 1, real].float() for a in args),
            initial_state=state[row : row + 1].float(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm,
        )
        torch.testing.assert_close(out[row : row + 1, real].float(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state[row : row + 1].float(), want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", [family for family, module in FAMILIES.items() if hasattr(module, "textbook")])
def test_naive_loop_equals_the_equations_with_padding(family):
    """Against the family's equations written out per real token (its module's ``textbook``): rows
    left-padded, all real, and with nothing real (the state stays)."""
    module = FAMILIES[family]
    args, state = module.draw_inputs(torch.Generator().manual_seed(0), 3, 7)
    mask = padding_mask(7, [3, 0, 7])
    want = module.textbook(*args, mask, state)
    assert_outputs_and_state_close(module.reference_loop(*args, mask, state), want, mask, tol=1e-12)


@pytest.mark.parametrize("family", ["selective_scan", "rg_lru", "lightning_attention"])
def test_cell_without_options_is_rebuilt_and_is_no_target(family):
    """A cell whose sizes are its spec's takes no option, keeps an fp32 state, and is no ``--to`` target."""
    cell = FAMILIES[family].new_cell()
    assert cell.target == family and family in OWN_LAYERS and cell.options() == {} and cell.exact
    assert cell.init_state(3, torch.device("cpu"), torch.bfloat16)[0].dtype == torch.float32
    with pytest.raises(rnnify.RnnifyError, match="window"):
        build_cell(family, cell.spec, {"window": 4})
    with pytest.raises(rnnify.RnnifyError, match=f"unknown target '{family}'"):
        rnnify.convert("unused", to=family)  # a layer's own recurrence, never a --to target


@pytest.mark.parametrize(
    ("family", "length"),
    [(family, n) for family, module in FAMILIES.items() for n in (1, 7, module.CHUNK, 2 * module.CHUNK + 22)],
)
def test_prefill_and_step_equal_the_naive_loop(family, length):
    """The fp32 chunked prefill (across chunk boundaries) and the step, from a nonzero state, with a
    left-padded row, against the fp64 loop."""
    module = FAMILIES[family]
    args, state = module.draw_inputs(torch.Generator().manual_seed(length), 2, length)
    mask = padding_mask(length, [0, length // 3])
    want = module.reference_loop(*args, mask, state)
    got = module.new_cell()(*(a.float() for a in args), mask, state.float())
    assert got[0].dtype == got[1].dtype == torch.float32 and got[0].shape == want[0].shape
    assert_outputs_and_state_close(got, want, mask, tol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_prefill_and_steps_equal_one_prefill(family):
    """Prefills of 70 and 70 tokens, then a step a token, from the state each leaves, give one
    prefill's outputs and state (inputs without a token axis, the decays' and skips' weights, go
    whole to each part)."""
    module = FAMILIES[family]
    args = [a.float() for a in module.draw_inputs(torch.Generator().manual_seed(5), 2, 150)[0]]
    cell = module.new_cell()
    mask = padding_mask(150, [0, 0])
    (state,) = cell.init_state(2, torch.device("cpu"), torch.float32)
    full, full_state = cell(*args, mask, state)
    pieces = []
    for start, stop in [(0, 70), (70, 140), *((t, t + 1) for t in range(140, 150))]:
        part = [a[:, start:stop] if a.shape[:2] == mask.shape else a for a in args]
        out, state = cell(*part, mask[:, start:stop], state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, full_state, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def converted():
    return exact_conversions(lambda model: FAMILIES[FAMILY_OF[model]].tiny_model(model))


def _without_own_state(model, state, family: str):
    """``state`` with the entries of every cell of ``family`` zeroed."""
    kinds = [cell.target for cell in model.cells for _ in cell.state_names]
    tensors = tuple(torch.zeros_like(t) if kind == family else t for kind, t in zip(kinds, state.tensors, strict=True))
    return dataclasses.replace(state, tensors=tensors)


@pytest.mark.parametrize("name", list(FAMILY_OF))
def test_exact_equals_the_original_prefill_and_steps(name, converted):
    """Past a chunk of the source's and of the cell's prefill, then stepping; where the family's
    state moves the logits, it is what the steps read."""
    family = FAMILY_OF[name]
    source, model = converted(name)
    want_cells = CELLS.get(name, dict.fromkeys([family, "short_conv", "exact"], 1))
    assert collections.Counter(cell.target for cell in model.cells) == want_cells
    ids = torch.randint(3, source.config.vocab_size, (2, 90), generator=torch.Generator().manual_seed(2))
    want = original_logits(source, ids)
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, PROMPT)[0], want) < 1e-4
    if family in STATE_MOVES_LOGITS:
        _, state = model.prefill(ids[:, :PROMPT])
        forgotten, _ = model.step(ids[:, PROMPT : PROMPT + 1], _without_own_state(model, state, family))
        assert rel_diff(forgotten, want[:, PROMPT : PROMPT + 1]) > 1e-2
    assert_steps_and_split_prefill_match(model, ids[:, :40], split=17)


@pytest.mark.parametrize("name", ["bamba", "jamba", "qwen3_next", "kimi_linear", "recurrent_gemma", "minimax"])
def test_left_padded_rows_equal_rows_alone(name, converted):
    """Rows of 3, 70 (past a chunk of every cell's) and 9 tokens."""
    _, model = converted(name)
    assert_left_padded_rows_equal_rows_alone(model, [3, 70, 9], torch.Generator().manual_seed(3), steps=5)


def test_layers_inside_a_model_of_another_module_call_the_stand_ins():
    """A composite's text path (``TextPath``) is rnnify's class around the whole's decoder: the
    stand-ins go into the modeling module of every layer, not only of the outermost class."""
    from transformers.models.kimi_linear import modeling_kimi_linear

    from rnnify.compiler.recurrences import own_recurrences
    from rnnify.compiler.recurrences.kda import KDA

    original = modeling_kimi_linear.chunk_kimi_delta_attention
    outer = torch.nn.ModuleDict({"decoder": test_kda_layers.tiny_model("kimi_linear").model})
    with own_recurrences(outer):
        assert modeling_kimi_linear.chunk_kimi_delta_attention is KDA.stand_in
    assert modeling_kimi_linear.chunk_kimi_delta_attention is original
