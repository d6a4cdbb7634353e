"""Distillation's speed options: transfer without the LM head, the fused token losses, --train choices."""

from __future__ import annotations

import pytest
import torch
from distill_support import FAST, aaren_dir, hybrid_dir, tokens  # noqa: F401  (fixtures)

import rnnify
from rnnify.cells import parameters as cell_parameters
from rnnify.cli import main
from rnnify.distillation import attention_transfer, train
from rnnify.distillation.losses import token_losses
from rnnify.original.attention import cells_only

# -- attention transfer without what follows the last cell ----------------------------------


def transfer_losses_and_grads(model, ids, mask, pruned: bool):
    params = [p for p in cell_parameters(model)]
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    with attention_transfer(model) as recorder:
        recorder.loss_mask = mask
        if pruned:
            with cells_only(model):
                model(ids, model.init_state(ids.shape[0]))
        else:
            model(ids, model.init_state(ids.shape[0]))
        losses = recorder.losses()
    torch.stack(losses).sum().backward()
    return torch.stack(losses).detach(), [p.grad.clone() for p in params]


def test_transfer_without_the_lm_head_gives_the_same_losses_and_gradients(hybrid_dir):
    model = rnnify.load(hybrid_dir)
    ids = tokens(3, length=24)
    mask = torch.ones(3, 24, dtype=torch.bool)
    mask[1, 17:] = False  # right padding, as training batches have
    full, full_grads = transfer_losses_and_grads(model, ids, mask, pruned=False)
    cut, cut_grads = transfer_losses_and_grads(model, ids, mask, pruned=True)
    assert len(full) == 2 and len(full_grads) > 0
    torch.testing.assert_close(cut, full, rtol=0, atol=1e-6)
    for a, b in zip(cut_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_cells_only_drops_the_lm_head_and_restores_the_graph(hybrid_dir):
    model = rnnify.load(hybrid_dir)
    graph = model.graph
    reads = lambda g: {n.target for n in g.graph.nodes if n.op == "get_attr"}  # noqa: E731
    assert "lm_head.weight" in reads(graph) or "model.embed_tokens.weight" in reads(graph)
    with cells_only(model):
        assert model.graph is not graph
        assert "lm_head.weight" not in reads(model.graph)
        assert "model.norm.weight" not in reads(model.graph)  # the final norm only feeds the LM head
        assert model.cells[0] is graph.get_submodule("cells.0")  # the same cells, so the same hooks and params
    assert model.graph is graph


# -- cross-entropy and KL in one pass -------------------------------------------------------------


def naive_losses(logits, ids, mask, teacher):
    """Autograd through float64 log-softmax, position by position: the definition."""
    ce = kl = torch.zeros((), dtype=torch.float64)
    B, T, _ = logits.shape
    for b in range(B):
        for t in range(T):
            log_q = torch.log_softmax(logits[b, t].double(), -1)
            if t + 1 < T and mask[b, t] and mask[b, t + 1]:
                ce = ce - log_q[ids[b, t + 1]]
            if teacher is not None and mask[b, t]:
                log_p = torch.log_softmax(teacher[b, t].double(), -1)
                kl = kl + (log_p.exp() * (log_p - log_q)).sum()
    return ce, kl


@pytest.mark.parametrize("with_teacher", [True, False])
def test_token_losses_match_the_definition_in_float64(with_teacher, monkeypatch):
    monkeypatch.setattr("rnnify.distillation.losses._CHUNK_ELEMENTS", 3 * 50)  # several chunks, a ragged last one
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 9, 50, generator=g)).requires_grad_(True)
    teacher = 3 * torch.randn(2, 9, 50, generator=g) if with_teacher else None
    ids = torch.randint(0, 50, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    ce, ce_count, kl, kl_count = token_losses(logits, ids, mask, teacher)
    assert (int(ce_count), int(kl_count)) == (8 + 5, 9 + 6)
    (0.3 * ce + (0.7 * kl if kl is not None else 0)).backward()
    ref = logits.detach().double().requires_grad_(True)
    ref_ce, ref_kl = naive_losses(ref, ids, mask, teacher)
    (0.3 * ref_ce + 0.7 * ref_kl).backward()
    torch.testing.assert_close(ce.double(), ref_ce, rtol=1e-6, atol=1e-5)
    if with_teacher:
        torch.testing.assert_close(kl.double(), ref_kl, rtol=1e-6, atol=1e-5)
    else:
        assert kl is None
    torch.testing.assert_close(logits.grad.double(), ref.grad, rtol=0, atol=1e-6)


# -- what the finetune stage trains -----------------------------------------------------------


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize("choice", ["lora", "attention", "all"])
def test_train_choice_trains_exactly_what_it_names(hybrid_dir, choice):
    model = rnnify.load(hybrid_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cells = {n for n, p in model.named_parameters() if any(p is c for c in cell_parameters(model))}
    rnnify.distill(model, tokens(8), stages=["finetune"], train=choice, kl_weight=0.0, lr=1e-2, **FAST)
    after = model.state_dict()
    assert after.keys() == before.keys()  # LoRA merged away
    projections = {k for k in before if k.split(".")[-2] in PROJECTIONS and k.endswith(".weight")}
    assert len(projections) == 8
    if choice == "all":
        expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    else:  # LoRA's merged updates land in the same weights that "attention" trains in full
        expected = projections | cells
    assert changed(before, after) == expected
    assert model.manifest.distill["train"] == choice


@pytest.mark.parametrize("limit, expected", [(10**9, "all"), (0, "lora")])
def test_auto_trains_every_weight_of_a_small_model_and_lora_above_the_limit(hybrid_dir, monkeypatch, limit, expected):
    monkeypatch.setattr(train, "AUTO_ALL_MAX_PARAMETERS", limit)
    model = rnnify.load(hybrid_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rnnify.distill(model, tokens(8), stages=["finetune"], kl_weight=0.0, lr=1e-2, **FAST)  # train: the default
    assert model.manifest.distill["train"] == expected
    trained = changed(before, model.state_dict())
    if expected == "all":
        assert trained == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    else:
        assert not any("embed" in n or "mlp" in n for n in trained)


def test_all_leaves_the_weights_of_an_ignored_query_alone(aaren_dir):
    """Aaren's learned query replaces q: its projection never gets a gradient, so "all" does not
    train it (under DDP it would fail on a parameter without one)."""
    model = rnnify.load(aaren_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rnnify.distill(model, tokens(8), stages=["finetune"], train="all", kl_weight=0.0, lr=1e-2, **FAST)
    untrained = {n for n, _ in model.named_parameters(remove_duplicate=False)} - changed(before, model.state_dict())
    assert untrained and all("q_proj" in n for n in untrained)


def test_resume_with_full_finetuning_is_bit_exact(hybrid_dir, tmp_path, monkeypatch):
    options = dict(stages=["finetune"], train="all", kl_weight=0.0, lr=1e-3, checkpoint_every=2, **FAST)
    data = tokens(16)  # 4 steps
    whole = rnnify.load(hybrid_dir)
    rnnify.distill(whole, data, checkpoint_dir=tmp_path / "a", **options)
    step, calls = train._Trainer.step, []

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 4:  # the last checkpoint is after step 2
            raise KeyboardInterrupt
        return step(self, *args)

    monkeypatch.setattr(train._Trainer, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rnnify.distill(rnnify.load(hybrid_dir), data, checkpoint_dir=tmp_path / "b", **options)
    monkeypatch.setattr(train._Trainer, "step", step)
    resumed = rnnify.load(hybrid_dir)
    rnnify.distill(resumed, data, checkpoint_dir=tmp_path / "b", resume=True, **options)
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_train_flag(capsys, hybrid_dir, tmp_path):
    data = tmp_path / "ids.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 40)
    out = tmp_path / "out"
    code = main(
        [
            "distill",
            str(hybrid_dir),
            "--data",
            str(data),
            "-o",
            str(out),
            "--stages",
            "finetune",
            "--train",
            "attention",
            "--kl-weight",
            "0",
            "--seq-len",
            "16",
            "--batch-size",
            "2",
            "--max-tokens",
            "64",
            "--no-compile",
        ]
    )
    assert code in (0, None)
    assert rnnify.load(out).manifest.distill["train"] == "attention"
    assert (
        main(["distill", str(hybrid_dir), "--data", str(data), "-o", str(tmp_path / "o2"), "--train", "everything"])
        == 2
    )
    assert "--train" in capsys.readouterr().err
