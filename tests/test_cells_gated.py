"""The `gated` target (GatedCell: RetNet, GLA, GateLoop) against references written here.

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
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from support import assert_steps_and_split_prefill_match, random_qkv, rel_diff

import rnnify
from rnnify.cells import CELLS, CellSpec, build_cell, parameters
from rnnify.cells.gated import GatedCell, step_gated_attn
from rnnify.cells.linear import FEATURE_MAPS, LinearCell
from rnnify.errors import RnnifyError
from rnnify.kernels.linear_attn.naive import chunk_gated_attn, naive_recurrent_gated_attn, parallel_gated_attn

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


def _gen(seed: int) -> torch.Generator:
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


# --------------------------------------------------------------------------- the forms


def _step_loop(phi_q, phi_k, v, log_a, kv, k_sum, eps=1e-6):
    outs = []
    for t in range(phi_k.shape[2]):
        out, kv, k_sum = step_gated_attn(
            phi_q[:, :, :, t : t + 1],
            phi_k[:, :, t : t + 1],
            v[:, :, t : t + 1],
            log_a[:, :, t : t + 1],
            kv,
            k_sum,
            eps,
        )
        outs.append(out)
    return torch.cat(outs, dim=3), kv, k_sum


@st.composite
def gated_problems(draw):
    batch = draw(st.integers(1, 3))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    feature_dim = draw(st.sampled_from([4, 8, 16]))
    value_dim = draw(st.sampled_from([4, 8, 16]))
    length = draw(st.one_of(st.just(1), st.integers(1, 70)))
    chunk_size = draw(st.sampled_from([1, 2, 3, 5, 16, 64]))
    vector = draw(st.booleans())
    normalize = draw(st.booleans())
    decay = draw(st.sampled_from([0.0, 0.05, 0.5, 4.0]))  # the largest -log a
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, num_kv_heads, group, feature_dim, value_dim, length, chunk_size, vector, normalize, decay, seed


def _gated_inputs(batch, num_kv_heads, group, feature_dim, value_dim, length, vector, normalize, decay, seed):
    """Positive features (as any phi gives), values of both signs, gates with some exact 1s, a nonzero state."""
    gen = _gen(seed)
    phi_q = torch.rand(batch, num_kv_heads, group, length, feature_dim, generator=gen) + 0.05
    phi_k = torch.rand(batch, num_kv_heads, length, feature_dim, generator=gen) + 0.05
    v = torch.randn(batch, num_kv_heads, length, value_dim, generator=gen)
    log_a = -decay * torch.rand(batch, num_kv_heads, length, feature_dim if vector else 1, generator=gen)
    log_a = log_a.masked_fill(torch.rand(log_a.shape, generator=gen) < 0.2, 0.0)
    kv0 = torch.randn(batch, num_kv_heads, feature_dim, value_dim, generator=gen)
    z0 = torch.rand(batch, num_kv_heads, feature_dim, generator=gen) + 0.5 if normalize else None
    return phi_q, phi_k, v, log_a, kv0, z0


@HYPOTHESIS
@given(problem=gated_problems())
def test_gated_forms_match_float64_reference(problem):
    *shape, chunk_size, vector, normalize, decay, seed = problem
    phi_q, phi_k, v, log_a, kv0, z0 = _gated_inputs(*shape, vector, normalize, decay, seed)
    copies = [t.clone() for t in (phi_q, phi_k, v, log_a, kv0) + ((z0,) if normalize else ())]
    ref, ref_kv, ref_z = reference_gated_attention(phi_q, phi_k, v, log_a, kv0, z0)
    forms = {
        "naive_recurrent": naive_recurrent_gated_attn,
        "parallel": parallel_gated_attn,
        f"chunk_{chunk_size}": lambda *a: chunk_gated_attn(*a, chunk_size=chunk_size),
        "step_loop": _step_loop,
    }
    for name, form in forms.items():
        out, kv, k_sum = form(phi_q, phi_k, v, log_a, kv0, z0)
        assert out.shape == ref.shape and out.dtype == torch.float32, name
        assert_close(out, ref, msg=lambda m: f"{name}: {m}")
        assert_close(kv, ref_kv, msg=lambda m: f"{name}: {m}")
        if normalize:
            assert_close(k_sum, ref_z, msg=lambda m: f"{name}: {m}")
        else:
            assert k_sum is None
    # functional: inputs untouched
    assert all(torch.equal(a, b) for a, b in zip(copies, (phi_q, phi_k, v, log_a, kv0) + ((z0,) if normalize else ())))


def test_gated_chunk_form_lengths_around_the_chunk_size():
    for length in (1, 2, 3, 5, 63, 64, 65, 130):
        for vector in (False, True):
            phi_q, phi_k, v, log_a, kv0, z0 = _gated_inputs(1, 2, 2, 4, 4, length, vector, True, 0.5, seed=length)
            ref, ref_kv, ref_z = reference_gated_attention(phi_q, phi_k, v, log_a, kv0, z0)
            for chunk in (1, 3, 64):
                out, kv, k_sum = chunk_gated_attn(phi_q, phi_k, v, log_a, kv0, z0, chunk_size=chunk)
                msg = f"T={length} C={chunk} vector={vector}"
                assert_close(out.double(), ref, msg=msg)
                assert_close(kv.double(), ref_kv, msg=msg)
                assert_close(k_sum.double(), ref_z, msg=msg)


@pytest.mark.parametrize("vector", [False, True])
def test_long_sequences_with_strong_decay_stay_finite_in_every_form(vector):
    """T = 4096 with log a = -3 per token: cumulative log gates reach -12,288; exp(G) underflows
    to 0 and exp(-G) would overflow. No form may produce inf or NaN, and they must still agree."""
    length, feature_dim = 4096, 2  # small F: the parallel form's vector decays are [T, T, F]
    gen = _gen(11)
    phi_q = torch.rand(1, 1, 1, length, feature_dim, generator=gen) + 0.05
    phi_k = torch.rand(1, 1, length, feature_dim, generator=gen) + 0.05
    v = torch.randn(1, 1, length, 4, generator=gen)
    log_a = -3.0 - torch.rand(1, 1, length, feature_dim if vector else 1, generator=gen)
    kv0, z0 = torch.randn(1, 1, feature_dim, 4, generator=gen), torch.rand(1, 1, feature_dim, generator=gen) + 0.5
    results = {
        "naive_recurrent": naive_recurrent_gated_attn(phi_q, phi_k, v, log_a, kv0, z0),
        "parallel": parallel_gated_attn(phi_q, phi_k, v, log_a, kv0, z0),
        "chunk_64": chunk_gated_attn(phi_q, phi_k, v, log_a, kv0, z0, chunk_size=64),
        "step_loop": _step_loop(phi_q, phi_k, v, log_a, kv0, z0),
        "naive_unnormalised": naive_recurrent_gated_attn(phi_q, phi_k, v, log_a, kv0, None),
        "chunk_unnormalised": chunk_gated_attn(phi_q, phi_k, v, log_a, kv0, None, chunk_size=64),
        "step_unnormalised": _step_loop(phi_q, phi_k, v, log_a, kv0, None),
    }
    for name, result in results.items():
        assert all(torch.isfinite(t).all() for t in result if t is not None), name
    truth = results["naive_recurrent"]
    for name in ("parallel", "chunk_64", "step_loop"):
        for got, want in zip(results[name], truth):
            assert_close(got, want, msg=lambda m: f"{name}: {m}")
    for name in ("chunk_unnormalised", "step_unnormalised"):
        for got, want in zip(results[name], results["naive_unnormalised"]):
            if want is not None:
                assert_close(got, want, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- the cell


def _cell(
    gate="retnet", num_kv_heads=2, group=2, head_dim=8, value_dim=8, chunk_size=4, seed=0, **options
) -> GatedCell:
    """A cell whose trainable gates (gla, gateloop) are randomised, so they vary with x."""
    spec = CellSpec(num_kv_heads * group, num_kv_heads, head_dim, value_dim, head_dim**-0.5, hidden_size=HIDDEN)
    cell = GatedCell(spec, gate=gate, chunk_size=chunk_size, **options)
    gen = _gen(seed)
    with torch.no_grad():
        if gate == "gla":  # log a = logsigmoid(N(0, ~2)) / 16: between about -0.5 and 0
            cell.gate_down.weight.copy_(torch.randn(cell.gate_down.weight.shape, generator=gen) / math.sqrt(HIDDEN))
            cell.gate_up.weight.copy_(torch.randn(cell.gate_up.weight.shape, generator=gen) / 2)
            cell.gate_up.bias.copy_(torch.randn(cell.gate_up.bias.shape, generator=gen))
        elif gate == "gateloop":  # log a = logsigmoid(N(1, ~1)): between about -3 and 0
            cell.gate_proj.weight.copy_(torch.randn(cell.gate_proj.weight.shape, generator=gen) / math.sqrt(HIDDEN))
            cell.gate_proj.bias.copy_(1 + torch.randn(cell.gate_proj.bias.shape, generator=gen) / 2)
    return cell


def _qkvx(cell, batch, length, gen, dtype=torch.float32):
    q, k, v = random_qkv(batch, cell.spec, length, gen, dtype)
    x = torch.randn(batch, length, HIDDEN, generator=gen).to(dtype)
    return q, k, v, x


def _random_state(cell, batch, gen):
    kv, *rest = cell.init_state(batch, torch.device("cpu"), torch.float32)
    kv = torch.randn(kv.shape, generator=gen)
    return (kv,) + tuple(torch.rand(t.shape, generator=gen) + 0.5 for t in rest)


def _steps(cell, q, k, v, mask, x, state):
    outs = []
    for t in range(q.shape[2]):
        sl = slice(t, t + 1)
        out, *state = cell(q[:, :, sl], k[:, :, sl], v[:, :, sl], mask[:, sl], *state, x=x[:, sl])
        outs.append(out)
    return torch.cat(outs, dim=2), state


@HYPOTHESIS
@given(
    gate=st.sampled_from(GATES),
    normalize=st.booleans(),
    batch=st.integers(1, 3),
    num_kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8, 16]),
    length=st.one_of(st.just(1), st.integers(1, 30)),
    chunk_size=st.sampled_from([1, 3, 8, 64]),
    left_pad=st.integers(0, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_gated_cell_matches_reference_in_prefill_and_steps(
    gate, normalize, batch, num_kv_heads, group, head_dim, length, chunk_size, left_pad, seed
):
    """Prefill (chunked form) and token-by-token decode (step form) from a nonzero state, with GQA
    and a left-padded last row, against the float64 reference of the whole cell."""
    gen = _gen(seed)
    cell = _cell(gate, num_kv_heads, group, head_dim, head_dim, chunk_size, seed=seed, normalize=normalize)
    q, k, v, x = _qkvx(cell, batch, length, gen)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[-1, : min(left_pad, length - 1)] = False
    state = _random_state(cell, batch, gen)
    ref, ref_state = reference_gated_cell(cell, q, k, v, mask, x, state)

    one_shot, *final = cell(q, k, v, mask, *state, x=x)
    stepped, stepped_state = _steps(cell, q, k, v, mask, x, state)
    assert one_shot.shape == (batch, cell.spec.num_heads, length, head_dim) and one_shot.dtype == torch.float32
    assert len(final) == len(cell.state_names) == (2 if normalize else 1)
    for out in (one_shot, stepped):
        assert torch.isfinite(out).all()  # padding outputs too
        real = mask[:, None, :, None].expand_as(out)
        assert_close(out.double()[real], ref[real])
    for got in (final, stepped_state):
        for a, b in zip(got, ref_state):
            assert_close(a, b)


@pytest.mark.parametrize("gate", GATES)
def test_padding_tokens_do_not_change_the_state(gate):
    gen = _gen(5)
    cell = _cell(gate)
    q, k, v, x = _qkvx(cell, 2, 9, gen)
    mask = torch.ones(2, 9, dtype=torch.bool)
    _, *state = cell(q, k, v, mask, *cell.init_state(2, torch.device("cpu"), torch.float32), x=x)
    pq, pk, pv, px = _qkvx(cell, 2, 5, gen)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    _, *after = cell(pq, pk, pv, padding, *state, x=px)  # a prefill of padding only
    assert all(torch.equal(a, b) for a, b in zip(after, state))
    _, *after = cell(pq[:, :, :1], pk[:, :, :1], pv[:, :, :1], padding[:, :1], *state, x=px[:, :1])  # a padding step
    assert all(torch.equal(a, b) for a, b in zip(after, state))

    # left padding in front of a sequence: same final state and same outputs as without it
    lq, lk, lv = (torch.cat([p, t], dim=2) for p, t in ((pq, q), (pk, k), (pv, v)))
    lx, lmask = torch.cat([px, x], dim=1), torch.cat([padding, mask], dim=1)
    init = cell.init_state(2, torch.device("cpu"), torch.float32)
    out_padded, *state_padded = cell(lq, lk, lv, lmask, *init, x=lx)
    out_plain, *state_plain = cell(q, k, v, mask, *init, x=x)
    for a, b in zip(state_padded, state_plain):
        assert_close(a, b)
    assert_close(out_padded[:, :, 5:], out_plain)


@pytest.mark.parametrize("gate", GATES)
def test_bf16_inputs_keep_an_fp32_state(gate):
    gen = _gen(6)
    cell = _cell(gate, chunk_size=3)
    q, k, v, x = _qkvx(cell, 2, 10, gen, dtype=torch.bfloat16)
    mask = torch.ones(2, 10, dtype=torch.bool)
    init = cell.init_state(2, torch.device("cpu"), torch.bfloat16)
    assert all(t.dtype == torch.float32 for t in init)
    out, *state = cell(q, k, v, mask, *init, x=x)
    assert out.dtype == torch.bfloat16 and all(t.dtype == torch.float32 for t in state)
    # Reference in fp64 from the very same bf16 numbers. Features, gates and state are computed in
    # fp32 from exactly representable inputs: the state is held to the fp32 tolerance. The output
    # is rounded once to bf16 (8 significant bits, relative error <= 2**-9): 2**-7 relative/absolute.
    ref, ref_state = reference_gated_cell(cell, q, k, v, mask, x, init)
    for a, b in zip(state, ref_state):
        assert_close(a.double(), b)
    torch.testing.assert_close(out.double(), ref, rtol=2**-7, atol=2**-7)
    # and decoding on: many bf16 steps do not drift, because the state never leaves fp32
    q2, k2, v2, x2 = _qkvx(cell, 2, 40, gen, dtype=torch.bfloat16)
    mask2 = torch.ones(2, 40, dtype=torch.bool)
    stepped, state2 = _steps(cell, q2, k2, v2, mask2, x2, state)
    ref2, ref_state2 = reference_gated_cell(cell, q2, k2, v2, mask2, x2, ref_state)
    for a, b in zip(state2, ref_state2):
        assert_close(a.double(), b)
    torch.testing.assert_close(stepped.double(), ref2, rtol=2**-7, atol=2**-7)


def _decay_of_one_token(cell: GatedCell, x: torch.Tensor) -> torch.Tensor:
    """kv_after / kv_before for one token whose phi(k) is exactly 0 (elu(-100) + 1 == 0 in fp32):
    the gate a_t as the state sees it, [B, Hkv, F]."""
    spec = cell.spec
    batch = x.shape[0]
    q = torch.randn(batch, spec.num_heads, 1, spec.head_dim)
    k = torch.full((batch, spec.num_kv_heads, 1, spec.head_dim), -100.0)
    v = torch.randn(batch, spec.num_kv_heads, 1, spec.value_dim)
    kv0 = torch.ones(batch, spec.num_kv_heads, cell.phi.feature_dim, spec.value_dim)
    state = (kv0,) + tuple(torch.ones_like(t) for t in cell.init_state(batch, torch.device("cpu"), torch.float32)[1:])
    mask = torch.ones(batch, 1, dtype=torch.bool)
    _, kv, *_ = cell(q, k, v, mask, *state, x=x)
    return kv[..., 0]


def test_retnet_gammas_are_one_minus_two_to_the_minus_five_minus_h():
    cell = _cell("retnet", num_kv_heads=6, group=1)
    expected = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(6)], dtype=torch.float64)
    torch.testing.assert_close(cell.log_gamma.double().exp(), expected, rtol=1e-7, atol=0)
    decay = _decay_of_one_token(cell, torch.randn(3, 1, HIDDEN))  # the decay the state actually gets
    torch.testing.assert_close(decay.double(), expected[None, :, None].expand(decay.shape), rtol=1e-6, atol=0)
    assert not list(cell.parameters()) and "log_gamma" not in cell.state_dict()  # fixed, derived from the spec
    assert cell.needs_input is False


@pytest.mark.parametrize("gate", ["gla", "gateloop"])
def test_trainable_gates_start_close_to_no_decay(gate):
    spec = CellSpec(4, 2, 8, 8, 8**-0.5, hidden_size=HIDDEN)
    cell = GatedCell(spec, gate=gate)  # the default initialisation
    assert cell.needs_input is True
    x = torch.randn(4, 1, HIDDEN, generator=_gen(8))  # unit-scale layer inputs
    log_a = _decay_of_one_token(cell, x).double().log()
    if gate == "gateloop":  # one scalar per kv head: the same for every feature
        assert torch.equal(log_a, log_a[..., :1].expand_as(log_a))
    assert (log_a > -0.05).all() and (log_a <= 0).all()
    torch.testing.assert_close(log_a.exp(), torch.full_like(log_a, 0.99), rtol=1e-5, atol=0)  # decay_init
    names = set(cell.state_dict())
    expected = (
        {"gate_down.weight", "gate_up.weight", "gate_up.bias"}
        if gate == "gla"
        else {"gate_proj.weight", "gate_proj.bias"}
    )
    assert expected <= names and expected == {n for n, _ in cell.named_parameters()}


@pytest.mark.parametrize("gate", ["gla", "gateloop"])
def test_a_few_sgd_steps_train_the_gates(gate):
    gen = _gen(9)
    spec = CellSpec(4, 2, 8, 8, 8**-0.5, hidden_size=HIDDEN)
    cell = GatedCell(spec, gate=gate, chunk_size=4)
    q, k, v, x = _qkvx(cell, 2, 24, gen)
    mask = torch.ones(2, 24, dtype=torch.bool)
    init = cell.init_state(2, torch.device("cpu"), torch.float32)
    target = torch.randn(2, 4, 24, 8, generator=gen)
    before = cell(q, k, v, mask, *init, x=x)[0].detach()
    optimizer = torch.optim.SGD(parameters(cell), lr=10.0)  # gates near 1 move slowly: d log a / d bias ~ 1e-2
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = (cell(q, k, v, mask, *init, x=x)[0] - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    after = cell(q, k, v, mask, *init, x=x)[0].detach()
    assert all(b < a for a, b in zip(losses, losses[1:]))
    assert (after - before).abs().max() > 1e-5
    assert all(torch.isfinite(p).all() and p.grad is not None for p in cell.parameters())


def test_retnet_with_decay_one_is_the_linear_cell():
    gen = _gen(10)
    cell = _cell("retnet", num_kv_heads=2, group=2, chunk_size=5)
    cell.log_gamma.zero_()  # test only: gamma = 1 for every head
    linear = LinearCell(cell.spec, feature_map="elu", chunk_size=3, eps=cell.eps)
    q, k, v, x = _qkvx(cell, 2, 17, gen)
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, :4] = False
    init = cell.init_state(2, torch.device("cpu"), torch.float32)
    out, *state = cell(q, k, v, mask, *init)
    ref, *ref_state = linear(q, k, v, mask, *linear.init_state(2, torch.device("cpu"), torch.float32))
    assert_close(out, ref)
    for a, b in zip(state, ref_state):
        assert_close(a, b)
    q2, k2, v2, _ = _qkvx(cell, 2, 1, gen)
    step, *_ = cell(q2, k2, v2, mask[:, :1] | True, *state)
    ref_step, *_ = linear(q2, k2, v2, mask[:, :1] | True, *ref_state)
    assert_close(step, ref_step)


@pytest.mark.parametrize("normalize", [True, False])
def test_state_size_does_not_depend_on_length(normalize):
    cell = _cell("gla", num_kv_heads=3, group=2, head_dim=4, value_dim=6, normalize=normalize)
    shapes = set()
    for length in (1, 7, 100):
        q, k, v, x = _qkvx(cell, 1, length, _gen(length))
        _, *state = cell(
            q,
            k,
            v,
            torch.ones(1, length, dtype=torch.bool),
            *cell.init_state(1, torch.device("cpu"), torch.float32),
            x=x,
        )
        shapes.add(tuple(tuple(t.shape) for t in state))
    expected = ((1, 3, 4, 6), (1, 3, 4)) if normalize else ((1, 3, 4, 6),)
    assert shapes == {expected}
    per_sequence = 3 * 4 * 6 + (3 * 4 if normalize else 0)
    assert cell.state_nbytes(1) == cell.state_nbytes(10**6) == per_sequence * 4


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("gate", GATES)
def test_options_rebuild_the_cell(gate):
    cell = _cell(gate, chunk_size=3, normalize=False)
    options = cell.options()
    assert options["gate"] == gate and options["normalize"] is False and options["chunk_size"] == 3
    rebuilt = type(cell)(cell.spec, **options)
    rebuilt.load_state_dict(cell.state_dict(), strict=True)
    rebuilt_by_name = build_cell("gated", cell.spec, options)
    assert rebuilt_by_name.options() == options
    q, k, v, x = _qkvx(cell, 1, 6, _gen(12))
    mask = torch.ones(1, 6, dtype=torch.bool)
    init = cell.init_state(1, torch.device("cpu"), torch.float32)
    assert torch.equal(cell(q, k, v, mask, *init, x=x)[0], rebuilt(q, k, v, mask, *init, x=x)[0])


def test_default_options():
    spec = CellSpec(4, 2, 8, 8, 0.35)  # no hidden size: fine for retnet, the default gate
    cell = build_cell("gated", spec)
    assert isinstance(CELLS["gated"](spec), GatedCell)
    assert cell.options() == {
        "gate": "retnet",
        "feature_map": "elu",
        "feature_options": {},
        "normalize": True,
        "chunk_size": 64,
        "eps": 1e-6,
    }
    gla = build_cell("gated", CellSpec(4, 2, 8, 8, 0.35, hidden_size=HIDDEN), {"gate": "gla"})
    assert gla.options() == {
        "gate": "gla",
        "feature_map": "elu",
        "feature_options": {},
        "normalize": True,
        "chunk_size": 64,
        "eps": 1e-6,
        "gate_rank": 16,
        "tau": 16.0,
        "decay_init": 0.99,
    }
    assert gla.gate_down.weight.shape == (16, HIDDEN) and gla.gate_up.weight.shape == (2 * 8, 16)
    gateloop = build_cell("gated", CellSpec(4, 2, 8, 8, 0.35, hidden_size=HIDDEN), {"gate": "gateloop"})
    assert gateloop.options()["tau"] == 1.0 and "gate_rank" not in gateloop.options()


@pytest.mark.parametrize(
    "options, match",
    [
        ({"gate": "mamba"}, "unknown gate 'mamba'"),
        ({"gate": "retnet", "gate_rank": 4}, "'gate_rank' does not apply to gate 'retnet'"),
        ({"gate": "gateloop", "gate_rank": 4}, "'gate_rank' does not apply to gate 'gateloop'"),
        ({"gate": "retnet", "tau": 2.0}, "'tau' does not apply"),
        ({"gate": "gla", "gate_rank": 0}, "gate_rank must be a positive integer"),
        ({"gate": "gla", "tau": 0}, "tau must be > 0"),
        ({"gate": "gla", "decay_init": 1.0}, "decay_init must be strictly between 0 and 1"),
        ({"gate": "gateloop", "decay_init": 0.0}, "decay_init must be strictly between 0 and 1"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"normalize": "yes"}, "normalize must be true or false"),
        ({"feature_map": "cosine"}, "unknown feature map 'cosine'"),
        ({"feature_options": [1]}, "feature_options must be a dict"),
        ({"eps": -1.0}, "eps must be a number >= 0"),
        ({"feature_map": "identity"}, "needs normalize=False"),
        ({"feature_map": "elu", "feature_options": {"seed": 1}}, "feature map 'elu' has no option"),
        ({"window": 3}, "'gated'"),
    ],
)
def test_invalid_options_are_user_errors(options, match):
    with pytest.raises(RnnifyError, match=match):
        build_cell("gated", CellSpec(4, 2, 8, 8, 0.35, hidden_size=HIDDEN), options)


def test_trainable_gates_need_the_layer_width_and_input():
    with pytest.raises(RnnifyError, match="hidden_size"):
        build_cell("gated", CellSpec(4, 2, 8, 8, 0.35), {"gate": "gla"})
    cell = _cell("gateloop")
    q, k, v, _ = _qkvx(cell, 1, 3, _gen(13))
    with pytest.raises(ValueError, match="needs the layer input"):
        cell(q, k, v, torch.ones(1, 3, dtype=torch.bool), *cell.init_state(1, torch.device("cpu"), torch.float32))


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
def test_every_feature_map_works_in_every_form(feature_map):
    """Any map of linear.py (with its own options, defaults resolved): prefill (chunked) equals
    token-by-token decode (step), the options rebuild the cell, the map's weights are trainable
    parameters of the cell when it has any."""
    normalize = feature_map != "identity"  # identity features can make phi(q) . z vanish
    gen = _gen(22)
    cell = _cell("gla", chunk_size=3, normalize=normalize, feature_map=feature_map)
    q, k, v, x = _qkvx(cell, 2, 11, gen)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = False
    init = cell.init_state(2, torch.device("cpu"), torch.float32)
    assert init[0].shape == (2, 2, cell.phi.feature_dim, 8)
    one_shot, *final = cell(q, k, v, mask, *init, x=x)
    stepped, state = _steps(cell, q, k, v, mask, x, init)
    assert torch.isfinite(one_shot).all()
    torch.testing.assert_close(stepped[0], one_shot[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stepped[1, :, 3:], one_shot[1, :, 3:], rtol=1e-4, atol=1e-5)
    for a, b in zip(state, final):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rebuilt = GatedCell(cell.spec, **cell.options())
    rebuilt.load_state_dict(cell.state_dict(), strict=True)
    assert torch.equal(rebuilt(q, k, v, mask, *init, x=x)[0], one_shot)
    assert {id(p) for p in cell.phi.parameters()} <= {id(p) for p in parameters(cell)}


# --------------------------------------------------------------------------- stability


def _stability(gate: str, steps: int) -> None:
    """``steps`` single decode steps on random fp32 inputs (B=1, H=2, d=8): always finite, and the
    last outputs and the final state equal the chunked form over the same inputs."""
    cell = _cell(gate, num_kv_heads=2, group=1, head_dim=8, value_dim=8, chunk_size=64, seed=14)
    q, k, v, x = _qkvx(cell, 1, steps, _gen(15))
    mask = torch.ones(1, steps, dtype=torch.bool)
    init = cell.init_state(1, torch.device("cpu"), torch.float32)
    state, finite = init, torch.tensor(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra threads only add sync cost (x30 on a loaded 2-core box)
    try:
        with torch.no_grad():
            for t in range(steps):
                sl = slice(t, t + 1)
                out, *state = cell(q[:, :, sl], k[:, :, sl], v[:, :, sl], mask[:, sl], *state, x=x[:, sl])
                finite &= torch.isfinite(out).all()
            one_shot, *final = cell(q, k, v, mask, *init, x=x)
    finally:
        torch.set_num_threads(threads)
    assert finite and all(torch.isfinite(t).all() for t in state)
    torch.testing.assert_close(out, one_shot[:, :, -1:], rtol=1e-4, atol=1e-4)
    for a, b in zip(state, final):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gate", GATES)
def test_2000_steps_stay_finite_and_match_the_chunked_form(gate):
    _stability(gate, 2_000)


@pytest.mark.slow
@pytest.mark.parametrize("gate", GATES)
def test_100000_steps_stay_finite_and_match_the_chunked_form(gate):
    start = time.perf_counter()
    _stability(gate, 100_000)
    print(f"{gate}: 100,000 steps in {time.perf_counter() - start:.1f} s")


# --------------------------------------------------------------------------- converted models


@pytest.fixture(scope="module")
def gated_model(tiny_model_dir):
    """``gated_model(arch, gate)`` -> a converted model; trainable gates randomised to vary with x."""
    built = {}

    def get(arch: str, gate: str):
        if (arch, gate) not in built:
            model = rnnify.convert(tiny_model_dir(arch), to="gated", gate=gate, chunk_size=8)
            gen = _gen(16)
            with torch.no_grad():
                for p in parameters(model):
                    p.add_(torch.randn(p.shape, generator=gen) * 0.5)
            built[arch, gate] = model
        return built[arch, gate]

    return get


ARCH_GATES = [(arch, gate) for arch in ("gpt2", "llama") for gate in GATES]


@pytest.mark.parametrize("arch, gate", ARCH_GATES)
def test_converted_step_equals_prefill_and_prefill_continues(arch, gate, gated_model):
    model = gated_model(arch, gate)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=_gen(17))
    assert_steps_and_split_prefill_match(model, ids, 23)


@pytest.mark.parametrize("arch, gate", ARCH_GATES)
def test_converted_left_padding_matches_unpadded(arch, gate, gated_model):
    model = gated_model(arch, gate)
    ids = torch.randint(1, model.manifest.vocab_size, (2, 30), generator=_gen(18))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :6] = 0
    padded, state = model.prefill(ids, attention_mask=mask)
    plain, plain_state = model.prefill(ids[1:, 6:])
    assert rel_diff(padded[1:, 6:], plain) < 1e-4
    for a, b in zip(state.tensors, plain_state.tensors):
        torch.testing.assert_close(a[1:], b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, gate", ARCH_GATES)
def test_converted_state_is_constant(arch, gate, gated_model):
    model = gated_model(arch, gate)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 100), generator=_gen(19))
    _, short = model.prefill(ids[:, :16])
    _, long = model.prefill(ids)
    assert short.nbytes == long.nbytes == model.state_nbytes(16) == model.state_nbytes(100)


@pytest.mark.parametrize("arch, gate", ARCH_GATES)
def test_converted_save_and_load_give_identical_logits(arch, gate, gated_model, tmp_path):
    model = gated_model(arch, gate)
    model.save(tmp_path / "model")
    loaded = rnnify.load(tmp_path / "model")
    ids = torch.randint(0, model.manifest.vocab_size, (2, 20), generator=_gen(20))
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])
    logits, state = model.prefill(ids)
    assert torch.equal(loaded.step(ids[:, :1], loaded.prefill(ids)[1])[0], model.step(ids[:, :1], state)[0])
    # the trainable gates are saved (and only they are the cells' parameters)
    stored = load_file(tmp_path / "model" / "model.safetensors")
    trained = dict(model.named_parameters())
    cell_params = [n for n, p in trained.items() if any(p is q for q in parameters(model))]
    assert len(cell_params) == (0 if gate == "retnet" else (6 if gate == "gla" else 4))  # 2 layers
    for name in cell_params:
        key = name.removeprefix("graph.")
        assert key in stored and torch.equal(stored[key], trained[name].detach())
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]


@pytest.mark.parametrize("gate", ["gla", "gateloop"])
def test_sgd_on_the_converted_models_gates_changes_its_outputs(gate, tiny_model_dir):
    model = rnnify.convert(tiny_model_dir("llama"), to="gated", gate=gate)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 24), generator=_gen(21))
    gates = list(parameters(model))
    assert gates and all(p.requires_grad for p in gates)
    before = model.prefill(ids)[0]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if all(p is not g for g in gates)}
    # a tiny random model barely depends on its gates near 1: a large step, so the change shows
    optimizer = torch.optim.SGD(gates, lr=300.0)
    for _ in range(3):
        optimizer.zero_grad()
        logits, _ = model(ids, model.init_state(2))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
    after = model.prefill(ids)[0]
    assert torch.isfinite(after).all() and (after - before).abs().max() > 1e-5
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
