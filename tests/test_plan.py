"""Per-layer targets: --layers rules and --keep-softmax."""

from __future__ import annotations

import pytest
import torch
from support import decode

import rnnify
from rnnify.compiler.plan import LayerRule, make_plan, parse_layers
from rnnify.errors import RnnifyError, RnnifyWarning


def test_parse_layers():
    assert parse_layers("0-1:exact, 2-:linear ,5:exact") == [
        LayerRule(0, 1, "exact"),
        LayerRule(2, None, "linear"),
        LayerRule(5, 5, "exact"),
    ]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0-1", "RANGE:TARGET"),
        ("a-b:exact", "RANGE:TARGET"),
        ("3-1:exact", "empty"),
        ("0:quantum", "unknown target"),
        (",", "names no layers"),
    ],
)
def test_bad_layer_specs(spec, message):
    with pytest.raises(RnnifyError, match=message):
        parse_layers(spec)


def test_later_rules_win_and_keep_softmax_wins_over_all():
    plan = make_plan("linear", layers="0-3:exact,2-:linear", keep_softmax=[3])
    assert [plan.target_for(layer) for layer in range(6)] == ["exact", "exact", "linear", "exact", "linear", "linear"]


def test_options_go_only_to_cells_that_take_them():
    plan = make_plan("linear", layers="0:exact", feature_map="elu", block_size=64)
    assert plan.options_for("linear") == {"feature_map": "elu"}
    assert plan.options_for("exact") == {"block_size": 64}
    with pytest.raises(RnnifyError, match="nonsense apply to none of the targets used"):
        make_plan("linear", nonsense=1)


def test_window_options_reach_both_window_cells():
    """--window and --sinks go to the window target and to the hybrid's window part alike."""
    plan = make_plan("hybrid", layers="0:window", window=8, sinks=4, memory_init=0.5)
    assert plan.options_for("hybrid") == {"window": 8, "sinks": 4, "memory_init": 0.5}
    assert plan.options_for("window") == {"window": 8, "sinks": 4}


def test_a_rule_s_own_options_win_and_survive_save(tiny_model_dir, tmp_path):
    model = rnnify.convert(
        tiny_model_dir("llama"), to="window", layers="0:window(window=12,sinks=0)", window=4, sinks=1
    )
    assert [(c.options()["window"], c.options()["sinks"]) for c in model.cells] == [(12, 0), (4, 1)]
    assert model.manifest.layers == ["0:window(sinks=0,window=12)"]
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    full, _ = loaded.prefill(ids)
    torch.testing.assert_close(decode(loaded, ids, 1)[0], full, rtol=1e-4, atol=1e-5)
    with pytest.raises(RnnifyError, match="exact takes no option window"):
        make_plan("window", layers="0:exact(window=3)")


def test_keep_softmax_converts_a_mixed_model(tiny_model_dir):
    model = rnnify.convert(tiny_model_dir("llama"), to="linear", keep_softmax=[0])
    assert [cell.target for cell in model.cells] == ["exact", "linear"]
    assert not model.constant_memory  # one exact layer makes the state grow
    ids = torch.randint(0, model.manifest.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    full, _ = model.prefill(ids)
    torch.testing.assert_close(decode(model, ids, 1)[0], full, rtol=1e-4, atol=1e-5)
    assert model.manifest.layers == ["0:exact"]


def test_layers_spec_and_save_round_trip(tiny_model_dir, tmp_path):
    model = rnnify.convert(tiny_model_dir("gpt2"), to="exact", layers="1-:linear")
    assert [cell.target for cell in model.cells] == ["exact", "linear"]
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert [cell.target for cell in loaded.cells] == ["exact", "linear"]
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])


def test_a_rule_matching_no_layer_is_an_error(tiny_model_dir):
    with pytest.raises(RnnifyError, match="matches no layer"):
        rnnify.convert(tiny_model_dir("llama"), to="linear", layers="7-:exact")


