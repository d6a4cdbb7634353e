"""LoLCATs hybrid cells (a window + sinks and a linear memory of older tokens) against float64
references (tests/window_support.py, docs/math.md §Hybrid window and linear): every form equals the
naive loop and the naive loop the reference; the cell's chunks and steps equal one call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import (
    random_qkv,
)
from window_support import (
    ATOL,
    BF16_TOL,
    CELL_DRAWS,
    CELL_HYPOTHESIS,
    CPU,
    HYPOTHESIS,
    RTOL,
    assert_forms_agree,
    check_cell,
    form_inputs,
    garbage_buffers,
    grouped_queries,
    make_spec,
    mask_of_kind,
    reference_gated_hybrid_attention,
    reference_hybrid_attention,
    reference_linear_state,
    reference_window_attention,
    seeded,
    step_loop,
    window_problems,
)

from rnnify.cells import build_cell
from rnnify.cells.hybrid import HybridCell
from rnnify.cells.hybrid_window import (
    chunked_window_and_leaving,
    prompt_window_and_leaving,
)
from rnnify.cells.linear import FEATURE_MAPS, build_feature_map
from rnnify.cells.linear_memory import (
    chunk_hybrid_attn,
    fused_hybrid_attn,
    naive_recurrent_hybrid_attn,
    parallel_hybrid_attn,
    step_hybrid_attn,
)
from rnnify.errors import RnnifyError


@pytest.mark.parametrize(
    "options, message",
    [
        ({"window": 0}, "window must be a positive integer"),
        ({"chunk_size": 0}, "chunk_size must be"),
        ({"feature_map": "cosine"}, "unknown feature map 'cosine'"),
        ({"feature_options": [1]}, "feature_options must be a dict"),
        ({"feature_options": {"bogus": 1}}, "bogus"),
        ({"sinks": -1}, "sinks must be an integer >= 0"),
        ({"sinks": 1.5}, "sinks must be an integer"),
    ],
)
def test_hybrid_cell_rejects_bad_options(options, message):
    with pytest.raises(RnnifyError, match=message):
        build_cell("hybrid", make_spec(), options)


# --------------------------------------------------------------------------- hybrid: the forms


@st.composite
def hybrid_problems(draw):
    return {**draw(window_problems()), "sinks": draw(st.sampled_from([0, 1, 3]))}


# the forms' state: the cell's, with (empty, when the cell has no sinks) sink buffers after the ring
FORM_STATE = ("keys", "values", "sink_keys", "sink_values", "length", "kv", "k_sum")


def _form_state(cell, state):
    if cell.sinks:
        return state
    keys, values, *rest = state
    return (keys, values, keys[:, :, :0], values[:, :, :0], *rest)


def _factor(spec, gen):
    return torch.sigmoid(2 * torch.randn(spec.num_heads, generator=gen))


@HYPOTHESIS
@given(hybrid_problems())
def test_hybrid_forms_equal_the_naive_loop_and_the_reference(p):
    spec = make_spec(p["num_kv_heads"], p["group"], p["head_dim"], p["value_dim"])
    cell = HybridCell(spec, window=p["window"], sinks=p["sinks"], feature_map="elu")
    q, k, v, mask, state = form_inputs(p, cell)
    state = _form_state(cell, state)
    factor = _factor(spec, seeded(p["seed"] + 1))
    gate = torch.rand(spec.num_heads, generator=seeded(p["seed"] + 2))
    P, scale, phi = p["prefix"], spec.scale, cell.phi
    grouped = (spec.num_kv_heads, spec.group_size)
    fixed = {"phi": phi, "factor": factor.reshape(grouped), "scale": scale, "gate": gate.reshape(grouped)}
    gq = grouped_queries(q, spec)
    if P:
        _, *state = naive_recurrent_hybrid_attn(gq[:, :, :, :P], k[:, :, :P], v[:, :, :P], mask[:, :P], *state, **fixed)
    args = (gq[:, :, :, P:], k[:, :, P:], v[:, :, P:], mask[:, P:])
    before = [t.clone() for t in (*args, *state)]

    want, *want_state = naive_recurrent_hybrid_attn(*args, *state, **fixed)
    ref = reference_gated_hybrid_attention(q, k, v, mask, p["window"], factor, gate, scale, sinks=p["sinks"])
    ref = ref[:, :, P:]
    real = mask[:, None, P:, None].expand_as(ref)
    torch.testing.assert_close(want.reshape(ref.shape).double()[real], ref[real], rtol=RTOL, atol=ATOL)
    real = real.reshape(want.shape)  # the same, grouped per kv head
    ref_kv, ref_z = reference_linear_state(k, v, mask, p["window"], sinks=p["sinks"])
    torch.testing.assert_close(want_state[5].double(), ref_kv, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(want_state[6].double(), ref_z, rtol=RTOL, atol=ATOL)

    forms = {
        "parallel": lambda: parallel_hybrid_attn(*args, *state, **fixed),
        "chunk": lambda: chunk_hybrid_attn(*args, *state, **fixed, chunk_size=p["chunk"]),
        "step_loop": lambda: step_loop(step_hybrid_attn, *args, *state, **fixed),
    }
    assert_forms_agree(forms, want, want_state, real, FORM_STATE)
    assert all(torch.equal(a, b) for a, b in zip(before, (*args, *state)))


@pytest.mark.parametrize(
    "window, sinks, length",
    [(3, 0, 1), (3, 2, 4), (3, 2, 5), (3, 2, 6), (4, 1, 23), (8, 0, 30), (2, 3, 17), (64, 0, 70)],
)
def test_whole_prompt_off_kernels_equals_the_naive_loop(window, sinks, length):
    """``fused_hybrid_attn`` off kernels on a whole unpadded prompt (``prompt_hybrid_attn``: the window
    part of all blocks at once, the memory read without the shift) gives the naive loop's output and
    state, prompts shorter than W + S included."""
    spec = make_spec(2, 2, 8, 6)
    cell = HybridCell(spec, window=window, sinks=sinks, feature_map="elu")
    gen = seeded(length)
    q, k, v = random_qkv(2, spec, length, gen)
    mask = torch.ones(2, length, dtype=torch.bool)
    state = _form_state(cell, garbage_buffers(cell, cell.init_state(2, CPU, torch.float32), gen))
    grouped = (spec.num_kv_heads, spec.group_size)
    gate = torch.rand(spec.num_heads, generator=gen).reshape(grouped)
    fixed = {"phi": cell.phi, "factor": _factor(spec, gen).reshape(grouped), "scale": spec.scale, "gate": gate}
    want, *want_state = naive_recurrent_hybrid_attn(grouped_queries(q, spec), k, v, mask, *state, **fixed)
    got, *got_state = fused_hybrid_attn(
        grouped_queries(q, spec), k, v, mask, *state, **fixed, chunk_size=cell.chunk_size, backend=None
    )
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for name, a, b in zip(FORM_STATE, got_state, want_state):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=name)


@HYPOTHESIS
@given(
    window=st.integers(1, 12),
    sinks=st.integers(0, 5),
    length=st.integers(2, 40),
    block=st.sampled_from([1, 3, 16, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_whole_prompt_window_part_equals_the_chunked_one(window, sinks, length, block, dtype, seed):
    """A whole unpadded prompt from the empty state: the window part of all query blocks at once, the
    leaving tokens shifted by W and the state written from the tail equal the general, chunked path
    (prompts shorter than the window or the sinks, any block size, a bf16 ring, junk in the buffers)."""
    gen, spec = seeded(seed), make_spec(num_kv_heads=2, group=2, head_dim=4, value_dim=3)
    q, k, v = random_qkv(2, spec, length, gen)
    cell = HybridCell(spec, window=window, sinks=sinks, feature_map="elu")
    state = garbage_buffers(cell, cell.init_state(2, CPU, dtype), gen)
    state = tuple(t.to(dtype) if t.is_floating_point() else t for t in _form_state(cell, state)[:5])
    args = (grouped_queries(q, spec), k, v)
    factor = _factor(spec, gen).reshape(2, 2)
    fast = prompt_window_and_leaving(*args, state, factor, spec.scale, block)
    general = chunked_window_and_leaving(
        *args, torch.ones(2, length, dtype=torch.bool), state, factor, spec.scale, 5, None
    )
    for a, b in zip(fast[:5], general[:5]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert all(torch.equal(a, b) for a, b in zip(fast[5], general[5]))


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
def test_hybrid_forms_agree_for_every_feature_map(feature_map):
    """Whatever phi is (trained, random or fixed), the four forms compute the same thing."""
    torch.manual_seed(0)  # feature maps with random weights
    spec = make_spec(num_kv_heads=2, group=2, head_dim=4)
    phi = build_feature_map(feature_map, spec)
    for seed, window, sinks, chunk in ((0, 3, 0, 4), (1, 1, 0, 64), (2, 3, 2, 5)):
        gen = seeded(seed)
        q, k, v = random_qkv(2, spec, 19, gen)
        mask = mask_of_kind("left", 2, 19, gen)
        cell = HybridCell(spec, window=window, sinks=sinks, feature_map="elu")
        init = _form_state(cell, cell.init_state(2, CPU, torch.float32))
        init = (*init[:5], torch.zeros(2, 2, phi.feature_dim, 4), torch.zeros(2, 2, phi.feature_dim))
        fixed = {"phi": phi, "factor": _factor(spec, gen).reshape(2, 2), "scale": spec.scale}
        with torch.no_grad():
            args = (grouped_queries(q, spec), k, v, mask, *init)
            want, *want_state = naive_recurrent_hybrid_attn(*args, **fixed)
            for name, (out, *state) in {
                "parallel": parallel_hybrid_attn(*args, **fixed),
                "chunk": chunk_hybrid_attn(*args, **fixed, chunk_size=chunk),
                "step_loop": step_loop(step_hybrid_attn, *args, **fixed),
            }.items():
                assert torch.isfinite(out).all(), name
                torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
                for a, b in zip(state, want_state):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


# --------------------------------------------------------------------------- hybrid: the cell


@CELL_HYPOTHESIS
@given(**CELL_DRAWS, sinks=st.sampled_from([0, 1, 3]), chunk_size=st.sampled_from([1, 3, 64]))
def test_hybrid_cell_chunked_and_stepped_equal_one_shot_and_reference(
    window, sinks, length, splits, chunk_size, group, left_pad, seed
):
    gen = seeded(seed)
    cell = HybridCell(make_spec(group=group), window=window, sinks=sinks, chunk_size=chunk_size, feature_map="elu")
    with torch.no_grad():
        cell.window_logit.copy_(2 * torch.randn(cell.spec.num_heads, generator=gen))
        cell.memory_gate.copy_(torch.rand(cell.spec.num_heads, generator=gen))

    def reference(q, k, v, mask):
        factor = torch.sigmoid(cell.window_logit)
        return reference_gated_hybrid_attention(
            q, k, v, mask, window, factor, cell.memory_gate, cell.spec.scale, sinks=sinks
        )

    check_cell(cell, reference, length, splits, left_pad, gen)
    assert len(cell.state_names) == (7 if sinks else 5)


@pytest.mark.parametrize("window", [30, 31, 100])
def test_hybrid_with_a_window_covering_everything_is_softmax_attention(window):
    gen = seeded(6)
    cell = HybridCell(make_spec(num_kv_heads=2, group=2), window=window, chunk_size=7, feature_map="elu", sinks=0)
    with torch.no_grad():
        cell.window_logit.copy_(torch.randn(4, generator=gen))  # f_h cancels out
        spec = cell.spec
        q, k, v = random_qkv(2, spec, 30, gen)
        mask = torch.ones(2, 30, dtype=torch.bool)
        init = cell.init_state(2, CPU, torch.float32)
        softmax = reference_window_attention(q, k, v, mask, window=10**9, sinks=0, scale=spec.scale)
        out, *_ = cell(q, k, v, mask, *init)
        torch.testing.assert_close(out.double(), softmax, rtol=RTOL, atol=ATOL)
        state, outs = init, []
        for t in range(30):
            o, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs, dim=2).double(), softmax, rtol=RTOL, atol=ATOL)
        assert not state[3].any() and not state[4].any()  # nothing has left the window


def test_hybrid_cell_bf16_inputs_keep_an_fp32_linear_state():
    gen = seeded(7)
    cell = HybridCell(make_spec(), window=4, chunk_size=3, memory_init=1.0, feature_map="elu", sinks=0)
    spec = cell.spec
    q, k, v = random_qkv(2, spec, 30, gen, dtype=torch.bfloat16)
    mask = torch.ones(2, 30, dtype=torch.bool)
    with torch.no_grad():
        init = cell.init_state(2, CPU, torch.bfloat16)
        assert [t.dtype for t in init] == [torch.bfloat16, torch.bfloat16, torch.long, torch.float32, torch.float32]
        out, *state = cell(q[:, :, :12], k[:, :, :12], v[:, :, :12], mask[:, :12], *init)
        outs = [out]
        for t in range(12, 30):
            out, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
            outs.append(out)
    out = torch.cat(outs, dim=2)
    assert out.dtype == torch.bfloat16
    ref = reference_hybrid_attention(q, k, v, mask, 4, torch.full((spec.num_heads,), 0.5), spec.scale)
    torch.testing.assert_close(out.double(), ref, rtol=BF16_TOL, atol=BF16_TOL)
    # the linear state is accumulated in fp32 from exactly representable bf16 inputs
    ref_kv, ref_z = reference_linear_state(k, v, mask, 4)
    torch.testing.assert_close(state[3].double(), ref_kv, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(state[4].double(), ref_z, rtol=RTOL, atol=ATOL)


def test_hybrid_cell_parameters_train():
    cell = HybridCell(make_spec(), window=3, feature_map="elu", feature_options={}, sinks=0)
    assert isinstance(cell.window_logit, torch.nn.Parameter) and not cell.window_logit.any()  # theta = 0
    assert isinstance(cell.memory_gate, torch.nn.Parameter) and not cell.memory_gate.any()  # g = 0
    assert {"window_logit", "memory_gate"} <= set(cell.state_dict())
    assert cell.options() == {
        "window": 3,
        "sinks": 0,
        "feature_map": "elu",
        "feature_options": {},
        "chunk_size": 64,
        "memory_init": 0.0,
        "memory": "linear",
    }
    assert type(cell)(cell.spec, **cell.options()).options() == cell.options()
    gen = seeded(8)
    q, k, v = random_qkv(1, cell.spec, 12, gen)
    mask = torch.ones(1, 12, dtype=torch.bool)
    out, *_ = cell(q, k, v, mask, *cell.init_state(1, CPU, torch.float32))
    out.square().sum().backward()
    # at g = 0 only the gate itself moves the output; from there the mix and the map learn too
    assert cell.memory_gate.grad is not None and cell.memory_gate.grad.abs().sum() > 0
    assert cell.window_logit.grad.abs().max() < 1e-5  # f cancels in w / u (up to rounding)
    with torch.no_grad():
        cell.memory_gate.fill_(0.5)
    cell.zero_grad()
    out, *_ = cell(q, k, v, mask, *cell.init_state(1, CPU, torch.float32))
    out.square().sum().backward()
    assert cell.window_logit.grad.abs().sum() > 0


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0"])
def test_hybrid_memory_init_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="memory_init"):
        HybridCell(make_spec(), window=3, memory_init=bad, sinks=0)


@pytest.mark.parametrize("sinks", [0, 3])
def test_training_free_hybrid_is_its_window_alone(sinks):
    """memory_init=0 (the default): every form equals softmax over the last W tokens and the first
    S, however far back the linear memory reaches and whatever the feature map says."""
    gen = seeded(10)
    cell = HybridCell(make_spec(num_kv_heads=2, group=2), window=5, sinks=sinks, chunk_size=4, feature_map="hedgehog")
    spec = cell.spec
    q, k, v = random_qkv(2, spec, 40, gen)
    mask = mask_of_kind("left", 2, 40, gen)
    window = reference_window_attention(q, k, v, mask, window=5, sinks=sinks, scale=spec.scale)
    real = mask[:, None, :, None].expand_as(window)
    with torch.no_grad():
        out, *state = cell(q, k, v, mask, *cell.init_state(2, CPU, torch.float32))
        torch.testing.assert_close(out.double()[real], window[real], rtol=RTOL, atol=ATOL)
        assert state[-1].any()  # the memory did fill: it is only gated off
        state, outs = cell.init_state(2, CPU, torch.float32), []
        for t in range(40):
            o, *state = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], *state)
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs, 2).double()[real], window[real], rtol=RTOL, atol=ATOL)


def test_hybrid_saved_without_a_memory_gate_loads_as_the_plain_lolcats_sum():
    cell = HybridCell(make_spec(), window=3, feature_map="elu", sinks=0)
    old = {k: v for k, v in cell.state_dict().items() if k != "memory_gate"}
    fresh = HybridCell(make_spec(), window=3, feature_map="elu", sinks=0)
    fresh.load_state_dict(old, strict=True)
    assert torch.equal(fresh.memory_gate.detach(), torch.ones(fresh.spec.num_heads))


@pytest.mark.skipif("hedgehog" not in FEATURE_MAPS, reason="no hedgehog feature map registered")
def test_hybrid_hedgehog_feature_map_weights_get_gradients():
    cell = HybridCell(make_spec(), window=3, feature_map="hedgehog", sinks=0)
    trainable = list(cell.parameters())
    assert len(trainable) > 1  # window_logit and the feature map's weights
    q, k, v = random_qkv(1, cell.spec, 12, seeded(9))
    out, *_ = cell(q, k, v, torch.ones(1, 12, dtype=torch.bool), *cell.init_state(1, CPU, torch.float32))
    out.square().sum().backward()
    assert all(p.grad is not None for p in trainable)
