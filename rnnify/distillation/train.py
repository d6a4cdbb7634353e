"""``rnnify.distill``: LoLCATs' two stages (docs/math.md §Attention transfer) on a converted model, on one process or many.

1. ``transfer`` (attention transfer): only the cells' own parameters train (feature maps, gates,
   mixing factors, Aaren queries), to minimise the sum over layers of the MSE between each cell's
   output and the original softmax attention on the same inputs. Teacher forcing (``attention``)
   feeds every layer the original model's activations, so one forward trains all layers and no
   separate teacher model runs.
2. ``finetune``: every weight of a model up to 1B parameters, else LoRA on the attention
   projections (``train``: ``auto``; or LoRA, the projections in full, or every weight) plus the
   cells' parameters, on next-token cross-entropy + ``kl_weight`` * KL(teacher || student) against
   the original model's logits. LoRA is merged into the weights at the end.

Each step reads one global batch from ``rnnify.data.token_batches`` (right-padded rows; the models
run without a mask and padded positions are left out of every loss). Steps are counted in global
batches, which is also the data position a checkpoint resumes from.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from rnnify import choices
from rnnify.cells import gate_parameters
from rnnify.cells import parameters as cell_parameters
from rnnify.choices import AUTO_ALL_MAX_PARAMETERS, DEFAULT_LR, DEFAULT_SCHEDULE, SCHEDULES, STAGES, TRAIN
from rnnify.data import check_sizes, row_length, token_batches, tokenizer_for
from rnnify.distillation.checkpoint import Checkpoint, check_checkpoint_dir, load_checkpoint, save_checkpoint, set_aside
from rnnify.distillation.distributed import Runtime, setup
from rnnify.distillation.lora import add_lora, lora_targets, merge_lora, unreached_weights
from rnnify.distillation.losses import token_losses
from rnnify.distillation.worth import check_worth_training
from rnnify.errors import RnnifyError, check_int, warn_caller
from rnnify.original import attention_transfer, load_teacher
from rnnify.original.attention import cells_only
from rnnify.runtime.devices import usable_device
from rnnify.runtime.model import RecurrentModel

__all__ = ["AUTO_ALL_MAX_PARAMETERS", "DEFAULT_LR", "SCHEDULES", "STAGES", "TRAIN", "distill", "lr_factor"]

_WARMUP, _FINAL = 0.05, 0.1  # cosine: warm-up share of a stage's steps, and the last step's share of the rate
_MAX_GRAD_NORM = 1.0


def distill(
    model: RecurrentModel,
    data: Any,
    *,
    teacher: str | os.PathLike | nn.Module | None = None,
    tokenizer: Any = None,
    stages: Sequence[str] = STAGES,
    max_tokens: int | None = None,
    seq_len: int | None = None,
    batch_size: int = choices.DISTILL_BATCH_SIZE,
    lr: float | Sequence[float] | None = None,
    lora_rank: int = choices.LORA_RANK,
    lora_alpha: float | None = None,
    train: str = choices.DEFAULT_TRAIN,
    kl_weight: float = choices.KL_WEIGHT,
    schedule: str = DEFAULT_SCHEDULE,
    gate_lr_scale: float | Sequence[float] = choices.GATE_LR_SCALE,
    seed: int = choices.SEED,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = choices.CHECKPOINT_EVERY,
    resume: bool = False,
    fsdp: bool = False,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> RecurrentModel:
    """Train ``model`` towards the model it was converted from; returns ``model`` (plain weights).

    ``data``: what ``rnnify.data.token_batches`` reads (text file, folder, ``.jsonl``, a LongTensor
    ``[N, T]`` or an iterable of batches); text is tokenized with ``tokenizer`` (default: the
    tokenizer saved with the model, else the source model's: ``rnnify.data.tokenizer_for``, as
    ``evaluate`` does). ``stages``: any of ``"transfer"``, ``"finetune"``, in that order; transfer
    is skipped, with a message, when the cells have no trainable parameters. ``max_tokens``: real
    tokens to train on, split evenly between the stages that run, each reading from the start of
    the data (None: each stage reads the data once).
    ``seq_len``/``batch_size``: tokens per row (default 1024, or the model's position limit if
    lower: ``rnnify.data.row_length``) and rows per global batch (one optimizer step).
    ``lr``: one rate for every stage, or one per stage run (default ``DEFAULT_LR``). LoRA has rank
    ``lora_rank`` and ``alpha = lora_alpha`` (default ``2 * lora_rank``). ``train``: what the
    finetune stage trains besides the cells' parameters: ``"lora"`` (LoRA on the attention
    projections), ``"attention"`` (the attention projection weights themselves, in full),
    ``"all"`` (every weight of the model) or ``"auto"``: ``"all"`` up to
    ``AUTO_ALL_MAX_PARAMETERS``, whose gradients and AdamW state (3x the weights) a CPU or one GPU
    holds, else ``"lora"``; full training gets far closer to the teacher on a small budget
    (docs/distill.md). ``kl_weight`` 0 needs
    no teacher; otherwise ``teacher`` goes to ``load_teacher``. AdamW, gradient norm clipped at 1.
    ``schedule``: ``"cosine"`` warms the rate up over the first 5% of a stage's steps and decays it
    to a tenth by its last (``lr_factor``; a stage without a token budget, whose length is unknown,
    keeps the rate after the warm-up), ``"constant"`` keeps it throughout. ``gate_lr_scale`` (one
    for all stages or one per stage run): the cells' gates (``Cell.gates``, e.g. the hybrid's memory
    gate, one scalar per head) train at this multiple of the stage's rate, so that a short stage can
    move them as far as they need.

    ``checkpoint_dir``: every ``checkpoint_every`` steps and at the end of each stage the trainable
    tensors, optimizer and step go there; ``resume=True`` continues from it exactly (a fresh start
    if there is none yet) and refuses one written for other settings or another model; a run
    without ``resume`` first moves an earlier run's checkpoint aside (``checkpoint.pt.previous``),
    so that a later resume continues this run. Under ``torchrun`` each of the ``WORLD_SIZE`` ranks
    reads its slice of every global batch and DDP averages gradients (``batch_size`` must divide
    by the world size); only rank 0 shows progress and writes checkpoints. ``fsdp=True`` shards
    the weights over the ranks instead of DDP's full copies (``rnnify.distillation.fsdp``: one FSDP
    unit per decoder layer, the model itself left in place and updated at the end of each stage);
    on one process it changes nothing. ``device``: where training runs (default: where the model
    is; under ``torchrun`` on CUDA, each rank's ``LOCAL_RANK`` GPU); the model moves there, except
    under FSDP, where it stays where it is (e.g. the CPU) and only its shards go to ``device``.
    Torch's global random state is left as it was: LoRA is drawn from a generator seeded with
    ``seed``. The settings and tokens are recorded in ``model.manifest.distill`` (an earlier
    distillation's record under ``"earlier"``).
    """
    stages = _check_stages(stages)
    lrs = _per_stage("lr (--lr)", stages, [DEFAULT_LR[s] for s in stages] if lr is None else lr)
    gate_scales = _per_stage("gate_lr_scale (--gate-lr-scale)", stages, gate_lr_scale)
    seq_len = row_length(model, seq_len)  # before the teacher loads, and before the data is read
    check_worth_training(model, stages, seq_len)
    check_sizes(seq_len, batch_size, max_tokens)
    check_int("checkpoint_every (--checkpoint-every)", checkpoint_every, 1, RnnifyError)
    check_int("lora_rank (--lora-rank)", lora_rank, 1, RnnifyError)
    if train not in TRAIN:
        raise RnnifyError(f"train (--train) must be one of {', '.join(TRAIN)}, got {train!r}")
    if schedule not in SCHEDULES:
        raise RnnifyError(f"schedule (--schedule) must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not isinstance(kl_weight, (int, float)) or not kl_weight >= 0:
        raise RnnifyError(f"kl_weight (--kl-weight) must be a number >= 0, got {kl_weight!r}")
    if not isinstance(fsdp, bool):
        raise RnnifyError(f"fsdp must be True or False, got {fsdp!r}")
    check_checkpoint_dir(checkpoint_dir, resume)
    if isinstance(data, Iterator) and len(stages) > 1:
        raise RnnifyError(
            "data is a one-shot iterator but every stage reads the data from the start; "
            "pass a path, a tensor or a list of batches"
        )
    if train == "auto":
        train = "all" if sum(p.numel() for p in model.parameters()) <= AUTO_ALL_MAX_PARAMETERS else "lora"
    config = _Config(
        stages,
        lrs,
        max_tokens,
        seq_len,
        batch_size,
        lora_rank,
        float(lora_alpha if lora_alpha is not None else 2 * lora_rank),
        train,
        float(kl_weight),
        schedule,
        seed,
        checkpoint_every,
        gate_scales,
    )
    runtime = setup(usable_device(device) if device is not None else model.device)
    try:
        return _Trainer(model, runtime, config, data, tokenizer, teacher, checkpoint_dir, progress, fsdp).run(resume)
    finally:
        runtime.close()


@dataclass(frozen=True)
class _Config:
    stages: list[str]
    lr: dict[str, float]
    max_tokens: int | None
    seq_len: int
    batch_size: int
    lora_rank: int
    lora_alpha: float
    train: str
    kl_weight: float
    schedule: str
    seed: int
    checkpoint_every: int
    gate_lr_scale: dict[str, float]


def lr_factor(step: int, total: int | None, schedule: str = DEFAULT_SCHEDULE) -> float:
    """The rate of a stage's optimizer step ``step`` (0-based, of ``total``; None: unknown) as a share of its lr.

    Cosine: linear warm-up to the full rate over the first 5% of the steps (at least one), then a
    half cosine down to a tenth at the last step. A short budget spends most of its steps at a
    high constant rate otherwise, and ends on whatever the last noisy steps left; Adam's first
    steps at the full rate are the largest updates of the run. Depends on the step alone, so a
    resumed run follows the same curve.
    """
    if schedule == "constant":
        return 1.0
    warmup = max(1, math.ceil(_WARMUP * total)) if total else 1
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if not total or total <= warmup + 1:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - 1 - warmup))
    return _FINAL + (1 - _FINAL) * 0.5 * (1 + math.cos(math.pi * progress))


def _check_stages(stages: Sequence[str]) -> list[str]:
    """``stages`` as a list, in the order they run: another order is refused, not sorted, as a rate
    given per stage (``lr``) would then go to the stage it was not written beside."""
    stages = [stages] if isinstance(stages, str) else list(stages)
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages or len(set(stages)) != len(stages):
        raise RnnifyError(f"stages (--stages) must be one or both of {', '.join(STAGES)} (each once), got {stages!r}")
    if stages != sorted(stages, key=STAGES.index):
        raise RnnifyError(
            f"stages (--stages) {','.join(stages)}: they run in the order {','.join(STAGES)}; write them so "
            "(and a rate per stage, --lr, in that order)"
        )
    return stages


def _per_stage(name: str, stages: list[str], value: float | Sequence[float]) -> dict[str, float]:
    """``value`` by stage: one positive number for every stage, or one per stage."""
    values = [value] * len(stages) if isinstance(value, (int, float)) else list(value)
    if len(values) != len(stages) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in values
    ):
        raise RnnifyError(f"{name} must be a positive number or one per stage ({', '.join(stages)}), got {value!r}")
    return dict(zip(stages, map(float, values)))


class _Trainer:
    """One distillation run: the stages in order, each an optimizer over its trainable tensors."""

    def __init__(
        self,
        model: RecurrentModel,
        runtime: Runtime,
        config: _Config,
        data,
        tokenizer,
        teacher,
        checkpoint_dir: str | os.PathLike | None,
        progress: bool,
        fsdp: bool = False,
    ):
        self.runtime, self.config = runtime, config
        self.progress = progress and runtime.main
        self.fsdp = fsdp and runtime.world_size > 1
        if fsdp and not self.fsdp:  # said with progress off too: the run is not what was asked for
            warn_caller("FSDP in one process has nothing to shard: training without it (run under torchrun)")
        # Under FSDP the model stays where it is (e.g. on the CPU): only its shards go to the device.
        self.model = model if self.fsdp else model.to(runtime.device)
        self.mesh = None
        if self.fsdp:
            from rnnify.distillation.fsdp import device_mesh

            self.mesh = device_mesh(runtime.device)
        self.cell_names = _names(self.model, [p for p in cell_parameters(self.model) if p.requires_grad])
        self.stages = config.stages
        skips_transfer = "transfer" in self.stages and not self.cell_names
        if skips_transfer:
            self.stages = [s for s in self.stages if s != "transfer"]
        stages = self.stages
        self.budget = None if config.max_tokens is None or not stages else max(1, config.max_tokens // len(stages))
        self.batches_args = dict(
            data=data,
            tokenizer=tokenizer_for(model, data, tokenizer) if stages else None,
            seq_len=config.seq_len,
            batch_size=config.batch_size,
            seed=config.seed,
            rank=runtime.rank,
            world_size=runtime.world_size,
            max_tokens=self.budget,
        )
        if stages:
            token_batches(**self.batches_args)  # checks the data and sizes now, before the teacher loads
        if skips_transfer:  # said once the data is known to be good: a bad --data is the one line
            self.log("skipping transfer: the cells of this model have no trainable parameters")
        self.uses_teacher = "finetune" in stages and config.kl_weight > 0
        self.teacher_source = teacher
        self.teacher: nn.Module | None = None  # loaded by ``run``
        self.settings = {
            **{k: v for k, v in asdict(config).items() if k != "checkpoint_every"},
            "stages": stages,
            "lr": [config.lr[s] for s in stages],
            "gate_lr_scale": [config.gate_lr_scale[s] for s in stages],
            "target": model.target,
            "data": os.fspath(data) if isinstance(data, (str, os.PathLike)) else type(data).__name__,
            "teacher": _teacher_name(model, teacher) if self.uses_teacher else None,
        }
        # A checkpoint continues only the same training of the same model: the settings, and what
        # the model was converted from and to (cells' options, per-layer rules).
        self.compared = {**self.settings, **_model_settings(model)}
        self.checkpoint_dir = checkpoint_dir

    def log(self, message: str) -> None:
        if self.progress:
            print(message, file=sys.stderr, flush=True)

    def run(self, resume: bool) -> RecurrentModel:
        model, config, stages, checkpoint_dir = self.model, self.config, self.stages, self.checkpoint_dir
        if not stages:
            return model
        checkpoint = None
        if resume:
            checkpoint = load_checkpoint(checkpoint_dir, self.compared)
            if checkpoint is None:
                self.log(f"no checkpoint in {checkpoint_dir} yet: starting from the beginning")
        elif checkpoint_dir is not None and self.runtime.main and (moved := set_aside(checkpoint_dir)) is not None:
            self.log(
                f"moved the checkpoint of an earlier run to {moved}: this run starts afresh "
                "(to continue a run, pass --resume / resume=True)"
            )

        requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
        try:
            finetune_names = _finetune_names(model, config) if "finetune" in stages else []
            model.requires_grad_(False)  # each stage turns on what it trains
            if self.uses_teacher:
                self.teacher = _teacher(model, self.teacher_source)
                if self.fsdp:  # as large as the model: sharded per decoder layer too
                    from rnnify.distillation.fsdp import shard_teacher

                    layers = shard_teacher(self.teacher, model, self.mesh)
                    self.log(
                        f"fsdp: teacher sharded over {self.runtime.world_size} ranks, "
                        f"{len(layers)} decoder layers as units of their own"
                    )
            records: list[dict[str, Any]] = []
            if checkpoint is not None:
                params = dict(model.named_parameters())
                _check_parameters(checkpoint, params, self.cell_names, checkpoint_dir)
                with torch.no_grad():
                    for name, tensor in checkpoint.trainable.items():
                        params[name].copy_(tensor)
                records = list(checkpoint.records)
            for index, stage in enumerate(stages):
                if checkpoint is not None:
                    done = stages.index(checkpoint.stage) - (0 if checkpoint.done else 1)
                    if index <= done:
                        continue
                resumed = checkpoint if checkpoint is not None and checkpoint.stage == stage else None
                cells = self.cell_names
                names = cells if stage == "transfer" else cells + [n for n in finetune_names if n not in cells]
                records.append(self.train_stage(stage, names, resumed, records))
        finally:  # also when interrupted: the model is left with plain weights and its own flags
            merge_lora(model)
            for name, param in model.named_parameters():
                param.requires_grad_(requires_grad.get(name, True))
        earlier = model.manifest.distill  # a model distilled before keeps that record: its stages came first
        model.manifest.distill = {
            **self.settings,
            "world_size": self.runtime.world_size,
            "fsdp": self.fsdp,
            "trained": records,
            **({"earlier": earlier} if earlier else {}),
        }
        return model

    def param_groups(
        self, originals: list[nn.Parameter], trainable: list[nn.Parameter], gate_scale: float
    ) -> list[dict]:
        """AdamW's groups over ``trainable`` (``originals`` or their shards, in the same order), each
        with its ``scale``, the multiple of the stage's scheduled rate it trains at (set every step):
        ``gate_scale`` for the cells' gates, 1 for the rest."""
        gates = {id(p) for p in gate_parameters(self.model)}
        groups = [
            {"params": [t for p, t in zip(originals, trainable) if (id(p) in gates) == is_gate], "scale": scale}
            for is_gate, scale in ((False, 1.0), (True, gate_scale))
        ]
        return [g for g in groups if g["params"]]

    def train_stage(
        self, stage: str, names: list[str], resumed: Checkpoint | None, records: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Train ``names`` for one stage (from ``resumed`` if given); the stage's record."""
        model, runtime, lr = self.model, self.runtime, self.config.lr[stage]
        params = dict(model.named_parameters())
        originals = [params[n] for n in names]
        for p in originals:
            p.requires_grad_(True)
        sharded, restore = None, ExitStack()
        try:
            if self.fsdp:  # a sharded training copy, built after requires_grad is set (FSDP reads it once)
                from rnnify.distillation.fsdp import ShardedModel

                sharded = ShardedModel(model, self.mesh)
                run, wrapped, trainable = sharded.view, sharded.view, [sharded.param(p) for p in originals]
                self.log(
                    f"{stage}: FSDP over {runtime.world_size} ranks, units: {', '.join(sharded.units)}"
                    + (f" ({', '.join(sharded.rooted)}: with the root, sharing a weight)" if sharded.rooted else "")
                )
            else:  # DDP after requires_grad is set: it reduces what needs a gradient
                if stage == "transfer":  # the losses are at the cells: nothing after the last one runs
                    restore.enter_context(cells_only(model))
                run, wrapped, trainable = model, runtime.wrap(model), originals
            groups = self.param_groups(originals, trainable, self.config.gate_lr_scale[stage])
            optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
            step, tokens = 0, 0
            if resumed is not None:
                state = resumed.optimizer
                if sharded is not None:
                    from rnnify.distillation.fsdp import shard_optimizer_state

                    # the state is numbered in the groups' order (gates last), not in ``trainable``'s
                    state = shard_optimizer_state(state, [p for g in optimizer.param_groups for p in g["params"]])
                optimizer.load_state_dict(state)
                step, tokens = resumed.step, resumed.tokens
            self.log(
                f"{stage}: training {sum(p.numel() for p in trainable):,} parameters in {len(trainable)} tensors, "
                f"lr {lr:g} ({self.config.schedule})"
                + (f", up to {self.budget:,} tokens" if self.budget else ", one pass over the data")
                + (f", resuming at step {step}" if step else "")
            )
            from tqdm import tqdm

            per_step = self.config.seq_len * self.config.batch_size
            total = None if self.budget is None else -(-self.budget // per_step)
            # the loss of the stage's last batch of the most real tokens: a short last batch (the token
            # budget's remainder) can hold a few tokens the window computes exactly, a loss that says nothing
            loss, final, most, start, first = float("nan"), float("nan"), 0, time.perf_counter(), tokens
            with tqdm(
                total=total, initial=step, desc=stage, unit="step", disable=not self.progress, file=sys.stderr
            ) as bar:
                for batch in token_batches(**self.batches_args, skip_batches=step):
                    for group in optimizer.param_groups:
                        group["lr"] = lr * group["scale"] * lr_factor(step, total, self.config.schedule)
                    loss, batch_tokens = self.step(stage, run, wrapped, optimizer, trainable, batch)
                    step, tokens = step + 1, tokens + batch_tokens
                    if batch_tokens >= most:
                        final, most = loss, batch_tokens
                    bar.update()
                    bar.set_postfix(
                        loss=f"{loss:.4g}", tok_s=f"{(tokens - first) / (time.perf_counter() - start):,.0f}"
                    )
                    if self.checkpoint_dir is not None and step % self.config.checkpoint_every == 0:
                        self.save(stage, step, tokens, False, optimizer, names, records, sharded)
            record = {"stage": stage, "steps": step, "tokens": tokens, "lr": lr, "final_loss": final}
            if self.checkpoint_dir is not None:
                self.save(stage, step, tokens, True, optimizer, names, [*records, record], sharded)
            if sharded is not None:
                # Only on success: gathering takes every rank, and after an error some may never come.
                # An interrupted FSDP stage leaves the model as the stage found it (its checkpoint has the progress).
                sharded.copy_back(originals)
        finally:
            restore.close()
            for p in originals:
                p.requires_grad_(False)
        self.log(f"{stage}: {step} step{'s' if step != 1 else ''}, {tokens:,} tokens, final loss {final:.4g}")
        return record

    def step(
        self, stage: str, model: RecurrentModel, wrapped: nn.Module, optimizer, trainable, batch
    ) -> tuple[float, int]:
        """One optimizer step on one global batch; (the batch's loss, its real tokens), all ranks together.

        ``model`` makes the state and carries the attention hooks; ``wrapped`` is what runs: ``model``
        under DDP, or ``model`` itself (under FSDP, the sharded training copy's view).
        """
        runtime = self.runtime
        ids = batch["input_ids"].to(runtime.device)
        mask = batch["attention_mask"].to(runtime.device)
        state = model.init_state(ids.shape[0])
        tokens = mask.sum()
        if stage == "transfer":
            with attention_transfer(model, teacher_forcing=True) as recorder, _region("student forward"):
                recorder.loss_mask = mask
                wrapped(ids, state)
                sums, counts, weights = [recorder.loss() * tokens], [tokens], [1.0]  # layer means -> token sums
        else:
            teacher_logits = None
            if self.teacher is not None:
                with torch.no_grad(), _region("teacher forward"):
                    teacher_logits = self.teacher(input_ids=ids, use_cache=False).logits
            with _region("student forward"):
                logits, _ = wrapped(ids, state)
            with _region("losses"):
                ce, ce_count, kl, kl_count = token_losses(logits, ids, mask, teacher_logits)
                sums, counts, weights = [ce], [ce_count], [1.0]
                if kl is not None:
                    sums, counts, weights = [ce, kl], [ce_count, kl_count], [1.0, self.config.kl_weight]
        k = len(sums)
        totals = runtime.sum(torch.stack([*(s.detach().float() for s in sums), *counts, tokens]).float())
        global_counts = totals[k : 2 * k].clamp_min(1)
        loss = sum(w * s / n for w, s, n in zip(weights, sums, global_counts)) * runtime.world_size
        optimizer.zero_grad(set_to_none=True)
        with _region("backward"):
            loss.backward()
        with _region("optimizer"):
            torch.nn.utils.clip_grad_norm_(trainable, _MAX_GRAD_NORM)
            optimizer.step()
        value = sum(w * s / n for w, s, n in zip(weights, totals[:k], global_counts))
        return float(value), int(totals[-1])

    def save(self, stage, step, tokens, done, optimizer, names, records, sharded=None) -> None:
        """Rank 0 writes a checkpoint; under FSDP every rank first helps gather the full tensors."""
        if sharded is None and not self.runtime.main:
            return
        params = dict(self.model.named_parameters())
        if sharded is not None:  # same format as without FSDP: full tensors, optimizer state by position
            from rnnify.distillation.fsdp import full_optimizer_state

            trainable = {n: sharded.full(params[n]) for n in names}
            optimizer_state = full_optimizer_state(optimizer.state_dict())
        else:
            trainable = {n: params[n].detach().cpu().clone() for n in names}
            optimizer_state = optimizer.state_dict()
        if not self.runtime.main:
            return
        save_checkpoint(
            self.checkpoint_dir,
            Checkpoint(
                stage=stage,
                step=step,
                done=done,
                tokens=tokens,
                trainable=trainable,
                optimizer=optimizer_state,
                settings=self.compared,
                records=records,
            ),
        )


def _finetune_names(model: RecurrentModel, config: _Config) -> list[str]:
    """What the finetune stage trains besides the cells' parameters (``config.train``); adds LoRA for ``"lora"``."""
    if config.train == "lora":
        generator = torch.Generator().manual_seed(config.seed)
        loras = add_lora(model, config.lora_rank, config.lora_alpha, generator)
        return _names(model, [p for lora in loras.values() for p in lora.parameters()])
    if config.train == "attention":
        return _names(model, [model.graph.get_parameter(name) for name in lora_targets(model)])
    frozen = {id(p) for p in cell_parameters(model) if not p.requires_grad}  # a cell's fixed tensors stay fixed
    unreached = unreached_weights(model)
    frozen |= {id(p) for name, p in model.graph.named_parameters() if name in unreached}
    return [name for name, p in model.named_parameters() if id(p) not in frozen]


def _region(name: str):
    """A named range for ``torch.profiler`` (``benchmarks/distill_speed.py --profile``); free when it is off."""
    return torch.profiler.record_function(f"distill: {name}")


def _names(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    """The names of ``params`` in ``model``, in ``model``'s order (checkpoints key tensors by name)."""
    wanted = {id(p) for p in params}
    return [name for name, p in model.named_parameters() if id(p) in wanted]


def _check_parameters(
    checkpoint: Checkpoint, params: dict[str, torch.Tensor], cell_names: list[str], directory: Any
) -> None:
    """A checkpoint holds every parameter of the model's cells and none the model lacks (one
    written by an earlier rnnify whose cells had other parameters does not)."""
    missing = [n for n in cell_names if n not in checkpoint.trainable]
    unknown = [n for n in checkpoint.trainable if n not in params]
    if missing or unknown:
        what = f"lacks {missing[0]}" if missing else f"has {unknown[0]}, which the model lacks"
        raise RnnifyError(
            f"the checkpoint in {directory} {what} (written for cells with other parameters, by an "
            "earlier rnnify?); use another checkpoint directory to start over"
        )


def _teacher(model: RecurrentModel, teacher) -> nn.Module:
    try:
        return load_teacher(model, teacher)
    except RnnifyError as exc:
        if teacher is not None:
            raise
        raise RnnifyError(f"{exc}; or fine-tune without one with kl_weight=0 (--kl-weight 0)") from exc


def _teacher_name(model: RecurrentModel, teacher) -> str | None:
    """The teacher as recorded and compared on resume: its directory or hub id (by default the source)."""
    if teacher is None:
        return model.manifest.source
    if isinstance(teacher, (str, os.PathLike)):
        return os.fspath(teacher)
    return getattr(getattr(teacher, "config", None), "_name_or_path", None) or type(teacher).__name__


def _model_settings(model: RecurrentModel) -> dict[str, Any]:
    """The source and the cells (target and options per layer, per-layer rules) of ``model``, as JSON
    gives them (so a converted model and the same model loaded from disk compare equal)."""
    manifest = model.manifest
    return json.loads(
        json.dumps(
            {
                "source": manifest.source,
                "layers": manifest.layers,
                "cells": [
                    {"layer": entry.layer, "target": entry.target, "options": entry.options} for entry in manifest.cells
                ],
            }
        )
    )
