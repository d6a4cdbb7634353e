"""Sparse attention over pools of keys converts exactly: Qwen4-Exp's QSA (rnnify/cells/index_select.py's
block form) and GLM-5-Next's k-pool indexer (rnnify/cells/pool_select.py), both captured as one op
(rnnify/compiler/block_selection.py).

The tiny models read 2 pools of 4 keys a query (a budget of 8) beside their unfinished pool. Their
indexers have 2 heads unless said otherwise: pools often score exactly 0 (both heads' relu zero),
ties the conversion must break as the source does. At 40 tokens the selection drops most keys, and
the original with every key kept differs, so a conversion that dropped the indexer would fail here.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_round_trips_a_save,
    decode,
    original_logits,
    rel_diff,
)

import rnnify
from rnnify.cells import CellSpec, build_cell
from rnnify.cells.index_select import BlockRanking, naive_block_selection
from rnnify.compiler.passes.find_selection import find_selection
from rnnify.errors import RnnifyError, UnsupportedModelError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from arch_configs import build  # noqa: E402

LENGTH = 40
BUDGET, RATIO = 8, 4  # arch_configs' tiny Qwen4-Exp; the tiny GLM-5-Next's here


def _qwen4(**changes):
    """``arch_configs``' tiny Qwen4-Exp (a Gated DeltaNet layer, then an indexed attention layer) with ``changes``."""
    model, _ = build("qwen4_exp_text")
    for key, value in changes.items():
        setattr(model.config, key, value)
    torch.manual_seed(0)
    return type(model)(model.config).eval()


@pytest.fixture(scope="module")
def qsa_exact():
    return rnnify.convert(_qwen4(), to="exact")


def _ids(length: int = LENGTH, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(length))


@pytest.mark.parametrize("length", [1, 6, 23])
def test_block_ranking_chooses_the_keys_the_source_s_loop_chooses(length):
    """The source's own ``_select_tokens``, ``naive_block_selection`` and the cell's ``BlockRanking``
    choose the same keys for a prompt (23 of 23 tokens), a continuation and one decode step: a
    left-padded row, a row whose index queries are 0 (every block ties), a norm weight of its own
    and a rotary part narrower than the key."""
    indexer = _qwen4().model.layers[1].self_attn.indexer
    gen = torch.Generator().manual_seed(length)
    batch, total, heads, dim, rotary = 3, 23, 2, indexer.index_head_dim, 12
    with torch.no_grad():
        indexer.k_layernorm.weight.copy_(torch.randn(dim, generator=gen))
    q = torch.randn(batch, length, heads, dim, generator=gen)
    q[2] = 0.0
    raw = torch.randn(batch, total, dim, generator=gen)
    cos, sin = torch.randn(2, batch, total, rotary, generator=gen)
    valid = torch.ones(batch, total, dtype=torch.bool)
    valid[1, :5] = False
    q_pos = torch.arange(total - length, total)
    visible = valid[:, None, :] & (torch.arange(total)[None, None, :] <= q_pos[None, :, None])
    with torch.no_grad():
        source = indexer._select_tokens(torch.zeros(batch, length, 4), q, raw, cos, sin, visible[:, None])[:, 0]
    norm = indexer.k_layernorm
    index_keys = torch.cat([raw, cos, sin], dim=-1)
    naive = naive_block_selection(q, index_keys, visible, norm.weight, norm.eps, RATIO, BUDGET)
    cell = BlockRanking(index_keys, valid, dim, norm.weight, norm.eps, RATIO, BUDGET).read(q, q_pos)
    assert torch.equal(naive, source) and torch.equal(cell, source)
    if length > 1:
        assert (source.sum(-1) < visible.sum(-1)).any()  # the selection drops keys


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_qwen4_exp_converts_exactly_past_its_selection(attention, qsa_exact):
    """Prompt and step by step, the conversion gives the original's logits at 40 tokens, where each
    query reads at most 11 of up to 40 keys; the original keeping every key differs there. Its SDPA
    ands a boolean selection into the mask, its eager attention fills a float mask."""
    source = _qwen4()
    source.set_attn_implementation(attention)
    converted = qsa_exact if attention == "sdpa" else rnnify.convert(source, to="exact")
    (spec,) = [cell.spec for cell in converted.cells if cell.spec.selects]
    assert (spec.index_topk, spec.index_block, spec.index_pool, spec.selected_keys) == (BUDGET, RATIO, "mean", 11)
    ids = _ids()
    want = original_logits(source, ids)
    assert rel_diff(converted.prefill(ids)[0], want) < 1e-5
    assert rel_diff(decode(converted, ids, 11)[0], want) < 1e-5
    every_key = original_logits(_qwen4(indexer_budget=LENGTH), ids)
    assert rel_diff(every_key, want) > 1e-3


