"""The gated-RNN target (Zucchet et al.'s construction, docs/math.md §Gated linear RNN) against the
float64 references of tests/linear_support.py, and tiny models converted to linear and gated-RNN
targets: the gated RNN equals unnormalised identity linear attention, every target keeps the
converted-model contract, trainable maps are saved and trained."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from linear_support import (
    CPU,
    HYPOTHESIS,
    cell_problems,
    close,
    make_spec,
    one_thread,  # noqa: F401 - an autouse fixture
    problem_inputs,
    reference_gated_rnn,
    seeded,
)
from safetensors.torch import load_file
from support import assert_steps_and_split_prefill_match, decode, random_qkv, rel_diff

import rnnify
from rnnify.cells import CELLS, CellSpec, build_cell, parameters
from rnnify.cells.gated_rnn import (
    GatedRNNCell,
    chunk_gated_rnn,
    gate_inputs,
    input_gate,
    naive_recurrent_gated_rnn,
    parallel_gated_rnn,
    step_gated_rnn,
)
from rnnify.errors import RnnifyError

# --------------------------------------------------------------------------- gated RNN


def test_gated_rnn_neurons_follow_the_construction():
    """d^2 kv neurons (lambda = decay, input v_i k_j) and d query neurons (lambda = 0, input q_j)."""
    spec = CellSpec(2, 1, 3, 3, 0.5)  # 2 query heads on one kv head: G = 2
    cell = GatedRNNCell(spec, decay=0.75)
    assert cell.neurons_per_head == 3 * 3 + 2 * 3
    assert GatedRNNCell(CellSpec(4, 4, 8, 8, 0.3)).neurons_per_head == 8**2 + 8  # d^2 + d without GQA
    net = cell.neurons
    assert net.lam.tolist() == [0.75] * 9 + [0.0] * 6
    gen = seeded(12)
    q = torch.randn(1, 1, 2, 1, 3, generator=gen)  # [B, Hkv, G, T, d]
    k, v = torch.randn(1, 1, 1, 3, generator=gen), torch.randn(1, 1, 1, 3, generator=gen)
    u = input_gate(gate_inputs(q, k, v), net)[0, 0, 0]
    expected = [v[0, 0, 0, i] * k[0, 0, 0, j] for i in range(3) for j in range(3)]
    expected += [q[0, 0, g, 0, j] for g in range(2) for j in range(3)]
    torch.testing.assert_close(u, torch.stack(expected))
    # the output gate: y_g,i = sum_j kv(i, j) * query(g, j)
    h = torch.randn(1, 1, 15, generator=gen)
    out, _ = step_gated_rnn(torch.zeros(1, 1, 1, 3 + 6 + 3 + 1), torch.zeros(1, 1, dtype=torch.bool), h, net)
    S, Q = h[0, 0, :9].reshape(3, 3), h[0, 0, 9:].reshape(2, 3)
    torch.testing.assert_close(out[0, 0, :, 0], Q @ S.T)


@HYPOTHESIS
@given(p=cell_problems(), decay=st.sampled_from([1.0, 0.9, 0.5, 0.0]))
def test_gated_rnn_forms_match_float64_reference(p, decay):
    spec = make_spec(p["num_kv_heads"], p["group"], p["head_dim"], p["value_dim"])
    cell = GatedRNNCell(spec, decay=decay, chunk_size=p["chunk_size"])
    q, k, v, mask, (h0,) = problem_inputs(cell, p)
    h0 = h0 + 0.1 * torch.randn(h0.shape, generator=seeded(p["seed"] + 1))  # any state, query neurons too
    ref_out, ref_h = reference_gated_rnn(q, k, v, mask, h0, decay)
    real = mask[:, None, :, None].expand_as(ref_out)

    out, h = cell(q, k, v, mask, h0)
    assert out.shape == ref_out.shape and h.shape == h0.shape and h.dtype == torch.float32
    close(torch.where(real, out, 0), torch.where(real, ref_out, 0))
    close(h, ref_h)
    steps, hs = [], h0
    for t in range(q.shape[2]):
        o, hs = cell(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], mask[:, t : t + 1], hs)
        steps.append(o)
    close(torch.where(real, torch.cat(steps, 2), 0), torch.where(real, ref_out, 0))
    close(hs, ref_h)

    batch, length = q.shape[0], q.shape[2]
    z = gate_inputs(q.reshape(batch, spec.num_kv_heads, spec.group_size, length, -1), k, v)
    real5 = mask[:, None, None, :, None]
    ref5 = ref_out.reshape(batch, spec.num_kv_heads, spec.group_size, length, -1)
    for name, form in {
        "naive": naive_recurrent_gated_rnn,
        "parallel": parallel_gated_rnn,
        "chunk": lambda *a: chunk_gated_rnn(*a, chunk_size=p["chunk_size"]),
    }.items():
        got, got_h = form(z, mask, h0, cell.neurons)
        close(torch.where(real5, got, 0), torch.where(real5, ref5, 0), msg=name)
        close(got_h, ref_h, msg=name)


def test_gated_rnn_padding_does_not_change_the_state():
    cell = GatedRNNCell(make_spec(), decay=0.9, chunk_size=3)
    gen = seeded(13)
    q, k, v = random_qkv(2, cell.spec, 7, gen)
    _, h = cell(q, k, v, torch.ones(2, 7, dtype=torch.bool), *cell.init_state(2, CPU, torch.float32))
    pq, pk, pv = (100 * x for x in random_qkv(2, cell.spec, 4, gen))
    padding = torch.zeros(2, 4, dtype=torch.bool)
    out, after = cell(pq, pk, pv, padding, h)
    assert torch.equal(after, h) and torch.isfinite(out).all()
    out, after = cell(pq[:, :, :1], pk[:, :, :1], pv[:, :, :1], padding[:, :1], h)
    assert torch.equal(after, h) and torch.isfinite(out).all()


def test_gated_rnn_bf16_inputs_keep_an_fp32_state():
    cell = GatedRNNCell(make_spec(), decay=0.9, chunk_size=3)
    q, k, v = random_qkv(2, cell.spec, 10, seeded(14), dtype=torch.bfloat16)
    mask = torch.ones(2, 10, dtype=torch.bool)
    (h0,) = cell.init_state(2, CPU, torch.bfloat16)
    out, h = cell(q, k, v, mask, h0)
    assert h0.dtype == h.dtype == torch.float32 and out.dtype == torch.bfloat16
    ref_out, ref_h = reference_gated_rnn(q, k, v, mask, h0, 0.9)
    close(h, ref_h)
    close(out, ref_out, tol=2**-7)


def test_gated_rnn_options_state_and_errors():
    spec = make_spec(num_kv_heads=3, group=2, head_dim=4, value_dim=6)
    cell = build_cell("gated-rnn", spec, {"decay": 0.95, "chunk_size": 7})
    assert isinstance(cell, GatedRNNCell) and CELLS["gated-rnn"] is GatedRNNCell
    again = build_cell("gated-rnn", spec, json.loads(json.dumps(cell.options())))
    assert again.options() == cell.options() == {"decay": 0.95, "chunk_size": 7}
    assert cell.state_names == ("h",) and cell.neurons_per_head == 4 * 6 + 2 * 4
    assert cell.state_nbytes(1) == cell.state_nbytes(10**6) == 3 * (4 * 6 + 2 * 4) * 4
    assert list(cell.parameters()) == [] and cell.state_dict() == {}  # the construction is rebuilt, not saved
    bad_options = (
        ({"decay": 1.5}, "decay must be"),
        ({"decay": -0.1}, "decay must"),
        ({"chunk_size": 0}, "chunk_size"),
    )
    for bad, match in bad_options:
        with pytest.raises(RnnifyError, match=match):
            build_cell("gated-rnn", spec, bad)


# --------------------------------------------------------------------------- converted models


def _ids(model, batch, length, seed):
    return torch.randint(0, model.manifest.vocab_size, (batch, length), generator=seeded(seed))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gated_rnn_model_equals_unnormalised_identity_linear(arch, tiny_model_dir):
    """The must-have: the gated RNN construction IS linear attention, layer for layer, to 1e-5."""
    path = tiny_model_dir(arch)
    grnn = rnnify.convert(path, to="gated-rnn")
    lin = rnnify.convert(path, to="linear", feature_map="identity", normalize=False)
    ids = _ids(grnn, 2, 30, 20)
    a, state_a = grnn.prefill(ids)
    b, state_b = lin.prefill(ids)
    assert rel_diff(a, b) < 1e-5
    a, state_a = decode(grnn, ids, 10)
    b, state_b = decode(lin, ids, 10)
    assert rel_diff(a, b) < 1e-5
    # and the states hold the same numbers: kv neuron (i, j) is S[j, i] of linear attention
    for cell, h, kv in zip(grnn.cells, state_a.tensors, state_b.tensors):
        dk, dv = cell.spec.head_dim, cell.spec.value_dim
        close(h[..., : dk * dv].reshape(*h.shape[:2], dv, dk), kv.transpose(-1, -2))


MODEL_CONFIGS = {
    "performer": ("linear", {"feature_map": "performer", "feature_options": {"num_features": 24, "seed": 1}}),
    "taylor": ("linear", {"feature_map": "taylor"}),
    "hedgehog": ("linear", {"feature_map": "hedgehog"}),
    "t2r-unnormalised": ("linear", {"feature_map": "t2r", "normalize": False}),
    "gated-rnn-decay": ("gated-rnn", {"decay": 0.95, "chunk_size": 16}),
}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("config", list(MODEL_CONFIGS))
def test_converted_model_contract(arch, config, tiny_model_dir, tmp_path):
    target, options = MODEL_CONFIGS[config]
    model = rnnify.convert(tiny_model_dir(arch), to=target, **options)
    with torch.no_grad():  # trained-looking maps, so save/load must carry the real values
        for p in parameters(model):
            p.add_(0.2 * torch.randn(p.shape, generator=seeded(21)))
    ids = _ids(model, 2, 100, 22)

    full, _ = assert_steps_and_split_prefill_match(model, ids[:, :40], 17, state_tol=1e-4)

    _, short = model.prefill(ids[:, :16])
    _, long = model.prefill(ids)
    assert short.nbytes == long.nbytes == model.state_nbytes(16, 2) == model.state_nbytes(100, 2)

    model.save(tmp_path / "model")
    loaded = rnnify.load(tmp_path / "model")
    assert [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    assert torch.equal(loaded.prefill(ids[:, :40])[0], full)


@pytest.mark.parametrize("name", ["hedgehog", "t2r"])
def test_trainable_maps_are_model_parameters_saved_and_trained(name, tiny_model_dir, tmp_path):
    model = rnnify.convert(tiny_model_dir("llama"), to="linear", feature_map=name)
    params = list(parameters(model))
    per_cell = 1 if name == "hedgehog" else 2
    assert len(params) == per_cell * len(model.cells) and all(p.requires_grad for p in params)
    names = {n for n, p in model.graph.named_parameters() if any(p is q for q in params)}
    assert all(".phi." in n for n in names)
    model.save(tmp_path / "m")
    saved = load_file(tmp_path / "m" / "model.safetensors")
    assert names <= set(saved)

    # a few SGD steps through the whole graph, next-token loss, only the feature maps move. The
    # tiny random model's q and k are small (init std 0.02), so softmax(x W) is nearly uniform and
    # its gradients tiny (~1e-5): hence the large learning rate.
    ids = _ids(model, 2, 24, 23)
    with torch.no_grad():
        before = model.prefill(ids)[0]
    opt = torch.optim.SGD(params, lr=100.0)
    losses = []
    for _ in range(4):
        logits, _ = model(ids, model.init_state(2))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    with torch.no_grad():
        after = model.prefill(ids)[0]
    assert rel_diff(after, before) > 1e-5
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
