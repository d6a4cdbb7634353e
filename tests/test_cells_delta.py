"""The `delta` and `gated-delta` targets (DeltaCell, GatedDeltaCell), and the hybrid's recurrent
memories (delta, gated-delta, gla), against references written here.

The reference is a float64 loop over the equations of docs/math.md §Delta rule, per batch row, kv
head and token, with S = [d_v, d_k], unit q and k, beta_t = sigmoid(x_t W_beta + b_beta) and
alpha_t = sigmoid(x_t W_alpha + b_alpha), and padding tokens skipped:

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    o_t = S_t q_t
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_support import nan_buffers  # noqa: F401 - autouse: NaN-filled kernel outputs

import rnnify
from rnnify.bench import OpCount
from rnnify.cells import CellSpec, build_cell, hybrid_window, linear_memory, parameters
from rnnify.cells.delta import (
    DeltaCell,
    chunk_delta_attn,
    naive_recurrent_delta_attn,
    step_delta_attn,
)
from rnnify.cells.delta_memory import delta_memory_hybrid_attn, mass_share
from rnnify.cells.gated import gla_log_gates
from rnnify.cells.hybrid import GLA_TAU
from rnnify.cells.linear_memory import chunk_hybrid_attn, fused_hybrid_attn
from rnnify.errors import RnnifyError
from rnnify.kernels import utils

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


@pytest.mark.parametrize("target", ["delta", "gated-delta"])
def test_cell_matches_float64_reference(target):
    cell = make_cell(target)
    q, k, v, x, mask = make_inputs(19)
    ref, ref_S = reference(cell, q, k, v, x, mask)
    out, S = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
    real = mask[:, None, :, None].expand_as(out)
    assert rel_diff(out[real], ref[real]) < 1e-5 and rel_diff(S, ref_S) < 1e-5
    # decode: one token at a time from the state the prefill of the first 7 left
    _, state = cell(
        q[:, :, :7], k[:, :, :7], v[:, :, :7], mask[:, :7], *cell.init_state(2, q.device, q.dtype), x=x[:, :7]
    )
    outs = []
    for t in range(7, 19):
        o, state = cell(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], state, x=x[:, t : t + 1]
        )
        outs.append(o)
    assert rel_diff(torch.cat(outs, 2), ref[:, :, 7:]) < 1e-5 and rel_diff(state, ref_S) < 1e-5


@pytest.mark.parametrize("gated", [False, True])
def test_forms_agree(gated):
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(2, 2, 3, 23, 8, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(2, 2, 23, 8, generator=gen), dim=-1)
    v, beta = torch.randn(2, 2, 23, 6, generator=gen), torch.rand(2, 2, 23, generator=gen)
    log_a = -torch.rand(2, 2, 23, generator=gen) if gated else None
    kv = torch.randn(2, 2, 8, 6, generator=gen)
    ref, ref_kv = naive_recurrent_delta_attn(q, k, v, beta, log_a, kv)
    for chunk in (1, 5, 64):
        out, new_kv = chunk_delta_attn(q, k, v, beta, log_a, kv, chunk)
        assert rel_diff(out, ref) < 1e-5 and rel_diff(new_kv, ref_kv) < 1e-5
    outs, state = [], kv
    for t in range(23):
        o, state = step_delta_attn(
            q[:, :, :, t : t + 1],
            k[:, :, t : t + 1],
            v[:, :, t : t + 1],
            beta[:, :, t : t + 1],
            None if log_a is None else log_a[:, :, t : t + 1],
            state,
        )
        outs.append(o)
    assert rel_diff(torch.cat(outs, 3), ref) < 1e-5 and rel_diff(state, ref_kv) < 1e-5


def test_initialisation_is_modest():
    """Training-free: beta = beta_init and alpha = decay_init for every token; outputs stay on the
    scale of the values (no normaliser needed)."""
    cell = build_cell("gated-delta", SPEC, {"beta_init": 0.3, "decay_init": 0.95})
    q, k, v, x, mask = make_inputs(100, pad=0)
    beta, log_a = cell.writer(x * 100, mask)
    torch.testing.assert_close(beta, torch.full_like(beta, 0.3))
    torch.testing.assert_close(log_a.exp(), torch.full_like(log_a, 0.95))
    for target in ("delta", "gated-delta"):
        cell = build_cell(target, SPEC)
        out, _ = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
        assert out.abs().max() <= v.abs().max()


def test_trainable_parameters_and_gradients():
    cell = make_cell("gated-delta")
    names = {n for n, _ in cell.named_parameters()}
    assert names == {
        "writer.beta_proj.weight",
        "writer.beta_proj.bias",
        "writer.gate_proj.weight",
        "writer.gate_proj.bias",
    }
    assert len(list(parameters(torch.nn.ModuleList([cell])))) == 4
    q, k, v, x, mask = make_inputs(9)
    out, _ = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in cell.parameters())


@pytest.mark.parametrize(
    "target, kernels",
    [
        ("delta", "reference"),
        ("gated-delta", "reference"),
        pytest.param("gated-delta", "triton", marks=pytest.mark.slow),
    ],
)
def test_fused_matches_own_forms(target, kernels):
    """The kernels' ops (the reference path; Triton through the interpreter, slow) against the cell's own forms: left-padded prefill then decode steps, outputs, state and
    gradients of q, k, v, x and the cell's parameters."""
    cell = make_cell(target)
    inputs = make_inputs(7, pad=2)

    def run(kernels):
        cell.use_kernels(kernels)
        q, k, v, x, mask = (t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs)
        state = cell.init_state(2, q.device, q.dtype)
        outs = []
        for t in (slice(0, 5), slice(5, 6), slice(6, 7)):
            out, *state = cell(q[:, :, t], k[:, :, t], v[:, :, t], mask[:, t], *state, x=x[:, t])
            outs.append(out)
        out = torch.cat(outs, 2)
        leaves = [q, k, v, x, *cell.parameters()]
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, 6)).sum() + state[0].square().sum(), leaves)
        return out.detach(), state[0].detach(), grads

    expected = run("none")
    assert cell.use_kernels("triton") == {"prefill": "chunk_delta_rule", "decode": "fused_recurrent_delta_rule"}
    out, state, grads = run(kernels)
    real = inputs[4][:, None, :, None].expand_as(out)
    assert rel_diff(out[real], expected[0][real]) < 1e-5 and rel_diff(state, expected[1]) < 1e-5
    for a, b in zip(grads, expected[2]):
        assert rel_diff(a, b) < 1e-4