def test_block_selection_state_round_trips_and_left_padding_is_invisible(tmp_path, qsa_exact):
    converted = qsa_exact
    cell = next(cell for cell in converted.cells if cell.spec.selects)
    assert cell.state_names[-1] == "index_keys"
    assert (
        cell.describe() == f"reads the {BUDGET // RATIO} pools of {RATIO} keys its indexer selects and its latest keys"
    )
    assert_round_trips_a_save(converted, tmp_path / "qsa", _ids())
    assert_left_padded_rows_equal_rows_alone(converted, [3, 17, 30], torch.Generator().manual_seed(0), steps=6)


def test_other_targets_refuse_a_pooling_selection_counting_the_keys_a_query_reads():
    """Only ``exact`` computes a selection (the conversion names the layer, as for DSA's in
    tests/test_sparse_attention.py); the refusal counts a query's pools and its unfinished pool."""
    spec = CellSpec(4, 2, 8, 8, 0.5, index_topk=8, index_dim=24, index_block=4, index_pool="mean", index_eps=1e-6)
    with pytest.raises(RnnifyError, match=r"^target 'window': this attention reads only the 11 earlier keys its"):
        build_cell("window", spec)


def test_a_pooling_spec_states_what_it_needs():
    pooled = dict(index_topk=8, index_dim=24, index_block=4)
    mean = CellSpec(4, 2, 8, 8, 0.5, **pooled, index_pool="mean", index_eps=1e-6)
    gated = CellSpec(4, 2, 8, 8, 0.5, **pooled, index_pool="gated", index_scale=0.25)
    assert CellSpec(**mean.to_json()) == mean and CellSpec(**gated.to_json()) == gated
    assert mean.selected_keys == gated.selected_keys == 11
    refused = [
        (dict(pooled, index_pool="mean", index_eps=1e-6, index_scale=0.25), "a mean-pooling indexer needs"),
        (dict(pooled, index_pool="mean"), "a mean-pooling indexer needs"),
        (dict(pooled, index_pool="gated", index_eps=1e-6, index_scale=0.25), "a gated-pooling indexer needs"),
        (dict(pooled, index_pool="max", index_scale=0.25), "index_pool must be 'mean' or 'gated'"),
        (dict(pooled, index_scale=0.25), "a pooling indexer needs index_block and index_pool"),
        (dict(index_topk=8, index_dim=8, index_scale=0.5, index_eps=1e-6), "index_eps belongs to a pooling"),
    ]
    for fields, message in refused:
        with pytest.raises(ValueError, match=message):
            CellSpec(4, 2, 8, 8, 0.5, **fields)


def _mask(use: str, causal, selected, dtype):
    """An SDPA mask made from a pool selection (True: read): in ``READ`` the ways the sources use it,
    the others reading keys the selection does not keep (``MASKS``)."""
    lowest = torch.finfo(dtype).min
    if use == "and":  # Qwen4-Exp's SDPA path
        return causal & selected
    if use == "itself":  # GLM-5-Next's SDPA path
        return selected
    if use == "filled":  # the eager paths
        return torch.zeros(selected.shape, dtype=dtype).masked_fill(~selected, lowest)
    if use == "dropped":
        return causal & ~selected
    if use == "either":
        return causal | selected
    if use == "negated and":
        return ~(causal & selected)
    if use == "cast":  # a 0/1 bias: every key read
        return selected.to(dtype)
    return torch.zeros(selected.shape, dtype=dtype).masked_fill(~selected, 0.0)  # "filled with 0"


MASKS = ("and", "itself", "filled", "dropped", "either", "negated and", "cast", "filled with 0")
READ = ("and", "itself", "filled")


class _PoolSelecting(torch.nn.Module):
    """Attention masked by a pool selection op as ``use`` names (``_mask``)."""

    def __init__(self, op: str, use: str):
        super().__init__()
        self.op, self.use = op, use
        self.learned = torch.nn.Parameter(torch.zeros(2, 8) if op == "gated" else torch.zeros(8))

    def forward(self, q, k, v, index_q, index_keys, weights):
        length = q.shape[2]
        causal = torch.ones(length, length, dtype=torch.bool).tril().expand(q.shape[0], -1, -1)
        if self.op == "mean":
            selected = torch.ops.rnnify.block_index_select(index_q, index_keys, causal, self.learned, 1e-6, 2, 4)
        else:
            valid = torch.ones(q.shape[0], length, dtype=torch.bool)
            keys = index_keys[..., :16]
            selected = torch.ops.rnnify.pool_index_select(index_q, keys, weights, valid, self.learned, 0.5, 4, 2)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=_mask(self.use, causal, selected, q.dtype)[:, None]
        )


