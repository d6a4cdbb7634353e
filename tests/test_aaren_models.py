"""Tiny models converted to the `aaren` target: step = prefill, a constant state, left-padded rows,
queries saved and loaded as parameters, and the mean query calibrated from what the model sees."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
)

import rnnify
from rnnify.cells import parameters


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- aaren: converted models


@pytest.fixture(scope="module")
def aaren_models(tiny_model_dir):
    """gpt2 and llama converted to aaren (chunk 5, so prefills cross chunk boundaries), random queries."""
    models = {}
    for i, arch in enumerate(("gpt2", "llama")):
        model = rnnify.convert(tiny_model_dir(arch), to="aaren", chunk_size=5)
        with torch.no_grad():
            for j, cell in enumerate(model.cells):
                cell.query.copy_(3 * torch.randn(cell.query.shape, generator=_gen(100 * i + j)))
        models[arch] = model
    return models


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_aaren_model_steps_equal_prefill_and_prefill_continues(arch, aaren_models):
    model = aaren_models[arch]
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=_gen(40))
    assert_steps_and_split_prefill_match(model, ids, 23)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_aaren_model_state_is_constant(arch, aaren_models):
    model = aaren_models[arch]
    ids = torch.randint(0, model.manifest.vocab_size, (1, 100), generator=_gen(41))
    _, short = model.prefill(ids[:, :16])
    _, long = model.prefill(ids)
    assert model.constant_memory
    assert short.nbytes == long.nbytes == model.state_nbytes(16) == model.state_nbytes(100)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_aaren_model_left_padded_rows_equal_rows_alone(arch, aaren_models):
    model = aaren_models[arch]
    assert_left_padded_rows_equal_rows_alone(model, [12, 7, 3], _gen(42), steps=1)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_aaren_model_queries_are_parameters_and_survive_save_and_load(arch, aaren_models, tmp_path):
    model = aaren_models[arch]
    queries = [cell.query for cell in model.cells]
    assert len(queries) == 2
    assert {id(p) for p in parameters(model)} == {id(q) for q in queries}
    names = [name for name in model.state_dict() if name.endswith(".query")]
    assert len(names) == 2
    model.save(tmp_path / "model")
    stored = load_file(tmp_path / "model" / "model.safetensors")
    for entry, cell in zip(model.manifest.cells, model.cells):
        (name,) = [n for n in stored if n.endswith(f"{entry.module}.query")]
        assert torch.equal(stored[name], cell.query.detach())
    loaded = rnnify.load(tmp_path / "model")
    assert loaded.target == "aaren" and [c.options() for c in loaded.cells] == [c.options() for c in model.cells]
    for a, b in zip(loaded.cells, model.cells):
        assert torch.equal(a.query, b.query)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 20), generator=_gen(43))
    want, state = model.prefill(ids)
    got, loaded_state = loaded.prefill(ids)
    assert torch.equal(got, want)
    assert torch.equal(loaded.step(ids[:, :1], loaded_state)[0], model.step(ids[:, :1], state)[0])


def test_aaren_model_calibrates_from_the_queries_it_sees(tiny_model_dir):
    """The calibration workflow: record each cell's q on a batch (forward pre-hook), then calibrate."""
    model = rnnify.convert(tiny_model_dir("llama"), to="aaren")
    seen = {}

    def record(module, args):  # args = (q, k, v, mask, *state)
        seen[module] = (args[0].clone(), args[3].clone())

    hooks = [cell.register_forward_pre_hook(record) for cell in model.cells]
    ids = torch.randint(1, model.manifest.vocab_size, (2, 12), generator=_gen(44))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    before, _ = model.prefill(ids, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    for cell in model.cells:
        q, cell_mask = seen[cell]
        assert q.shape == (2, cell.spec.num_heads, 12, cell.spec.head_dim)
        cell.calibrate(q, cell_mask)
        expected = torch.cat([q[b, :, cell_mask[b]] for b in range(2)], dim=1).mean(1)
        torch.testing.assert_close(cell.query.detach(), expected)
    after, _ = model.prefill(ids, attention_mask=mask)
    assert (after - before).abs().max() > 0
