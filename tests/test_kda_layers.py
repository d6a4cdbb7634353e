"""A model's own Kimi Delta Attention layers carry their state between tokens (rnnify/cells/kda.py,
rnnify/compiler/recurrences/kda.py, rnnify/compiler/passes/rewrite_scans.py): the cell's fp64 loop
against transformers' own token loop, the cell's forms against that loop, and converted Kimi-Linear
and Bailing-hybrid (the tiny models of benchmarks/arch_sweep.py) against the original models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
    decode,
    exact_conversions,
    rel_diff,
)

import rnnify
from rnnify.cells import OWN_LAYERS, KimiDeltaAttentionCell, build_cell
from rnnify.cells.kda import CHUNK, naive_recurrent_kda

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

HEADS, KEY_DIM, VALUE_DIM = 3, 5, 4


def _inputs(gen, batch, length, dtype=torch.float64):
    """q, k ``[b, t, H, d_k]``, v ``[b, t, H, d_v]``, g <= 0 ``[b, t, H, d_k]`` (a decay per key
    channel, some near 1 and some near 0) and beta in (0, 1) ``[b, t, H]``."""

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return (
        draw(batch, length, HEADS, KEY_DIM),
        draw(batch, length, HEADS, KEY_DIM),
        draw(batch, length, HEADS, VALUE_DIM),
        -2 * draw(batch, length, HEADS, KEY_DIM).abs() * torch.rand(KEY_DIM, generator=gen, dtype=dtype),
        torch.sigmoid(draw(batch, length, HEADS)),
    )


def _state(gen, batch, dtype=torch.float64):
    return torch.randn(batch, HEADS, KEY_DIM, VALUE_DIM, generator=gen, dtype=dtype)


def _cell(l2norm: bool = True):
    return build_cell("kda", KimiDeltaAttentionCell.spec_for(HEADS, KEY_DIM, VALUE_DIM), {"l2norm": l2norm})


@pytest.mark.parametrize("l2norm", [True, False])
def test_naive_loop_equals_transformers_loop(l2norm):
    """Against transformers' own token loop (fp32), from a nonzero state; a padded token takes no
    step: a row with padding, before and among its tokens, equals its real tokens alone."""
    from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

    gen = torch.Generator().manual_seed(0)
    args, state = _inputs(gen, 2, 11), _state(gen, 2)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = mask[1, 6] = False
    out, got_state = naive_recurrent_kda(*args, mask, state, l2norm)
    for row in range(2):
        real = mask[row]
        q, k, v, g, beta = (a[row : row + 1, real].float() for a in args)
        want, want_state = recurrent_kimi_delta_attention(
            q, k, v, g=g, beta=beta, initial_state=state[row : row + 1].float(), output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm,
        )  # fmt: skip
        torch.testing.assert_close(out[row : row + 1, real].float(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state[row : row + 1].float(), want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [1, 7, CHUNK, 2 * CHUNK + 22])
def test_prefill_and_step_equal_the_naive_loop(length):
    """The fp32 chunked prefill (across chunk boundaries) and the step, from a nonzero state, with a
    left-padded row, against the fp64 loop."""
    gen = torch.Generator().manual_seed(length)
    args, state = _inputs(gen, 2, length), _state(gen, 2)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, : length // 3] = False
    want, want_state = naive_recurrent_kda(*args, mask, state, True)
    out, got_state = _cell()(*(a.float() for a in args), mask, state.float())
    assert out.dtype == got_state.dtype == torch.float32 and out.shape == want.shape
    real = mask[..., None, None]
    torch.testing.assert_close(torch.where(real, out.double(), 0.0), torch.where(real, want, 0.0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state.double(), want_state, rtol=1e-4, atol=1e-4)


def test_strong_decays_stay_finite():
    """Decays that empty a channel within a chunk (log decay -30 a token) leave no inf or nan: every
    exponent of the chunked form is a masked difference, never positive."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, g, beta = _inputs(gen, 1, 100)
    g[..., 0] = -30.0
    mask = torch.ones(1, 100, dtype=torch.bool)
    state = _state(gen, 1)
    want, want_state = naive_recurrent_kda(q, k, v, g, beta, mask, state, True)
    out, got_state = _cell()(*(a.float() for a in (q, k, v, g, beta)), mask, state.float())
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state.double(), want_state, rtol=1e-4, atol=1e-4)