def test_options_are_checked():
    with pytest.raises(RnnifyError, match="beta_init must be a number strictly between 0 and 1"):
        build_cell("delta", SPEC, {"beta_init": 1.0})
    with pytest.raises(RnnifyError, match="decay_init must be"):
        build_cell("gated-delta", SPEC, {"decay_init": 0})
    with pytest.raises(RnnifyError, match="unexpected keyword argument 'decay_init'"):
        build_cell("delta", SPEC, {"decay_init": 0.9})
    with pytest.raises(RnnifyError, match="hidden_size"):
        build_cell("delta", CellSpec(4, 2, 8, 6, 0.3))
    assert build_cell("gated-delta", SPEC).options() == {"beta_init": 0.5, "chunk_size": 64, "decay_init": 0.99}


@pytest.mark.slow
def test_convert_tiny_llama_left_padded(tiny_model_dir):
    """A converted model: a left-padded row gives the same logits as the same row unpadded."""
    model = rnnify.convert(tiny_model_dir("llama"), to="gated-delta", chunk_size=4)
    ids = torch.randint(0, model.manifest.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    alone, _ = model.prefill(ids)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1).repeat(2, 1)
    padded[1, :3] = ids[0, :3]
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[0, :3] = False
    logits, _ = model.prefill(padded, attention_mask=mask)
    assert rel_diff(logits[0, 3:], alone[0]) < 1e-4


# --------------------------------------------------------------------------- the hybrid's delta memory


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


@pytest.mark.parametrize("memory", ["delta", "gated-delta"])
def test_hybrid_delta_memory_blends_window_and_readout(memory):
    """out = the window target's output blended with the delta memory of the tokens that left the
    window, by each query's share; at the default g = 0 the window target (to rounding). Prefill in
    chunks, then decode, from a state."""
    window, sinks = 3, 1
    torch.manual_seed(0)
    hybrid = build_cell("hybrid", SPEC, {"window": window, "sinks": sinks, "memory": memory, "chunk_size": 4})
    assert hybrid.state_names[-1] == "kv" and hybrid.needs_input
    q, k, v, x, mask = make_inputs(13, pad=2)
    expected_window = assert_starts_as_window(hybrid, q, k, v, x, mask)

    gate = torch.tensor([0.3, -0.5, 1.0, 0.7])
    with torch.no_grad():
        hybrid.memory_gate.copy_(gate)
        for p in (*hybrid.writer.parameters(), *hybrid.reader.parameters()):
            p.add_(torch.randn_like(p), alpha=0.3)
    expected = delta_memory_reference(hybrid, q, k, v, x, mask, window, sinks, expected_window)
    assert_every_phase_matches(hybrid, q, k, v, x, mask, expected)