@pytest.mark.parametrize("op", ["mean", "gated"])
@pytest.mark.parametrize("use", MASKS)
def test_only_a_mask_keeping_the_selected_pools_alone_is_read(op, use):
    """``find_selection`` reads either op where the mask keeps the selected keys alone (and-ed into a
    mask, SDPA's mask itself, or filling a float mask with the lowest value) and refuses every other use."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    index = (
        torch.randn(1, 6, 3, 8, generator=gen),
        torch.randn(1, 6, 24, generator=gen),
        torch.randn(1, 6, 3, generator=gen),
    )
    graph = torch.export.export(_PoolSelecting(op, use), (q, k, v, *index)).module().graph
    sdpa = next(n for n in graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    find = functools.partial(find_selection, sdpa, [sdpa.args[3]], set(sdpa.args[:3]), "site")
    if use not in READ:
        with pytest.raises(UnsupportedModelError, match=r"^site: sparse attention .*pool selection otherwise"):
            find()
        return
    selection = find()
    learned = next(n for n in graph.nodes if n.op == "get_attr")
    assert (selection.query, selection.pool_weight, selection.topk, selection.block) == (placeholders[3], learned, 4, 2)
    if op == "mean":
        assert (selection.key, selection.pool, selection.eps) == (placeholders[4], "mean", 1e-6)
        assert selection.weights is None and selection.scale is None
    else:
        assert (selection.weights, selection.pool, selection.scale, selection.eps) == (
            placeholders[5],
            "gated",
            0.5,
            None,
        )


def test_bench_fills_and_verify_counts_the_block_selection(qsa_exact):
    """``rnnify bench`` fills the index keys (with their rotary tables) with the rest of a grown state;
    ``verify`` on fewer tokens than a query may read says what a longer run would check."""
    from rnnify.bench import fill_state
    from rnnify.verify import run_checks

    state = fill_state(qsa_exact, context=30, batch=1, fill_tokens=4)
    logits, _ = qsa_exact.step(_ids(1, batch=1), state)
    assert torch.isfinite(logits).all()
    notes = {result.note for result in run_checks(qsa_exact, tokens=6, batch=1)}
    assert any("holds 11 tokens; --tokens 17 checks" in note for note in notes)


def _glm5(**changes):
    """``arch_configs``' tiny GLM-5-Next reading 2 pools of 4 keys: a Kimi Delta layer, then two indexed
    attention layers, the second reusing the first's selection ("shared"), with ``changes``."""
    model, _ = build("glm5_next")
    text = model.config.get_text_config(decoder=True)
    layers = dict(
        num_hidden_layers=3,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        indexer_types=["full", "full", "shared"],
    )
    for key, value in {"index_topk": BUDGET, "index_kpool": RATIO, **layers, **changes}.items():
        setattr(text, key, value)
    torch.manual_seed(0)
    return type(model)(model.config).eval()


@pytest.fixture(scope="module")
def glm5_exact():
    return rnnify.convert(_glm5(index_n_heads=16), to="exact")


@pytest.fixture(scope="module")
def glm5_ties():
    """The tiny GLM-5-Next with 2 index heads (pools tie at 0) and its exact conversion."""
    source = _glm5()
    return source, rnnify.convert(source, to="exact")


@pytest.mark.parametrize("dtype, draws", [(torch.float32, 1), (torch.bfloat16, 30)])
def test_pool_ranking_chooses_the_keys_the_source_s_indexer_chooses(dtype, draws):
    """The source's own ``Glm5NextTextIndexer.forward`` and mask (``build_attention_mask_from_topk``)
    and ``pooled_selection`` choose the same keys for a prompt with left-padded rows, learned slot
    logits of their own and a row whose every pool ties at 0; in bfloat16 over 30 draws, where the
    pooling's weights rounded to the keys' dtype decide some selections."""
    from rnnify.cells.pool_select import pooled_selection

    attention = _glm5().to(dtype).model.language_model.layers[1].self_attn
    indexer = attention.indexer
    batch, length = 4, 37
    valid = torch.ones(batch, length, dtype=torch.bool)
    valid[1, :5], valid[2, :14] = False, False
    for draw in range(draws):
        gen = torch.Generator().manual_seed(draw)
        with torch.no_grad():
            for parameter in (indexer.index_kpool_compress_ape, indexer.index_kpool_compress_gate):
                parameter.copy_(torch.randn(parameter.shape, generator=gen))
        hidden = torch.randn(batch, length, indexer.hidden_size, generator=gen).to(dtype)
        q_resid = torch.randn(batch, length, indexer.q_lora_rank, generator=gen).to(dtype)
        q_resid[3] = 0.0  # index queries 0: every pool scores 0
        with torch.no_grad():
            indices = indexer(hidden_states=hidden, q_resid=q_resid, attention_mask=valid, cache=None)
            source = attention.build_attention_mask_from_topk(indices, torch.zeros(1), length)[:, 0]
            q = indexer.wq_b(q_resid).view(batch, length, -1, indexer.head_dim)
            keys = torch.cat(
                [indexer.k_norm(indexer.wk(hidden)), F.linear(hidden, indexer.index_kpool_compress_gate)], -1
            )
            weights = indexer.weights_proj(hidden).float() * indexer.n_heads**-0.5
            ape = indexer.index_kpool_compress_ape
            got = pooled_selection(q, keys, weights, valid, ape, indexer.softmax_scale, BUDGET, RATIO)
        assert torch.equal(got, source), draw
    causal = torch.ones(length, length, dtype=torch.bool).tril() & valid[:, None, :] & valid[:, :, None]
    assert (source.sum(-1) < causal.sum(-1)).any()  # the selection drops keys


