"""Converted models against independent references: the original HF model, and their own forms."""

from __future__ import annotations

import pytest
import torch
from support import assert_left_padded_rows_equal_rows_alone, decode, rel_diff
from transformers import AutoModelForCausalLM

import rnnify


def original(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_exact_equals_original(arch, tiny_model_dir, converted_dir):
    """prefill(16) + 32 steps, batch 2, against the original's full forward (eager attention)."""
    model = rnnify.load(converted_dir(arch, "exact"))
    ids = torch.randint(0, model.manifest.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(tiny_model_dir(arch))(input_ids=ids).logits
    got, _ = decode(model, ids, 16)
    assert rel_diff(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_exact_respects_the_models_sliding_window(tiny_model_dir):
    """Mistral with sliding_window=16: the window is the model's, so `exact` stays exact (64+ tokens)."""
    path = tiny_model_dir("mistral")
    model = rnnify.convert(path, to="exact")
    assert all(cell.spec.window == 16 for cell in model.cells)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = original(path)(input_ids=ids).logits
    got, state = decode(model, ids, 8)
    assert rel_diff(got, expected) < 1e-4
    assert state.nbytes == decode(model, ids[:, :40], 8)[1].nbytes  # bounded by the window


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("target", ["exact", "linear"])
def test_step_equals_prefill_and_prefill_continues(arch, target, converted_dir):
    model = rnnify.load(converted_dir(arch, target))
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    full, full_state = model.prefill(ids)
    stepped, _ = decode(model, ids, 1)
    assert rel_diff(stepped, full) < 1e-4
    first, state = model.prefill(ids[:, :23])
    second, state = model.prefill(ids[:, 23:], state)
    assert rel_diff(torch.cat([first, second], 1), full) < 1e-4
    for a, b in zip(state.tensors, full_state.tensors):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_linear_state_is_constant(converted_dir):
    """Llama (rotary) decodes past max_position_embeddings=128 with one warning, state unchanged."""
    model = rnnify.load(converted_dir("llama", "linear"))
    ids = torch.randint(0, model.manifest.vocab_size, (1, 1024), generator=torch.Generator().manual_seed(4))
    _, short = model.prefill(ids[:, :16])
    with pytest.warns(UserWarning, match="max_position_embeddings") as record:
        _, long = model.prefill(ids)
        model.step(ids[:, :1], long)
    assert len(record) == 1
    assert short.nbytes == long.nbytes == model.state_nbytes(16) == model.state_nbytes(1024)


def test_exact_state_grows(converted_dir):
    model = rnnify.load(converted_dir("llama", "exact"))
    ids = torch.zeros(1, 64, dtype=torch.long)
    _, short = model.prefill(ids[:, :16])
    _, long = model.prefill(ids)
    assert long.nbytes > short.nbytes
    assert long.nbytes == model.state_nbytes(64)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("target", ["exact", "linear"])
def test_left_padded_rows_equal_rows_alone(arch, target, converted_dir):
    model = rnnify.load(converted_dir(arch, target))
    assert_left_padded_rows_equal_rows_alone(model, [12, 7, 3], torch.Generator().manual_seed(5))


def test_greedy_generate_equals_transformers(tiny_model_dir, converted_dir):
    """Same tokens as transformers' generate with its KV cache, for a left-padded batch."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    model = rnnify.load(converted_dir("llama", "exact"))
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    got = model.generate(ids, 12, attention_mask=mask)
    assert torch.equal(got, expected)


def test_sampling_is_seeded_and_eos_stops(converted_dir):
    model = rnnify.load(converted_dir("llama", "linear"))
    ids = torch.tensor([[5, 6, 7]])
    kwargs = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    a = model.generate(ids, 16, seed=7, **kwargs)
    assert torch.equal(a, model.generate(ids, 16, seed=7, **kwargs))
    eos = int(a[0, 4])
    stopped = model.generate(ids, 16, seed=7, eos_token_id=eos, **kwargs)
    assert stopped.shape[1] <= 5 and int(stopped[0, -1]) == eos