def delta_memory_mass_reference(cell, q, k, v, x, mask, window: int, sinks: int):
    """float64, share by mass (elu map): the delta memory written as in ``delta_memory_reference``,
    and z += phi(k_j) beside it; each query blends the window's output w / u with the readout S q'
    by g_h M / (f_h u + M), M = phi(q) . z, the linear memory's weight of the tokens it holds (0 while M = 0);
    with ``share="mass-input"`` by g_h M / (f_h u exp(-l) + M), l = x W_s + b_s of the query's token."""
    writer, reader = cell.writer, cell.reader
    by_input = cell.share == "mass-input"
    gate, f = cell.memory_gate.double(), torch.sigmoid(cell.window_logit.double())

    def mapped(t, h):
        return t.double() @ reader.key_map[h].double() + reader.key_bias[h].double()

    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
    group = SPEC.group_size
    for b in range(2):
        real = [t for t in range(q.shape[2]) if mask[b, t]]
        for h in range(2):
            S, z = torch.zeros(6, 8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
            for n, t in enumerate(real):
                if n >= window + sinks:
                    j = real[n - window]
                    scale = anneal_scale(cell, h, n - window - sinks)
                    S = delta_write(S, writer, x[b, t], h, mapped(k[b, h, j], h), v[b, h, j], scale)
                    z = z + elu_plus_one(k[b, h, j].double())
                held = [real[i] for i in range(n + 1) if n - i < window or i < sinks]
                for i in range(h * group, (h + 1) * group):
                    scores = SPEC.scale * k[b, h, held].double() @ q[b, i, t].double()
                    e = torch.exp(scores - scores.max())
                    w, u = e @ v[b, h, held].double(), e.sum()
                    mass = elu_plus_one(q[b, i, t].double()) @ z
                    query = mapped(q[b, i, t], h)
                    odds = 1.0
                    if by_input:
                        odds = torch.exp(
                            x[b, t].double() @ reader.share_proj.weight[i].double() + reader.share_proj.bias[i].double()
                        )
                    share = gate[i] * mass / (f[i] * u / odds + mass) if mass > 0 else 0.0
                    out[b, i, t] = w / u + share * (S @ (query / query.norm()) - w / u)
    return out


@pytest.mark.parametrize("share", ["mass", "mass-input"])
@pytest.mark.parametrize("memory", ["delta", "gated-delta"])
def test_hybrid_delta_memory_weighed_by_mass(memory, share):
    """share="mass": the delta memory's readout takes the weight the linear memory's tokens would
    have in LoLCATs' sum ("mass-input": those odds times exp of a logit from the layer input); at
    g = 0 the window target; every phase against the float64 loop."""
    window, sinks = 3, 1
    torch.manual_seed(0)
    options = {
        "window": window,
        "sinks": sinks,
        "memory": memory,
        "chunk_size": 4,
        "share": share,
        "feature_map": "elu",
    }
    hybrid = build_cell("hybrid", SPEC, options)
    assert hybrid.state_names[-2:] == ("kv", "k_sum") and not hasattr(hybrid.reader, "count_weight")
    assert hasattr(hybrid.reader, "share_proj") == (share == "mass-input")
    q, k, v, x, mask = make_inputs(13, pad=2)
    assert_starts_as_window(hybrid, q, k, v, x, mask)
    with torch.no_grad():
        hybrid.memory_gate.copy_(torch.tensor([0.3, -0.5, 1.0, 0.7]))
        hybrid.window_logit.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
        for p in (*hybrid.writer.parameters(), *hybrid.reader.parameters()):
            p.add_(torch.randn_like(p), alpha=0.3)
    expected = delta_memory_mass_reference(hybrid, q, k, v, x, mask, window, sinks)
    assert_every_phase_matches(hybrid, q, k, v, x, mask, expected)


@pytest.mark.parametrize("pad", [2, 0])  # 0: the whole unpadded prompt's own path too
@pytest.mark.parametrize("share", ["count", "mass", "mass-input"])
@pytest.mark.parametrize("memory", ["delta", "gated-delta"])
def test_hybrid_delta_memory_annealed(memory, share, pad):
    """anneal=tau: each write's beta times tau_h / (tau_h + m), m the tokens written before (a running
    mean along each key direction), tau_h learned; every phase against the float64 loops, with
    prompts split across calls, so m continues from the state."""
    window, sinks = 3, 1
    torch.manual_seed(0)
    options = {"window": window, "sinks": sinks, "memory": memory, "chunk_size": 4, "share": share, "anneal": 2.0}
    if share != "count":
        options["feature_map"] = "elu"
    hybrid = build_cell("hybrid", SPEC, options)
    assert hybrid.options()["anneal"] == 2.0
    q, k, v, x, mask = make_inputs(13, pad=pad)
    expected_window = assert_starts_as_window(hybrid, q, k, v, x, mask)
    with torch.no_grad():
        hybrid.memory_gate.copy_(torch.tensor([0.3, -0.5, 1.0, 0.7]))
        hybrid.log_tau.copy_(torch.tensor([-1.0, 1.5]))  # tau 0.37 and 4.5: strongly and mildly annealed
        if share != "count":
            hybrid.window_logit.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
        for p in (*hybrid.writer.parameters(), *hybrid.reader.parameters()):
            p.add_(torch.randn_like(p), alpha=0.3)
    if share != "count":
        expected = delta_memory_mass_reference(hybrid, q, k, v, x, mask, window, sinks)
    else:
        expected = delta_memory_reference(hybrid, q, k, v, x, mask, window, sinks, expected_window)
    assert_every_phase_matches(hybrid, q, k, v, x, mask, expected)
    hybrid.anneal = 0.0  # the same cell unannealed is another function: the test can tell them apart
    unannealed, *_ = hybrid(q, k, v, mask, *hybrid.init_state(2, q.device, q.dtype), x=x)
    real = mask[:, None, :, None].expand_as(expected)
    assert rel_diff(unannealed[real], expected[real]) > 1e-3


def test_hybrid_delta_memory_annealed_trains_tau():
    hybrid = build_cell("hybrid", SPEC, {"window": 3, "sinks": 0, "memory": "delta", "anneal": 4.0})
    with torch.no_grad():
        hybrid.memory_gate.fill_(0.5)
    q, k, v, x, mask = make_inputs(13, pad=0)
    out, *_ = hybrid(q, k, v, mask, *hybrid.init_state(2, q.device, q.dtype), x=x)
    out.square().sum().backward()
    assert hybrid.log_tau.grad is not None and hybrid.log_tau.grad.abs().min() > 0


@pytest.mark.parametrize("share", ["mass", "mass-input"])
def test_hybrid_delta_memory_weighed_by_mass_unpadded_with_hedgehog_and_trains(share):
    """A whole unpadded prompt (its own window path) with the default hedgehog map: the prompt equals
    its token-by-token steps, and the gate, f_h, the map and the memory's reader all get gradients."""
    torch.manual_seed(0)
    hybrid = build_cell(
        "hybrid", SPEC, {"window": 3, "sinks": 1, "memory": "delta", "share": share, "memory_init": 0.5}
    )
    assert hybrid.feature_map == "hedgehog"
    q, k, v, x, mask = make_inputs(11, pad=0)
    mask = torch.ones_like(mask)
    prompt, *_ = hybrid(q, k, v, mask, *hybrid.init_state(2, q.device, q.dtype), x=x)
    state, steps = hybrid.init_state(2, q.device, q.dtype), []
    for t in range(q.shape[2]):
        out, *state = hybrid(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state, x=x[:, t : t + 1]
        )
        steps.append(out)
    assert rel_diff(torch.cat(steps, 2), prompt) < 1e-5
    prompt.square().sum().backward()
    for name, p in hybrid.named_parameters():
        if not name.startswith("writer.gate"):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_mass_share_is_finite_with_extreme_logits_and_empty_memories():
    """The share by mass and input at logits far past any odds that matter, with an empty memory
    (M = 0) and a query with no window weight (u = 0): finite shares and gradients, 0 where M = 0,
    and within (0, g] elsewhere."""
    gate, factor = torch.full((1, 1), 0.7), torch.ones(1, 1)
    phi_q = torch.ones(1, 1, 1, 4, 2)
    phi_written = torch.tensor([0.0, 0.0, 1.0, 1.0])[None, None, :, None].expand(1, 1, 4, 2).clone()
    window_den = torch.tensor([1.0, 0.0, 1.0, 0.0]).view(1, 1, 1, 4)
    logit = torch.tensor([-100.0, 120.0, -1000.0, 1000.0]).view(1, 1, 1, 4).requires_grad_()
    share, _ = mass_share(gate, factor, phi_q, phi_written, torch.zeros(1, 1, 2), window_den, logit)
    share.sum().backward()
    assert torch.isfinite(share).all() and torch.isfinite(logit.grad).all()
    assert share[..., :2].eq(0).all() and (share[..., 2:] > 0).all() and (share[..., 2:] <= 0.7).all()


def test_hybrid_share_by_mass_is_for_the_delta_memories():
    with pytest.raises(RnnifyError, match="shares by mass apply to the delta memories only"):
        build_cell("hybrid", SPEC, {"memory": "linear", "share": "mass"})
    with pytest.raises(RnnifyError, match="share must be one of"):
        build_cell("hybrid", SPEC, {"memory": "delta", "share": "softmax"})
    with pytest.raises(RnnifyError, match="can make negative"):
        build_cell("hybrid", SPEC, {"memory": "delta", "share": "mass", "feature_map": "identity"})
    assert build_cell("hybrid", SPEC, {"memory": "delta", "share": "mass"}).options()["feature_map"] == "hedgehog"


# --------------------------------------------------------------------------- the hybrid's gla memory


def elu_map(memory: str) -> dict:
    """The elu map for the linear and gla memories, as the references below compute it (the delta memories have none)."""
    return {"feature_map": "elu"} if memory in ("linear", "gla") else {}


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0)))


