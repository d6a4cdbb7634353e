"""FSDP distillation: the per-layer split of the step graph, and 2 gloo processes against 1 (tiny models)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from distill_support import distill_recording_losses, free_port

import rnnify
from rnnify.distillation import train
from rnnify.distillation.lora import add_lora
from rnnify.distillation.split_layers import split_layers

OPTIONS = dict(lr=[1e-2, 1e-3], seq_len=16, batch_size=4, progress=False, checkpoint_every=2)


def tokens(rows: int, seed: int = 0, vocab: int = 320, length: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def state_dict(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def with_lora(model_dir):
    model = rnnify.load(model_dir)
    torch.manual_seed(0)
    for lora in add_lora(model, rank=4, alpha=8.0).values():
        torch.nn.init.normal_(lora.lora_b, std=0.1)  # LoRA that changes the logits
    return model


def graph_inputs(model, ids):
    state = model.init_state(ids.shape[0])
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    return ids, positions, torch.ones(ids.shape, dtype=torch.bool), *state.tensors


def grads(module, inputs) -> dict[int, torch.Tensor]:
    """Gradients of a loss over every output (logits and states), by parameter object."""
    module.zero_grad(set_to_none=True)
    outputs = module(*inputs)
    sum(out.float().square().mean() for out in outputs if out.is_floating_point()).backward()
    return {id(p): p.grad.clone() for p in module.parameters() if p.grad is not None}


# -- the split, on one process -------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: tied embedding read by the first and last piece
def test_split_computes_the_flat_graph_and_its_gradients(converted_dir, arch):
    model = with_lora(converted_dir(arch, "hybrid"))
    split = split_layers(model.graph, model.manifest.cells)
    assert [name for name, _ in split.named_children()] == ["prologue", "layer_0", "layer_1", "epilogue"]
    inputs = graph_inputs(model, tokens(2, length=72))  # past the 64-token window: every parameter is read
    flat, pieces = model.graph(*inputs), split(*inputs)
    assert len(flat) == len(pieces) and all(torch.equal(a, b) for a, b in zip(flat, pieces))
    expected, got = grads(model.graph, inputs), grads(split, inputs)  # the same Parameter objects
    assert expected.keys() == got.keys() and len(expected) == len(list(model.parameters()))
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # each layer piece reads its own layer's weights and cell, nothing else
    prefix = {"llama": "model.layers.{}.", "gpt2": "transformer.h.{}."}[arch]
    for i in range(2):
        names = [n for n, _ in getattr(split, f"layer_{i}").named_parameters()]
        assert names and all(n.startswith((prefix.format(i), f"cells.{i}.")) for n in names), names


def test_split_copies_alias_the_model_and_train_the_same(converted_dir):
    model = with_lora(converted_dir("llama", "hybrid"))
    memo = {}
    split = split_layers(model.graph, model.manifest.cells, memo=memo)
    originals = {id(p): p for p in model.parameters()}
    copies = {id(p) for p in split.parameters()}
    assert not copies & originals.keys()  # new objects, so FSDP can replace them without touching the model...
    for (
        key,
        original,
    ) in originals.items():  # ...over the same storage (LoRA factors and cells copied with their modules)
        assert memo[key].data_ptr() == original.data_ptr() and id(memo[key]) in copies
    inputs = graph_inputs(model, tokens(2, length=12))
    assert all(torch.equal(a, b) for a, b in zip(model.graph(*inputs), split(*inputs)))
    expected, got = grads(model.graph, inputs), grads(split, inputs)
    assert all(torch.equal(expected[key], got[id(memo[key])]) for key in expected)


def test_fsdp_on_one_process_changes_nothing_and_says_so(hybrid_dir):
    """One process has nothing to shard: the run trains without FSDP and warns, progress off too."""
    model = rnnify.load(hybrid_dir)
    with pytest.warns(rnnify.RnnifyWarning, match="FSDP in one process has nothing to shard") as caught:
        rnnify.distill(model, tokens(8), stages=["transfer"], seq_len=16, batch_size=4, fsdp=True, progress=False)
    assert caught[0].filename == __file__  # the caller's line
    assert model.manifest.distill["fsdp"] is False and model.manifest.distill["trained"][0]["steps"] == 2
    with pytest.raises(rnnify.RnnifyError, match="fsdp"):
        rnnify.distill(model, tokens(8), fsdp="yes", **{k: OPTIONS[k] for k in ("seq_len", "batch_size", "progress")})


def test_cli_fsdp_flag(capsys, hybrid_dir, tmp_path):
    from rnnify.cli import build_parser, main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def main(argv):\n    for arg in argv:\n        print(arg.upper(), len(arg))\n" * 4)
    args = [
        "--data",
        corpus,
        "-o",
        tmp_path / "out",
        "--seq-len",
        16,
        "--batch-size",
        4,
        "--stages",
        "transfer",
        "--no-compile",
    ]
    assert main(["distill", str(hybrid_dir), *map(str, args), "--fsdp"]) == 0
    assert "warning: FSDP in one process has nothing to shard" in capsys.readouterr().err
    assert (
        build_parser()
        .parse_args(["convert", "m", "--to", "hybrid", "--distill", str(corpus), "-o", "o", "--fsdp"])
        .fsdp
    )


# -- two gloo processes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, tiny_model_dir):
    """Llama as LoLCATs' hybrid with a window shorter than the rows: every stage has real gradients.

    (With the default window, longer than the rows, the cells are exact, the transfer loss ~1e-17
    and its gradients rounding noise that Adam amplifies: no curve to compare.)
    """
    out = tmp_path_factory.mktemp("hybrid") / "model"
    rnnify.convert(tiny_model_dir("llama"), to="hybrid", window=4, feature_map="hedgehog").save(out)
    return out


def _distill(model_dir, data, **options) -> tuple[list[float], rnnify.RecurrentModel]:
    return distill_recording_losses(model_dir, data, **{**OPTIONS, **options})


def _memory_probe(model_dir: str) -> dict:
    """Shard a model's training copy; what each rank holds, and what is gathered while each layer runs."""
    from torch.distributed.tensor import DTensor

    from rnnify.distillation.fsdp import ShardedModel, device_mesh

    model = rnnify.load(model_dir)
    sharded = ShardedModel(model, device_mesh(torch.device("cpu")))
    params = list(sharded.view.graph.parameters())
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    pieces = dict(sharded.view.graph.named_children())
    seen = []

    def probe(name):
        def hook(module, args):
            gathered = sorted(
                n for n, piece in pieces.items() if any(not isinstance(p, DTensor) for p in piece.parameters())
            )
            seen.append((name, gathered))

        return hook

    for name in sharded.units:
        pieces[name].register_forward_pre_hook(probe(name))
    ids = tokens(2)
    with torch.no_grad():
        sharded.view(ids, sharded.view.init_state(2))
    return {
        "units": sharded.units,
        "all_sharded": all(isinstance(p, DTensor) for p in params),
        "local": sum(nbytes(p.to_local()) for p in params),
        "full": sum(nbytes(p) for p in params),
        "model_bytes": sum(nbytes(p) for p in model.parameters()),
        "model_plain": not any(isinstance(p, DTensor) for p in model.parameters()),
        "seen": seen,
    }


