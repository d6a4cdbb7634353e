"""rnnify.distill: attention transfer, LoRA fine-tuning, checkpoints and DDP, on tiny models."""

from __future__ import annotations

import dataclasses
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F
from distill_support import FAST, aaren_dir, distill_recording_losses, free_port, hedgehog_dir, hybrid_dir, tokens  # noqa: F401 - fixtures

import rnnify
from rnnify.distillation import attention_transfer, load_teacher, train
from rnnify.distillation.checkpoint import CHECKPOINT_FILE, PREVIOUS_FILE, remove_checkpoint
from rnnify.distillation.lora import add_lora, lora_targets, merge_lora


def state_dict(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_logits(model_dir, ids, mask=None):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa").eval()
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


# -- attention transfer --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: its own sliding window (16) inside 40 tokens
def test_exact_cells_record_no_error(converted_dir, arch):
    model = rnnify.load(converted_dir(arch, "exact"))
    ids = tokens(2, length=40)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :7] = False  # left padding
    with attention_transfer(model, teacher_forcing=False) as recorder:
        model(ids, model.init_state(2), attention_mask=mask)
    errors = recorder.errors()
    assert [e.layer for e in errors] == [0, 1]
    assert all(e.rel_error < 1e-5 and e.tokens == 73 for e in errors), errors


def test_teacher_forcing_feeds_every_layer_the_original_activations(hybrid_dir, tiny_model_dir):
    model = rnnify.load(hybrid_dir)
    ids = tokens(2, length=24)
    expected = hf_logits(tiny_model_dir("llama"), ids)
    with torch.no_grad(), attention_transfer(model, teacher_forcing=True) as recorder:
        forced, _ = model(ids, model.init_state(2))
    torch.testing.assert_close(forced, expected, rtol=1e-4, atol=1e-4)
    assert all(e.rel_error > 1e-2 for e in recorder.errors())  # the cells themselves do differ
    free, _ = model(ids, model.init_state(2))
    assert (free - expected).abs().max() > 1e-2


def test_attention_transfer_refuses_a_continued_state(hybrid_dir):
    model = rnnify.load(hybrid_dir)
    _, state = model.prefill(tokens(1, length=4))
    with attention_transfer(model) as _, pytest.raises(rnnify.RnnifyError, match="init_state"):
        model(tokens(1, length=4), state)


def test_transfer_lowers_attention_error_and_trains_only_cells(hedgehog_dir):
    model = rnnify.load(hedgehog_dir)
    held_out = tokens(8, seed=1)

    def error() -> float:
        with torch.no_grad(), attention_transfer(model) as recorder:
            model(held_out, model.init_state(8))
        return sum(e.mse for e in recorder.errors())

    before, weights = error(), state_dict(model)
    rnnify.distill(model, tokens(96), stages=["transfer"], **FAST)
    after = state_dict(model)
    assert error() < 0.7 * before
    cells = {k for k in after if k.startswith("graph.cells.")}
    assert cells and all(not torch.equal(after[k], weights[k]) for k in cells)
    assert all(torch.equal(after[k], weights[k]) for k in after.keys() - cells)
    assert all(p.requires_grad for p in model.parameters())  # flags restored
    assert model.manifest.distill["trained"][0]["steps"] == 24


def test_an_exact_model_is_not_distilled(converted_dir, tiny_model_dir):
    """It computes the original already: finetuning it only moves it away (and it would still say exact)."""
    for model in (
        rnnify.load(converted_dir("llama", "exact")),
        rnnify.convert(tiny_model_dir("llama"), to="linear", layers="0-:heads(0=exact;*=exact)"),
    ):
        weights = state_dict(model)
        with pytest.raises(rnnify.RnnifyError, match="^every attention of this model is exact softmax"):
            rnnify.distill(model, tokens(8), stages=["transfer", "finetune"], seq_len=16, batch_size=4)
        assert all(torch.equal(v, weights[k]) for k, v in state_dict(model).items())


