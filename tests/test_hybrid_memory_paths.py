"""The hybrid's gla memory against the decayed LoLCATs sum, and the hybrid's decode and prompt
paths (the lean step, the whole-prompt path) against the general one and the references;
directories saved by older versions."""

from __future__ import annotations

import math

import pytest
import torch
from delta_support import (
    SPEC,
    assert_every_phase_matches,
    assert_starts_as_window,
    delta_memory_reference,
    elu_map,
    elu_plus_one,
    make_inputs,
    rel_diff,
)
from kernel_support import nan_buffers  # noqa: F401 - autouse: NaN-filled kernel outputs

from rnnify.bench import OpCount
from rnnify.cells import build_cell, hybrid_window, linear_memory
from rnnify.cells.delta_memory import delta_memory_hybrid_attn
from rnnify.cells.gated import gla_log_gates
from rnnify.cells.hybrid import GLA_TAU
from rnnify.cells.linear_memory import chunk_hybrid_attn, fused_hybrid_attn
from rnnify.errors import RnnifyError
from rnnify.kernels import utils

# --------------------------------------------------------------------------- the hybrid's gla memory


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
