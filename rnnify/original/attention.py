"""Attention transfer: each cell against the softmax attention it replaced, on the same inputs.

LoLCATs' first stage (docs/math.md §Attention transfer) trains every layer's cell to reproduce the original layer's
attention output. No separate teacher model is needed: the converted graph still computes the
original q, k and v at every site, so a hook on each cell computes exact softmax attention of
those very inputs and compares. With teacher forcing the hook then hands the softmax output
downstream in place of the cell's, so every layer sees the original model's activations and all
layers train at once from one forward pass, each against its own target.

The softmax is ``torch.nn.functional.scaled_dot_product_attention`` in fp32 (causal, grouped
kv heads, the model's own sliding window ``cell.spec.window``, padded keys masked), independent
of the ``exact`` cell's code, so ``exact`` cells give an independent ~0 error. A site whose scores
carry terms (``CellSpec.score_terms``: Gemma 2's softcap, ALiBi, gpt-oss's learned sinks; docs/math.md
§Score terms) gets them here too, written out as the models' eager attention computes them (every
score of the call, then the softmax over the scores and the sink logit), not with the cells'
online softmax: it is the reference the cells are held to.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from rnnify.cells import Cell
from rnnify.cells.base import SCORE_TERMS
from rnnify.cells.online_softmax import chunk_of
from rnnify.errors import RnnifyError
from rnnify.runtime.model import RecurrentModel

__all__ = ["AttentionRecorder", "LayerError", "attention_transfer", "cells_only", "softmax_attention"]


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    softcap: float | None = None,
    alibi_slopes: Sequence[float] | None = None,
    sink_logits: Sequence[float] | None = None,
    relative_extent: int | None = None,
    query_sinks: bool | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """``softmax_attention(q [B,H,T,d], k [B,Hkv,T,d], v [B,Hkv,T,dv], mask [B,T], scale, window) -> [B,H,T,dv]`` fp32.

    Causal softmax attention of one call's tokens, as the original model computed it: query i
    sees keys j <= i with ``i - j < window`` (if set), in its own ``chunk`` of real tokens (if set),
    that ``mask`` marks real. Queries with no key
    to see (left padding) give 0, not NaN, so teacher forcing never spreads NaN downstream.

    The score terms, as ``CellSpec`` holds them: each score s = scale q_i . k_j becomes
    ``softcap`` c tanh(s / c), then gains ``alibi_slopes[h]`` (j - i) with i and j counted in the
    row's real tokens, and ``sink_logits[h]`` is one more logit in each query's softmax, with no value.
    What each query brings (``relative_extent``, ``query_sinks``) is not taken: inputs of their own,
    which only the exact cell reads.
    """
    if relative_extent is not None or query_sinks:
        raise ValueError("the reference attention takes no terms per query; only --to exact computes them")
    length = q.shape[2]
    pos = torch.arange(length, device=q.device)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed = allowed & (pos[:, None] - pos[None, :] < window)
    allowed = allowed[None, None] & mask.to(torch.bool)[:, None, None, :]  # [B, 1, T, T]
    if chunk is not None:
        of = chunk_of(mask.to(torch.bool), chunk)
        allowed = allowed & (of[:, :, None] == of[:, None, :])[:, None]
    if softcap is None and alibi_slopes is None and sink_logits is None:
        out = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    else:
        out = _scored_attention(q, k, v, mask, allowed, scale, softcap, alibi_slopes, sink_logits)
    return torch.where(allowed.any(-1, keepdim=True), out, 0.0)


def _scored_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float | None,
    alibi_slopes: Sequence[float] | None,
    sink_logits: Sequence[float] | None,
) -> torch.Tensor:
    """``softmax_attention`` of a site with score terms, fp32: every score ``[B, H, T, T]`` at once (as
    the models' own eager attention holds them), the terms added in the model's order, the softmax
    taken over the allowed scores and the sink logit, whose column is dropped before the values."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))  # query head h reads kv head h // group
    scores = scale * q.float() @ k.transpose(-1, -2)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        real = mask.to(torch.bool).long().cumsum(1) - 1  # [B, T]: each token's place among its row's real tokens
        distance = (real[:, None, :] - real[:, :, None]).float()  # [B, T(i), T(j)]: j - i
        slopes = torch.tensor(alibi_slopes, dtype=torch.float32, device=q.device)
        scores = scores + slopes[None, :, None, None] * distance[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink_logits is not None:
        sinks = torch.tensor(sink_logits, dtype=torch.float32, device=q.device)
        scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    if sink_logits is not None:
        weights = weights[..., :-1]
    return weights @ v


@dataclass(frozen=True)
class LayerError:
    """How far one cell is from softmax attention, averaged over the real tokens recorded."""

    layer: int
    module: str  # the cell's submodule, e.g. "cells.0"
    mse: float  # mean over tokens of the squared error averaged over heads and channels
    rel_error: float  # mean over tokens of ||cell_out - softmax_out|| / ||softmax_out|| (over heads, channels)
    tokens: int


class AttentionRecorder:
    """What ``attention_transfer`` yields: per-cell errors of the latest forward and running averages.

    ``loss_mask`` (``[B, T]`` bool, or None) marks the positions that count, on top of the mask
    the model itself passes to the cells: set it per batch when the model is called without a
    mask on right-padded rows, so padding never enters a loss or a metric. A model's own
    recurrent layers (``Cell.own_layer``: short convolutions, Mamba scans) are the source's layers
    unchanged, and so is exact attention over an indexer's selection (``CellSpec.index_topk``) or
    with terms each query brings (``CellSpec.per_query_terms``), which only ``exact`` computes:
    nothing is compared there, and their errors stay 0 over 0 tokens.
    """

    def __init__(self, model: RecurrentModel, teacher_forcing: bool):
        self.teacher_forcing = teacher_forcing
        self.loss_mask: torch.Tensor | None = None
        self._cells: list[Cell] = model.cells
        self._entries = list(model.manifest.cells)
        self.compared = [
            i
            for i, cell in enumerate(self._cells)
            if not (cell.own_layer or cell.spec.selects or cell.spec.per_query_terms)
        ]
        self._latest: dict[int, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Forget the running averages (``errors()``) and the latest losses."""
        self._latest.clear()
        self._sums: list[torch.Tensor | None] = [None] * len(self._cells)  # per cell: mse, rel, tokens (on device)

    def losses(self) -> list[torch.Tensor]:
        """``losses() -> list[Tensor]``: the latest forward's MSE per cell (scalar, differentiable), in cell order."""
        if len(self._latest) != len(self.compared):
            raise RnnifyError("no forward pass was recorded yet: call the model inside attention_transfer")
        return [self._latest[i] for i in self.compared]

    def loss(self) -> torch.Tensor:
        """``loss() -> Tensor``: the sum over layers of the latest forward's MSE (the stage-1 objective)."""
        return torch.stack(self.losses()).sum()

    def errors(self) -> list[LayerError]:
        """``errors() -> list[LayerError]``: per cell, averages over every forward since ``reset()``."""
        out = []
        for entry, sums in zip(self._entries, self._sums):
            mse, rel, tokens = sums.tolist() if sums is not None else (0.0, 0.0, 0.0)
            n = max(tokens, 1.0)
            out.append(LayerError(entry.layer, entry.module, mse / n, rel / n, int(tokens)))
        return out

    def _record(self, index: int, cell: Cell, args: tuple, output: tuple) -> tuple:
        q, k, v, mask = args[:4]
        out, *state = output
        valid = mask.to(torch.bool)
        if self.loss_mask is not None:
            if self.loss_mask.shape != valid.shape:
                raise RnnifyError(f"loss_mask shape {tuple(self.loss_mask.shape)} != input shape {tuple(valid.shape)}")
            valid = valid & self.loss_mask.to(device=valid.device, dtype=torch.bool)
        with torch.no_grad():
            terms = {name: getattr(cell.spec, name) for name in SCORE_TERMS}
            target = softmax_attention(q, k, v, mask, cell.spec.scale, cell.spec.window, chunk=cell.spec.chunk, **terms)
        diff = out.float() - target  # [B, H, T, dv]
        per_token = torch.where(valid, diff.square().mean(dim=(1, 3)), 0.0)  # [B, T]; where: padding may be NaN
        tokens = valid.sum()
        mse = per_token.sum() / tokens.clamp_min(1)
        self._latest[index] = mse
        with torch.no_grad():
            norm = target.square().sum(dim=(1, 3)).sqrt().clamp_min(torch.finfo(torch.float32).tiny)
            rel = torch.where(valid, diff.square().sum(dim=(1, 3)).sqrt() / norm, 0.0)
            update = torch.stack([per_token.sum(), rel.sum(), tokens.to(rel.dtype)]).double()
            previous = self._sums[index]
            self._sums[index] = update if previous is None else previous + update
        if self.teacher_forcing:
            return (target.to(out.dtype), *state)
        return output


@contextmanager
def attention_transfer(model: RecurrentModel, teacher_forcing: bool = True) -> Iterator[AttentionRecorder]:
    """``with attention_transfer(model, teacher_forcing=True) as recorder:`` compare cells with softmax.

    While active, every call of ``model`` (directly, or through a DDP wrapper) makes each cell
    also compute exact softmax attention of its own q, k, v (fp32) and record the error of its
    output against it: ``recorder.losses()`` / ``recorder.loss()`` for the latest forward (with
    gradients to the cell's parameters), ``recorder.errors()`` averaged over all forwards. With
    ``teacher_forcing`` the softmax output replaces the cell's downstream, so the logits are
    the original model's and each layer is judged on the original model's activations; without
    it the model runs as converted and errors compound across layers.

    Softmax attention here covers the tokens of one call only, so every call must start from
    ``model.init_state(batch)``; a call that continues from a state raises ``RnnifyError``.
    """
    recorder = AttentionRecorder(model, teacher_forcing)

    def check_fresh(module, args, kwargs):
        state = args[1] if len(args) > 1 else kwargs.get("state")
        if state is not None and bool((state.positions != 0).any()):
            raise RnnifyError(
                "attention transfer compares one call's tokens: start each call from model.init_state(batch)"
            )

    def hook_for(index: int):
        def hook(cell, args, kwargs, output):
            return recorder._record(index, cell, args, output)

        return hook

    handles = [model.register_forward_pre_hook(check_fresh, with_kwargs=True)]
    cells = model.cells
    handles += [cells[i].register_forward_hook(hook_for(i), with_kwargs=True) for i in recorder.compared]
    try:
        yield recorder
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def cells_only(model: RecurrentModel) -> Iterator[RecurrentModel]:
    """``with cells_only(model):`` calls of ``model`` run only what some cell's inputs need.

    Attention transfer's losses are all at the cells, so the rest of a forward is waste: the last
    layer's output projection and MLP, the final norm and the LM head (on a 49k-token vocabulary,
    a tenth of SmolLM2-135M's forward). While active, ``model.graph`` is a copy of the step graph
    whose output is the cells' calls, with everything they do not reach removed; it shares every
    submodule, parameter and buffer with the original (LoRA parametrizations included), so hooks,
    gradients and DDP see the same objects. A call then returns the cells' outputs in place of the
    logits and an empty state. Each cell computes what it did before, from the same inputs, so the
    transfer losses and their gradients are unchanged.
    """
    original = model.graph
    cells = {entry.module for entry in model.manifest.cells}
    graph = copy.deepcopy(original.graph)
    calls = [node for node in graph.nodes if node.op == "call_module" and node.target in cells]
    output = next(node for node in graph.nodes if node.op == "output")
    output.args = ((tuple(calls),),)
    pruned = torch.fx.GraphModule(original, graph)
    for name, child in original.named_children():  # the originals themselves, not the copies fx makes
        setattr(pruned, name, child)
    pruned.graph.eliminate_dead_code()
    pruned.recompile()
    model.graph = pruned
    try:
        yield model
    finally:
        model.graph = original