@pytest.mark.parametrize(
    "target, options, seq_len, refused",
    [
        ("hybrid", {}, 4, True),
        ("hybrid", {}, 5, True),
        ("hybrid", {}, 6, False),
        ("lola", {"keep": 2, "chunk": 8}, 8, True),  # its first chunk reads every token
        ("lola", {"keep": 2, "chunk": 8}, 9, False),
        ("lola", {"keep": 2, "chunk": 8}, 14, False),  # refused before, as if a chunk's leavers stayed
    ],
)
def test_transfer_on_rows_the_windows_hold_whole_is_refused(tiny_model_dir, target, options, seq_len, refused):
    """A hybrid of window 4 and 1 sink computes 5 tokens exactly; a LoLA cell of the same with 2 kept
    tokens and decisions every 8 reads every token until its second chunk (position 8: the first
    past 4 + 1 + 2), whose queries read 2 of tokens 1 to 4: rows no longer than that have a loss of
    0 and teach nothing, refused; one token more and the loss is not 0."""
    model = rnnify.convert(tiny_model_dir("llama"), to=target, window=4, sinks=1, **options)
    run = dict(stages=["transfer"], seq_len=seq_len, batch_size=4, progress=False)
    if refused:
        with pytest.raises(rnnify.RnnifyError, match=r"^rows of \d+ tokens fit in the window .* above \d+$"):
            rnnify.distill(model, tokens(4), **run)
    else:
        rnnify.distill(model, tokens(4), **run)
        assert model.manifest.distill["trained"][0]["final_loss"] > 1e-6


def test_rows_past_the_positions_the_original_was_trained_on_are_refused(hybrid_dir):
    """Rotary positions run on past the trained length, where the teacher's outputs are no target, and
    the teacher's attention over such rows is seq_len x seq_len: 100,000 tokens filled 23 GB."""
    model = rnnify.load(hybrid_dir)
    trained_on = model.manifest.positions["limit"]
    with pytest.raises(rnnify.RnnifyError, match=f"{trained_on + 1} is past the {trained_on} positions"):
        rnnify.distill(model, tokens(4), stages=["transfer"], seq_len=trained_on + 1, batch_size=4, progress=False)


@pytest.mark.parametrize("where", ["file", "file/below"])
def test_a_checkpoint_directory_that_is_a_file_is_refused_before_training(hybrid_dir, tmp_path, where):
    (tmp_path / "file").write_text("notes")
    with pytest.raises(rnnify.RnnifyError, match=f"{tmp_path / 'file'} is a file, not a directory"):
        rnnify.distill(rnnify.load(hybrid_dir), tokens(8), checkpoint_dir=tmp_path / where, **FAST)


def test_final_loss_skips_a_short_last_batch(hybrid_dir):
    """A token budget that ends in a short batch: the record's final loss is the last full batch's, not
    the loss of the few tokens left over; with rows that fill no batch, the last of the largest."""
    losses, model = distill_recording_losses(hybrid_dir, tokens(9), stages=["transfer"], max_tokens=9 * 16, **FAST)
    assert len(losses) == 3  # 4 + 4 rows, then 1
    (record,) = model.manifest.distill["trained"]
    assert record["final_loss"] == losses[1] != losses[2]
    # rows shorter than seq_len, never packed: no batch is full
    losses, model = distill_recording_losses(hybrid_dir, tokens(12, length=14), stages=["transfer"], **FAST)
    assert len(losses) == 3 and model.manifest.distill["trained"][0]["final_loss"] == losses[2]


def test_transfer_is_skipped_when_the_cells_have_nothing_to_train(tiny_model_dir, capsys):
    model = rnnify.convert(tiny_model_dir("llama"), to="window", window=4)
    weights = state_dict(model)
    rnnify.distill(model, tokens(8), stages=["transfer"], seq_len=16, batch_size=4)
    assert "skipping transfer" in capsys.readouterr().err
    assert all(torch.equal(v, weights[k]) for k, v in state_dict(model).items())
    with pytest.raises(rnnify.RnnifyError, match="does not exist"):  # bad data: its error alone
        rnnify.distill(model, "missing.txt", stages=["transfer", "finetune"], seq_len=16, batch_size=4)
    assert "skipping transfer" not in capsys.readouterr().err


# -- fine-tuning and LoRA ------------------------------------------------------------------


