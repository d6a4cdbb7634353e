"""``--to auto`` on model families whose attention is more than plain causal softmax: a model's own
sliding windows (per layer, or every layer), Gemma 2's softcap, gpt-oss's and Flint's sink logits
(Flint's keys cast after their repeat per query head), Falcon-RW's ALiBi, Doge's mask bias, BLOOM
(ALiBi, and attention that transformers' attention interface does not reach: probed through its
exact conversion), DiffLlama (two attention sites per layer, sharing the layer's choice) and hybrids
whose own recurrent layers are not attention. What the probe scores must be
what the conversion builds: its all-exact pass is the original, the sites it records are the
compiler's, and a choice's calibration KL and state are those of the model it converts to."""

import pytest
import torch

import rnnify
from rnnify.auto import HeadScorer, auto_convert
from rnnify.auto.graph_probe import probe_runner
from rnnify.errors import RnnifyError
from tests.support import original_logits, tiny_causal_lm

BASE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
)  # fmt: skip
FAMILIES = {
    "mistral": ("mistral", dict(sliding_window=16)),
    "gemma2": (
        "gemma2",
        dict(head_dim=16, sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    ),
    "gemma3_text": (
        "gemma3_text",
        dict(head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    ),
    "gpt_oss": ("gpt_oss", dict(head_dim=16, sliding_window=16, num_local_experts=4, num_experts_per_tok=2)),
    "falcon@alibi": (
        "falcon",
        dict(alibi=True, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=True),
    ),
    "flint": ("flint", dict(head_dim=16, sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    "doge": ("doge", {}),
    # ALiBi, attention outside transformers' interface; weights large enough for a KL that tells
    "bloom": ("bloom", dict(n_head=4, n_layer=2, initializer_range=0.3)),
    "gpt_neo": (  # a local layer of 8 tokens, attention outside transformers' interface
        "gpt_neo",
        dict(window_size=8, attention_types=[[["global", "local"], 1]], initializer_range=0.3),
    ),
    "llama4_text": (  # layer 0 attends in chunks of 8 tokens: kept exact, not scored
        "llama4_text",
        dict(
            head_dim=16, intermediate_size_mlp=128, num_local_experts=2, no_rope_layers=[1, 0], attention_chunk_size=8
        ),
    ),
    "diffllama": ("diffllama", {}),  # two attention maps per layer: two sites, one choice
    "granitemoehybrid": (
        "granitemoehybrid",
        dict(layer_types=["mamba", "attention"], mamba_d_state=16, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1),
    ),
}
SCORING = dict(score="kl", window=4, sinks=1, calib_len=64, calib_rows=2, passkey=0)
CONTEXT = 64


def family(name: str):
    model_type, config = FAMILIES[name]
    return tiny_causal_lm(model_type, **{**BASE, **config})


def rows() -> torch.Tensor:
    return torch.randint(3, 320, (2, 64), generator=torch.Generator().manual_seed(0))


def calibration_kl(original, converted, scorer: HeadScorer) -> float:
    """The converted model's KL from the original on the scorer's calibration rows, weighted and
    averaged as the scorer averages (every row here is text)."""
    kls = []
    with torch.no_grad():
        for ids, weights in zip(scorer.calibration.rows, scorer.calibration.weights):
            want = original_logits(original, ids)[0].float().log_softmax(-1)
            got = converted.prefill(ids)[0][0].float().log_softmax(-1)
            kl = (want.exp() * (want - got)).sum(-1)
            kls.append(float((kl * weights).sum() / weights.sum()))
    return sum(kls) / len(kls)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_probe_records_the_compilers_sites_and_computes_the_original(name):
    model = family(name)
    ids = rows()[:1]
    _, specs = probe_runner(model, torch.float32, ids)
    converted = rnnify.convert(model, to="exact")
    sites = {entry.layer: entry.spec for entry in converted.manifest.cells if entry.target == "exact"}
    assert sorted(specs) == sorted(sites)  # the attention layers, and only those
    for layer, spec in specs.items():
        site = sites[layer]
        shape = (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.value_dim, spec.window, spec.chunk)
        keys = ("num_heads", "num_kv_heads", "head_dim", "value_dim", "window", "chunk")
        assert shape == tuple(site.get(k) for k in keys)
        assert spec.scale == pytest.approx(site["scale"])
        for term in ("softcap", "alibi_slopes", "sink_logits"):
            mine, theirs = getattr(spec, term), site.get(term)
            assert (mine is None) == (theirs is None), term
            if mine is not None:
                assert torch.allclose(torch.tensor(mine), torch.tensor(theirs, dtype=torch.float32), rtol=2e-2), term
    scorer = HeadScorer(model, rows(), **SCORING)
    for ids, probed in zip(scorer.calibration.rows, scorer.originals):
        want = original_logits(model, ids)[0].float()
        assert (probed - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_choice_costs_and_loses_what_its_conversion_does(name):
    model = family(name)
    scorer = HeadScorer(model, rows(), **SCORING)
    converted, report = auto_convert(model, rows(), budget="60%", context=CONTEXT, **SCORING)
    attention = [cell for cell in converted.cells if not cell.own_layer]
    state = sum(cell.state_nbytes(CONTEXT, 1, converted.dtype) for cell in attention)
    assert report.state_bytes == state + torch.empty((), dtype=torch.long).element_size()
    assert report.state_bytes <= report.budget
    assert report.calibration_kl > 1e-4  # a choice that loses something, so that the comparison tells
    assert report.calibration_kl == pytest.approx(calibration_kl(model, converted, scorer), rel=2e-3)
    assert 0 < len(report.retrieval) < sum(spec.num_kv_heads for spec in scorer.specs.values())


@pytest.mark.parametrize("name", ["mistral", "gemma3_text", "gpt_neo"])
def test_a_kind_wider_than_a_layers_own_window_is_scored_as_the_original_it_builds(name):
    """A retrieval head given a window past its layer's own sliding window (16 tokens; GPT-Neo's local
    layer: 8) and sinks is built as that own window, the original (``plan.within_own_window``); the
    probe scores the same model, so the choice's calibration KL is its conversion's."""
    model = family(name)
    levels = "window(window=32),exact"
    scorer = HeadScorer(model, rows(), levels=levels, **SCORING)
    lost = scorer.level_scores["kl"]["window(window=32)"]
    sliding = {layer for layer, spec in scorer.specs.items() if spec.window is not None}
    assert sliding and all(lost[head] < 1e-7 for head in lost if head[0] in sliding)  # the original: nothing lost
    if len(sliding) < len(scorer.specs):  # a layer reading every token loses what the window drops
        assert max(lost[head] for head in lost if head[0] not in sliding) > 1e-4
    converted, report = auto_convert(model, rows(), levels=levels, budget="60%", context=CONTEXT, **SCORING)
    assert report.calibration_kl == pytest.approx(calibration_kl(model, converted, scorer), rel=2e-3)


def test_a_layers_sites_must_share_one_shape():
    """Two sites of one layer share its heads' kinds, so they must have the same kv heads and widths;
    otherwise one line says to choose that layer by hand."""
    from rnnify.auto.probe import sites_per_layer

    assert sites_per_layer([(0, (4, 2, 16, 16)), (0, (4, 2, 16, 16)), (1, (4, 2, 16, 16))]) == {0: 2, 1: 1}
    with pytest.raises(RnnifyError, match="layer 0 computes attention at sites of different shapes"):
        sites_per_layer([(0, (4, 2, 16, 16)), (1, (4, 2, 16, 16)), (0, (4, 1, 16, 16))])


def test_the_original_kv_cache_counts_each_layers_own_window():
    model = family("gemma3_text")  # layer 0 slides over 16 tokens, layer 1 reads them all
    report = HeadScorer(model, rows(), **SCORING).choose("100%", 1000)
    per_token = 2 * 2 * 16 * 4  # kv heads x (keys and values) x head dim x float32 bytes
    assert report.kv_cache_bytes == per_token * (16 + 1000)


def test_a_kind_that_cannot_compute_the_scores_is_refused_before_scoring():
    with pytest.raises(
        RnnifyError,
        match=r"--levels select\(window=8,keep=4\): layer 0's attention: .*softcapping; exact and window can",
    ):
        HeadScorer(family("gemma2"), rows(), levels="select(window=8,keep=4),exact", **SCORING)


def test_a_model_outside_the_attention_interface_is_probed_through_its_conversion():
    from rnnify.auto.graph_probe import GraphRunner

    assert isinstance(HeadScorer(family("bloom"), rows(), **SCORING).runner, GraphRunner)


def test_a_choice_whose_heads_the_conversion_does_not_find_is_refused():
    from dataclasses import replace

    from rnnify.auto import convert_chosen

    model = family("mistral")
    report = HeadScorer(model, rows(), **SCORING).choose("60%", CONTEXT)
    moved = replace(report, kinds={**report.kinds, "0.2": "streaming"})  # a kv head layer 0 does not have
    with pytest.raises(RnnifyError, match=r"scored kv heads per attention layer \{0: 3, 1: 2\}.*found \{0: 2, 1: 2\}"):
        convert_chosen(model, moved)


def test_a_layer_with_two_attention_modules_counts_both_sites():
    """LongCat-Flash runs two attention modules in each decoder layer: the probe counts both, as
    many as the conversion makes cells."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from arch_configs import build

    longcat, _ = build("longcat_flash")
    scorer = HeadScorer(longcat, torch.randint(3, 256, (2, 64)), **SCORING)
    cells = rnnify.convert(longcat, to="exact").manifest.cells
    assert set(scorer.sites.values()) == {2} and sum(scorer.sites.values()) == len(cells)


def test_a_score_bias_that_is_not_alibi_is_refused():
    model = family("doge")
    with torch.no_grad():  # Doge's bias on each key depends on the tokens once A is not zero (trained)
        for name, parameter in model.named_parameters():
            if name.endswith(".A"):
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(RnnifyError, match="layer 0 adds a bias to its scores that is not ALiBi's"):
        HeadScorer(model, rows(), **SCORING)