def gla_memory_reference(cell, q, k, v, x, mask, window: int, sinks: int):
    """float64 (a linear memory: a = 1), per row, kv head and real token n: first, if n >= W + S, the memory decays by
    a_n = exp(logsigmoid(x_n W_down W_up + b) / tau) (per feature) and token n - W (not a sink)
    is written, kv += phi(k)^T v, z += phi(k); then each query head reads the LoLCATs sum
    y = (f w + phi(q) kv) / (f u + phi(q) . z) over the window (w, u: softmax numerator and
    denominator over the last W tokens and the sinks) and outputs w / u + g (y - w / u)."""
    num_kv, group, features = 2, SPEC.group_size, SPEC.head_dim  # elu: F = d
    x = x.double()
    log_a = torch.zeros(*x.shape[:2], num_kv, features, dtype=torch.float64)  # the linear memory: a = 1
    if cell.memory == "gla":
        logits = x @ cell.gate_down.weight.double().T @ cell.gate_up.weight.double().T + cell.gate_up.bias.double()
        log_a = torch.nn.functional.logsigmoid(logits).reshape(*x.shape[:2], num_kv, features) / 16.0
    f, g = torch.sigmoid(cell.window_logit.double()), cell.memory_gate.double()
    out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float64)
    for b in range(2):
        real = [t for t in range(q.shape[2]) if mask[b, t]]
        for h in range(num_kv):
            kv, z = torch.zeros(features, 6, dtype=torch.float64), torch.zeros(features, dtype=torch.float64)
            for n, t in enumerate(real):
                if n >= window + sinks:
                    j, a = real[n - window], log_a[b, t, h].exp()
                    phi_k = elu_plus_one(k[b, h, j].double())
                    kv, z = a[:, None] * kv + torch.outer(phi_k, v[b, h, j].double()), a * z + phi_k
                held = [real[i] for i in range(n + 1) if n - i < window or i < sinks]
                for i in range(h * group, (h + 1) * group):
                    scores = SPEC.scale * k[b, h, held].double() @ q[b, i, t].double()
                    e = torch.exp(scores - scores.max())
                    w, u = e @ v[b, h, held].double(), e.sum()
                    phi_q = elu_plus_one(q[b, i, t].double())
                    y = (f[i] * w + phi_q @ kv) / (f[i] * u + phi_q @ z)
                    out[b, i, t] = w / u + g[i] * (y - w / u)
    return out


