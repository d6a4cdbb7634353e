"""A model's own Mamba-2 layers carry their state between tokens (rnnify/cells/ssd.py,
rnnify/compiler/recurrences/mamba2.py, rnnify/compiler/passes/rewrite_scans.py): the cell's forms
against an fp64 loop of the equations, and converted Granite 4 (GraniteMoeHybrid), Bamba, Falcon-H1,
Nemotron-H and Zamba2 against the original models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import (
    assert_left_padded_rows_equal_rows_alone,
    assert_steps_and_split_prefill_match,
    decode,
    exact_conversions,
    rel_diff,
)

import rnnify
from rnnify.cells import OWN_LAYERS, SSDCell, build_cell
from rnnify.cells.ssd import CHUNK, naive_recurrent_ssd
from rnnify.original import attention_transfer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

HEADS, WIDTH, GROUPS, STATE = 4, 3, 2, 5


def _inputs(gen, batch, length, dtype=torch.float64):
    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return (
        draw(batch, length, HEADS * WIDTH),  # x
        draw(batch, length, GROUPS * STATE),  # B
        draw(batch, length, GROUPS * STATE),  # C
        draw(batch, length, HEADS),  # dt before dt_bias and softplus
        draw(HEADS).abs().log(),  # A_log
        draw(HEADS),  # D
        draw(HEADS),  # dt_bias
    )


def _textbook(x, B, C, dt, A_log, D, dt_bias, mask, state):
    """The equations written once more, per row, head and real token, in fp64."""
    out = torch.zeros(x.shape[0], x.shape[1], HEADS, WIDTH, dtype=torch.float64)
    state = state.clone().double()
    for row in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not mask[row, t]:
                continue
            for h in range(HEADS):
                g = h // (HEADS // GROUPS)
                step = F.softplus(dt[row, t, h] + dt_bias[h])
                b, c = B[row, t, g * STATE : (g + 1) * STATE], C[row, t, g * STATE : (g + 1) * STATE]
                xh = x[row, t, h * WIDTH : (h + 1) * WIDTH]
                state[row, h] = torch.exp(-step * torch.exp(A_log[h])) * state[row, h] + step * torch.outer(xh, b)
                out[row, t, h] = state[row, h] @ c + D[h] * xh
    return out.flatten(2), state


def test_naive_loop_equals_the_equations_with_padding():
    gen = torch.Generator().manual_seed(0)
    args = _inputs(gen, 3, 9)
    state = torch.randn(3, HEADS, WIDTH, STATE, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[2, :] = False  # nothing real: the state stays
    want, want_state = _textbook(*args, mask, state)
    out, got_state = naive_recurrent_ssd(*args, mask, state, HEADS, GROUPS)
    torch.testing.assert_close(torch.where(mask[..., None], out, 0.0), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_state, want_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length", [1, 7, CHUNK, 2 * CHUNK + 22])
def test_prefill_and_step_equal_the_naive_loop(length):
    """The fp32 chunked prefill (across chunk boundaries) and the step, from a nonzero state, with
    dt limits, against the fp64 loop."""
    gen = torch.Generator().manual_seed(length)
    args = _inputs(gen, 2, length)
    state = torch.randn(2, HEADS, WIDTH, STATE, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, : length // 3] = False
    cell = build_cell("ssd", SSDCell.spec_for(HEADS, WIDTH, STATE), {"groups": GROUPS, "dt_min": 0.01, "dt_max": 2.0})
    want, want_state = naive_recurrent_ssd(*args, mask, state, HEADS, GROUPS, dt_min=0.01, dt_max=2.0)
    out, got_state = cell(*(a.float() for a in args), mask, state.float())
    assert out.dtype == got_state.dtype == torch.float32
    real = mask[..., None]
    torch.testing.assert_close(torch.where(real, out.double(), 0.0), torch.where(real, want, 0.0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state.double(), want_state, rtol=1e-4, atol=1e-4)


def test_split_prefill_and_steps_equal_one_prefill():
    gen = torch.Generator().manual_seed(5)
    args = [a.float() for a in _inputs(gen, 2, 150)]
    cell = build_cell("ssd", SSDCell.spec_for(HEADS, WIDTH, STATE), {"groups": GROUPS})
    mask = torch.ones(2, 150, dtype=torch.bool)
    (state,) = cell.init_state(2, torch.device("cpu"), torch.float32)
    full, full_state = cell(*args, mask, state)

    def part(a, b):
        return [t[:, a:b] for t in args[:4]] + args[4:]

    out, mid = cell(*part(0, 70), mask[:, :70], state)
    pieces = [out]
    out, mid = cell(*part(70, 140), mask[:, 70:140], mid)
    pieces.append(out)
    for t in range(140, 150):
        out, mid = cell(*part(t, t + 1), mask[:, t : t + 1], mid)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mid, full_state, rtol=1e-5, atol=1e-5)


def test_cell_options_are_checked():
    spec = SSDCell.spec_for(HEADS, WIDTH, STATE)
    with pytest.raises(rnnify.RnnifyError, match="num_heads"):
        build_cell("ssd", spec, {"groups": 3})
    with pytest.raises(rnnify.RnnifyError, match="dt_min"):
        build_cell("ssd", spec, {"groups": GROUPS, "dt_min": 1.0, "dt_max": 0.5})
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'ssd'"):
        rnnify.convert("unused", to="ssd")  # a layer's own scan, never a --to target
    assert {"ssd", "short_conv"} <= OWN_LAYERS


def _tiny(model_type: str):
    """Two layers, a Mamba-2 layer then attention (Falcon-H1: both in each layer), with 2 heads of
    Mamba, a chunk of 16 and a 3-token convolution."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    common = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        mamba_d_conv=3,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    layouts = {
        "bamba": dict(attn_layer_indices=[1]),
        "granitemoehybrid": dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2),
        "falcon_h1": dict(head_dim=16, mamba_d_ssm=128),
    }
    config = CONFIG_MAPPING[model_type](**common, **layouts[model_type])
    torch.manual_seed(0)
    model_class = getattr(
        transformers, transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    )
    return model_class(config).eval()


