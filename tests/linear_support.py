"""What the linear-attention and gated-RNN cell tests share: small cells, tolerances and references.

References are float64 and come straight from the equations (docs/math.md §Linear attention and §Gated linear RNN), never from
rnnify's helpers: each feature map written out; linear attention as the loop
S_t = S_{t-1} + phi(k_t)^T v_t, z_t = z_{t-1} + phi(k_t), o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps)
(or o_t = phi(q_t) S_t unnormalised); the gated RNN as Zucchet et al.'s construction, a matrix
S of key-value neurons (lambda = decay) and query neurons (lambda = 0). Reading a map's own
weights (its random or trained W) is fine: they are data, the equation is the reference's own.

Tolerances. fp32 computation against float64 on O(1) inputs: 1e-5 relative to the size of the
result (``close``: rtol 1e-5 and an absolute floor of 1e-5 * max(1, max |ref|), so unnormalised
outputs, which grow with T, are held to 1e-5 of their scale). bf16 inputs: the state is held to
the fp32 tolerance (fp32 accumulation of exactly representable inputs); outputs are rounded once
to bf16 (relative error <= 2**-9) and held to 2**-7.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from support import draw_heads, random_qkv

from rnnify.cells import CellSpec
from rnnify.cells.linear import (
    FeatureMap,
    LinearCell,
)

TOL = 1e-5
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CPU = torch.device("cpu")

# (feature_map, normalize): every map, normalised and not where that makes sense
LINEAR_CONFIGS = [
    ("elu", True),
    ("elu", False),
    ("relu", True),
    ("relu", False),
    ("identity", False),
    ("performer", True),
    ("taylor", True),
    ("taylor", False),
    ("hedgehog", True),
    ("t2r", True),
    ("t2r", False),
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: on a shared 2-core machine, torch's intra-op thread pool makes each
    small bmm wait for a busy core (milliseconds instead of microseconds). One thread here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(got: torch.Tensor, ref: torch.Tensor, tol: float = TOL, msg: str = "") -> None:
    got, ref = got.detach().double(), ref.detach().double()
    scale = max(1.0, float(ref.abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * scale, msg=msg or None)


def make_spec(num_kv_heads=2, group=2, head_dim=8, value_dim=None) -> CellSpec:
    return CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim or head_dim, 1 / math.sqrt(head_dim))


def make_linear(name, normalize=True, chunk_size=4, perturb=0, **spec_kw) -> LinearCell:
    """A linear cell; ``perturb`` moves trainable maps away from their identity init (seeded)."""
    cell = LinearCell(make_spec(**spec_kw), feature_map=name, chunk_size=chunk_size, normalize=normalize)
    if perturb:
        gen = seeded(perturb)
        with torch.no_grad():
            for p in cell.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return cell


def left_padding_mask(batch, length, gen) -> torch.Tensor:
    pads = torch.randint(0, length, (batch,), generator=gen)  # every row keeps at least one token
    return torch.arange(length)[None, :] >= pads[:, None]


# --------------------------------------------------------------------------- references


def reference_phi(name: str, x: torch.Tensor, phi: FeatureMap, scale: float, query: bool = False) -> torch.Tensor:
    """float64 feature maps from their equations; x ``[B, Hkv, ..., d]`` (dim 1 = kv head)."""
    x = x.double()
    if name == "elu":
        return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    if name == "identity":
        return x
    if name == "performer":  # exp(W x' - |x'|^2/2) / sqrt(m); normalised queries shifted by their max
        w = phi.weight.double()  # [Hkv, d, m]
        xs = x * math.sqrt(scale)
        u = torch.einsum("bh...d,hdm->bh...m", xs, w) - (xs**2).sum(-1, keepdim=True) / 2
        if query:
            u = u - u.max(-1, keepdim=True).values
        return torch.exp(u) / math.sqrt(w.shape[-1])
    if name == "taylor":  # [1, x', x'_i x'_j / sqrt 2 for i, j]
        xs = x * math.sqrt(scale)
        second = torch.einsum("...i,...j->...ij", xs, xs).flatten(-2) / math.sqrt(2)
        return torch.cat([torch.ones_like(xs[..., :1]), xs, second], dim=-1)
    if name == "hedgehog":  # [softmax(x W), softmax(-x W)]
        u = torch.einsum("bh...d,hdm->bh...m", x, phi.weight.double())
        pos, neg = torch.exp(u), torch.exp(-u)
        return torch.cat([pos / pos.sum(-1, keepdim=True), neg / neg.sum(-1, keepdim=True)], dim=-1)
    if name == "t2r":  # relu(x W + b)
        u = torch.einsum("bh...d,hdm->bh...m", x, phi.weight.double())
        bias = phi.bias.double().reshape(phi.bias.shape[0], *[1] * (x.dim() - 3), phi.bias.shape[1])
        u = u + bias
        return torch.where(u > 0, u, torch.zeros_like(u))
    raise AssertionError(name)


def reference_linear_attention(phi_q, phi_k, v, kv0, z0, eps=1e-6, normalize=True):
    """float64 loop over t; phi_q [B, Hkv, G, T, F], phi_k [B, Hkv, T, F]; z0 ignored unnormalised."""
    phi_q, phi_k, v = phi_q.double(), phi_k.double(), v.double()
    S = kv0.double().clone()
    z = z0.double().clone() if normalize else None
    outs = []
    for t in range(phi_k.shape[2]):
        S = S + phi_k[:, :, t, :, None] * v[:, :, t, None, :]
        num = torch.einsum("bhgf,bhfd->bhgd", phi_q[:, :, :, t], S)
        if normalize:
            z = z + phi_k[:, :, t]
            den = torch.einsum("bhgf,bhf->bhg", phi_q[:, :, :, t], z)
            num = num / (den[..., None] + eps)
        outs.append(num)
    return torch.stack(outs, dim=3), S, z


def reference_features(cell: LinearCell, q, k, mask):
    """float64 phi(q) grouped per kv head ``[B, Hkv, G, T, F]`` and phi(k) ``[B, Hkv, T, F]``, padding keys 0."""
    batch, num_heads, length, _ = q.shape
    hkv = k.shape[1]
    grouped = q.double().reshape(batch, hkv, num_heads // hkv, length, -1)
    phi_q = reference_phi(cell.feature_map, grouped, cell.phi, cell.spec.scale, query=cell.normalize)
    phi_k = reference_phi(cell.feature_map, k, cell.phi, cell.spec.scale) * mask[:, None, :, None].double()
    return phi_q, phi_k


def reference_linear_cell(cell: LinearCell, q, k, v, mask, state):
    """The LinearCell contract: [B, H, T, d] in, padding keys ignored; returns (out, *state)."""
    phi_q, phi_k = reference_features(cell, q, k, mask)
    z0 = state[1] if cell.normalize else None
    out, S, z = reference_linear_attention(phi_q, phi_k, v, state[0], z0, cell.eps, cell.normalize)
    out = out.reshape(*q.shape[:3], -1)
    return (out, S, z) if cell.normalize else (out, S)


def well_conditioned(cell: LinearCell, q, k, mask, state) -> torch.Tensor:
    """``[B, H, T]``: True where the output is well conditioned in the features' float32 rounding.

    A normalised output o = phi(q) S / (s + eps), s = phi(q) . z, moves by eps / (s + eps)^2 per unit
    of s; a relu feature near zero carries float32 rounding of its pre-activation as a large relative
    error, so where s is within a few decades of eps the float32 cell and the float64 reference part
    by design. Below 100 eps that gain exceeds 100; such queries are compared on the cell's own
    features (the forms check) instead. Unnormalised cells are linear in the features: all True.
    """
    if not cell.normalize:
        return torch.ones(q.shape[:3], dtype=torch.bool)
    phi_q, phi_k = reference_features(cell, q, k, mask)
    z = state[1].double()[:, :, None] + phi_k.cumsum(2)  # [B, Hkv, T, F], z after each token
    s = torch.einsum("bhgtf,bhtf->bhgt", phi_q, z)
    return (s >= 100 * cell.eps).reshape(q.shape[:3])


def reference_gated_rnn(q, k, v, mask, h0, decay):
    """Zucchet et al.'s construction as a float64 loop, per kv head:

    key-value neurons S[i, j] (lambda = decay, input v_i k_j), query neurons Q[g, j] (lambda = 0,
    input q_g,j), output y_g,i = sum_j S[i, j] Q[g, j]. Padding tokens leave every neuron alone.
    State layout (as documented): [S[i, j] at i*dk + j, then Q[g, j] at dv*dk + g*dk + j].
    """
    q, k, v = q.double(), k.double(), v.double()
    batch, num_heads, length, dk = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    group = num_heads // hkv
    S = h0[..., : dv * dk].double().reshape(batch, hkv, dv, dk).clone()
    Q = h0[..., dv * dk :].double().reshape(batch, hkv, group, dk).clone()
    out = torch.zeros(batch, num_heads, length, dv, dtype=torch.float64)
    for b in range(batch):
        for t in range(length):
            if bool(mask[b, t]):
                for h in range(hkv):
                    S[b, h] = decay * S[b, h] + torch.outer(v[b, h, t], k[b, h, t])
                    Q[b, h] = q[b, h * group : (h + 1) * group, t]
            for h in range(num_heads):
                out[b, h, t] = S[b, h // group] @ Q[b, h // group, h % group]
    return out, torch.cat([S.flatten(-2), Q.flatten(-2)], dim=-1)


@st.composite
def cell_problems(draw):
    return dict(
        **draw_heads(draw),
        length=draw(st.one_of(st.just(1), st.integers(1, 40))),
        chunk_size=draw(st.sampled_from([1, 3, 5, 64])),
        prefix=draw(st.integers(0, 5)),
        padded=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def problem_inputs(cell, p):
    """Inputs plus a realistic starting state: the cell's state after a random prefix."""
    gen = seeded(p["seed"])
    spec = cell.spec
    q, k, v = random_qkv(p["batch"], spec, p["length"], gen)
    mask = torch.ones(p["batch"], p["length"], dtype=torch.bool)
    if p["padded"]:
        mask = left_padding_mask(p["batch"], p["length"], gen)
    state = cell.init_state(p["batch"], CPU, torch.float32)
    if p["prefix"]:
        pq, pk, pv = random_qkv(p["batch"], spec, p["prefix"], gen)
        _, *state = cell(pq, pk, pv, torch.ones(p["batch"], p["prefix"], dtype=torch.bool), *state)
    return q, k, v, mask, tuple(state)