def test_hybrid_gla_memory_is_the_decayed_lolcats_sum():
    """The gla memory: LoLCATs' normalised sum with a memory decayed per feature by GLA's gate of
    each arriving token; at the default g = 0 the window target. Prefill in chunks, then decode,
    from a state, left padding; the kernels' path too."""
    window, sinks = 3, 1
    torch.manual_seed(0)
    hybrid = build_cell(
        "hybrid", SPEC, {"window": window, "sinks": sinks, "memory": "gla", "chunk_size": 4, "feature_map": "elu"}
    )
    assert hybrid.state_names[-2:] == ("kv", "k_sum") and hybrid.needs_input
    q, k, v, x, mask = make_inputs(13, pad=2)
    assert_starts_as_window(hybrid, q, k, v, x, mask)

    with torch.no_grad():
        hybrid.memory_gate.copy_(torch.tensor([0.3, -0.5, 1.0, 0.7]))
        hybrid.window_logit.normal_()
        hybrid.gate_up.weight.normal_(std=0.3)
        hybrid.gate_up.bias.normal_(std=2.0)  # decays far from 1: a wrong decay shows
    expected = gla_memory_reference(hybrid, q, k, v, x, mask, window, sinks)
    assert_every_phase_matches(hybrid, q, k, v, x, mask, expected)