def _join_gloo(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # ours, so the distill calls share it


def _worker(rank: int, world_size: int, port: int, model_dir: str, gpt2_dir: str, data: torch.Tensor, out: str) -> None:
    import torch.distributed as dist

    _join_gloo(rank, world_size, port)
    result = {"memory": _memory_probe(model_dir), "memory_gpt2": _memory_probe(gpt2_dir)}
    losses, model = _distill(model_dir, data, fsdp=True, checkpoint_dir=f"{out}.a")
    result.update(losses=losses, weights=state_dict(model), record=model.manifest.distill)

    calls, step = [], train._Trainer.step

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == 9:  # finetune's 4th step (5 per stage); its last checkpoint is after step 2
            raise KeyboardInterrupt
        return step(self, *args)

    train._Trainer.step = interrupted
    try:
        rnnify.distill(
            stopped := rnnify.load(model_dir), data, **{**OPTIONS, "fsdp": True, "checkpoint_dir": f"{out}.b"}
        )
    except KeyboardInterrupt:
        pass
    finally:
        train._Trainer.step = step
    result["stopped_keys"] = sorted(stopped.state_dict())
    dist.barrier()
    if rank == 0:  # for the test to resume without FSDP
        shutil.copytree(f"{out}.b", f"{out}.c")
    dist.barrier()
    _, resumed = _distill(model_dir, data, fsdp=True, checkpoint_dir=f"{out}.b", resume=True)
    result["resumed"] = state_dict(resumed)
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def _one_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    _join_gloo(rank, 1, port)
    torch.save(_memory_probe(model_dir), out)
    dist.destroy_process_group()


def test_fsdp_shards_a_laid_out_tied_head_and_runs_without_grad(converted_dir, tmp_path):
    """The default suite's guard for what the slow tests cover: GPT-2's head, tied to the embedding and
    laid out column-major (``runtime.weight_layout``), shards (FSDP takes only contiguous tensors)
    and a no-grad call gathers it (through the root's hook, which a direct call would skip)."""
    gpt2_dir = str(converted_dir("gpt2", "hybrid"))
    assert any(p.dim() == 2 and not p.is_contiguous() for p in rnnify.load(gpt2_dir).parameters())
    out = str(tmp_path / "probe")
    torch.multiprocessing.spawn(_one_rank, args=(free_port(), gpt2_dir, out), nprocs=1, join=True)
    memory = torch.load(out, weights_only=False)
    assert memory["all_sharded"] and memory["model_plain"] and memory["full"] == memory["model_bytes"]
    assert [name for name, _ in memory["seen"]] == ["layer_0", "layer_1"]


@pytest.fixture(scope="module")
def fsdp_runs(hybrid_dir, converted_dir, tmp_path_factory):
    """Results of 2 gloo processes with FSDP (see ``_worker``), and of 1 process without it."""
    model_dir = str(hybrid_dir)
    out = tmp_path_factory.mktemp("fsdp") / "run"
    data = tokens(20)  # 5 global batches of 4 rows per stage; each rank reads 2 rows of each
    gpt2_dir = str(converted_dir("gpt2", "hybrid"))
    torch.multiprocessing.spawn(
        _worker, args=(2, free_port(), model_dir, gpt2_dir, data, str(out)), nprocs=2, join=True
    )
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    losses, single = _distill(model_dir, data)
    return {
        "ranks": ranks,
        "losses": losses,
        "weights": state_dict(single),
        "model_dir": model_dir,
        "data": data,
        "out": out,
    }


@pytest.mark.slow  # multi-process / end to end; the default suite stays under 10 minutes
def test_fsdp_on_two_processes_follows_the_loss_curve_of_one(fsdp_runs):
    assert len(fsdp_runs["losses"]) == 10
    for result in fsdp_runs["ranks"]:
        assert result["record"]["fsdp"] and result["record"]["world_size"] == 2
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(fsdp_runs["losses"]), rtol=1e-4, atol=1e-6
        )
        assert result["weights"].keys() == fsdp_runs["weights"].keys()  # LoRA merged into the model's own weights
        for name, tensor in fsdp_runs["weights"].items():
            torch.testing.assert_close(result["weights"][name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # multi-process / end to end; the default suite stays under 10 minutes
@pytest.mark.parametrize(
    "arch, units, root",
    [
        ("llama", ["prologue", "layer_0", "layer_1", "epilogue"], []),
        ("gpt2", ["layer_0", "layer_1"], ["prologue", "epilogue"]),  # tied embedding: both ends stay with the root
    ],
)
def test_fsdp_shards_each_layer_and_gathers_one_at_a_time(fsdp_runs, arch, units, root):
    memories = [result["memory" if arch == "llama" else f"memory_{arch}"] for result in fsdp_runs["ranks"]]
    for memory in memories:
        assert memory["units"] == units
        assert memory["all_sharded"] and memory["model_plain"]  # the model itself is left alone
        assert memory["full"] == memory["model_bytes"]  # every weight is in the training copy, once
        assert 0.45 < memory["local"] / memory["full"] < 0.55, memory  # each rank holds about half of each
        # while a layer runs (forward), it is the only unit gathered, besides the root's pieces
        assert [name for name, _ in memory["seen"]] == units
        assert all(gathered == sorted([name, *root]) for name, gathered in memory["seen"]), memory["seen"]
    assert sum(m["local"] for m in memories) == memories[0]["full"]


@pytest.mark.slow  # multi-process / end to end; the default suite stays under 10 minutes
def test_fsdp_checkpoints_resume_with_and_without_fsdp(fsdp_runs, tmp_path):
    whole = fsdp_runs["ranks"][0]["weights"]
    for result in fsdp_runs["ranks"]:
        assert result["stopped_keys"] == sorted(whole)  # interrupted: plain, merged weights
        for name, tensor in whole.items():  # resumed under FSDP: where the uninterrupted FSDP run ended
            torch.testing.assert_close(result["resumed"][name], tensor, rtol=0, atol=0)
    # the FSDP checkpoint holds full tensors: one process without FSDP continues from it
    _, resumed = _distill(
        fsdp_runs["model_dir"], fsdp_runs["data"], checkpoint_dir=f"{fsdp_runs['out']}.c", resume=True
    )
    for name, tensor in state_dict(resumed).items():
        torch.testing.assert_close(tensor, fsdp_runs["weights"][name], rtol=1e-4, atol=1e-5)
