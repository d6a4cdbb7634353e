"""Sliding-window softmax plus a fixed-size memory of the older tokens (LoLCATs, Zhang et al.
2024): the ``hybrid`` target.

The math: docs/math.md §Hybrid window and linear; the options, and the measurements behind their
defaults: docs/targets.md, ``hybrid``.

Query i reads the last W tokens and the first S (the attention sinks of ``cells/window.py``,
StreamingLLM) by softmax and every other older token through a recurrent memory, so each token is
counted once: by the window part while in the window or a sink, by the memory once it has left.
The state is the ``window`` target's (a ring of the last W keys and values, the S sinks and
``length``) plus the memory's; the window part is kept in decode, not dropped for the memory alone.

A training-free memory is far from what a pretrained model's attention computes, so the cell's
output is the window's own output plus a learned, zero-initialised share of the memory's correction:

    out_i = w_i / u_i + g_h (y_i - w_i / u_i),        g_h = ``memory_gate`` (``memory_init``, default 0)

At g = 0 the converted model is exactly the ``window`` target with the same W and S, and
distillation grows g together with the memory, adding long-range memory instead of first
repairing damage.

The memories share the window part and the tokens leaving the window (``cells/hybrid_window.py``):
``linear`` and ``gla`` (``cells/linear_memory.py``) are linear attention, plain or decayed by GLA's
gate, whose sums join the window part's in one normalised sum y_i (at g = 1, LoLCATs' own);
``delta`` and ``gated-delta`` (``cells/delta_memory.py``) are a delta-rule memory, which has no
normaliser and takes its share of the query's weight instead.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from rnnify.cells.base import Cell, CellSpec
from rnnify.cells.delta import DeltaWriter
from rnnify.cells.delta_memory import (
    BY_MASS,
    DELTA_MEMORIES,
    SHARES,
    DeltaReader,
    delta_memory_hybrid_attn,
    step_delta_memory_hybrid_attn,
)
from rnnify.cells.gated import gate_bias, gla_log_gates, gla_projections
from rnnify.cells.linear import KERNEL_MAX_FEATURES, build_feature_map
from rnnify.cells.linear_memory import (
    chunk_hybrid_attn,
    fused_hybrid_attn,
    step_hybrid_attn,
)
from rnnify.choices import MEMORIES
from rnnify.errors import RnnifyError, check_int

# the linear and gla memories' map when none is given: trainable, so distillation can fit the memory to
# softmax (an untrained map leaves it gated off, the window alone); elu, the default before, has no parameters
DEFAULT_FEATURE_MAP = "hedgehog"
# attention sinks when none are given: on a real model a window without them loses what its first tokens
# anchor (StreamingLLM; measured in docs/targets.md, ``hybrid``)
DEFAULT_SINKS = 4
GLA_RANK, GLA_TAU, GLA_DECAY = 16, 16.0, 0.99  # the gla memory's gate: the gated target's defaults (cells/gated.py)


class HybridCell(Cell):
    """Softmax over the last W tokens and the first S (sinks) plus linear attention over the other
    older ones (LoLCATs), trainable.

    ``sinks`` (default ``DEFAULT_SINKS``, 4) are the attention sinks of the window part; ``feature_map`` is any name in
    ``rnnify.cells.linear.FEATURE_MAPS`` (default ``DEFAULT_FEATURE_MAP``, hedgehog), built with
    ``feature_options``; ``chunk_size`` is the prefill chunk; ``memory_init`` the initial memory
    gate (0: the converted model starts as its window target alone). Trainable: ``window_logit``
    (f_h = sigmoid of it, per query head), ``memory_gate`` (g_h, per query head) and the feature
    map's parameters. ``memory``: ``linear`` (the default), or ``delta`` / ``gated-delta``: a
    delta-rule memory (``cells/delta_memory.py``), trainable through ``memory_gate``, its beta (and
    alpha) projections and its reader (key map, share projection, count weight), with no f_h or
    feature map; ``gla``: the linear memory decayed by GLA's gate of the arriving token (trainable too).
    ``share`` (delta memories): ``count`` (the default) or ``mass``, the readout weighed as the linear
    memory's tokens would be, through the feature map and f_h, or ``mass-input``, those odds scaled
    by a learned factor of the layer input (``cells/delta_memory.py``). ``anneal`` (delta
    memories; 0, the default: off): beta falls as 1 / n with the tokens the memory holds, from tau_h
    = ``anneal``, learned (``log_tau``; ``cells/delta_memory.py``).

    The state is the window target's (keys, values, sink_keys, sink_values, length) then the linear
    memory (kv, k_sum); with no sinks the empty sink buffers are left out, so a hybrid without
    sinks keeps the five state tensors of hybrids saved before sinks existed.
    """

    target = "hybrid"
    own_forms_without_triton = frozenset({"prefill", "decode"})
    manifest_defaults: ClassVar[dict[str, Any]] = {"sinks": 0}  # hybrids saved before sinks existed had none
    gates = ("memory_gate", "window_logit")
    state_names = ("keys", "values", "length", "kv", "k_sum")  # with sinks: + sink_keys, sink_values after values

    def __init__(
        self,
        spec: CellSpec,
        window: int = 64,
        feature_map: str | None = None,
        feature_options: dict[str, Any] | None = None,
        chunk_size: int = 64,
        memory_init: float = 0.0,
        sinks: int = DEFAULT_SINKS,
        memory: str = "linear",
        share: str = "count",
        anneal: float = 0.0,
    ):
        super().__init__(spec)
        if memory not in MEMORIES:
            raise ValueError(f"unknown memory {memory!r}; choose from {list(MEMORIES)}")
        if share not in SHARES or (share != "count" and memory not in DELTA_MEMORIES):
            raise ValueError(
                f"share must be one of {list(SHARES)}, and the shares by mass apply to the delta "
                f"memories only; got {share!r} with memory {memory!r}"
            )
        # a delta memory read by count has no feature map: "elu" is what its manifests recorded while that was the default
        if memory in DELTA_MEMORIES and share == "count" and (feature_map not in (None, "elu") or feature_options):
            raise ValueError(
                f"memory {memory!r} has no feature map unless its share is by mass (share='mass' or "
                "'mass-input'): feature_map and feature_options apply to the linear and gla memories "
                "and to the shares by mass"
            )
        if (
            isinstance(anneal, bool)
            or not isinstance(anneal, (int, float))
            or not 0 <= anneal < math.inf
            or (anneal and memory not in DELTA_MEMORIES)
        ):
            raise ValueError(
                f"anneal must be a finite number >= 0 (0: off), for the delta memories only; got "
                f"{anneal!r} with memory {memory!r}"
            )
        if feature_options is not None and not isinstance(feature_options, dict):
            raise ValueError(f"feature_options must be a dict of feature-map options, got {feature_options!r}")
        if isinstance(memory_init, bool) or not isinstance(memory_init, (int, float)) or not 0 <= memory_init <= 1:
            raise ValueError(
                f"memory_init must be a number in [0, 1] (0: start as the window alone), got {memory_init!r}"
            )
        self.window = check_int("window", window, 1)
        self.sinks = check_int("sinks", sinks, 0)
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        self.memory_init, self.memory, self.share, self.anneal = float(memory_init), memory, share, float(anneal)
        weighed = memory not in DELTA_MEMORIES or share in BY_MASS  # has a feature map and f_h
        if feature_map is None:  # the delta memories read by count record the old default, which they never use
            feature_map = DEFAULT_FEATURE_MAP if weighed else "elu"
        self.feature_map, self.feature_options = feature_map, dict(feature_options or {})
        self.memory_gate = nn.Parameter(torch.full((spec.num_heads,), self.memory_init))
        memory_state = ("kv", "k_sum")
        if weighed:
            self.phi = build_feature_map(feature_map, spec, **self.feature_options)
            if share in BY_MASS and not getattr(self.phi, "non_negative_products", False):
                raise ValueError(
                    f"share={share!r} weighs the memory by phi(q) . phi(k), which feature map {feature_map!r} "
                    "can make negative: choose a non-negative map (hedgehog, elu, relu, ...)"
                )
            self.window_logit = nn.Parameter(torch.zeros(spec.num_heads))
        if memory == "gla":  # per-feature decays from the layer input
            if spec.hidden_size is None:
                raise ValueError("the gla memory reads the layer input, but its width (spec.hidden_size) is unknown")
            self.gate_down, self.gate_up = gla_projections(
                spec.hidden_size, GLA_RANK, spec.num_kv_heads * self.phi.feature_dim, gate_bias(GLA_DECAY, GLA_TAU)
            )
            self.needs_input = True
        elif memory in DELTA_MEMORIES:  # beta (and alpha) from the layer input
            self.writer = DeltaWriter(spec, memory == "gated-delta", 0.5, None)
            self.reader = DeltaReader(spec, share)
            if self.anneal:  # tau_h of ``annealed``, learned from here
                self.log_tau = nn.Parameter(torch.full((spec.num_kv_heads,), math.log(self.anneal)))
            self.needs_input = True
            memory_state = ("kv", "k_sum") if share in BY_MASS else ("kv",)
        window_state = ("keys", "values", "sink_keys", "sink_values") if self.sinks else ("keys", "values")
        self.state_names = (*window_state, "length", *memory_state)

    def options(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "sinks": self.sinks,
            "feature_map": self.feature_map,
            "feature_options": dict(self.feature_options),
            "chunk_size": self.chunk_size,
            "memory_init": self.memory_init,
            "memory": self.memory,
            **({"share": self.share} if self.memory in DELTA_MEMORIES else {}),
            **({"anneal": self.anneal} if self.anneal else {}),
        }

    def fused_ops(self) -> dict[str, str]:
        if self.memory in DELTA_MEMORIES:
            return {"prefill": "chunk_delta_rule", "decode": "window_attn_step + fused_recurrent_delta_rule"}
        if self.phi.feature_dim > KERNEL_MAX_FEATURES:
            return {}
        # prefill: the linear part (the window part stays PyTorch); decode: both parts
        return {"prefill": "chunk_linear_attn", "decode": "window_attn_step + fused_recurrent_linear_attn"}

    def init_state(self, batch_size, device, dtype):
        spec = self.spec

        def buffer(slots: int, dim: int) -> torch.Tensor:
            return torch.zeros(batch_size, spec.num_kv_heads, slots, dim, device=device, dtype=dtype)

        sinks = (buffer(self.sinks, spec.head_dim), buffer(self.sinks, spec.value_dim)) if self.sinks else ()
        if self.memory in DELTA_MEMORIES:
            mass = (
                (torch.zeros(batch_size, spec.num_kv_heads, self.phi.feature_dim, device=device, dtype=torch.float32),)
                if self.share in BY_MASS
                else ()
            )
            return (
                buffer(self.window, spec.head_dim),
                buffer(self.window, spec.value_dim),
                *sinks,
                torch.zeros(batch_size, device=device, dtype=torch.long),
                torch.zeros(
                    batch_size, spec.num_kv_heads, spec.head_dim, spec.value_dim, device=device, dtype=torch.float32
                ),
                *mass,
            )
        features = self.phi.feature_dim
        return (
            buffer(self.window, spec.head_dim),
            buffer(self.window, spec.value_dim),
            *sinks,
            torch.zeros(batch_size, device=device, dtype=torch.long),
            torch.zeros(batch_size, spec.num_kv_heads, features, spec.value_dim, device=device, dtype=torch.float32),
            torch.zeros(batch_size, spec.num_kv_heads, features, device=device, dtype=torch.float32),
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # hybrids saved before the memory gate existed computed the plain LoLCATs sum: gate 1
        state_dict.setdefault(prefix + "memory_gate", torch.ones_like(self.memory_gate, dtype=torch.float32))
        by_count = self.memory in DELTA_MEMORIES and self.share == "count"
        if by_count and prefix + "reader.share_proj.weight" not in state_dict:
            raise RnnifyError(
                "this hybrid's delta memory was saved by an earlier rnnify, which added its readout to the window's "
                "output; the memory is now read through a learned key map and blended in: convert the model again"
            )
        if by_count:  # saved before the share counted the memory's tokens: c = 0 is that share
            state_dict.setdefault(prefix + "reader.count_weight", torch.zeros_like(self.reader.count_weight))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def exact_span(self) -> int:
        return self.window + self.sinks

    def mixing_factor(self) -> torch.Tensor:
        """f_h = sigmoid(theta_h), grouped per kv head ``[Hkv, G]``, fp32."""
        return torch.sigmoid(self.window_logit.float()).reshape(self.spec.num_kv_heads, self.spec.group_size)

    def forward(self, q, k, v, mask, *state, x=None):
        batch, _, steps, _ = q.shape
        grouped = q.float().reshape(batch, self.spec.num_kv_heads, self.spec.group_size, steps, -1)
        if not self.sinks:  # the forms take sink buffers: empty ones
            keys, values, *rest = state
            state = (keys, values, keys[:, :, :0], values[:, :, :0], *rest)
        gate = self.memory_gate.float().reshape(self.spec.num_kv_heads, self.spec.group_size)
        mask = mask.to(torch.bool)
        backend = self.backend(q, steps)
        if self.memory in DELTA_MEMORIES:
            out, *state = self._delta_memory(grouped, k, v, mask, state, gate, x, backend)
        else:
            out, *state = self._linear_memory(grouped, k, v, mask, state, gate, x, backend)
        if not self.sinks:
            del state[2:4]
        return out.reshape(batch, self.spec.num_heads, steps, -1).to(q.dtype), *state

    def _delta_memory(self, q, k, v, mask, state, gate, x, backend: str | None):
        """A delta or gated-delta memory: the lean step for a decode token off kernels, else the general forms."""
        beta, log_a = self.writer(x, mask)
        mass = None
        if self.share in BY_MASS:  # the last state tensor is z; the share is read from it, the gate (and the input)
            *state, k_sum = state
            logit = self.reader.logit(x) if self.share == "mass-input" else None
            mass, share = (self.phi, self.mixing_factor(), k_sum, logit), gate
        else:
            share = self.reader.share(x, gate)
        log_tau = self.log_tau if self.anneal else None
        reading = {"share": share, "key_map": self.reader.key_map, "key_bias": self.reader.key_bias, "mass": mass}
        options = {"beta": beta, "log_a": log_a, "log_tau": log_tau, **reading, "scale": self.spec.scale}
        if q.shape[3] == 1 and backend is None:
            return step_delta_memory_hybrid_attn(q, k, v, mask, *state, **options)
        return delta_memory_hybrid_attn(q, k, v, mask, *state, **options, chunk_size=self.chunk_size, kernels=backend)

    def _linear_memory(self, q, k, v, mask, state, gate, x, backend: str | None):
        """A linear or gla memory: the lean step for a decode token off kernels; a prompt through
        ``fused_hybrid_attn`` (in PyTorch off Triton: the whole-prompt window part, the linear part
        chunked on featurised inputs), or the general ``chunk_hybrid_attn`` with kernels "none" (and
        for a cell with no fused form: a feature map wider than the ops take)."""
        options, log_a = {"phi": self.phi, "factor": self.mixing_factor(), "scale": self.spec.scale, "gate": gate}, None
        if self.memory == "gla":
            if x is None:
                raise ValueError("the gla memory needs the layer input: call the cell with x=[B, T, hidden]")
            log_a = gla_log_gates(x, self.gate_down, self.gate_up, GLA_TAU, self.spec.num_kv_heads, mask)
        if q.shape[3] == 1 and backend is None:
            return step_hybrid_attn(q, k, v, mask, *state, **options, log_a=log_a)
        if self.kernels is None and log_a is None:  # kernels "none" (or no fused form): the general chunked form
            return chunk_hybrid_attn(q, k, v, mask, *state, **options, chunk_size=self.chunk_size)
        return fused_hybrid_attn(
            q, k, v, mask, *state, **options, chunk_size=self.chunk_size, backend=backend, log_a=log_a
        )
