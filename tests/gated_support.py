"""What the `gated` target's tests share: small cells with random gates, their inputs, and references.

The reference is a float64 loop over the equations of docs/math.md §Gated linear attention, per batch row, kv head and
token, with explicit gates:

    S_t = diag(a_t) S_{t-1} + phi(k_t)^T v_t,  z_t = diag(a_t) z_{t-1} + phi(k_t),
    o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)      (o_t = phi(q_t) S_t without the normaliser)

with a_t = 1 - 2^(-5-h) (retnet), sigmoid(x W_down W_up + b)^(1/tau) (gla, a vector over the
features), sigmoid(x W + b)^(1/tau) (gateloop, a scalar per kv head), a_t = 1 and phi(k_t) = 0
on padding. Nothing here calls the implementation's helpers to build a reference.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings
from support import random_qkv

from rnnify.cells import CellSpec
from rnnify.cells.gated import GatedCell

# fp32 computation against a float64 reference on O(1) inputs: 1e-5 relative, and the same
# absolute floor for entries that happen to be near zero.
RTOL = ATOL = 1e-5


def assert_close(got, want, msg=None):
    """Within 1e-5 relative to the tensor's scale: unnormalised outputs and states are sums of up
    to T terms, so an entry that cancels to near 0 carries the fp32 error of its O(T) terms."""
    atol = ATOL * max(1.0, float(want.detach().abs().max())) if want.numel() else ATOL
    torch.testing.assert_close(got.double(), want.double(), rtol=RTOL, atol=atol, msg=msg)


GATES = ("retnet", "gla", "gateloop")
HIDDEN = 12  # width of the layer input x in the cell-level tests

HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- references


def reference_gated_attention(phi_q, phi_k, v, log_a, kv0, z0, eps=1e-6):
    """float64 loop; phi_q [B, Hkv, G, T, F], log_a [B, Hkv, T, 1 or F]; z0 None: no normaliser."""
    phi_q, phi_k, v = phi_q.double(), phi_k.double(), v.double()
    a = log_a.double().exp().expand(phi_k.shape)  # a scalar gate is the same for every feature
    S = kv0.double().clone()
    z = None if z0 is None else z0.double().clone()
    batch, num_kv_heads, group, length, _ = phi_q.shape
    out = torch.zeros(batch, num_kv_heads, group, length, v.shape[-1], dtype=torch.float64)
    for t in range(length):
        for b in range(batch):
            for h in range(num_kv_heads):
                S[b, h] = a[b, h, t][:, None] * S[b, h] + torch.outer(phi_k[b, h, t], v[b, h, t])
                if z is not None:
                    z[b, h] = a[b, h, t] * z[b, h] + phi_k[b, h, t]
                for g in range(group):
                    qt = phi_q[b, h, g, t]
                    num = qt @ S[b, h]
                    out[b, h, g, t] = num if z is None else num / (torch.dot(qt, z[b, h]) + eps)
    return out, S, z


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """Katharopoulos' feature map written out: x + 1 for x > 0, exp(x) otherwise."""
    x = x.double()
    return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))


def reference_log_gates(cell: GatedCell, x, mask) -> torch.Tensor:
    """log a_t [B, Hkv, T, 1 or F] in float64, from the cell's parameters and the equations."""
    batch, length = mask.shape
    num_kv_heads = cell.spec.num_kv_heads
    if cell.gate == "retnet":
        gammas = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(num_kv_heads)], dtype=torch.float64)
        log_a = gammas.log()[None, :, None, None].expand(batch, num_kv_heads, length, 1)
    else:
        x = x.double()
        if cell.gate == "gla":
            w_down, w_up, bias = (
                p.detach().double() for p in (cell.gate_down.weight, cell.gate_up.weight, cell.gate_up.bias)
            )
            logits = x @ w_down.T @ w_up.T + bias
        else:
            weight, bias = cell.gate_proj.weight.detach().double(), cell.gate_proj.bias.detach().double()
            logits = x @ weight.T + bias
        a = torch.sigmoid(logits) ** (1 / cell.tau)
        log_a = a.log().reshape(batch, length, num_kv_heads, -1).permute(0, 2, 1, 3)
    return torch.where(mask[:, None, :, None], log_a, torch.zeros((), dtype=torch.float64))


def reference_gated_cell(cell: GatedCell, q, k, v, mask, x, state):
    """The GatedCell contract from first principles (elu+1 map): [B, H, T, d] in, padding ignored."""
    batch, num_heads, length, _ = q.shape
    num_kv_heads = k.shape[1]
    phi_q = elu_plus_one(q).reshape(batch, num_kv_heads, num_heads // num_kv_heads, length, -1)
    phi_k = elu_plus_one(k) * mask[:, None, :, None].double()
    log_a = reference_log_gates(cell, x, mask)
    z0 = state[1] if cell.normalize else None
    out, S, z = reference_gated_attention(phi_q, phi_k, v, log_a, state[0], z0, cell.eps)
    return out.reshape(batch, num_heads, length, -1), (S,) if z is None else (S, z)


def make_cell(
    gate="retnet", num_kv_heads=2, group=2, head_dim=8, value_dim=8, chunk_size=4, seed=0, **options
) -> GatedCell:
    """A cell whose trainable gates (gla, gateloop) are randomised, so they vary with x."""
    spec = CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim, head_dim**-0.5, hidden_size=HIDDEN)
    cell = GatedCell(spec, gate=gate, chunk_size=chunk_size, **options)
    gen = seeded(seed)
    with torch.no_grad():
        if gate == "gla":  # log a = logsigmoid(N(0, ~2)) / 16: between about -0.5 and 0
            cell.gate_down.weight.copy_(torch.randn(cell.gate_down.weight.shape, generator=gen) / math.sqrt(HIDDEN))
            cell.gate_up.weight.copy_(torch.randn(cell.gate_up.weight.shape, generator=gen) / 2)
            cell.gate_up.bias.copy_(torch.randn(cell.gate_up.bias.shape, generator=gen))
        elif gate == "gateloop":  # log a = logsigmoid(N(1, ~1)): between about -3 and 0
            cell.gate_proj.weight.copy_(torch.randn(cell.gate_proj.weight.shape, generator=gen) / math.sqrt(HIDDEN))
            cell.gate_proj.bias.copy_(1 + torch.randn(cell.gate_proj.bias.shape, generator=gen) / 2)
    return cell


def qkvx(cell, batch, length, gen, dtype=torch.float32):
    q, k, v = random_qkv(batch, cell.spec, length, gen, dtype)
    x = torch.randn(batch, length, HIDDEN, generator=gen).to(dtype)
    return q, k, v, x


def random_state(cell, batch, gen):
    kv, *rest = cell.init_state(batch, torch.device("cpu"), torch.float32)
    kv = torch.randn(kv.shape, generator=gen)
    return (kv,) + tuple(torch.rand(t.shape, generator=gen) + 0.5 for t in rest)


def step_by_step(cell, q, k, v, mask, x, state):
    outs = []
    for t in range(q.shape[2]):
        sl = slice(t, t + 1)
        out, *state = cell(q[:, :, sl], k[:, :, sl], v[:, :, sl], mask[:, sl], *state, x=x[:, sl])
        outs.append(out)
    return torch.cat(outs, dim=2), state