@pytest.mark.parametrize(
    "memory, sinks, gated, feature_map, dtype",
    [
        ("linear", 1, True, "elu", torch.float32),
        ("linear", 0, False, "elu", torch.float32),
        ("gla", 2, True, "elu", torch.float32),
        ("linear", 1, True, "identity", torch.float32),  # products of either sign: the read keeps its guard
        ("linear", 4, True, "hedgehog", torch.bfloat16),  # the defaults, with a bf16 ring
    ],
)
def test_hybrid_steady_decode_is_the_lolcats_sum(monkeypatch, memory, sinks, gated, feature_map, dtype):
    """Decoding an unpadded batch token by token from the empty state: once every row holds W + S
    tokens, each step takes the steady path (``steady_step_hybrid_attn``: slice_scatter into the
    ring, no masks, the sum divided through by u), and every output equals the float64 reference
    (elu, fp32), before and after that point; output and state are the general step's."""
    window, T = 3, 14
    torch.manual_seed(0)
    hybrid = build_cell(
        "hybrid", SPEC, {"window": window, "sinks": sinks, "memory": memory, "feature_map": feature_map}
    )
    with torch.no_grad():
        hybrid.window_logit.normal_()
        hybrid.memory_gate.copy_(torch.tensor([0.3, -0.5, 1.0, 0.7]) if gated else torch.ones(4))
        if memory == "gla":
            hybrid.gate_up.weight.normal_(std=0.3)
            hybrid.gate_up.bias.normal_(std=2.0)
    q, k, v, x, mask = make_inputs(T, pad=0)
    steady, steady_step = [], linear_memory.steady_step_hybrid_attn

    def spy(*args, **kwargs):
        steady.append(kwargs["n"])
        return steady_step(*args, **kwargs)

    monkeypatch.setattr(linear_memory, "steady_step_hybrid_attn", spy)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    state, general_state, outs = hybrid.init_state(2, q.device, dtype), None, []
    with torch.no_grad():
        for t in range(T):
            one = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1])
            with monkeypatch.context() as general:  # the same token through the general step
                general.setattr(linear_memory, "steady_length", lambda *a: None)
                general_out, *general_state = hybrid(*one, *state, x=x[:, t : t + 1])
            out, *state = hybrid(*one, *state, x=x[:, t : t + 1])
            outs.append(out)
            for a, b in zip((out, *state), (general_out, *general_state)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert steady == list(range(window + sinks, T))  # n, the tokens held before each steady step
    if feature_map == "elu":
        assert rel_diff(torch.cat(outs, 2), gla_memory_reference(hybrid, q, k, v, x, mask, window, sinks)) < 1e-5


def test_hybrid_decode_of_rows_at_different_lengths_keeps_the_general_step(monkeypatch):
    """Every row real but one left-padded before (so the rows hold different counts): no steady step,
    and the output is still the reference's."""
    window, sinks = 3, 1
    hybrid = build_cell("hybrid", SPEC, {"window": window, "sinks": sinks, "feature_map": "elu", "memory_init": 0.5})
    q, k, v, x, mask = make_inputs(14, pad=2)
    monkeypatch.setattr(linear_memory, "steady_step_hybrid_attn", lambda *a, **kw: pytest.fail("took the steady step"))
    state, outs = hybrid.init_state(2, q.device, q.dtype), []
    with torch.no_grad():
        for t in range(14):
            out, *state = hybrid(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
            outs.append(out)
    real = mask[:, None, :, None].expand(-1, 4, -1, 6)
    expected = gla_memory_reference(hybrid, q, k, v, x, mask, window, sinks)
    assert rel_diff(torch.cat(outs, 2)[real], expected[real]) < 1e-5


def test_hybrid_memory_option_is_checked():
    with pytest.raises(RnnifyError, match="unknown memory 'lstm'"):
        build_cell("hybrid", SPEC, {"memory": "lstm"})
    with pytest.raises(RnnifyError, match="no feature map unless its share is by mass"):
        build_cell("hybrid", SPEC, {"memory": "delta", "feature_map": "hedgehog"})
    assert build_cell("hybrid", SPEC, {"memory": "gla", "feature_map": "hedgehog"}).phi.feature_dim == 16
    assert build_cell("hybrid", SPEC).state_names[-2:] == ("kv", "k_sum")
    assert build_cell("hybrid", SPEC).feature_map == "hedgehog"  # trainable: distillation can fit the memory to softmax
    # a delta memory has no map; its manifests recorded elu, the default before, and still load
    assert build_cell("hybrid", SPEC, {"memory": "delta", "feature_map": "elu"}).state_names[-1] == "kv"
    assert build_cell("hybrid", SPEC).sinks == 4  # a real model's window needs its first tokens (StreamingLLM)
    for memory, anneal in (("linear", 4.0), ("delta", -1), ("delta", math.inf), ("delta", math.nan)):
        with pytest.raises(RnnifyError, match="anneal must be a finite number >= 0"):
            build_cell("hybrid", SPEC, {"memory": memory, "anneal": anneal})
    unannealed = build_cell("hybrid", SPEC, {"memory": "delta"})  # off by default: manifests as before it existed
    assert "anneal" not in unannealed.options() and not hasattr(unannealed, "log_tau")


# --------------------------------------------------------------------------- the hybrid's lean decode step


def general_step(cell, q, k, v, x, mask, state):
    """One token through the hybrid's general forms (the prefill's, off kernels), not its lean step:
    ``(out [B, H, 1, d_v], *state)`` in the cell's layout."""
    spec, sinks = cell.spec, cell.sinks
    grouped = q.reshape(2, spec.num_kv_heads, spec.group_size, 1, -1)
    keys, values, *rest = state
    if not sinks:
        state = (keys, values, keys[:, :, :0], values[:, :, :0], *rest)
    gate = cell.memory_gate.reshape(spec.num_kv_heads, spec.group_size)
    if cell.memory in ("delta", "gated-delta"):
        reader, options = cell.reader, {"scale": spec.scale, "chunk_size": cell.chunk_size, "kernels": None}
        beta, log_a = cell.writer(x, mask)
        reading = {"share": reader.share(x, gate), "key_map": reader.key_map, "key_bias": reader.key_bias}
        log_tau = cell.log_tau if cell.anneal else None
        out, *state = delta_memory_hybrid_attn(
            grouped, k, v, mask, *state, beta=beta, log_a=log_a, **reading, **options, log_tau=log_tau
        )
    else:
        fixed = {"phi": cell.phi, "factor": cell.mixing_factor(), "scale": spec.scale, "gate": gate}
        if cell.memory == "gla":
            log_a = gla_log_gates(x, cell.gate_down, cell.gate_up, GLA_TAU, spec.num_kv_heads, mask)
            out, *state = fused_hybrid_attn(
                grouped, k, v, mask, *state, **fixed, chunk_size=cell.chunk_size, backend=None, log_a=log_a
            )
        else:
            out, *state = chunk_hybrid_attn(grouped, k, v, mask, *state, **fixed, chunk_size=cell.chunk_size)
    if not sinks:
        del state[2:4]
    return out.reshape(2, spec.num_heads, 1, -1), *state


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("memory", ["linear", "gla", "delta", "gated-delta"])
def test_hybrid_lean_step_equals_the_general_path_and_the_reference(memory, sinks):
    """The decode step off kernels (``window_step`` and the memory's step, far fewer ops) equals,
    token by token from the empty state, the general forms' one-token call, state included, and the
    float64 reference: a left-padded row, and 19 steps, so that a window of 3 wraps many times."""
    window, steps = 3, 19
    torch.manual_seed(0)
    cell = build_cell("hybrid", SPEC, {"window": window, "sinks": sinks, "memory": memory, **elu_map(memory)})
    with torch.no_grad():
        cell.memory_gate.copy_(torch.tensor([0.3, -0.5, 1.0, 0.7]))
        for p in cell.parameters():
            p.normal_(std=0.3) if p.dim() == 2 else None
        if memory in ("linear", "gla"):
            cell.window_logit.normal_()
    q, k, v, x, mask = make_inputs(steps, pad=4)
    lean = general = cell.init_state(2, q.device, q.dtype)
    outs = []
    with torch.no_grad():
        for t in range(steps):
            token = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], x[:, t : t + 1], mask[:, t : t + 1])
            out, *lean = cell(*token[:3], token[4], *lean, x=token[3])
            want, *general = general_step(cell, *token, general)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
            for a, b in zip(lean, general):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            outs.append(out)
        out = torch.cat(outs, 2)
        if memory in ("delta", "gated-delta"):
            windowed = build_cell("window", SPEC, {"window": window, "sinks": sinks})
            expected, *_ = windowed(q, k, v, mask, *windowed.init_state(2, q.device, q.dtype))
            expected = delta_memory_reference(cell, q, k, v, x, mask, window, sinks, expected)
        else:
            expected = gla_memory_reference(cell, q, k, v, x, mask, window, sinks)
    real = mask[:, None, :, None].expand_as(expected)
    assert rel_diff(out[real], expected[real]) < 1e-5


