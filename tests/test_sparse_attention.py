"""Sparse attention by an indexer (DeepSeek-V3.2's DSA) converts exactly (rnnify/cells/index_select.py,
rnnify/compiler/passes/find_selection.py).

The tiny models keep 8 keys a query and give the indexer 16 heads: a random indexer with few heads
often scores several keys exactly 0 (every head's relu zero), a tie the source itself breaks one way
in a prompt and another in its cached decode; with 16 such ties are too rare to meet. At 40 tokens
the selection drops most keys, and the original with every key kept differs, so a conversion that
dropped the indexer would fail here.
"""

from __future__ import annotations

import copy
import functools
import sys
import types
from pathlib import Path

import pytest
import torch
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_round_trips_a_save,
    decode,
    original_logits,
    rel_diff,
    tiny_causal_lm,
)
from test_export_capture import DEEPSEEK_V32

import rnnify
from rnnify.cells import CellSpec, build_cell
from rnnify.cells.exact import selected_softmax_attn
from rnnify.cells.index_select import naive_selected_softmax_attn
from rnnify.compiler.passes.find_selection import find_selection
from rnnify.errors import RnnifyError, UnsupportedModelError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from arch_configs import build  # noqa: E402

TOPK = 8
SPARSE = dict(DEEPSEEK_V32, index_topk=TOPK, index_n_heads=16)
LENGTH = 40


def _model(model_type: str = "deepseek_v32", **changes):
    return tiny_causal_lm(model_type, **{**SPARSE, **changes})


@pytest.fixture(scope="module")
def dsa_exact():
    """The tiny DeepSeek-V3.2's exact conversion, shared by the tests that only read it."""
    return rnnify.convert(_model(), to="exact")