def next_token_loss(model, ids) -> float:
    with torch.no_grad():
        logits, _ = model(ids, model.init_state(ids.shape[0]))
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def test_finetune_lowers_next_token_loss_through_lora_and_cells(hybrid_dir):
    model = rnnify.load(hybrid_dir)
    data = tokens(64, vocab=8)  # 8 of 320 tokens: a unigram shift the attention's LoRA can learn
    before, weights = next_token_loss(model, tokens(8, seed=1, vocab=8)), state_dict(model)
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    rnnify.distill(model, data, stages=["finetune"], train="lora", lr=1e-2, kl_weight=0.0, **FAST)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random state is the caller's
    # ln 320 = 5.77 at the start; the random tiny model's logits are too small to reach ln 8 = 2.08
    assert next_token_loss(model, tokens(8, seed=1, vocab=8)) < before - 0.15
    after = state_dict(model)
    assert after.keys() == weights.keys()  # LoRA merged: plain weights, no extra tensors
    changed = {k for k in after if not torch.equal(after[k], weights[k])}
    projections = {f"graph.{name}" for name in lora_targets(model)}
    assert projections <= changed and changed <= projections | {k for k in after if k.startswith("graph.cells.")}


def test_finetune_with_kl_needs_a_teacher(hybrid_dir, tmp_path):
    model = rnnify.load(hybrid_dir)
    model.manifest.source = str(tmp_path / "gone")
    with pytest.raises(rnnify.RnnifyError, match="--teacher.*kl-weight 0"):
        rnnify.distill(model, tokens(8), stages=["finetune"], **FAST)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: Conv1D's [in, out] weights
def test_merged_lora_gives_the_logits_of_the_unmerged_model(converted_dir, arch):
    model = rnnify.load(converted_dir(arch, "hybrid"))
    torch.manual_seed(0)
    loras = add_lora(model, rank=4, alpha=8.0)
    assert set(lora_targets(model).values()) == {arch == "gpt2"}
    for lora in loras.values():
        torch.nn.init.normal_(lora.lora_b, std=0.1)
    ids = tokens(2)
    with torch.no_grad():
        unmerged, _ = model(ids, model.init_state(2))
        merge_lora(model)
        merged, _ = model(ids, model.init_state(2))
    torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)
    assert not any("lora" in name or "original" in name for name in model.state_dict())


def test_lora_goes_only_where_a_gradient_reaches(hybrid_dir, aaren_dir):
    for directory, projections in (
        (hybrid_dir, {"q_proj", "k_proj", "v_proj", "o_proj"}),
        (aaren_dir, {"k_proj", "v_proj", "o_proj"}),
    ):  # Aaren ignores q
        model = rnnify.load(directory)
        loras = add_lora(model, rank=2, alpha=4.0)
        assert {name.split(".")[-2] for name in loras} == projections and len(loras) == 2 * len(projections)
        logits, _ = model(tokens(2), model.init_state(2))
        logits.square().mean().backward()
        assert all(p.grad is not None for lora in loras.values() for p in lora.parameters())


def test_distilled_model_round_trips_through_save(hybrid_dir, tmp_path):
    model = rnnify.load(hybrid_dir)
    rnnify.distill(model, tokens(16), lr=[1e-2, 1e-3], **FAST)
    model.save(tmp_path / "out")
    loaded = rnnify.load(tmp_path / "out")
    ids = tokens(2, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, loaded.init_state(2))[0], model(ids, model.init_state(2))[0])
    assert loaded.manifest.files["model.safetensors"] != rnnify.load(hybrid_dir).manifest.files["model.safetensors"]
    record = loaded.manifest.distill
    assert [r["stage"] for r in record["trained"]] == ["transfer", "finetune"]
    assert record["lr"] == [1e-2, 1e-3] and record["kl_weight"] == 1.0 and record["teacher"]
    assert "earlier" not in record
    rnnify.distill(loaded, tokens(8), stages=["finetune"], **FAST)  # a second run keeps the first's record
    assert [r["stage"] for r in loaded.manifest.distill["trained"]] == ["finetune"]
    assert loaded.manifest.distill["earlier"] == record


# -- checkpoints ---------------------------------------------------------------------------


