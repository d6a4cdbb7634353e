"""The `gated` target (GatedCell: RetNet, GLA, GateLoop) against the float64 references of
tests/gated_support.py (docs/math.md §Gated linear attention): every form, the cell in prefill and
steps, padding, bf16, the gates' initialisation and training, and long decodes."""

from __future__ import annotations

import time

import pytest
import torch
from gated_support import (
    GATES,
    HIDDEN,
    HYPOTHESIS,
    assert_close,
    make_cell,
    qkvx,
    random_state,
    reference_gated_attention,
    reference_gated_cell,
    seeded,
    step_by_step,
)
from hypothesis import given
from hypothesis import strategies as st

from rnnify.cells import CellSpec, parameters
from rnnify.cells.gated import GatedCell, step_gated_attn
from rnnify.cells.linear import LinearCell
from rnnify.kernels.linear_attn.naive import chunk_gated_attn, naive_recurrent_gated_attn, parallel_gated_attn

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
    gen = seeded(seed)
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
    gen = seeded(11)
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
    gen = seeded(seed)
    cell = make_cell(gate, num_kv_heads, group, head_dim, head_dim, chunk_size, seed=seed, normalize=normalize)
    q, k, v, x = qkvx(cell, batch, length, gen)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[-1, : min(left_pad, length - 1)] = False
    state = random_state(cell, batch, gen)
    ref, ref_state = reference_gated_cell(cell, q, k, v, mask, x, state)

    one_shot, *final = cell(q, k, v, mask, *state, x=x)
    stepped, stepped_state = step_by_step(cell, q, k, v, mask, x, state)
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
    gen = seeded(5)
    cell = make_cell(gate)
    q, k, v, x = qkvx(cell, 2, 9, gen)
    mask = torch.ones(2, 9, dtype=torch.bool)
    _, *state = cell(q, k, v, mask, *cell.init_state(2, torch.device("cpu"), torch.float32), x=x)
    pq, pk, pv, px = qkvx(cell, 2, 5, gen)
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
    gen = seeded(6)
    cell = make_cell(gate, chunk_size=3)
    q, k, v, x = qkvx(cell, 2, 10, gen, dtype=torch.bfloat16)
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
    q2, k2, v2, x2 = qkvx(cell, 2, 40, gen, dtype=torch.bfloat16)
    mask2 = torch.ones(2, 40, dtype=torch.bool)
    stepped, state2 = step_by_step(cell, q2, k2, v2, mask2, x2, state)
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
    cell = make_cell("retnet", num_kv_heads=6, group=1)
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
    x = torch.randn(4, 1, HIDDEN, generator=seeded(8))  # unit-scale layer inputs
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
    gen = seeded(9)
    spec = CellSpec(4, 2, 8, 8, 8**-0.5, hidden_size=HIDDEN)
    cell = GatedCell(spec, gate=gate, chunk_size=4)
    q, k, v, x = qkvx(cell, 2, 24, gen)
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
    gen = seeded(10)
    cell = make_cell("retnet", num_kv_heads=2, group=2, chunk_size=5)
    cell.log_gamma.zero_()  # test only: gamma = 1 for every head
    linear = LinearCell(cell.spec, feature_map="elu", chunk_size=3, eps=cell.eps)
    q, k, v, x = qkvx(cell, 2, 17, gen)
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[1, :4] = False
    init = cell.init_state(2, torch.device("cpu"), torch.float32)
    out, *state = cell(q, k, v, mask, *init)
    ref, *ref_state = linear(q, k, v, mask, *linear.init_state(2, torch.device("cpu"), torch.float32))
    assert_close(out, ref)
    for a, b in zip(state, ref_state):
        assert_close(a, b)
    q2, k2, v2, _ = qkvx(cell, 2, 1, gen)
    step, *_ = cell(q2, k2, v2, mask[:, :1] | True, *state)
    ref_step, *_ = linear(q2, k2, v2, mask[:, :1] | True, *ref_state)
    assert_close(step, ref_step)


@pytest.mark.parametrize("normalize", [True, False])
def test_state_size_does_not_depend_on_length(normalize):
    cell = make_cell("gla", num_kv_heads=3, group=2, head_dim=4, value_dim=6, normalize=normalize)
    shapes = set()
    for length in (1, 7, 100):
        q, k, v, x = qkvx(cell, 1, length, seeded(length))
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


# --------------------------------------------------------------------------- stability


def _stability(gate: str, steps: int) -> None:
    """``steps`` single decode steps on random fp32 inputs (B=1, H=2, d=8): always finite, and the
    last outputs and the final state equal the chunked form over the same inputs."""
    cell = make_cell(gate, num_kv_heads=2, group=1, head_dim=8, value_dim=8, chunk_size=64, seed=14)
    q, k, v, x = qkvx(cell, 1, steps, seeded(15))
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