def no_whole_prompt(patch: pytest.MonkeyPatch) -> None:
    """Every memory's general path for a whole prompt: ``whole_prompt`` False where the forms read it."""
    for module in (hybrid_window, linear_memory):
        patch.setattr(module, "whole_prompt", lambda mask, length: False)


@pytest.mark.parametrize("steps", [23, 4])  # 4: with 2 sinks nothing leaves the window of 3
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("memory", ["linear", "gla", "delta", "gated-delta"])
def test_hybrid_whole_prompt_path_equals_the_general_path(memory, sinks, steps, monkeypatch):
    """A whole unpadded prompt from the empty state (the window part in one go, the state from the
    prompt's tail) gives the general path's output and state, through the cell's own forms and the
    kernels' references, and off Triton with kernels auto."""
    window = 3
    torch.manual_seed(0)
    cell = build_cell(
        "hybrid", SPEC, {"window": window, "sinks": sinks, "memory": memory, "chunk_size": 4, **elu_map(memory)}
    )
    with torch.no_grad():
        cell.memory_gate.copy_(torch.tensor([0.3, -0.5, 1.0, 0.7]))
        for p in cell.parameters():
            p.normal_(std=0.3) if p.dim() == 2 else None
    q, k, v, x, mask = make_inputs(steps, pad=0)
    monkeypatch.setattr(utils, "FORCE_TRITON", False)  # auto: the cell's own prompt forms (prompt_hybrid_attn)
    for kernels in ("none", "reference", "auto"):
        cell.use_kernels(kernels)
        with torch.no_grad(), monkeypatch.context() as patch:
            fast, *fast_state = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
            no_whole_prompt(patch)
            general, *general_state = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
        assert rel_diff(fast, general) < 1e-5, kernels
        for a, b in zip(fast_state, general_state):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps", [23, 4])  # 4: nothing leaves the window (3 + 2 sinks)