def test_resumed_run_ends_where_an_uninterrupted_one_does(hybrid_dir, tmp_path, monkeypatch):
    options = dict(stages=["transfer", "finetune"], lr=[1e-2, 1e-3], checkpoint_every=2, max_tokens=768, **FAST)
    data = tokens(24)  # 6 steps per stage, on the cosine schedule's curve
    whole = rnnify.load(hybrid_dir)
    rnnify.distill(whole, data, checkpoint_dir=tmp_path / "a", **options)

    step, calls = train._Trainer.step, []

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 10:  # finetune's 4th step; the last checkpoint is after its 2nd
            raise KeyboardInterrupt
        return step(self, *args)

    monkeypatch.setattr(train._Trainer, "step", interrupted)
    stopped = rnnify.load(hybrid_dir)
    with pytest.raises(KeyboardInterrupt):
        rnnify.distill(stopped, data, checkpoint_dir=tmp_path / "b", **options)
    assert stopped.state_dict().keys() == whole.state_dict().keys()  # LoRA merged even when interrupted
    monkeypatch.setattr(train._Trainer, "step", step)
    resumed = rnnify.load(hybrid_dir)
    rnnify.distill(resumed, data, checkpoint_dir=tmp_path / "b", resume=True, **options)

    a, b = state_dict(whole), state_dict(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.manifest.distill["trained"] == whole.manifest.distill["trained"]


def _rates(monkeypatch, model, data, **options) -> list[float]:
    """The learning rate of every optimizer step of ``rnnify.distill(model, data, **options)``."""
    step, rates = train._Trainer.step, []

    def recording(self, stage, run, wrapped, optimizer, *args):
        rates.append(optimizer.param_groups[0]["lr"])
        return step(self, stage, run, wrapped, optimizer, *args)

    monkeypatch.setattr(train._Trainer, "step", recording)
    rnnify.distill(model, data, **options)
    return rates


def test_cosine_schedule_warms_up_then_decays_to_a_tenth(hybrid_dir, monkeypatch):
    options = dict(stages=["transfer"], lr=1e-2, max_tokens=40 * 64, **FAST)  # 40 steps of 4 x 16 tokens
    rates = _rates(monkeypatch, rnnify.load(hybrid_dir), tokens(160), **options)
    assert len(rates) == 40
    # warm-up: ceil(5% of 40) = 2 steps rising to the full rate, then a half cosine to 1e-3 at the last step
    assert rates[:3] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])
    assert rates[-1] == pytest.approx(1e-3)
    assert rates[20] == pytest.approx(1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * 18 / 37)))
    assert all(a >= b for a, b in zip(rates[2:], rates[3:]))
    constant = _rates(monkeypatch, rnnify.load(hybrid_dir), tokens(160), schedule="constant", **options)
    assert constant == [1e-2] * 40
    # without a token budget the length is unknown: one warm-up step, then the full rate
    unbounded = _rates(monkeypatch, rnnify.load(hybrid_dir), tokens(16), stages=["transfer"], lr=1e-2, **FAST)
    assert unbounded == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2])


def test_gates_train_at_their_multiple_of_the_rate(tiny_model_dir):
    # gates half open: at 0 only the gate itself gets a gradient (the memory's share of the output is 0)
    model = rnnify.convert(tiny_model_dir("llama"), to="hybrid", window=4, feature_map="hedgehog", memory_init=0.5)
    before = state_dict(model)
    rnnify.distill(model, tokens(4), stages=["transfer"], lr=1e-3, schedule="constant", gate_lr_scale=20, **FAST)
    moved = {
        k: (v - before[k]).abs().max().item() for k, v in state_dict(model).items() if k.startswith("graph.cells.")
    }
    gates = {k for k in moved if k.endswith(("memory_gate", "window_logit"))}
    assert len(gates) == 2 * len(model.cells)
    # AdamW's first step moves a weight by its rate times g / (|g| + eps): 20 x 1e-3 for the gates, <= 1e-3 for the rest
    assert all(moved[k] == pytest.approx(2e-2, rel=1e-3) for k in gates)
    rest = [v for k, v in moved.items() if k not in gates]
    assert rest and 0 < max(rest) <= 1e-3 * (1 + 1e-6)
    assert model.manifest.distill["gate_lr_scale"] == [20]


def test_resume_refuses_other_settings(hybrid_dir, tmp_path):
    model = rnnify.load(hybrid_dir)
    rnnify.distill(model, tokens(8), stages=["transfer"], checkpoint_dir=tmp_path, **FAST)
    assert (tmp_path / CHECKPOINT_FILE).is_file()
    with pytest.raises(rnnify.RnnifyError, match="seq_len"):
        rnnify.distill(
            model, tokens(8), stages=["transfer"], checkpoint_dir=tmp_path, resume=True, **{**FAST, "seq_len": 8}
        )


