"""A gated linear RNN that implements linear attention exactly (Zucchet et al. 2023, docs/math.md §Gated linear RNN).

"Gated recurrent neural networks discover attention" (arXiv 2309.01775): a gated linear RNN
layer — GLU input gate, diagonal linear recurrence, GLU output gate —

    h_t = lambda * h_{t-1} + (W_m z_t) * (W_x z_t)          (input gate, elementwise product)
    y_t = D ((M_m h_t) * (M_x h_t))                          (output gate, then readout D)

implements linear self-attention y_t = sum_{t' <= t} (q_t . k_t') v_t' with this construction,
per kv head (d_k = head size, d_v = value size, G query heads read this kv head):

    neuron            lambda   input gate (W_m z) * (W_x z)    holds
    kv (i, j)         decay    v_i * k_j                       S_t[i, j] = sum_t' v_t',i k_t',j
    query (g, j)      0        q_g,j * 1                       q_g,j of the current token

and the output gate multiplies kv neuron (i, j) by query neuron (g, j), D sums over j:
y_g,i = sum_j S_t[i, j] q_g,j. That is d_k d_v + G d_k neurons per kv head (d^2 + d without
GQA), one diagonal lambda and elementwise gates, nothing else. decay = 1 is exactly
``linear`` with ``feature_map="identity", normalize=False`` (o = q S, no scale, no normaliser);
decay < 1 is RetNet's decayed form S_t = decay S_{t-1} + k_t^T v_t.

Here z_t = [v_t, q_t (all G heads), k_t, 1] is what the model's own projections (and RoPE)
produce, so the GLU weights W_m, W_x, M_m, M_x are 0/1 selection matrices with a single 1 per
row: they are stored as the column index of that 1 (``Neurons``), and applying them is a gather.

Forms (all equal to ``naive_recurrent_gated_rnn``): the per-token loop, ``parallel_*`` (each
neuron's state at every t as a masked decay matrix times the inputs, one matrix per distinct
lambda), ``chunk_*`` (parallel inside chunks, the recurrence between them; the prefill path),
``step_*`` (decode) and ``fused_*`` (the recurrence of every neuron through
``rnnify.kernels.linear_recurrence``, x_t = a_t x_{t-1} + b_t with a = lambda and b = the input
gate; run chunk by chunk in both phases once ``use_kernels`` is set). Shapes: z
``[B, Hkv, T, Dz]``, mask ``[B, T]`` bool, state h ``[B, Hkv, N]`` fp32, outputs
``[B, Hkv, G, T, Dv]``. A padding token leaves every neuron as it was (its lambda counts as 1 and
its input gate as 0).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch

from rnnify import kernels
from rnnify.cells.base import Cell, CellSpec
from rnnify.errors import check_int


class Neurons(NamedTuple):
    """The construction: a diagonal recurrence and four selection matrices (as indices)."""

    lam: torch.Tensor  # [N] the diagonal of the recurrence
    input_m: torch.Tensor  # [N] W_m: neuron n's first input-gate branch is z[input_m[n]]
    input_x: torch.Tensor  # [N] W_x: its second branch is z[input_x[n]]
    output_m: torch.Tensor  # [G * Dv * Dk] M_m: output slot (g, i, j) reads neuron output_m[.]
    output_x: torch.Tensor  # [G * Dv * Dk] M_x: and multiplies it by neuron output_x[.]
    readout: tuple[int, int, int]  # (G, Dv, Dk): D sums the slots over j (the last)


def build_neurons(key_dim: int, value_dim: int, group: int, decay: float) -> Neurons:
    """The Zucchet et al. construction for one kv head (z = [v, q_0 .. q_{G-1}, k, 1])."""
    dk, dv, g = key_dim, value_dim, group
    q_at, k_at, one_at = dv, dv + g * dk, dv + g * dk + dk  # where q, k and the 1 start in z
    i, j = torch.meshgrid(torch.arange(dv), torch.arange(dk), indexing="ij")  # kv neuron i * dk + j
    gq, jq = torch.meshgrid(torch.arange(g), torch.arange(dk), indexing="ij")  # query neuron dv*dk + g*dk + j
    lam = torch.cat([torch.full((dv * dk,), float(decay)), torch.zeros(g * dk)])
    input_m = torch.cat([i.flatten(), q_at + (gq * dk + jq).flatten()])  # v_i | q_g,j
    input_x = torch.cat([k_at + j.flatten(), torch.full((g * dk,), one_at)])  # k_j | 1
    go, io, jo = torch.meshgrid(torch.arange(g), torch.arange(dv), torch.arange(dk), indexing="ij")
    output_m = (io * dk + jo).flatten()  # kv neuron (i, j)
    output_x = (dv * dk + go * dk + jo).flatten()  # query neuron (g, j)
    return Neurons(lam, input_m, input_x, output_m, output_x, (g, dv, dk))


def gate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """z_t = [v_t, q_t of the G heads, k_t, 1]: q ``[B, Hkv, G, T, Dk]``, k/v ``[B, Hkv, T, *]``."""
    queries = q.transpose(2, 3).flatten(-2)  # [B, Hkv, T, G * Dk]
    return torch.cat([v, queries, k, torch.ones_like(k[..., :1])], dim=-1)


def input_gate(z: torch.Tensor, net: Neurons) -> torch.Tensor:
    """GLU input gate (W_m z) * (W_x z): ``[..., Dz] -> [..., N]``."""
    return z[..., net.input_m] * z[..., net.input_x]


def output_gate(h: torch.Tensor, net: Neurons) -> torch.Tensor:
    """y = D ((M_m h) * (M_x h)): neurons ``[B, Hkv, T, N]`` -> outputs ``[B, Hkv, G, T, Dv]``."""
    slots = (h[..., net.output_m] * h[..., net.output_x]).unflatten(-1, net.readout)  # [B, Hkv, T, G, Dv, Dk]
    return slots.sum(-1).transpose(2, 3)  # D: sum over j


def naive_recurrent_gated_rnn(z, mask, h, net: Neurons) -> tuple[torch.Tensor, torch.Tensor]:
    states = []
    for t in range(z.shape[2]):
        real = mask[:, None, t, None]  # [B, 1, 1]
        lam = torch.where(real, net.lam, 1.0)
        h = lam * h + torch.where(real, input_gate(z[:, :, t], net), 0.0)
        states.append(h)
    return output_gate(torch.stack(states, dim=2), net), h


def parallel_gated_rnn(z, mask, h, net: Neurons) -> tuple[torch.Tensor, torch.Tensor]:
    length = z.shape[2]
    u = torch.where(mask[:, None, :, None], input_gate(z, net), 0.0)  # [B, Hkv, T, N]
    count = mask.cumsum(1).to(u.dtype)  # real tokens among 1..t: how often lambda was applied
    states = net.lam ** count[:, None, :, None] * h[:, :, None]  # h_0 decayed: [B, Hkv, T, N]
    causal = torch.ones(length, length, dtype=torch.bool, device=z.device).tril()
    steps = (count[:, :, None] - count[:, None, :]).clamp_min(0)  # [B, T, S]: lambdas between s and t
    for value in net.lam.unique():  # one decay matrix per distinct lambda (decay and 0 here)
        group = net.lam == value
        decay = torch.where(causal, value**steps, 0.0)  # lambda^(steps), 0^0 = 1
        states[..., group] = states[..., group] + decay[:, None] @ u[..., group]
    return output_gate(states, net), states[:, :, -1]


def fused_gated_rnn(z, mask, h, net: Neurons, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    batch, num_kv_heads, length, _ = z.shape
    real = mask[:, None, :, None]
    lam = torch.where(real, net.lam, 1.0).expand(-1, num_kv_heads, -1, -1)  # [B, Hkv, T, N]
    u = torch.where(real, input_gate(z, net), 0.0)
    a, b = (x.transpose(1, 2).reshape(batch, length, -1) for x in (lam, u))  # the op's [B, T, Hkv * N]
    states, h = kernels.linear_recurrence(a, b, h.reshape(batch, -1), output_final_state=True, backend=backend)
    states = states.reshape(batch, length, num_kv_heads, -1).transpose(1, 2)
    return output_gate(states, net), h.reshape(batch, num_kv_heads, -1)


def chunk_gated_rnn(
    z, mask, h, net: Neurons, chunk_size: int = 64, form=parallel_gated_rnn
) -> tuple[torch.Tensor, torch.Tensor]:
    """``form`` (default the parallel one) chunk by chunk: the states of a chunk are held at once."""
    outs = []
    for start in range(0, z.shape[2], chunk_size):
        end = start + chunk_size
        out, h = form(z[:, :, start:end], mask[:, start:end], h, net)
        outs.append(out)
    return torch.cat(outs, dim=3), h


def step_gated_rnn(z, mask, h, net: Neurons) -> tuple[torch.Tensor, torch.Tensor]:
    real = mask[:, None, 0, None]  # T == 1
    lam = torch.where(real, net.lam, 1.0)
    h = lam * h + torch.where(real, input_gate(z[:, :, 0], net), 0.0)
    return output_gate(h[:, :, None], net), h


class GatedRNNCell(Cell):
    """Linear attention written as the gated linear RNN that implements it (d^2 + d neurons per head)."""

    target = "gated-rnn"
    state_names = ("h",)

    def __init__(self, spec: CellSpec, decay: float = 1.0, chunk_size: int = 64):
        super().__init__(spec)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be a number in [0, 1] (lambda of the key-value neurons), got {decay!r}")
        check_int("chunk_size", chunk_size)
        self.decay, self.chunk_size = float(decay), chunk_size
        net = build_neurons(spec.head_dim, spec.value_dim, spec.group_size, self.decay)
        for name in ("lam", "input_m", "input_x", "output_m", "output_x"):
            self.register_buffer(name, getattr(net, name), persistent=False)  # rebuilt from the options
        self._readout = net.readout

    @property
    def neurons(self) -> Neurons:
        return Neurons(self.lam.float(), self.input_m, self.input_x, self.output_m, self.output_x, self._readout)

    @property
    def neurons_per_head(self) -> int:
        """Recurrent neurons per kv head: d_k d_v key-value + G d_k query neurons (d^2 + d without GQA)."""
        return int(self.lam.numel())

    def options(self) -> dict[str, Any]:
        return {"decay": self.decay, "chunk_size": self.chunk_size}

    def describe(self) -> str:
        spec = self.spec
        kv, query = spec.head_dim * spec.value_dim, spec.group_size * spec.head_dim
        return f"{self.neurons_per_head} neurons per kv head ({kv} key-value, {query} query)"

    def fused_ops(self) -> dict[str, str]:
        return {"prefill": "linear_recurrence", "decode": "linear_recurrence"}

    def init_state(self, batch_size, device, dtype):
        shape = (batch_size, self.spec.num_kv_heads, self.neurons_per_head)
        return (torch.zeros(shape, device=device, dtype=torch.float32),)

    def forward(self, q, k, v, mask, h):
        spec, (batch, _, length, _) = self.spec, q.shape
        grouped = q.float().reshape(batch, spec.num_kv_heads, spec.group_size, length, -1)
        z = gate_inputs(grouped, k.float(), v.float())
        mask = mask.to(torch.bool)
        if self.kernels is not None:
            fused = partial(fused_gated_rnn, backend=self.kernels)
            out, h = chunk_gated_rnn(z, mask, h, self.neurons, self.chunk_size, fused)
        elif length == 1:
            out, h = step_gated_rnn(z, mask, h, self.neurons)
        else:
            out, h = chunk_gated_rnn(z, mask, h, self.neurons, self.chunk_size)
        return out.reshape(batch, spec.num_heads, length, -1).to(q.dtype), h