@pytest.mark.parametrize("memory", ["linear", "gla"])
def test_hybrid_whole_prompt_path_trains_as_the_general_path(memory, steps, monkeypatch):
    """Under autograd the whole-prompt path (``prompt_hybrid_attn``) gives the general path's
    gradients for q, k, v and every parameter; the window factor and the memory gate stay in the
    graph even when nothing leaves the window, so attention transfer on such rows still runs."""
    torch.manual_seed(0)
    cell = build_cell("hybrid", SPEC, {"window": 3, "sinks": 2, "memory": memory, "chunk_size": 4})
    with torch.no_grad():
        cell.memory_gate.copy_(torch.tensor([0.3, -0.5, 1.0, 0.7]))
    q, k, v, x, mask = make_inputs(steps, pad=0)
    monkeypatch.setattr(utils, "FORCE_TRITON", False)
    cell.use_kernels("auto")
    grads = []
    for whole in (True, False):
        with monkeypatch.context() as patch:
            if not whole:
                no_whole_prompt(patch)
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            cell.zero_grad(set_to_none=True)
            out, *_ = cell(*inputs, mask, *cell.init_state(2, q.device, q.dtype), x=x)
            out.square().sum().backward()
            assert cell.window_logit.grad is not None and cell.memory_gate.grad is not None
            grads.append([t.grad for t in inputs] + [p.grad for p in cell.parameters()])
    for (name, param), fast, general in zip([("q", q), ("k", k), ("v", v), *cell.named_parameters()], *grads):
        fast, general = (torch.zeros_like(param) if g is None else g for g in (fast, general))
        torch.testing.assert_close(
            fast, general, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )  # f, g: 0 up to rounding


@pytest.mark.parametrize("memory", ["linear", "gla", "delta", "gated-delta"])
def test_hybrid_lean_step_dispatches_few_ops(memory):
    """A CPU decode step's time is its op count (docs/performance.md): here the general forms
    dispatched 219-282 aten ops a step, the lean step 95-118 for the linear and gla memories (the
    feature map applied to the queries and the leaving key in one call: 2 ops more with this cheap
    elu map, 9 fewer with hedgehog) and 158-173 for the delta memories (their reader's key map, a
    share that counts the memory's tokens: 7 ops, and annealed writes: 9); held under 180 so a
    regression shows."""
    cell = build_cell("hybrid", SPEC, {"window": 3, "sinks": 2, "memory": memory, **elu_map(memory)})
    q, k, v, x, mask = make_inputs(1, pad=0)
    count = OpCount()
    with torch.no_grad(), count:
        cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
    assert count.ops < 180


@pytest.mark.parametrize("memory", ["delta", "gated-delta"])
def test_hybrid_delta_reader_trains_from_the_start(memory):
    """With the memory gate open, the key map, its bias and the share projection all get a gradient."""
    cell = build_cell("hybrid", SPEC, {"window": 3, "memory": memory, "memory_init": 0.5, "sinks": 0})
    q, k, v, x, mask = make_inputs(9, pad=2)
    out, *_ = cell(q, k, v, mask, *cell.init_state(2, q.device, q.dtype), x=x)
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in cell.reader.parameters())


def test_hybrid_delta_memory_saved_before_the_count_keeps_the_share_it_was_trained_with():
    """A delta memory saved before its share counted the memory's tokens loads with c = 0, which is
    that share, g_h 2 sigmoid(x W_s + b_s)."""
    torch.manual_seed(0)
    options = {"window": 3, "memory": "delta", "memory_init": 0.5, "sinks": 0}
    cell = build_cell("hybrid", SPEC, options)
    with torch.no_grad():
        for p in cell.reader.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    earlier = {name: value for name, value in cell.state_dict().items() if name != "reader.count_weight"}
    loaded = build_cell("hybrid", SPEC, options)
    loaded.load_state_dict(earlier)
    assert torch.equal(loaded.reader.count_weight, torch.zeros(SPEC.num_heads))
    q, k, v, x, mask = make_inputs(11, pad=2)
    windowed = build_cell("window", SPEC, {"window": 3})
    expected_window, *_ = windowed(q, k, v, mask, *windowed.init_state(2, q.device, q.dtype))
    expected = delta_memory_reference(loaded, q, k, v, x, mask, 3, 0, expected_window)
    out, *_ = loaded(q, k, v, mask, *loaded.init_state(2, q.device, q.dtype), x=x)
    real = mask[:, None, :, None].expand_as(out)
    assert rel_diff(out[real], expected[real]) < 1e-5


def test_hybrid_delta_memory_saved_with_the_added_readout_asks_to_convert_again():
    cell = build_cell("hybrid", SPEC, {"window": 3, "memory": "delta", "sinks": 0})
    earlier = {name: value for name, value in cell.state_dict().items() if not name.startswith("reader.")}
    with pytest.raises(RnnifyError, match="convert the model again"):
        build_cell("hybrid", SPEC, {"window": 3, "memory": "delta", "sinks": 0}).load_state_dict(earlier)
