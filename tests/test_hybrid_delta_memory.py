"""The hybrid's delta-rule memories (delta, gated-delta): a window + sinks blended with what the
memory reads, against float64 references written here: the readout blend, the share by mass and
the annealed share."""

from __future__ import annotations

import pytest
import torch
from delta_support import (
    SPEC,
    anneal_scale,
    assert_every_phase_matches,
    assert_starts_as_window,
    delta_memory_reference,
    delta_write,
    elu_plus_one,
    make_inputs,
    rel_diff,
)
from kernel_support import nan_buffers  # noqa: F401 - autouse: NaN-filled kernel outputs

from rnnify.cells import build_cell
from rnnify.cells.delta_memory import mass_share
from rnnify.errors import RnnifyError

# --------------------------------------------------------------------------- the hybrid's delta memory


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