def test_split_prefill_and_steps_equal_one_prefill():
    gen = torch.Generator().manual_seed(5)
    args = [a.float() for a in _inputs(gen, 2, 150)]
    cell = _cell()
    mask = torch.ones(2, 150, dtype=torch.bool)
    (state,) = cell.init_state(2, torch.device("cpu"), torch.float32)
    full, full_state = cell(*args, mask, state)
    out, mid = cell(*(a[:, :70] for a in args), mask[:, :70], state)
    pieces = [out]
    out, mid = cell(*(a[:, 70:140] for a in args), mask[:, 70:140], mid)
    pieces.append(out)
    for t in range(140, 150):
        out, mid = cell(*(a[:, t : t + 1] for a in args), mask[:, t : t + 1], mid)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mid, full_state, rtol=1e-5, atol=1e-5)


def test_cell_options_are_checked():
    spec = KimiDeltaAttentionCell.spec_for(HEADS, KEY_DIM, VALUE_DIM)
    with pytest.raises(rnnify.RnnifyError, match="l2norm"):
        build_cell("kda", spec, {"l2norm": "yes"})
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'kda'"):
        rnnify.convert("unused", to="kda")  # a layer's own recurrence, never a --to target
    assert "kda" in OWN_LAYERS
    cell = _cell(l2norm=False)
    assert type(cell)(cell.spec, **cell.options()).options() == {"l2norm": False}


def _tiny(model_type: str):
    """The sweep's tiny model: a KDA layer (2 heads of width 16, a 4-token convolution) then attention."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import arch_sweep

    return arch_sweep.build(model_type)[0]


_NAMES = ["kimi_linear", "bailing_hybrid"]


@pytest.fixture(scope="module")
def converted():
    return exact_conversions(_tiny)


@pytest.mark.parametrize("name", _NAMES)
def test_exact_equals_the_original_prefill_and_steps(name, converted):
    """Past a chunk of the source's and of the cell's prefill, then stepping."""
    source, model = converted(name)
    assert sorted(cell.target for cell in model.cells) == ["exact", "kda", "short_conv"]
    vocab = source.config.vocab_size
    ids = torch.randint(3, vocab, (2, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 80)[0], want) < 1e-4  # a prefill of 80, then 10 steps
    assert_steps_and_split_prefill_match(model, ids[:, :24], split=9)


def test_left_padded_rows_equal_rows_alone(converted):
    _, model = converted("kimi_linear")
    assert_left_padded_rows_equal_rows_alone(model, [3, 70, 9], torch.Generator().manual_seed(3), steps=5)


def test_other_targets_keep_the_layer_and_save(tmp_path):
    """A window target replaces the attention and keeps the model's own layers, which round-trip a
    save: within the window the converted model is still the original."""
    source = _tiny("bailing_hybrid")
    model = rnnify.convert(source, to="window", window=4)
    assert sorted(cell.target for cell in model.cells) == ["kda", "short_conv", "window"]
    back = rnnify.load(model.save(tmp_path / "bailing"))
    ids = torch.randint(3, source.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    assert rel_diff(back.prefill(ids)[0], model.prefill(ids)[0]) < 1e-6
    with torch.no_grad():
        want = source(input_ids=ids[:, :4], use_cache=False).logits
    assert rel_diff(back.prefill(ids[:, :4])[0], want) < 1e-4
    own = [cell for cell in back.cells if cell.target == "kda"]
    assert [cell.options() for cell in own] == [{"l2norm": True}]