_NAMES = ["bamba", "granitemoehybrid", "falcon_h1"]


@pytest.fixture(scope="module")
def converted():
    return exact_conversions(_tiny)


@pytest.mark.parametrize("name", _NAMES)
def test_exact_equals_the_original_prefill_and_steps(name, converted):
    """Past two chunks of the source's scan and of the cell's, then stepping."""
    source, model = converted(name)
    scans = [cell for cell in model.cells if cell.target == "ssd"]
    assert len(scans) == (2 if name == "falcon_h1" else 1)  # Falcon-H1: attention and Mamba in each layer
    assert {cell.target for cell in model.cells} == {"ssd", "short_conv", "exact"}
    ids = torch.randint(3, 320, (2, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 70)[0], want) < 1e-4  # a prefill of 70, then 20 steps
    assert_steps_and_split_prefill_match(model, ids[:, :40], split=17)


def test_left_padded_rows_equal_rows_alone(converted):
    _, model = converted("bamba")
    assert_left_padded_rows_equal_rows_alone(model, [3, 21, 9], torch.Generator().manual_seed(3), steps=5)


def test_other_targets_keep_the_scan_and_save(tmp_path):
    """A window target replaces the attention and keeps the model's own layers, which round-trip a
    save, and which attention transfer leaves out."""
    source = _tiny("granitemoehybrid")
    model = rnnify.convert(source, to="window", window=4)
    assert [cell.target for cell in model.cells] == ["short_conv", "ssd", "window"]  # in layer order
    back = rnnify.load(model.save(tmp_path / "granite"))
    ids = torch.randint(3, 320, (1, 30), generator=torch.Generator().manual_seed(4))
    assert rel_diff(back.prefill(ids)[0], model.prefill(ids)[0]) < 1e-6
    assert back.cells[1].options() == model.cells[1].options()
    with attention_transfer(model) as recorder:  # the scan is the source's own layer: not compared
        model(ids, model.init_state(1))
        assert [error.tokens for error in recorder.errors()] == [0, 0, 30]
