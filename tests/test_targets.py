"""Every registered target, converted from tiny GPT-2 and Llama: its step form equals its parallel
form, prefill continues from a state, the state is constant (except `exact`), and it saves."""

from __future__ import annotations

import pytest
import torch
from support import assert_steps_and_split_prefill_match

import rnnify
from rnnify.cells import CELLS

# Options per target variant; every registered target must appear here (see the last test).
VARIANTS = {
    "exact": {},
    "linear": {},
    "linear-relu": {"feature_map": "relu"},
    "linear-performer": {"feature_map": "performer"},
    "linear-taylor": {"feature_map": "taylor"},
    "linear-hedgehog": {"feature_map": "hedgehog"},
    "linear-t2r": {"feature_map": "t2r"},
    "window": {"window": 8, "sinks": 2},
    "hybrid": {"window": 8},
    "hybrid-hedgehog": {"window": 8, "feature_map": "hedgehog"},
    "gated-retnet": {"gate": "retnet"},
    "gated-gla": {"gate": "gla"},
    "gated-gateloop": {"gate": "gateloop"},
    "gated-rnn": {},
    "aaren": {},
    "hybrid-deltamemory": {"window": 8, "memory": "gated-delta", "memory_init": 0.5},
    "hybrid-deltamass": {"window": 8, "memory": "delta", "share": "mass-input", "anneal": 4.0, "memory_init": 0.5},
    "delta": {},
    "gated-delta": {},
    "select": {"window": 8, "keep": 4, "chunk": 4},
    "select-snapkv": {"window": 8, "keep": 4, "chunk": 4, "policy": "snapkv", "pool": 3},
    "lola": {"window": 8, "keep": 4, "chunk": 4, "memory_init": 0.5},
}


def target_of(variant: str) -> str:
    return variant if variant in CELLS else variant.rsplit("-", 1)[0]


@pytest.fixture(scope="module")
def converted(tiny_model_dir):
    cache = {}

    def get(arch: str, variant: str):
        if (arch, variant) not in cache:
            cache[arch, variant] = rnnify.convert(tiny_model_dir(arch), to=target_of(variant), **VARIANTS[variant])
        return cache[arch, variant]

    return get


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_target_forms_agree_and_state_is_constant(arch, variant, converted, tmp_path):
    if target_of(variant) not in CELLS:
        pytest.fail(f"target {target_of(variant)!r} is not registered")
    model = converted(arch, variant)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    full, full_state = assert_steps_and_split_prefill_match(model, ids, 17)

    _, short = model.prefill(ids[:, :16])
    if variant == "exact":
        assert full_state.nbytes > short.nbytes
    else:
        assert full_state.nbytes == short.nbytes == model.state_nbytes(40, batch_size=2)

    model.save(tmp_path / "m")
    assert torch.equal(rnnify.load(tmp_path / "m").prefill(ids)[0], full)


def test_every_registered_target_is_covered():
    assert set(CELLS) <= {target_of(v) for v in VARIANTS}
