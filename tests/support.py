"""Helpers every kind of test shares."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import torch
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "examples" / "models" / "stdlib-llama"  # the small Llama that ships with rnnify


def load_script(path: Path):
    """The module of the script at ``path`` (an example or a benchmark), its folder importable while it loads."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def reseal(directory: Path, **changes) -> dict:
    """Change ``directory``'s manifest by ``changes`` and record the files now there, sealed as a save
    records them (``rnnify.runtime.integrity``): a directory as someone who rewrote it whole would
    leave it, or a test's edit that is not about the record. Returns the manifest written."""
    from rnnify.runtime.integrity import record
    from rnnify.runtime.manifest import MANIFEST_FILE, content_digest

    path = directory / MANIFEST_FILE
    data = {**json.loads(path.read_text()), **changes}
    data["files"] = record(
        directory, sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    )
    data["digest"] = content_digest(data)
    path.write_text(json.dumps(data))
    return data


def exact_conversions(build):
    """``get(name) -> (source, rnnify.convert(source, to="exact"))`` with ``source = build(name)``,
    each built and converted once (a module fixture returns it)."""
    import rnnify

    @functools.cache
    def get(name):
        source = build(name)
        return source, rnnify.convert(source, to="exact")

    return get


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest reference entry, in float64 (of the values: no graph kept)."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max())


def decode_from(model, ids: torch.Tensor, state):
    """Logits of one ``model.step`` per token of ``ids [B, T]`` from ``state``, and the last state."""
    outs = []
    for t in range(ids.shape[1]):
        logits, state = model.step(ids[:, t : t + 1], state)
        outs.append(logits)
    return torch.cat(outs, 1), state


def decode(model, ids: torch.Tensor, prefill_length: int, attention_mask: torch.Tensor | None = None):
    """Logits of a prefill of ``ids[:, :prefill_length]`` (with ``attention_mask``), then one step per
    remaining token, and the last state."""
    logits, state = model.prefill(ids[:, :prefill_length], attention_mask=attention_mask)
    if prefill_length == ids.shape[1]:
        return logits, state
    stepped, state = decode_from(model, ids[:, prefill_length:], state)
    return torch.cat([logits, stepped], 1), state


def assert_steps_and_split_prefill_match(
    model, ids: torch.Tensor, split: int, tol: float = 1e-4, state_tol: float = 1e-5
):
    """One step per token after a 1-token prefill, and a prefill split at ``split`` and continued
    from its state, give the one-shot prefill's logits (and, for the split, its state). Returns the
    one-shot ``(logits, state)``."""
    full, full_state = model.prefill(ids)
    assert torch.isfinite(full).all()
    assert rel_diff(decode(model, ids, 1)[0], full) < tol
    first, state = model.prefill(ids[:, :split])
    second, state = model.prefill(ids[:, split:], state)
    assert rel_diff(torch.cat([first, second], 1), full) < tol
    for a, b in zip(state.tensors, full_state.tensors):
        torch.testing.assert_close(a, b, rtol=state_tol, atol=state_tol)
    return full, full_state


def random_qkv(batch: int, spec, length: int, gen: torch.Generator, dtype: torch.dtype = torch.float32):
    """Standard normal q ``[B, H, T, d]``, k ``[B, H_kv, T, d]``, v ``[B, H_kv, T, d_v]`` for a cell of ``spec``."""
    q = torch.randn(batch, spec.num_heads, length, spec.head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, spec.num_kv_heads, length, spec.head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, spec.num_kv_heads, length, spec.value_dim, generator=gen).to(dtype)
    return q, k, v


def assert_left_padded_rows_equal_rows_alone(
    model, lengths: list[int], gen: torch.Generator, steps: int = 4, tol: float = 1e-4
):
    """A left-padded batch of rows of ``lengths``, prefilled then stepped ``steps`` tokens, gives each
    row the logits it gets alone (within ``tol``, relative)."""
    rows = [torch.randint(1, model.manifest.vocab_size, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    logits, state = model.prefill(ids, attention_mask=mask)
    next_ids = torch.randint(1, model.manifest.vocab_size, (len(rows), steps), generator=gen)
    stepped, _ = decode_from(model, next_ids, state)
    for i, row in enumerate(rows):
        alone, alone_state = model.prefill(row[None])
        assert rel_diff(logits[i, width - len(row) :], alone[0]) < tol
        alone_steps, _ = decode_from(model, next_ids[i : i + 1], alone_state)
        assert rel_diff(stepped[i], alone_steps[0]) < tol


def draw_heads(draw) -> dict:
    """Inside an ``st.composite``: batch, kv heads, query heads per kv head (group) and sizes."""
    return dict(
        batch=draw(st.integers(1, 3)),
        num_kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([4, 8, 16])),
        value_dim=draw(st.sampled_from([4, 8])),
    )


# the head shapes of draw_heads (without value_dim), as keyword strategies of ``given``
HEAD_DRAWS = dict(
    batch=st.integers(1, 3),
    num_kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8, 16]),
)


# the vocabulary, depth and attention of the tiny hybrids (a model's own recurrent layer, then attention)
# that the own-layer tests build; each adds its layer's sizes
TINY_HYBRID = dict(
    vocab_size=320, pad_token_id=0, max_position_embeddings=256,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


# a tiny Mixtral: one layer of four experts, two a token (``tiny_causal_lm("mixtral", **TINY_MIXTRAL)``)
TINY_MIXTRAL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
)  # fmt: skip


def tiny_causal_lm(model_type: str, **config):
    """A random causal LM of ``model_type`` and ``config``, the same weights every call (seed 0), in
    eval mode: the tests' tiny models, built with no hub."""
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **config)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def original_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """A Hugging Face model's logits of ``ids`` without its cache: what a conversion is held to."""
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def assert_round_trips_a_save(model, directory: Path, ids: torch.Tensor):
    """``model`` saved to ``directory`` and loaded prefills ``ids`` as ``model`` does. Returns the loaded model."""
    import rnnify

    loaded = rnnify.load(model.save(directory))
    assert rel_diff(loaded.prefill(ids)[0], model.prefill(ids)[0]) < 1e-6
    return loaded


def standard_normal(gen: torch.Generator):
    """``draw(*shape)``: a standard normal float64 tensor from ``gen``, for a recurrence's reference inputs."""
    return functools.partial(torch.randn, generator=gen, dtype=torch.float64)


def padding_mask(length: int, padding: list[int]) -> torch.Tensor:
    """Real tokens ``[len(padding), length]`` of rows each left-padded by ``padding[i]`` tokens
    (``length`` of them: a row with nothing real)."""
    return torch.arange(length)[None, :] >= torch.tensor(padding)[:, None]


def assert_outputs_and_state_close(got: tuple, want: tuple, mask: torch.Tensor, tol: float):
    """``got`` and ``want``, each a recurrence's ``(outputs [B, T, ...], last state)``, agree within
    ``tol`` in float64 at the real tokens of ``mask [B, T]`` (what a padded token's output holds is no
    one's concern) and in the state."""
    (out, state), (want_out, want_state) = got, want
    real = mask.reshape(*mask.shape, *[1] * (out.dim() - 2))
    torch.testing.assert_close(
        torch.where(real, out.double(), 0.0), torch.where(real, want_out.double(), 0.0), rtol=tol, atol=tol
    )
    torch.testing.assert_close(state.double(), want_state.double(), rtol=tol, atol=tol)
