"""What the delta-rule cell tests share: a small cell and its inputs, and the float64 reference of
docs/math.md §Delta rule, per batch row, kv head and token, with S = [d_v, d_k], unit q and k,
beta_t = sigmoid(x_t W_beta + b_beta) and alpha_t = sigmoid(x_t W_alpha + b_alpha), and padding
tokens skipped:

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    o_t = S_t q_t
"""

from __future__ import annotations

import math

import torch

from rnnify.cells import CellSpec, build_cell
from rnnify.cells.delta import (
    DeltaCell,
)

SPEC = CellSpec(num_heads=4, num_kv_heads=2, head_dim=8, value_dim=6, scale=8**-0.5, hidden_size=12)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def make_cell(target: str, seed: int = 0, **options) -> DeltaCell:
    torch.manual_seed(seed)
    cell = build_cell(target, SPEC, options)
    with torch.no_grad():  # input-dependent beta and alpha
        for p in cell.parameters():
            if p.dim() == 2:
                p.normal_(std=0.3)
    return cell


def make_inputs(T: int, seed: int = 1, pad: int = 3):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 4, T, 8, generator=gen), torch.randn(2, 2, T, 8, generator=gen)
    v, x = torch.randn(2, 2, T, 6, generator=gen), torch.randn(2, T, 12, generator=gen)
    mask = torch.ones(2, T, dtype=torch.bool)
    mask[0, :pad] = False
    return q, k, v, x, mask


def delta_write(S, writer, x_t, h, k_t, v_t, beta_scale=1.0):
    """S alpha (I - beta k^ k^T) + beta v k^T with beta (times beta_scale), alpha of kv head h from x_t, float64."""
    x_t = x_t.double()
    beta = beta_scale * torch.sigmoid(x_t @ writer.beta_proj.weight[h].double() + writer.beta_proj.bias[h].double())
    alpha = 1.0
    if writer.gated:
        alpha = torch.sigmoid(x_t @ writer.gate_proj.weight[h].double() + writer.gate_proj.bias[h].double())
    k_t = k_t.double() / k_t.double().norm()
    return alpha * S @ (torch.eye(len(k_t), dtype=torch.float64) - beta * torch.outer(k_t, k_t)) + beta * torch.outer(
        v_t.double(), k_t
    )


def read(out, S, q, b, h, t):
    """out[b, i, t] = S q^ for the query heads i of kv head h."""
    group = SPEC.group_size
    for i in range(h * group, (h + 1) * group):
        out[b, i, t] = S @ (q[b, i, t].double() / q[b, i, t].double().norm())


def reference(cell: DeltaCell, q, k, v, x, mask, S0=None):
    writer = cell.writer
    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
    final = torch.zeros(2, 2, 6, 8, dtype=torch.float64)
    for b in range(2):
        for h in range(2):
            S = torch.zeros(6, 8, dtype=torch.float64) if S0 is None else S0[b, h].double().T.clone()
            for t in range(q.shape[2]):
                if mask[b, t]:
                    S = delta_write(S, writer, x[b, t], h, k[b, h, t], v[b, h, t])
                read(out, S, q, b, h, t)
            final[b, h] = S
    return out, final.transpose(-1, -2)


def anneal_scale(cell, h: int, written: int) -> float:
    """tau_h / (tau_h + m) for a write after m others when the cell anneals beta, else 1."""
    if not cell.anneal:
        return 1.0
    tau = math.exp(cell.log_tau[h].item())
    return tau / (tau + written)


def delta_memory_reference(cell, q, k, v, x, mask, window: int, sinks: int, expected_window):
    """float64: per row and kv head, token n - W (not a sink) is written when real token n >= W + S
    arrives, with beta and alpha of token n (beta annealed: times tau_h / (tau_h + m), m the writes
    before), through the reader's key map; every query blends the window's output with the readout
    S q' by its share g_h 2 sigmoid(x W_s + b_s + c_h log(n / W)), n the tokens written so far, once
    the memory holds one (before: the window's output alone)."""
    writer, reader = cell.writer, cell.reader
    gate, count_weight = cell.memory_gate.double(), reader.count_weight.double()
    logit = x.double() @ reader.share_proj.weight.double().T + reader.share_proj.bias.double()

    def mapped(t, h):
        return t.double() @ reader.key_map[h].double() + reader.key_bias[h].double()

    out = expected_window.double().clone()
    group = SPEC.group_size
    for b in range(2):
        real = [t for t in range(q.shape[2]) if mask[b, t]]
        for h in range(2):
            S, written = torch.zeros(6, 8, dtype=torch.float64), 0
            for t in range(q.shape[2]):
                n = real.index(t) if t in real else -1
                if n >= window + sinks:
                    j = real[n - window]
                    scale = anneal_scale(cell, h, written)
                    S, written = (
                        delta_write(S, writer, x[b, t], h, mapped(k[b, h, j], h), v[b, h, j], scale),
                        written + 1,
                    )
                if not written:
                    continue
                for i in range(h * group, (h + 1) * group):
                    query = mapped(q[b, i, t], h)
                    share = gate[i] * 2 * torch.sigmoid(logit[b, t, i] + count_weight[i] * math.log(written / window))
                    out[b, i, t] += share * (S @ (query / query.norm()) - out[b, i, t])
    return out


def assert_starts_as_window(hybrid, q, k, v, x, mask) -> torch.Tensor:
    """At the default memory gate g = 0 the hybrid is its window target (to rounding); returns that output."""
    windowed = build_cell("window", SPEC, {"window": hybrid.window, "sinks": hybrid.sinks})
    expected, *_ = windowed(q, k, v, mask, *windowed.init_state(2, q.device, q.dtype))
    out, *_ = hybrid(q, k, v, mask, *hybrid.init_state(2, q.device, q.dtype), x=x)
    real = mask[:, None, :, None].expand_as(out)
    assert rel_diff(out[real], expected[real]) < 1e-6
    return expected


def assert_every_phase_matches(hybrid, q, k, v, x, mask, expected) -> None:
    """Prefill in chunks, then decode, each from the state before, and the kernels' path: all = expected."""
    real = mask[:, None, :, None].expand_as(expected)
    state = hybrid.init_state(2, q.device, q.dtype)
    outs = []
    for t in (slice(0, 6), slice(6, 11), slice(11, 12), slice(12, 13)):
        o, *state = hybrid(q[:, :, t], k[:, :, t], v[:, :, t], mask[:, t], *state, x=x[:, t])
        outs.append(o)
    out = torch.cat(outs, 2)
    assert rel_diff(out[real], expected[real]) < 1e-5
    hybrid.use_kernels("reference")
    fused, *_ = hybrid(q, k, v, mask, *hybrid.init_state(2, q.device, q.dtype), x=x)
    assert rel_diff(fused[real], expected[real]) < 1e-5


def elu_map(memory: str) -> dict:
    """The elu map for the linear and gla memories, as the references below compute it (the delta memories have none)."""
    return {"feature_map": "elu"} if memory in ("linear", "gla") else {}


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))