def _ids(length: int = LENGTH, batch: int = 2) -> torch.Tensor:
    return torch.randint(
        3, DEEPSEEK_V32["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(length)
    )


def _index_inputs(batch, length, total, heads=16, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    index_q = torch.randn(batch, length, heads, dim, generator=gen, dtype=torch.float64)
    index_keys = torch.randn(batch, total, dim, generator=gen, dtype=torch.float64)
    index_weights = torch.randn(batch, length, heads, generator=gen, dtype=torch.float64)
    return index_q, index_keys, index_weights


@pytest.mark.parametrize("length", [1, 5, 19])
@pytest.mark.parametrize("sinks", [None, (0.5, -1.0, 0.0, 2.0)])
def test_block_form_equals_one_query_at_a_time(length, sinks):
    """The cell's path (blocks of queries, SDPA under the selection's mask) is the naive ranking and
    softmax, in float64, for a prompt (length 19 of 19), a continuation and one decode step, with
    padding, grouped heads and sink logits."""
    gen = torch.Generator().manual_seed(length)
    batch, total, topk, scale = 2, 19, 6, 0.3
    q = torch.randn(batch, 4, length, 8, generator=gen, dtype=torch.float64)
    keys = torch.randn(batch, 2, total, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, 2, total, 5, generator=gen, dtype=torch.float64)
    valid = torch.ones(batch, total, dtype=torch.bool)
    valid[1, :4] = False  # a left-padded row
    index = _index_inputs(batch, length, total, seed=length)
    want = naive_selected_softmax_attn(q, keys, values, valid, scale, *index, topk, 0.7, sinks)
    spec = CellSpec(4, 2, 8, 5, scale, sink_logits=sinks, index_topk=topk, index_dim=8, index_scale=0.7)
    terms = build_cell("exact", spec).terms
    got = selected_softmax_attn(q, keys, values, valid, scale, *index, topk, 0.7, block_size=4, terms=terms)
    assert torch.allclose(got, want, atol=1e-12)
    every_key = naive_selected_softmax_attn(q, keys, values, valid, scale, *index, total, 0.7, sinks)
    assert not torch.allclose(every_key, want, atol=1e-3)  # the selection matters


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_deepseek_v32_converts_exactly_past_its_selection(attention):
    """Prompt and step by step, the conversion gives the original's logits (float64) at 40 tokens,
    where each query reads 8 of up to 40 keys; the original keeping every key differs there. Its
    SDPA masks with booleans, its eager attention adds a float mask."""
    source = _model()
    source.set_attn_implementation(attention)
    converted = rnnify.convert(source, to="exact")
    assert [cell.spec.index_topk for cell in converted.cells] == [TOPK, TOPK]
    ids = _ids()
    want = original_logits(copy.deepcopy(source).double(), ids)
    assert rel_diff(converted.prefill(ids)[0], want) < 1e-5
    assert rel_diff(decode(converted, ids, 11)[0], want) < 1e-5
    every_key = original_logits(_model(index_topk=LENGTH), ids)
    assert rel_diff(every_key, want) > 1e-2


def test_selection_state_round_trips_and_left_padding_is_invisible(tmp_path, dsa_exact):
    converted = dsa_exact
    state = converted.prefill(_ids(12))[1]
    assert converted.cells[0].state_names[-1] == "index_keys"
    assert state.tensors[3].shape == (2, 12, DEEPSEEK_V32["index_head_dim"])  # the first cell's index keys
    assert_round_trips_a_save(converted, tmp_path / "dsa", _ids())
    assert_left_padded_rows_equal_rows_alone(converted, [3, 17, 30], torch.Generator().manual_seed(0), steps=6)


def _built(name: str, **changes):
    """``arch_configs``' tiny ``name`` keeping 16 keys a query, with an indexer of 16 heads."""
    model, _ = build(name)
    for key, value in {"index_topk": 16, "index_n_heads": 16, **changes}.items():
        setattr(model.config.get_text_config(decoder=True), key, value)
    torch.manual_seed(0)
    return type(model)(model.config).eval()


@pytest.mark.parametrize(
    "name",
    # slow: AXK2 (DeepSeek-V3.2's layers), HY-V4, dots3 and Mistral Large 4 (the architecture sweep
    # converts each exactly below its selection); the default suite keeps GLM-MoE-DSA's
    [
        "glm_moe_dsa",
        *(
            pytest.param(name, marks=pytest.mark.slow)
            for name in ("hy_v4", "axk2", "dots3_note_text", "mistral_large4")
        ),
    ],
)
def test_kin_of_deepseek_v32_convert_exactly(name):
    """GLM-MoE-DSA (interleaved rope; its second layer reuses the first's selection), HY-V4 (the
    scale folded into the weights, learned sinks), AXK2, dots3 (a sliding-window layer beside) and
    Mistral Large 4 (a vision-language whole that caps its logits, taken out as ``TextPath`` with
    the cap) at 40 tokens, prompt and steps, against the original in float32 (their experts run no
    float64)."""
    changes = {"indexer_types": ["full", "shared"]} if name == "glm_moe_dsa" else {}
    source = _built(name, **changes)
    converted = rnnify.convert(source, to="exact")
    ids = _ids()
    want = original_logits(source, ids)
    selecting = [cell.spec.index_topk for cell in converted.cells if cell.spec.selects]
    assert selecting == [16] * (1 if name == "dots3_note_text" else 2)
    assert rel_diff(converted.prefill(ids)[0], want) < 1e-5
    assert rel_diff(decode(converted, ids, 11)[0], want) < 1e-5
    assert rel_diff(original_logits(_built(name, **changes, index_topk=LENGTH), ids), want) > 1e-3


def test_other_targets_auto_and_vllm_refuse_the_selection_in_one_line(tmp_path, dsa_exact):
    source = _model()
    with pytest.raises(RnnifyError, match=r"^layer 0 .*indexer selects \(sparse attention\), which only --to exact"):
        rnnify.convert(source, to="window")
    from rnnify.auto.graph_probe import probe_runner

    with pytest.raises(
        RnnifyError, match=r"--to auto does not score sparse attention yet \(model.layers.0.self_attn.indexer"
    ):
        probe_runner(source, torch.float32, _ids(8))
    from rnnify.integrations.vllm.hosting import check_hostable

    path = dsa_exact.save(tmp_path / "dsa")
    with pytest.raises(RnnifyError, match=r"indexer selects \(sparse attention\), which rnnify's vLLM pages do not"):
        check_hostable(path)


def _indexers_calling(source, swap: dict) -> None:
    """Make every indexer of ``source`` run with the attributes ``swap`` names (``"torch.Tensor.topk"``,
    ...) replaced, as an indexer of another form would compute."""
    for layer in source.model.layers:
        indexer = layer.self_attn.indexer
        forward = type(indexer).forward

        def swapped(*args, _forward=forward, **kwargs):
            with pytest.MonkeyPatch.context() as patch:
                for name, value in swap.items():
                    patch.setattr(name, value)
                return _forward(*args, **kwargs)

        indexer.forward = swapped.__get__(indexer)


def _lowest(scores, k, dim=-1):
    return torch.topk(scores, k, dim, largest=False)


def _every_key_ranked(scores, k, dim=-1):
    return types.SimpleNamespace(indices=scores.argsort(dim, descending=True))


@pytest.mark.parametrize(
    "swap, refusal",
    [
        ({"torch.nn.functional.relu": torch.sigmoid}, r"not an indexer's sum_h w_h relu"),  # another score
        ({"torch.Tensor.topk": _lowest}, r"not an indexer's sum_h w_h relu"),  # the lowest k
        (
            {"torch.Tensor.topk": _every_key_ranked},
            r"its indexer selects the keys each query reads in a way",
        ),  # no top-k
    ],
)
def test_an_indexer_of_another_form_is_refused_by_name(swap, refusal):
    """An indexer the pass cannot read, or one whose selection reaches the mask by no top-k it
    recognises, is refused naming it, never dropped."""
    source = _model()
    _indexers_calling(source, swap)
    with pytest.raises(
        UnsupportedModelError, match=rf"sparse attention \(model.layers.0.self_attn.indexer[,)].*{refusal}"
    ):
        rnnify.convert(source, to="exact")


class _Selecting(torch.nn.Module):
    """Attention over an indexer's top 4 keys, the selection reaching the mask as ``unselected`` says:
    ``"false"`` the source's way (False scattered into ones: True where not selected), ``"true"``
    flipped (keeping the keys it did not select), ``"values"`` through the top-k's values,
    ``"float"`` through a float tensor (found all the same, and refused: not the source's form);
    ``"biased"`` the source's way, a learned bias added to the scores it ranks."""

    def __init__(self, unselected: str):
        super().__init__()
        self.unselected = unselected
        self.bias = torch.nn.Parameter(torch.randn(6)) if unselected == "biased" else None

    def forward(self, q, k, v, index_q, index_k, weights):
        length = q.shape[2]
        scores = torch.matmul(index_q, index_k.transpose(-1, -2).unsqueeze(1)) * 0.5
        scores = torch.matmul(weights.unsqueeze(-2), torch.nn.functional.relu(scores)).squeeze(-2)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if self.bias is None:
            top = scores.masked_fill(~causal, float("-inf")).topk(4, dim=-1)
        else:  # added where the source adds its float mask: a learned term in the ranking
            top = (scores + self.bias).topk(4, dim=-1)
        ones = top.indices.new_ones((q.shape[0], length, length), dtype=torch.bool)
        if self.unselected == "values":
            unselected = ones & (top.values.amax(-1, keepdim=True) > 0)
        elif self.unselected == "float":  # the selection as floats first, from a float made like the scores
            unselected = torch.zeros_like(scores).scatter(-1, top.indices, 1.0) < 0.5
        else:
            unselected = ones.scatter(-1, top.indices, self.unselected == "true")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~unselected[:, None])


@pytest.mark.parametrize("unselected", ["false", "true", "values", "float", "biased"])
def test_only_a_mask_keeping_the_selected_keys_alone_is_read(unselected):
    """``find_selection`` reads the source's form and refuses a top-k that reaches the mask otherwise."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    inputs = (q, k, v, torch.randn(1, 6, 3, 8, generator=gen), torch.randn(1, 6, 8, generator=gen))
    module = torch.export.export(_Selecting(unselected), (*inputs, torch.randn(1, 6, 3, generator=gen))).module()
    graph = module.graph  # its weights get_attr nodes, as in a captured graph
    sdpa = next(n for n in graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    find = functools.partial(find_selection, sdpa, [sdpa.args[3]], set(sdpa.args[:3]), "site")
    if unselected == "false":
        selection = find()
        assert (selection.query, selection.key, selection.weights) == tuple(placeholders[3:6])
        assert (selection.topk, selection.scale) == (4, 0.5)
    elif unselected == "biased":
        with pytest.raises(UnsupportedModelError, match=r"^site: sparse attention .*not an indexer's sum_h"):
            find()
    else:
        with pytest.raises(UnsupportedModelError, match=r"^site: sparse attention .*uses a top-k otherwise"):
            find()


def test_tools_that_build_or_judge_the_state_know_the_selection(dsa_exact):
    """``rnnify bench`` fills the index keys with the rest of a grown state; the ahead-of-time step
    is refused in words; attention transfer leaves the selected layers out (only exact computes
    them); ``verify`` on fewer tokens than the selection keeps says what a longer run would check."""
    from rnnify.bench import fill_state
    from rnnify.original.attention import attention_transfer
    from rnnify.runtime.aot import refusal
    from rnnify.verify import run_checks

    converted = dsa_exact
    state = fill_state(converted, context=30, batch=1, fill_tokens=4)
    logits, _ = converted.step(_ids(1, batch=1), state)
    assert torch.isfinite(logits).all()
    assert "not built for sparse attention" in refusal(converted)
    assert converted.cells[0].describe() == f"reads the {TOPK} keys its indexer selects"
    with attention_transfer(converted) as recorder:
        converted.prefill(_ids(12))
    assert recorder.compared == []
    notes = {result.note for result in run_checks(converted, tokens=6, batch=1)}
    assert any(f"holds {TOPK} tokens; --tokens {TOPK + 6} checks" in note for note in notes)