def test_resume_refuses_a_checkpoint_of_another_model(hybrid_dir, tiny_model_dir, tmp_path):
    rnnify.distill(rnnify.load(hybrid_dir), tokens(8), stages=["transfer"], checkpoint_dir=tmp_path, **FAST)
    other = rnnify.convert(tiny_model_dir("llama"), to="hybrid", window=8, feature_map="hedgehog")  # a wider window
    with pytest.raises(rnnify.RnnifyError, match=r"cells\[0\]: .*'window': 4.* -> .*'window': 8"):
        rnnify.distill(other, tokens(8), stages=["transfer"], checkpoint_dir=tmp_path, resume=True, **FAST)
    moved = rnnify.load(hybrid_dir)
    moved.manifest.source = "elsewhere/model"
    with pytest.raises(rnnify.RnnifyError, match="source: .* -> 'elsewhere/model'"):
        rnnify.distill(moved, tokens(8), stages=["transfer"], checkpoint_dir=tmp_path, resume=True, **FAST)


def test_resume_refuses_a_checkpoint_without_every_cell_parameter(hybrid_dir, tmp_path):
    """A checkpoint written for cells with fewer parameters (an earlier rnnify's) is one clear error,
    not a failure deep in the optimizer."""
    rnnify.distill(rnnify.load(hybrid_dir), tokens(8), stages=["transfer"], checkpoint_dir=tmp_path, **FAST)
    saved = torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)
    dropped = sorted(saved["trainable"])[0]
    del saved["trainable"][dropped]
    torch.save(saved, tmp_path / CHECKPOINT_FILE)
    with pytest.raises(rnnify.RnnifyError, match=f"lacks {re.escape(dropped)}.*another checkpoint directory"):
        rnnify.distill(
            rnnify.load(hybrid_dir), tokens(8), stages=["transfer"], checkpoint_dir=tmp_path, resume=True, **FAST
        )


@pytest.mark.parametrize("field, value", [("settings", []), ("step", "3"), ("records", {})])
def test_a_checkpoint_field_of_another_type_is_unreadable(tmp_path, field, value):
    """A field of another type would fail later, where it is used (``settings.keys()``), with a traceback."""
    from rnnify.distillation.checkpoint import Checkpoint, load_checkpoint, save_checkpoint

    good = Checkpoint("transfer", 3, False, 100, {"w": torch.ones(1)}, {}, {"source": "m"})
    save_checkpoint(tmp_path, good)
    assert load_checkpoint(tmp_path, {"source": "m"}) == good
    save_checkpoint(tmp_path, dataclasses.replace(good, **{field: value}))
    with pytest.raises(rnnify.RnnifyError, match=f"unreadable checkpoint \\(its {field} is a"):
        load_checkpoint(tmp_path, {"source": "m"})


def test_a_fresh_run_sets_an_earlier_checkpoint_aside(hybrid_dir, tmp_path, monkeypatch, capsys):
    rnnify.distill(rnnify.load(hybrid_dir), tokens(8), stages=["transfer"], checkpoint_dir=tmp_path, **FAST)
    finished = (tmp_path / CHECKPOINT_FILE).read_bytes()

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train._Trainer, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):  # stopped before its first checkpoint
        rnnify.distill(
            rnnify.load(hybrid_dir),
            tokens(8),
            stages=["transfer"],
            checkpoint_dir=tmp_path,
            **{**FAST, "progress": True},
        )
    assert not (tmp_path / CHECKPOINT_FILE).exists()
    assert (tmp_path / "checkpoint.pt.previous").read_bytes() == finished
    assert "moved the checkpoint of an earlier run" in capsys.readouterr().err
    monkeypatch.undo()
    rnnify.distill(
        rnnify.load(hybrid_dir),
        tokens(8),
        stages=["transfer"],
        checkpoint_dir=tmp_path,
        resume=True,
        **{**FAST, "progress": True},
    )
    assert "no checkpoint in" in capsys.readouterr().err  # not the finished earlier run's


def test_removing_a_checkpoint_keeps_an_earlier_runs_and_the_users_files(tmp_path):
    for extra in ([], [PREVIOUS_FILE], ["notes.txt"]):
        directory = tmp_path / f"run{len(extra)}{''.join(extra)}"
        directory.mkdir()
        for name in [CHECKPOINT_FILE, *extra]:
            (directory / name).write_bytes(b"x")
        assert remove_checkpoint(directory) == (not extra)  # gone only when nothing else was there
        assert not (directory / CHECKPOINT_FILE).exists()
        assert all((directory / name).is_file() for name in extra)


