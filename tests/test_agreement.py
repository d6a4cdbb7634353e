"""An exact conversion checks itself against the original before it is saved (rnnify/runtime/agreement.py)."""

from __future__ import annotations

import pytest
import torch

import rnnify
from rnnify.cli import main


def _falcon_alibi():
    """Falcon with ALiBi: the bias reaches attention as a float mask (which the cells carry)."""
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


class _RunningSum(torch.nn.Module):
    """An MLP replaced by a sum over the tokens so far: state a step does not carry."""

    def forward(self, x):
        return 0.1 * x.cumsum(1)


def _running_sum_llama(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    source.model.layers[0].mlp = _RunningSum()
    return source


@pytest.fixture
def capped_alibi(monkeypatch):
    """Falcon's ALiBi capped at distance 9: ALiBi on the 8 tokens find_attention probes, so the cells
    carry a linear bias, but not on the 12 the check reads."""
    from transformers.models.falcon import modeling_falcon

    build = modeling_falcon.build_alibi_tensor

    def capped(mask, num_heads, dtype):
        alibi = build(mask, num_heads, dtype)  # [B H, 1, S]: slope times the key's position
        return torch.minimum(alibi, 9 * alibi[..., 1:2])

    monkeypatch.setattr(modeling_falcon, "build_alibi_tensor", capped)


def test_a_dropped_bias_is_refused_naming_the_first_layer(capped_alibi):
    with pytest.raises(
        rnnify.RnnifyError,
        match=r"differs from the original from layer transformer\.h\.0 .*nothing "
        "was saved",
    ):
        rnnify.convert(_falcon_alibi(), to="exact")


def test_state_a_step_does_not_carry_is_refused(tiny_model_dir):
    with pytest.raises(rnnify.RnnifyError, match="reads a prompt as the original does but decodes differently"):
        rnnify.convert(_running_sum_llama(tiny_model_dir), to="exact")


def test_approximate_targets_are_not_held_to_the_original():
    model = rnnify.convert(_falcon_alibi(), to="window", window=4)  # a window differs by design: saved as asked
    assert model.cells[0].target == "window"


def test_the_cli_refuses_in_one_line_and_writes_nothing(tmp_path, capsys, capped_alibi):
    source = tmp_path / "falcon"
    _falcon_alibi().save_pretrained(source)
    code = main(["convert", str(source), "--to", "exact", "-o", str(tmp_path / "out"), "--no-compile"])
    err = capsys.readouterr().err
    assert code == 2 and "differs from the original" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_matching_model_converts(tiny_model_dir):
    model = rnnify.convert(tiny_model_dir("llama"), to="exact")
    assert all(cell.exact for cell in model.cells)


def test_logits_that_are_not_numbers_on_one_side_never_agree():
    """A NaN or an infinity that only one side has differs without bound (before, NaN compared as
    within every tolerance); entries equal on both sides, -inf masks included, agree."""
    from rnnify.runtime.agreement import relative_difference

    want = torch.tensor([[1.0, -2.0, float("-inf")]])
    assert relative_difference(want.clone(), want) == 0.0
    assert relative_difference(torch.tensor([[1.5, -2.0, float("-inf")]]), want) == pytest.approx(0.25)
    for wrong in (float("nan"), float("inf"), 3.0):
        got = want.clone()
        got[0, 2] = wrong
        assert relative_difference(got, want) == float("inf")
    assert relative_difference(torch.tensor([[float("nan"), 0.0, 1.0]]), torch.tensor([[1.0, 0.0, 1.0]])) == float(
        "inf"
    )


def test_a_conversion_whose_logits_turn_to_nan_is_refused(tiny_model_dir, monkeypatch):
    """The exact check fails a converted model that gives NaN where the original gives numbers."""
    from rnnify.runtime.model import RecurrentModel

    prefill = RecurrentModel.prefill

    def poisoned(self, *args, **kwargs):
        logits, state = prefill(self, *args, **kwargs)
        return logits * float("nan"), state

    monkeypatch.setattr(RecurrentModel, "prefill", poisoned)
    with pytest.raises(rnnify.RnnifyError, match="differs from the original"):
        rnnify.convert(tiny_model_dir("llama"), to="exact")


def test_verify_judges_logits_as_the_conversion_check_does():
    """``rnnify verify``'s rows: equal -inf masks agree (before, -inf - -inf made the row NaN and it
    failed); a NaN fails, on one side or on both (the converted model against itself)."""
    from rnnify.verify import _compare

    want = torch.tensor([[[1.0, -2.0, float("-inf")]]])
    assert _compare("vs original", want.clone(), want, torch.float32).passed
    poisoned = want.clone()
    poisoned[0, 0, 0] = float("nan")
    assert not _compare("vs original", poisoned, want, torch.float32).passed
    assert not _compare("step == prefill", poisoned, poisoned.clone(), torch.float32).passed  # itself, NaN
