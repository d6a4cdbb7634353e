"""The `gated` target's options (rebuilt from the manifest, defaults, errors, every feature map) and
tiny models converted to it: step = prefill, left padding, a constant state, save and load,
trainable gates."""

from __future__ import annotations

import pytest
import torch
from gated_support import (
    GATES,
    HIDDEN,
    make_cell,
    qkvx,
    seeded,
    step_by_step,
)
from safetensors.torch import load_file
from support import assert_steps_and_split_prefill_match, rel_diff

import rnnify
from rnnify.cells import CELLS, CellSpec, build_cell, parameters
from rnnify.cells.gated import GatedCell
from rnnify.cells.linear import FEATURE_MAPS
from rnnify.errors import RnnifyError

# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("gate", GATES)
def test_options_rebuild_the_cell(gate):
    cell = make_cell(gate, chunk_size=3, normalize=False)
    options = cell.options()
    assert options["gate"] == gate and options["normalize"] is False and options["chunk_size"] == 3
    rebuilt = type(cell)(cell.spec, **options)
    rebuilt.load_state_dict(cell.state_dict(), strict=True)
    rebuilt_by_name = build_cell("gated", cell.spec, options)
    assert rebuilt_by_name.options() == options
    q, k, v, x = qkvx(cell, 1, 6, seeded(12))
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
    cell = make_cell("gateloop")
    q, k, v, _ = qkvx(cell, 1, 3, seeded(13))
    with pytest.raises(ValueError, match="needs the layer input"):
        cell(q, k, v, torch.ones(1, 3, dtype=torch.bool), *cell.init_state(1, torch.device("cpu"), torch.float32))


@pytest.mark.parametrize("feature_map", sorted(FEATURE_MAPS))
def test_every_feature_map_works_in_every_form(feature_map):
    """Any map of linear.py (with its own options, defaults resolved): prefill (chunked) equals
    token-by-token decode (step), the options rebuild the cell, the map's weights are trainable
    parameters of the cell when it has any."""
    normalize = feature_map != "identity"  # identity features can make phi(q) . z vanish
    gen = seeded(22)
    cell = make_cell("gla", chunk_size=3, normalize=normalize, feature_map=feature_map)
    q, k, v, x = qkvx(cell, 2, 11, gen)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = False
    init = cell.init_state(2, torch.device("cpu"), torch.float32)
    assert init[0].shape == (2, 2, cell.phi.feature_dim, 8)
    one_shot, *final = cell(q, k, v, mask, *init, x=x)
    stepped, state = step_by_step(cell, q, k, v, mask, x, init)
    assert torch.isfinite(one_shot).all()
    torch.testing.assert_close(stepped[0], one_shot[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stepped[1, :, 3:], one_shot[1, :, 3:], rtol=1e-4, atol=1e-5)
    for a, b in zip(state, final):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rebuilt = GatedCell(cell.spec, **cell.options())
    rebuilt.load_state_dict(cell.state_dict(), strict=True)
    assert torch.equal(rebuilt(q, k, v, mask, *init, x=x)[0], one_shot)
    assert {id(p) for p in cell.phi.parameters()} <= {id(p) for p in parameters(cell)}


# --------------------------------------------------------------------------- converted models


@pytest.fixture(scope="module")
def gated_model(tiny_model_dir):
    """``gated_model(arch, gate)`` -> a converted model; trainable gates randomised to vary with x."""
    built = {}

    def get(arch: str, gate: str):
        if (arch, gate) not in built:
            model = rnnify.convert(tiny_model_dir(arch), to="gated", gate=gate, chunk_size=8)
            gen = seeded(16)
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
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=seeded(17))
    assert_steps_and_split_prefill_match(model, ids, 23)


@pytest.mark.parametrize("arch, gate", ARCH_GATES)
def test_converted_left_padding_matches_unpadded(arch, gate, gated_model):
    model = gated_model(arch, gate)
    ids = torch.randint(1, model.manifest.vocab_size, (2, 30), generator=seeded(18))
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
    ids = torch.randint(0, model.manifest.vocab_size, (1, 100), generator=seeded(19))
    _, short = model.prefill(ids[:, :16])
    _, long = model.prefill(ids)
    assert short.nbytes == long.nbytes == model.state_nbytes(16) == model.state_nbytes(100)


@pytest.mark.parametrize("arch, gate", ARCH_GATES)
def test_converted_save_and_load_give_identical_logits(arch, gate, gated_model, tmp_path):
    model = gated_model(arch, gate)
    model.save(tmp_path / "model")
    loaded = rnnify.load(tmp_path / "model")
    ids = torch.randint(0, model.manifest.vocab_size, (2, 20), generator=seeded(20))
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
    ids = torch.randint(0, model.manifest.vocab_size, (2, 24), generator=seeded(21))
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