def test_seq_len_is_checked_against_learned_positions_first(converted_dir):
    model = rnnify.load(converted_dir("gpt2", "hybrid"))  # 128 learned positions
    with pytest.raises(rnnify.RnnifyError, match=r"seq_len \(--seq-len\) 129 is past the model's 128 learned"):
        rnnify.distill(model, tokens(4), teacher="no/such/teacher", **{**FAST, "seq_len": 129})


@pytest.mark.parametrize(
    "options, words",
    [
        ({"stages": ["pretrain"]}, "stages"),
        ({"lr": [1e-2]}, "lr"),
        ({"resume": True}, "checkpoint_dir"),
        ({"kl_weight": -1}, "kl_weight"),
        ({"schedule": "linear"}, "schedule"),
        ({"gate_lr_scale": 0}, "gate_lr_scale"),
        ({"gate_lr_scale": [1, 10, 100]}, "gate_lr_scale"),
        ({"gate_lr_scale": float("inf")}, "gate_lr_scale"),
        ({"batch_size": 0}, r"batch_size \(--batch-size\)"),
        ({"kl_weight": -1}, r"kl_weight \(--kl-weight\)"),
        # a rate per stage goes with the stage written beside it: another order is refused, not sorted
        ({"stages": ["finetune", "transfer"], "lr": [1e-4, 1e-2]}, "they run in the order transfer,finetune"),
    ],
)
def test_bad_arguments_are_user_errors(hybrid_dir, options, words):
    with pytest.raises(rnnify.RnnifyError, match=words):
        rnnify.distill(rnnify.load(hybrid_dir), tokens(4), **{**FAST, **options})


def test_a_one_shot_iterator_cannot_feed_two_stages(hybrid_dir):
    with pytest.raises(rnnify.RnnifyError, match="one-shot"):
        rnnify.distill(rnnify.load(hybrid_dir), iter([tokens(4)]), **FAST)


def test_load_teacher(hybrid_dir, tiny_model_dir):
    model = rnnify.load(hybrid_dir)
    teacher = load_teacher(model)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    with pytest.raises(rnnify.RnnifyError, match="vocabulary"):
        load_teacher(model, _wide_vocab(tiny_model_dir))
    model.manifest.source = "some-org/not-here"
    with pytest.raises(rnnify.RnnifyError, match="teacher="):
        load_teacher(model)


def _wide_vocab(tiny_model_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_pretrained(tiny_model_dir("llama"))
    config.vocab_size = 400
    return AutoModelForCausalLM.from_config(config)


# -- data parallel -------------------------------------------------------------------------


DDP_OPTIONS = dict(lr=[1e-2, 1e-3], seq_len=16, batch_size=4, progress=False)


def _run_recording_losses(model_dir: str, data: torch.Tensor, **options) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, model = distill_recording_losses(model_dir, data, **{**DDP_OPTIONS, **options})
    return losses, state_dict(model)


def _ddp_worker(rank: int, world_size: int, port: int, runs: list, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # one group for every run: distill uses the group it finds
    try:
        results = [_run_recording_losses(model_dir, data, **options) for model_dir, data, options in runs]
    finally:
        dist.destroy_process_group()
    torch.save([{"losses": losses, "weights": weights} for losses, weights in results], f"{out}.{rank}")


@pytest.mark.slow  # multi-process / end to end; the default suite stays under 10 minutes
def test_two_processes_follow_the_loss_curve_of_one(hybrid_dir, aaren_dir, tmp_path):
    runs = [
        (str(hybrid_dir), tokens(20), {}),  # 5 global batches of 4 rows per stage; each rank reads 2 rows of each
        # Aaren ignores q: LoRA on q_proj would get no gradient, and DDP would fail at the second step
        (str(aaren_dir), tokens(8), {"stages": ["finetune"], "lr": 1e-2, "kl_weight": 0.0, "device": "cpu"}),
    ]
    singles = [_run_recording_losses(*run[:2], **run[2]) for run in runs]
    torch.multiprocessing.spawn(_ddp_worker, args=(2, free_port(), runs, str(tmp_path / "ddp")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"ddp.{r}", weights_only=True) for r in range(2)]
    assert [len(losses) for losses, _ in singles] == [10, 2]
    for result in ranks:
        for (single_losses, single), got in zip(singles, result):
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(single_losses), rtol=1e-4, atol=1e-6)
            for name, tensor in single.items():
                torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-4, atol=1e-5)
