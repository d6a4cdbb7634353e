"""An exact conversion checks itself against the original before it is saved (rnnify/runtime/agreement.py)."""

from __future__ import annotations

import pytest
import torch

import rnnify
from rnnify.cli import main


def _falcon_alibi():
    """Falcon with ALiBi: the bias reaches attention as a float mask, which the cells do not carry."""
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        alibi=True,
        new_decoder_architecture=False,
        multi_query=False,
        parallel_attn=True,
        bias=True,
    )
    return FalconForCausalLM(config).eval()


def _lfm2():
    """LFM2: short-convolution layers keep state between tokens that a step does not carry."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    config = Lfm2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"],
        max_position_embeddings=128,
    )
    return Lfm2ForCausalLM(config).eval()


def test_a_dropped_bias_is_refused_naming_the_first_layer():
    with pytest.raises(
        rnnify.RnnifyError,
        match=r"differs from the original from layer transformer\.h\.0 .*nothing "
        "was saved",
    ):
        rnnify.convert(_falcon_alibi(), to="exact")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_state_a_step_does_not_carry_is_refused():
    with pytest.raises(rnnify.RnnifyError, match="reads a prompt as the original does but decodes differently"):
        rnnify.convert(_lfm2(), to="exact")


def test_approximate_targets_are_not_held_to_the_original():
    model = rnnify.convert(_falcon_alibi(), to="window", window=4)  # a window differs by design: saved as asked
    assert model.cells[0].target == "window"


def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    source = tmp_path / "falcon"
    _falcon_alibi().save_pretrained(source)
    code = main(["convert", str(source), "--to", "exact", "-o", str(tmp_path / "out"), "--no-compile"])
    err = capsys.readouterr().err
    assert code == 2 and "differs from the original" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_matching_model_converts(tiny_model_dir):
    model = rnnify.convert(tiny_model_dir("llama"), to="exact")
    assert all(cell.exact for cell in model.cells)