def test_glm5_next_converts_exactly_past_its_selection(glm5_exact):
    """Prompt and step by step, the conversion gives the original's logits at 40 tokens, the shared
    layer reading the first's selection; the original keeping every key differs there."""
    specs = [cell.spec for cell in glm5_exact.cells if cell.spec.selects]
    assert [(s.index_topk, s.index_block, s.index_pool) for s in specs] == [(BUDGET, RATIO, "gated")] * 2
    ids = _ids()
    want = original_logits(_glm5(index_n_heads=16), ids)
    assert rel_diff(glm5_exact.prefill(ids)[0], want) < 1e-5
    assert rel_diff(decode(glm5_exact, ids, 11)[0], want) < 1e-5
    assert rel_diff(original_logits(_glm5(index_n_heads=16, index_topk=LENGTH), ids), want) > 1e-3


def test_glm5_next_breaks_ties_as_the_source_does_in_a_prompt_and_in_its_cached_decode(glm5_ties):
    """With 2 index heads, pools tie at 0 and the source ranks them over all its pools: a prompt's
    and a cached decode's vectors differ, and so do its logits. The conversion's prompt gives the
    source's prompt logits and its steps the source's cached steps."""
    source, converted = glm5_ties
    ids = _ids()
    with torch.no_grad():
        prompt = source(input_ids=ids).logits
        out = source(input_ids=ids[:, :11], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(11, LENGTH):
            out = source(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
    cached = torch.cat(steps, 1)
    assert rel_diff(cached, prompt) > 1e-3  # the source parts with itself at a tie
    assert rel_diff(converted.prefill(ids)[0], prompt) < 1e-5
    assert rel_diff(decode(converted, ids, 11)[0], cached) < 1e-5


def test_glm5_next_state_round_trips_and_left_padding_is_invisible(tmp_path, glm5_exact):
    assert_round_trips_a_save(glm5_exact, tmp_path / "glm5", _ids())
    assert_left_padded_rows_equal_rows_alone(glm5_exact, [3, 17, 30], torch.Generator().manual_seed(0), steps=6)


def test_a_qsa_indexer_whose_block_keys_are_normed_otherwise_is_refused():
    """The cell computes QSA's block-key norm itself (an RMS norm, weight 1 + w); an indexer whose norm
    computes something else is refused by name before capture, not converted to rank other blocks."""
    source = _qwen4()
    source.model.layers[1].self_attn.indexer.k_layernorm = torch.nn.LayerNorm(16)
    with pytest.raises(RnnifyError, match=r"block keys are normed by LayerNorm otherwise than as an RMS norm"):
        rnnify.convert(source, to="exact")


def test_glm5_next_left_padded_batch_gives_the_source_s_padded_batch(glm5_ties):
    """With 2 index heads (ties), a left-padded batch's prompt gives the source's logits for the same
    padded batch: the pools some row has whole, which the rows rank together, are the source's."""
    source, converted = glm5_ties
    ids = _ids(24, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :7], mask[2, :13] = 0, 0
    with torch.no_grad():
        want = source(input_ids=ids, attention_mask=mask).logits
    got = converted.prefill(ids, attention_mask=mask)[0]
    real = mask.bool()
    assert rel_diff(got[real], want[real]) < 1e-5


def test_a_glm5_next_indexer_that_reads_its_unfinished_pool_only_when_chosen_is_refused():
    with pytest.raises(RnnifyError, match=r"unfinished pool only when chosen"):
        rnnify.convert(_glm5(index_kpool_always_select_tail=False), to="exact")
