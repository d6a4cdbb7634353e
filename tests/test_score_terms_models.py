"""Score terms (docs/math.md §Score terms) wherever a layer's attention is computed again: the
reference softmax of attention transfer and ``rnnify eval``'s per-layer errors
(``rnnify.original.attention``), the per-head maps of ``heads(...)`` and ``--to auto``
(``rnnify.cells.heads``), and a Falcon-RW model saved and loaded. Tiny Gemma 2 (softcap), gpt-oss
(learned sinks) and Bloom (ALiBi) of tests/test_biases.py, held to the original Hugging Face model
(the reference is, through teacher forcing, the original's logits) and to the whole-layer cells."""

from __future__ import annotations

import pytest
import torch
from support import decode, rel_diff
from test_biases import PROMPT, VOCAB, _ids, _load, _logits, source_dir  # noqa: F401 - source_dir: a fixture
from test_score_terms import TERMS, problem, reference, spec_with

import rnnify
from rnnify.auto import auto_convert
from rnnify.cells import CellSpec, HeadSplitCell, build_cell
from rnnify.cells.base import SCORE_TERMS
from rnnify.cells.heads import query_heads
from rnnify.original import attention_transfer, softmax_attention

MODELS = ["gemma2", "gpt_oss", "bloom"]
WINDOW = 2  # the window heads' tokens: far fewer than the prompt, so they differ from softmax attention
MIXED = f"0-:heads(0=exact;*=window(window={WINDOW},sinks=0))"  # kv head 0 exact, the others windowed


@pytest.fixture(scope="module")
def converted(source_dir):
    """``converted(name, target, layers)`` -> ``rnnify.convert`` of the model's directory, once."""
    done = {}

    def get(name: str, target: str = "exact", layers: str | None = None):
        if (name, target, layers) not in done:
            done[name, target, layers] = rnnify.convert(source_dir(name), to=target, layers=layers)
        return done[name, target, layers]

    return get


def _left_padded(length: int = 16, padding: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of ``length`` tokens, the second left-padded by ``padding``."""
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, :padding] = False
    return _ids(2, length), mask


def _cell_inputs(model, ids: torch.Tensor, mask: torch.Tensor) -> list[tuple]:
    """Per cell, the ``(q, k, v, mask)`` it reads in a prefill of ``ids`` from a fresh state."""
    seen: list[tuple] = [()] * len(model.cells)
    hooks = [
        cell.register_forward_hook(lambda cell, args, out, i=i: seen.__setitem__(i, args[:4]))
        for i, cell in enumerate(model.cells)
    ]
    try:
        with torch.no_grad():
            model.prefill(ids, attention_mask=mask)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _run(cell, q, k, v, mask) -> torch.Tensor:
    with torch.no_grad():
        out, *_ = cell(q, k, v, mask, *cell.init_state(q.shape[0], q.device, q.dtype))
    return out


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, d]`` at real tokens only (0 at padding)."""
    return x * mask[:, None, :, None]


def _reference(spec: CellSpec, q, k, v, mask) -> torch.Tensor:
    terms = {name: getattr(spec, name) for name in SCORE_TERMS}
    return softmax_attention(q, k, v, mask, spec.scale, spec.window, **terms)


# --------------------------------------------------------------------------- the reference softmax


@pytest.mark.parametrize("name", MODELS)
def test_teacher_forcing_gives_the_originals_logits(name, converted, source_dir):
    """With the reference in place of every cell's output, a model of short windows computes what the
    original does, left padding included: the reference is the original's attention, terms and all."""
    model = converted(name, "window", MIXED)
    ids, mask = _left_padded()
    original = _load(source_dir(name), name)
    want = torch.cat(
        [_logits(original, ids[:1]), torch.nn.functional.pad(_logits(original, ids[1:, 5:]), (0, 0, 5, 0))]
    )
    with torch.no_grad():
        with attention_transfer(model, teacher_forcing=True):
            taught, _ = model.prefill(ids, attention_mask=mask)
        alone, _ = model.prefill(ids, attention_mask=mask)
    real = mask[..., None]
    assert rel_diff(taught * real, want * real) < 1e-4
    assert rel_diff(alone * real, want * real) > 1e-3  # the window heads change the logits: the check can fail


@pytest.mark.parametrize("name", MODELS)
def test_an_exact_conversion_shows_no_layer_error(name, converted):
    """``rnnify eval``'s per-layer errors (the recorder, teacher forcing, right-padded rows masked out)."""
    model = converted(name)
    ids, _ = _left_padded()
    loss_mask = torch.ones(2, ids.shape[1], dtype=torch.bool)
    loss_mask[1, -4:] = False
    with torch.no_grad(), attention_transfer(model, teacher_forcing=True) as recorder:
        recorder.loss_mask = loss_mask
        model.prefill(ids)
    errors = recorder.errors()
    assert len(errors) == len(model.cells) and all(e.tokens == int(loss_mask.sum()) for e in errors)
    assert max(e.rel_error for e in errors) < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_the_reference_computes_each_term(name, converted):
    """Without its term the reference is another attention: each test above can fail."""
    model = converted(name)
    ids, mask = _left_padded()
    for cell, (q, k, v, cell_mask) in zip(model.cells, _cell_inputs(model, ids, mask)):
        spec = cell.spec
        plain = softmax_attention(q, k, v, cell_mask, spec.scale, spec.window)
        assert rel_diff(_real(plain, mask), _real(_reference(spec, q, k, v, cell_mask), mask)) > 1e-3


# --------------------------------------------------------------------------- per-head maps


@pytest.mark.parametrize("terms", list(TERMS))
def test_each_head_of_a_split_has_its_own_terms(terms):
    """Against the float64 loop of tests/test_score_terms.py, head by head: kv head 1 (query heads 2, 3)
    exact, kv head 0 (query heads 0, 1) a window of 4 and 2 sinks, the row left-padded; prefill, then a
    prefill split by steps."""
    spec = spec_with(terms)
    q, k, v, mask = problem()
    groups = [
        {"kv_heads": [1], "target": "exact"},
        {"kv_heads": [0], "target": "window", "options": {"window": 4, "sinks": 2}},
    ]
    cell = build_cell("heads", spec, {"groups": groups}).double()
    want = torch.cat(
        [reference(q, k, v, mask, spec, window=4, sinks=2)[:, :2], reference(q, k, v, mask, spec)[:, 2:]], 1
    )
    state = cell.init_state(2, torch.device("cpu"), torch.float64)
    prefill, *_ = cell(q, k, v, mask, *state)
    assert (_real(prefill, mask) - want).abs().max() < 1e-5  # the window cell reads q in fp32
    outs, state = [], cell.init_state(2, torch.device("cpu"), torch.float64)
    for start, stop in [(0, 6), *((t, t + 1) for t in range(6, q.shape[2]))]:
        out, *state = cell(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], mask[:, start:stop], *state)
        outs.append(out)
    assert (_real(torch.cat(outs, 2), mask) - want).abs().max() < 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_an_all_exact_head_map_is_the_original(name, converted, source_dir):
    model = converted(name, "window", "0-:heads(1=exact;*=exact)")
    assert all(isinstance(cell, HeadSplitCell) and cell.exact for cell in model.cells)
    ids = _ids()
    with torch.no_grad():
        stepped, _ = decode(model, ids, PROMPT)
    assert rel_diff(stepped, _logits(_load(source_dir(name), name), ids)) < 1e-4


