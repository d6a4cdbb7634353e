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


def test_empty_tensors_agree():
    """A window's sink buffers without sinks are empty: no entry differs."""
    from rnnify.runtime.agreement import differences

    assert differences(torch.empty(1, 2, 0, 8), torch.empty(1, 2, 0, 8)) == (0.0, 0.0)


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


@pytest.fixture(scope="module")
def flint_bf16():
    """The architecture sweep's tiny Flint in bfloat16 (eager attention that keeps its scores in
    float32, which the conversion rounds otherwise; 4 experts, 2 a token) and its conversion."""
    from pathlib import Path

    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from arch_configs import build

        source = build("flint")[0].to(torch.bfloat16)
    return source, rnnify.convert(source, to="exact")


def test_a_half_precision_router_tie_is_checked_on_other_tokens(flint_bf16):
    """The bfloat16 Flint and its conversion round otherwise, and a draw of tokens may route a token
    to other experts in the two, between experts closer than rounding moves their scores: the check
    draws other tokens and converts the model it refused before."""
    source, model = flint_bf16
    assert model.dtype == torch.bfloat16


def test_a_tie_never_excuses_logits_that_differ_before_it(flint_bf16, monkeypatch):
    """The bfloat16 Flint with its conversion's logits scaled by 1.05: whether or not its router meets
    a tie on a draw, the tokens before it differ, so no draw is a tie and the check refuses."""
    from rnnify.runtime import agreement
    from rnnify.runtime.model import RecurrentModel

    source, model = flint_bf16
    prefill = RecurrentModel.prefill
    monkeypatch.setattr(RecurrentModel, "prefill", lambda self, *a, **k: _scaled(prefill(self, *a, **k)))
    for seed in range(2):
        ids = agreement.tokens_but(None, model.manifest.vocab_size, (1, agreement.CHECK_TOKENS), seed)
        assert not agreement.met_a_router_tie(model, source, ids, agreement.tolerance(torch.bfloat16))
    with pytest.raises(rnnify.RnnifyError, match="differs from the original"):
        agreement.check_against_original(model, source)


def _scaled(out):
    logits, state = out
    return logits * 1.05, state


def _choice(scores: list[float], k: int = 2):
    """One token's router scores and its top ``k``, as ``ExpertChoices.choices`` gives them."""
    scores = torch.tensor(scores)
    return scores, scores.topk(k).indices


def test_a_flip_is_rounding_only_between_scores_rounding_could_cross():
    """``first_difference``: the first token whose chosen experts differ, and whether the two scores
    that swapped were closer than twice the largest move, itself within the tolerance of their size."""
    from rnnify.runtime.expert_choices import first_difference

    want = {(0, 0): _choice([0.5, 0.3, 0.1, 0.1]), (0, 1): _choice([0.40, 0.30, 0.29, 0.0])}
    tie = {(0, 0): want[0, 0], (0, 1): _choice([0.40, 0.295, 0.296, 0.0])}  # moved 0.006, margin 0.01
    far = {(0, 0): want[0, 0], (0, 1): _choice([0.40, 0.10, 0.29, 0.0])}  # moved 0.2: no rounding
    assert first_difference(want, want, 2e-2) is None
    assert first_difference(tie, want, 2e-2) == {
        "token": 1,
        "call": 0,
        "margin": pytest.approx(0.01, rel=1e-4),
        "moved": pytest.approx(0.006, rel=1e-4),
        "rounding": True,
    }
    assert first_difference(far, want, 2e-2)["rounding"] is False
    assert first_difference({(0, 0): want[0, 0]}, want, 2e-2) is None  # not one router read alike


def test_choices_number_a_prompt_and_its_steps_and_a_padded_rows_tokens():
    """``ExpertChoices``: a prompt pass then one-token steps number tokens on; a left-padded row of a
    batch is numbered from its first real token, as the row alone is."""
    from rnnify.runtime.expert_choices import ExpertChoices

    def routed(rows: torch.Tensor, choices):  # one "layer": a router's top-2 of 4 experts a token
        with choices.one_pass():
            rows.reshape(-1, 4).topk(2)

    scores = torch.randn(1, 5, 4, generator=torch.Generator().manual_seed(0))
    alone, stepped = ExpertChoices({4}), ExpertChoices({4})
    routed(scores, alone)
    routed(scores[:, :3], stepped)
    for t in (3, 4):
        routed(scores[:, t : t + 1], stepped)
    assert alone.choices().keys() == stepped.choices().keys() == {(0, t) for t in range(5)}
    for key, (row_scores, chosen) in alone.choices().items():
        assert torch.equal(stepped.choices()[key][1], chosen) and torch.equal(row_scores, scores[0, key[1]])
    batch = ExpertChoices({4})
    routed(torch.cat([torch.randn(1, 5, 4), torch.cat([torch.randn(1, 2, 4), scores[:, :3]], 1)]), batch)
    padded = batch.choices(rows=2, row=1, skip=2)
    assert padded.keys() == {(0, t) for t in range(3)}
    assert all(torch.equal(padded[key][0], alone.choices()[key][0]) for key in padded)
