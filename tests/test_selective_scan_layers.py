"""A model's own Mamba-1 layers carry their state between tokens (rnnify/cells/selective_scan.py,
rnnify/compiler/recurrences/mamba.py, rnnify/compiler/passes/rewrite_scans.py): the cell's forms
against an fp64 loop of the equations, the captured op against transformers' own scan, and
converted Jamba and Zamba against the original models."""

from __future__ import annotations

import dataclasses

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
from rnnify.cells import OWN_LAYERS, SelectiveScanCell, build_cell
from rnnify.cells.selective_scan import CHUNK, chunk_selective_scan, naive_recurrent_selective_scan
from rnnify.compiler.recurrences.mamba import MAMBA_SELECTIVE_SCAN

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' kernels fall back to PyTorch

CHANNELS, STATE = 6, 5


def _inputs(gen, batch, length, dtype=torch.float64):
    """x, dt (before dt_bias and softplus), A, B, C, D, z, dt_bias, in the cell's layout."""

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return (
        draw(batch, length, CHANNELS),
        draw(batch, length, CHANNELS),
        -torch.exp(draw(CHANNELS, STATE)),
        draw(batch, length, STATE),
        draw(batch, length, STATE),
        draw(CHANNELS),
        draw(batch, length, CHANNELS),
        draw(CHANNELS),
    )


def _cell():
    return build_cell("selective_scan", SelectiveScanCell.spec_for(CHANNELS, STATE), {})