@pytest.mark.parametrize("name", MODELS)
def test_each_head_group_equals_its_whole_layer_cell(name, converted):
    """On the inputs each layer reads, the exact heads of a map give the reference and the window
    heads the window cell of the whole layer, head for head (the slopes and sinks of each head)."""
    model = converted(name, "window", MIXED)
    ids, mask = _left_padded()
    for cell, (q, k, v, cell_mask) in zip(model.cells, _cell_inputs(model, ids, mask)):
        spec = cell.spec
        assert spec.score_terms and [part.spec.score_terms for part in cell.parts] == [spec.score_terms] * 2
        exact_heads, window_heads = (query_heads(spec, kv) for kv in cell.kv_heads)
        got = _real(_run(cell, q, k, v, cell_mask), mask)
        window = build_cell("window", spec, {"window": WINDOW, "sinks": 0})
        want_window = _real(_run(window, q, k, v, cell_mask), mask)
        want_exact = _real(_reference(spec, q, k, v, cell_mask), mask)
        assert rel_diff(got[:, exact_heads], want_exact[:, exact_heads]) < 1e-5
        assert rel_diff(got[:, window_heads], want_window[:, window_heads]) < 1e-5
        assert rel_diff(got[:, window_heads], want_exact[:, window_heads]) > 1e-2


@pytest.mark.parametrize("name", MODELS)
def test_a_head_map_steps_as_it_prefills_and_saves(name, converted, tmp_path):
    model = converted(name, "window", MIXED)
    ids = _ids()
    with torch.no_grad():
        prefill, _ = model.prefill(ids)
        stepped, _ = decode(model, ids, PROMPT)
    assert rel_diff(stepped, prefill) < 1e-5
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    assert [cell.spec for cell in loaded.cells] == [cell.spec for cell in model.cells]
    assert torch.equal(loaded.prefill(ids)[0], prefill)


# Bloom's attention is outside transformers' interface: auto probes it through its exact conversion
@pytest.mark.parametrize("name", MODELS)
def test_auto_converts_a_model_with_score_terms(name, source_dir):
    """``--to auto`` scores each head and maps them: the map carries the terms, so it converts. At a
    context of 8 tokens an exact head holds 8, a streaming one 5 (window 4, a sink): 80% of the KV
    cache keeps some heads exact, not all."""
    model, report = auto_convert(
        source_dir(name),
        _ids(2, 32, seed=5),
        budget="80%",
        context=8,
        window=4,
        sinks=1,
        calib_len=32,
        calib_rows=2,
        passkey=0,
    )
    assert any(isinstance(cell, HeadSplitCell) for cell in model.cells), report.layers  # some heads each way
    assert all(cell.spec.score_terms for cell in model.cells)
    ids = _ids()
    with torch.no_grad():
        prefill, _ = model.prefill(ids)
        stepped, _ = decode(model, ids, PROMPT)
    assert rel_diff(stepped, prefill) < 1e-5


# --------------------------------------------------------------------------- Falcon-RW saved


def test_falcon_rw_saves_and_loads_exactly(source_dir, tmp_path):
    """Falcon-RW's step graph splits its fused q, k, v with ``aten.unflatten`` (in the op vocabulary)."""
    model = rnnify.convert(source_dir("falcon-rw"), to="exact")
    model.save(tmp_path / "m")
    loaded = rnnify.load(tmp_path / "m")
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stepped, _ = decode(loaded, ids, PROMPT)
        want = _logits(_load(source_dir("falcon-rw"), "falcon-rw"), ids)
    assert torch.equal(loaded.prefill(ids)[0], model.prefill(ids)[0])
    assert rel_diff(stepped, want) < 1e-4