def test_an_option_no_head_uses_is_an_error():
    """A heads rule that names every kv head leaves the default target none: --window goes unused."""
    plan = make_plan("window", layers="0-:heads(0,1=exact)", window=4)
    with pytest.raises(RnnifyError, match=r"window apply to none of the targets used \(exact\)"):
        plan.check({0: 2, 1: 2})
    plan.check({0: 4, 1: 2})  # layer 0's heads 2 and 3 are windowed


def test_a_rule_running_past_the_last_layer_is_an_error(tiny_model_dir):
    """A range written for a deeper model: layers 0-9 of a 2-layer model is a mistake, not 'all of them'."""
    with pytest.raises(
        RnnifyError, match=r"^layer rule '0-9:exact' runs to layer 9, past the model's last layer 1; '0-:"
    ):
        rnnify.convert(tiny_model_dir("llama"), to="linear", layers="0-9:exact")
    model = rnnify.convert(tiny_model_dir("llama"), to="linear", layers="1-1:exact")
    assert [cell.target for cell in model.cells] == ["linear", "exact"]


def test_ranges_number_decoder_layers_not_attention_layers():
    """A hybrid whose last layer is Mamba: a range to that layer names the model's own layers."""
    from support import TINY_HYBRID, tiny_causal_lm

    mamba = dict(mamba_d_state=8, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=4, num_experts=1)
    config = {**TINY_HYBRID, "num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64}
    jamba = tiny_causal_lm("jamba", **config, **mamba, attn_layer_period=2, attn_layer_offset=1)  # attention: 1
    assert "window" in [cell.target for cell in rnnify.convert(jamba, to="exact", layers="0-2:window", window=4).cells]
    with pytest.raises(RnnifyError, match=r"^layer rule '1-3:window' runs to layer 3, past the model's last layer 2"):
        rnnify.convert(jamba, to="exact", layers="1-3:window", window=4)


@pytest.fixture(scope="module")
def mistral(tiny_model_dir):
    """The tiny Mistral (its own sliding window of 16 tokens) and its logits of 60 tokens."""
    from support import original_logits
    from transformers import AutoModelForCausalLM

    directory = tiny_model_dir("mistral")
    source = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.randint(3, source.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(0))
    return directory, ids, original_logits(source, ids)


@pytest.mark.parametrize(
    "options",
    [
        dict(to="window", window=32),
        dict(to="window", window=16, sinks=4),
        dict(to="window", sinks=4),  # the cell's default window: the layer's own
        dict(to="hybrid"),  # the cell's default window, 64
        dict(to="select", window=16),
    ],
)
def test_a_target_reading_past_the_layers_own_window_keeps_that_window(mistral, options):
    """A target that would read keys the model's own sliding window never reads (a wider window,
    sinks, selected or remembered tokens) gets that window without sinks instead: the original, in a
    ring of its window, with one warning line naming the layers."""
    from support import rel_diff

    directory, ids, want = mistral
    with pytest.warns(RnnifyWarning, match=r"layers 0, 1 slide over their own window \(16 tokens\)"):
        model = rnnify.convert(directory, **options)
    assert [(cell.target, cell.window, cell.sinks) for cell in model.cells] == [("window", 16, 0)] * 2
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4


def test_a_shorter_window_is_the_targets_and_a_wider_head_group_keeps_its_own(mistral, recwarn):
    directory, ids, _ = mistral
    model = rnnify.convert(directory, to="window", window=8, layers="0:heads(0=window(window=32);1=linear)")
    assert [cell.target for cell in model.cells] == ["heads", "window"] and model.cells[1].window == 8
    assert [(part.target, part.window) for part in model.cells[0].parts[:1]] == [("window", 16)]
    assert [str(w.message) for w in recwarn if "slide" in str(w.message)] == [
        "layer 0 slides over its own window (16 tokens), which the target would read past: kept as that window, "
        "the original"
    ]
    plain = rnnify.convert(directory, to="window")  # the layer's own window, asked for: no warning
    assert [(cell.window, cell.sinks) for cell in plain.cells] == [(16, 0)] * 2
    assert not [w for w in recwarn if "slide" in str(w.message)][1:]
    exact = rnnify.convert(directory, to="exact", layers="0:heads(*=exact)")
    assert [cell.target for cell in exact.cells] == ["exact", "exact"]