def _textbook(x, dt, A, B, C, D, z, dt_bias, mask, state):
    """The equations written once more, per row, real token, channel and state entry, in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    h = state.clone().double()
    for row in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not mask[row, t]:
                continue
            for d in range(CHANNELS):
                step = F.softplus(dt[row, t, d] + dt_bias[d])
                for n in range(STATE):
                    h[row, d, n] = torch.exp(step * A[d, n]) * h[row, d, n] + step * B[row, t, n] * x[row, t, d]
                y = (h[row, d] * C[row, t]).sum() + D[d] * x[row, t, d]
                out[row, t, d] = y * z[row, t, d] * torch.sigmoid(z[row, t, d])
    return out, h


def test_naive_loop_equals_the_equations_with_padding():
    gen = torch.Generator().manual_seed(0)
    args = _inputs(gen, 3, 7)
    state = torch.randn(3, CHANNELS, STATE, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[2, :] = False  # nothing real: the state stays
    want, want_state = _textbook(*args, mask, state)
    out, got_state = naive_recurrent_selective_scan(*args, mask, state)
    torch.testing.assert_close(torch.where(mask[..., None], out, 0.0), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_state, want_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length", [1, 7, CHUNK, 2 * CHUNK + 22])
def test_prefill_and_step_equal_the_naive_loop(length):
    """The fp32 chunked prefill (across chunk boundaries) and the step, from a nonzero state, with a
    left-padded row, against the fp64 loop."""
    gen = torch.Generator().manual_seed(length)
    args = _inputs(gen, 2, length)
    state = torch.randn(2, CHANNELS, STATE, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, : length // 3] = False
    want, want_state = naive_recurrent_selective_scan(*args, mask, state)
    out, got_state = _cell()(*(a.float() for a in args), mask, state.float())
    assert out.dtype == got_state.dtype == torch.float32
    real = mask[..., None]
    torch.testing.assert_close(torch.where(real, out.double(), 0.0), torch.where(real, want, 0.0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_state.double(), want_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_chunk_sizes_agree(chunk):
    """The doubling scan within chunks of any size (powers of 2 or not, the last one short)."""
    gen = torch.Generator().manual_seed(chunk)
    x, dt, A, B, C = (a.float() for a in _inputs(gen, 2, 37)[:5])
    dt = F.softplus(dt)
    state = torch.randn(2, CHANNELS, STATE, generator=gen)
    want, want_state = chunk_selective_scan(x, dt, A, B, C, state, chunk=64)
    out, got_state = chunk_selective_scan(x, dt, A, B, C, state, chunk=chunk)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)


def test_split_prefill_and_steps_equal_one_prefill():
    gen = torch.Generator().manual_seed(5)
    args = [a.float() for a in _inputs(gen, 2, 150)]
    cell = _cell()
    mask = torch.ones(2, 150, dtype=torch.bool)
    (state,) = cell.init_state(2, torch.device("cpu"), torch.float32)
    full, full_state = cell(*args, mask, state)

    def part(a, b):
        return [t[:, a:b] if t.dim() == 3 else t for t in args]

    out, mid = cell(*part(0, 70), mask[:, :70], state)
    pieces = [out]
    out, mid = cell(*part(70, 140), mask[:, 70:140], mid)
    pieces.append(out)
    for t in range(140, 150):
        out, mid = cell(*part(t, t + 1), mask[:, t : t + 1], mid)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mid, full_state, rtol=1e-5, atol=1e-5)


def test_cell_is_rebuilt_from_its_options_and_is_no_target():
    cell = _cell()
    assert cell.options() == {} and cell.exact and "selective_scan" in OWN_LAYERS
    assert cell.init_state(3, torch.device("cpu"), torch.bfloat16)[0].shape == (3, CHANNELS, STATE)
    with pytest.raises(rnnify.RnnifyError, match="window"):
        build_cell("selective_scan", SelectiveScanCell.spec_for(CHANNELS, STATE), {"window": 4})
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'selective_scan'"):
        rnnify.convert("unused", to="selective_scan")  # a layer's own scan, never a --to target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_scan_equals_transformers_scan(dtype):
    """The stand-in (the op, through the cell) against transformers' own ``mamba_selective_scan``, in
    the source's channels-first layout, with its output dtype (fp32 for bf16 inputs: the skip
    weights are fp32)."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    gen = torch.Generator().manual_seed(6)
    x, dt, A, B, C, D, z, dt_bias = (a.float() for a in _inputs(gen, 2, 40))
    x, dt, B, C, z = (v.to(dtype) for v in (x, dt, B, C, z))
    op_args = (x, dt, A, B, C, D, z, dt_bias)
    torch.library.opcheck(
        torch.ops.rnnify.selective_scan.default, op_args, test_utils=("test_schema", "test_faketensor")
    )
    x, dt, B, C, z = (v.transpose(1, 2) for v in (x, dt, B, C, z))  # the source's layout
    kwargs = dict(D=D, z=z, delta_bias=dt_bias, delta_softplus=True)
    want = mamba_selective_scan(x, dt, A, B, C, **kwargs)
    got = MAMBA_SELECTIVE_SCAN.stand_in(x, dt, A, B, C, **kwargs)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == x.shape
    assert rel_diff(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


def _tiny(model_type: str):
    """Two layers (Jamba: a Mamba layer, then attention; Zamba: two hybrid layers, each its Mamba
    layer of 2 heads after the shared attention), with weights drawn wide enough (and decays, steps
    and skip weights redrawn) that the scan moves the logits: zeroing its state does, by far more
    than the tests' tolerance."""
    import transformers

    common = dict(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_dt_rank=4,
        max_position_embeddings=256,
        pad_token_id=0,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    if model_type == "jamba":
        config = transformers.JambaConfig(**common, attn_layer_period=2, attn_layer_offset=1, num_experts=1)
        model = transformers.JambaForCausalLM(config)
    else:
        config = transformers.ZambaConfig(**common, n_mamba_heads=2, layers_block_type=["hybrid", "hybrid"])
        model = transformers.ZambaForCausalLM(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("A_log"):
                weight.uniform_(-1.0, 1.0)
            elif name.endswith((".D", "dt_proj.bias", "dt_proj_bias")):
                weight.normal_()
    return model.eval()


_SCANS = {"jamba": 1, "zamba": 4}  # Zamba: one cell per Mamba head


@pytest.fixture(scope="module")
def converted():
    return exact_conversions(_tiny)


def _without_scan_state(model, state):
    """``state`` with every selective scan's entries zeroed."""
    kinds = [cell.target for cell in model.cells for _ in cell.state_names]
    tensors = tuple(
        torch.zeros_like(t) if kind == "selective_scan" else t for kind, t in zip(kinds, state.tensors, strict=True)
    )
    return dataclasses.replace(state, tensors=tensors)


@pytest.mark.parametrize("name", sorted(_SCANS))
def test_exact_equals_the_original_prefill_and_steps(name, converted):
    """Past one chunk of the cell's prefill, then stepping; the scans' state is what the steps read."""
    source, model = converted(name)
    targets = [cell.target for cell in model.cells]
    assert targets.count("selective_scan") == _SCANS[name] and set(targets) == {"selective_scan", "short_conv", "exact"}
    ids = torch.randint(3, 320, (2, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 70)[0], want) < 1e-4  # a prefill of 70, then 20 steps
    _, state = model.prefill(ids[:, :70])
    forgotten, _ = model.step(ids[:, 70:71], _without_scan_state(model, state))
    assert rel_diff(forgotten, want[:, 70:71]) > 1e-2
    assert_steps_and_split_prefill_match(model, ids[:, :40], split=17)


def test_left_padded_rows_equal_rows_alone(converted):
    _, model = converted("jamba")
    assert_left_padded_rows_equal_rows_alone(model, [3, 21, 9], torch.Generator().manual_seed(3), steps=5)


def test_window_keeps_the_scans_and_saves(converted, tmp_path):
    """A window target replaces the attention and keeps the model's own layers where they were; the
    window model equals the original on a prompt no longer than the window, and round-trips a save."""
    source, exact = converted("jamba")
    model = rnnify.convert(source, to="window", window=4)
    assert [cell.target for cell in model.cells] == [
        "window" if cell.target == "exact" else cell.target for cell in exact.cells
    ]

    def own(m):
        return [dataclasses.replace(entry, module="") for entry in m.manifest.cells if entry.target in OWN_LAYERS]

    assert own(model) == own(exact) and len(own(model)) == 2
    ids = torch.randint(3, 320, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = source(input_ids=ids[:, :4], use_cache=False).logits
    assert rel_diff(model.prefill(ids[:, :4])[0], want) < 1e-4
    back = rnnify.load(model.save(tmp_path / "jamba"))
    assert rel_diff(back.prefill(ids)[0], model.prefill(ids)[0]) < 1e-6
    assert [cell.options() for cell in back.cells] == [cell.options() for cell in model.cells]
