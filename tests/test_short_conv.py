"""Short convolution layers (LFM2's conv layers) carry their state between tokens (rnnify/cells/short_conv.py,
rnnify/compiler/passes/rewrite_convolutions.py): the cell against a plain causal convolution, and converted
LFM2, LFM2-MoE and LFM3 against the original models."""

from __future__ import annotations

import functools

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
from rnnify.cells import ShortConvCell, build_cell
from rnnify.cells.short_conv import naive_recurrent_short_conv, short_conv
from rnnify.cli import main
from rnnify.errors import UnsupportedModelError
from rnnify.original import attention_transfer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' conv kernel falls back to PyTorch

# LFM2-350M's first layers: two short convolutions, then attention
LFM2_LAYERS = ["conv", "conv", "full_attention", "conv"]


def _causal_conv_of_real_tokens(history, x, convs, mask):
    """Each row's real inputs (history, then the tokens its mask keeps) padded by K-1 zeros on the left
    and through the chain of ``F.conv1d``, the outputs of the new real tokens put back at their places
    (0 at padding)."""
    held = history.shape[2]
    out = torch.zeros(x.shape[0], convs[-1][0].shape[0], x.shape[2], dtype=x.dtype)
    for row in range(x.shape[0]):
        keep = mask[row].nonzero()[:, 0]
        y = F.pad(torch.cat([history[row], x[row][:, keep]], dim=1)[None], (held, 0))  # [1, C, 2(K-1) + n]
        for weight, bias, groups in convs:
            y = F.conv1d(y, weight, bias, groups=groups)
        out[row][:, keep] = y[0, :, held : held + len(keep)]
    return out


def _random_conv(gen, batch=3, channels=5, length=9, kernel_size=4, bias=True):
    x = torch.randn(batch, channels, length, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, 1, kernel_size, generator=gen, dtype=torch.float64)
    b = torch.randn(channels, generator=gen, dtype=torch.float64) if bias else None
    history = torch.randn(batch, channels, kernel_size - 1, generator=gen, dtype=torch.float64)
    return x, weight, b, history


def _chain(gen, channels=6):
    """ZAYA's layout: a depthwise convolution of 3 tokens, then one of 2 tokens in 2 groups (K = 4)."""
    draw = functools.partial(torch.randn, generator=gen, dtype=torch.float64)
    return [(draw(channels, 1, 3), draw(channels), channels), (draw(channels, channels // 2, 2), draw(channels), 2)]


@pytest.mark.parametrize("layout", ["depthwise", "depthwise without bias", "chain"])
@pytest.mark.parametrize("padded", [False, True])
def test_cell_forms_equal_a_causal_convolution_of_the_real_tokens(layout, padded):
    """From a state of earlier inputs, with padding anywhere in the new tokens (a continued prefill may be
    padded too): outputs at real tokens and the state of the last K-1 real inputs, in float64."""
    gen = torch.Generator().manual_seed(0)
    channels = 6 if layout == "chain" else 5
    x, weight, b, history = _random_conv(gen, channels=channels, bias=layout == "depthwise")
    convs = _chain(gen, channels) if layout == "chain" else [(weight, b, channels)]
    mask = torch.ones(x.shape[0], x.shape[2], dtype=torch.bool)
    if padded:
        mask[0, :4] = False  # left padding
        mask[1, 2:5] = False  # padding between real tokens
        mask[2, :] = False  # nothing real: the state stays
    want = _causal_conv_of_real_tokens(history, x, convs, mask)
    for form in (naive_recurrent_short_conv, short_conv):
        out, state = form(x, convs, mask, history)
        torch.testing.assert_close(torch.where(mask[:, None], out, 0.0), want, rtol=1e-12, atol=1e-12)
        for row in range(x.shape[0]):
            real = torch.cat([history[row], x[row][:, mask[row]]], dim=1)
            torch.testing.assert_close(state[row], real[:, -3:], rtol=0, atol=0)


def test_cell_steps_and_split_prefill_equal_one_prefill():
    gen = torch.Generator().manual_seed(1)
    x, weight, bias, _ = _random_conv(gen, batch=2, length=12)
    cell = build_cell("short_conv", ShortConvCell.spec_for(5), {"kernel_size": 4})
    mask = torch.ones(2, 12, dtype=torch.bool)
    (state,) = cell.init_state(2, torch.device("cpu"), torch.float64)
    full, full_state = cell(x, weight, bias, mask, state)
    want = F.conv1d(x, weight, bias, padding=3, groups=5)[..., :12]  # the original's form
    torch.testing.assert_close(full, want, rtol=1e-12, atol=1e-12)
    first, mid = cell(x[..., :5], weight, bias, mask[:, :5], state)
    steps = [first]
    for t in range(5, 12):
        out, mid = cell(x[..., t : t + 1], weight, bias, mask[:, t : t + 1], mid)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=2), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mid, full_state, rtol=0, atol=0)


def test_token_windows_are_each_real_tokens_last_inputs_prompt_and_steps():
    """``TokenWindowCell`` (Inkling 2's per-token convolution taps): each real token's window holds
    the K inputs up to it, oldest first, zeros before a row's first real token, as
    ``pad(x, [K-1, 0]).unfold(-1, K, 1)`` of the row alone; a prompt then steps, left padding."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False
    cell = build_cell("token_window", ShortConvCell.spec_for(5), {"kernel_size": 4})
    (state,) = cell.init_state(2, torch.device("cpu"), torch.float64)
    outs = []
    for part in [slice(0, 7), *(slice(t, t + 1) for t in range(7, 12))]:
        out, state = cell(x[..., part], mask[:, part], state)
        outs.append(out)
    got = torch.cat(outs, dim=2)
    for row in range(2):
        real = x[row][:, mask[row]]  # [C, real tokens]
        want = F.pad(real, (3, 0)).unfold(-1, 4, 1)  # the row alone, as the source reads it
        torch.testing.assert_close(got[row][:, mask[row]], want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "read, windows",
    [
        (lambda x: F.pad(x, (3, 0)).unfold(-1, 4, 1), True),  # Inkling 2's form
        (lambda x: F.pad(x, (3, 0))[..., -(x.shape[-1] + 3) :].unfold(-1, 4, 1), True),  # a slice keeping it all
        (lambda x: F.pad(x, (2, 0)).unfold(-1, 4, 1), False),  # a window past the padding: drops outputs
        (lambda x: F.pad(x, (3, 0)).unfold(-1, 4, 2), False),  # every other token's window
        (lambda x: F.pad(x, (3, 1)).unfold(-1, 4, 1), False),  # padded after: reads a later token
        (lambda x: F.pad(x, (3, 0))[..., 1:].unfold(-1, 3, 1), False),  # a slice that drops a position
    ],
)
def test_only_the_windows_of_each_tokens_last_inputs_are_carried(read, windows):
    """``rewrite_convolutions``' token windows: ``pad(x, [K-1, 0]).unfold(-1, K, 1)`` over the tokens,
    nothing else (what is left in the graph then fails the op vocabulary, by name)."""
    from rnnify.compiler.passes.rewrite_convolutions import _token_window

    class Read(torch.nn.Module):
        def forward(self, x):
            return read(x)

    tokens = torch.export.Dim("tokens", min=4, max=64)
    graph = torch.export.export(Read(), (torch.randn(2, 5, 8),), dynamic_shapes=({2: tokens},)).graph
    x = next(n for n in graph.nodes if n.op == "placeholder")
    length = str(x.meta["val"].shape[2])
    found = [_token_window(n, length) for n in graph.nodes if n.target == torch.ops.aten.unfold.default]
    assert found == ([(x, 4)] if windows else [None])


def test_cell_options_are_checked():
    with pytest.raises(
        rnnify.RnnifyError, match=r"kernel_size must be an integer >= 2 \(a 1-token kernel keeps no state\), got 1"
    ):
        build_cell("short_conv", ShortConvCell.spec_for(5), {"kernel_size": 1})
    with pytest.raises(rnnify.RnnifyError, match="groups must be a list"):
        build_cell("short_conv", ShortConvCell.spec_for(5), {"kernel_size": 4, "groups": []})
    with pytest.raises(rnnify.RnnifyError, match="unknown target 'short_conv'"):
        rnnify.convert("unused", to="short_conv")  # a layer's own convolution, never a --to target


def _lfm2():
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    config = Lfm2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LFM2_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=LFM2_LAYERS,
        max_position_embeddings=128,
    )
    return Lfm2ForCausalLM(config).eval()


def _lfm2_moe():
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(0)
    config = Lfm2MoeConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        num_dense_layers=1,
        layer_types=["conv", "full_attention", "conv"],
        max_position_embeddings=128,
    )
    return Lfm2MoeForCausalLM(config).eval()


def _lfm3():
    """LFM3's own layout (conv, conv, full, conv, sliding), a 7-token convolution and a window of 8."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Lfm3ForCausalLM"):
        pytest.skip("this transformers has no LFM3")
    torch.manual_seed(0)
    config = transformers.Lfm3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.Lfm3ForCausalLM(config).eval()


_SOURCES = {"lfm2": _lfm2, "lfm2_moe": _lfm2_moe, "lfm3": _lfm3}


@pytest.fixture(scope="module")
def converted():
    """``converted(name)`` -> (original, exact conversion), built once per module."""
    return exact_conversions(lambda name: _SOURCES[name]())


@pytest.mark.parametrize("name", list(_SOURCES))
def test_exact_equals_the_original_prefill_and_steps(name, converted):
    source, model = converted(name)
    layer_types = source.config.layer_types
    convs = [cell for cell in model.cells if cell.target == "short_conv"]
    assert len(convs) == layer_types.count("conv") and len(model.cells) == len(layer_types)
    assert {cell.kernel_size for cell in convs} == {source.config.conv_L_cache}
    ids = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(model.prefill(ids)[0], want) < 1e-4
    assert rel_diff(decode(model, ids, 8)[0], want) < 1e-4  # a prefill of 8, then 16 steps
    assert_steps_and_split_prefill_match(model, ids, split=7)


@pytest.mark.parametrize("name", ["lfm2", "lfm3"])
def test_left_padded_rows_equal_the_original_and_rows_alone(name, converted):
    source, model = converted(name)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 320, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = source.config.pad_token_id, 0
    with torch.no_grad():
        want = source(input_ids=ids, attention_mask=mask, use_cache=False).logits
    got, _ = model.prefill(ids, attention_mask=mask)
    assert rel_diff(got[0, 5:], want[0, 5:]) < 1e-4 and rel_diff(got[1], want[1]) < 1e-4
    assert_left_padded_rows_equal_rows_alone(model, [3, 11, 7], gen, steps=6)


def test_save_and_load_give_the_same_logits(converted, tmp_path, capsys):
    _, model = converted("lfm2")
    back = rnnify.load(model.save(tmp_path / "lfm2"))
    assert [entry.target for entry in back.manifest.cells] == ["short_conv", "short_conv", "exact", "short_conv"]
    ids = torch.randint(3, 320, (2, 10), generator=torch.Generator().manual_seed(4))
    assert torch.equal(decode(back, ids, 4)[0], decode(model, ids, 4)[0])
    assert main(["info", str(tmp_path / "lfm2")]) == 0
    out = capsys.readouterr().out
    assert "exact (block_size=512)" in out and out.count("short_conv") == 3  # the attention's options


def test_attention_transfer_compares_only_the_attention_layers():
    model = rnnify.convert(_lfm2(), to="linear")
    ids = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(6))
    with attention_transfer(model) as recorder:
        model(ids, model.init_state(2))
        errors = recorder.errors()
        assert [error.tokens for error in errors] == [0, 0, 24, 0] and errors[2].rel_error > 0
        assert len(recorder.losses()) == 1 and recorder.loss().requires_grad


@pytest.mark.parametrize("target, options", [("linear", {}), ("window", {"window": 4})])
def test_approximate_targets_convert_only_the_attention_layers(target, options):
    model = rnnify.convert(_lfm2(), to=target, **options)
    assert [cell.target for cell in model.cells] == ["short_conv", "short_conv", target, "short_conv"]
    ids = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(5))
    assert_steps_and_split_prefill_match(model, ids, split=9)


class _CenteredConv(torch.nn.Module):
    """A depthwise convolution over the tokens that reads the next token too: padded by the
    convolution (as LFM2's), or before it (as ZAYA's)."""

    def __init__(self, channels: int, pad_before: bool):
        super().__init__()
        self.pad_before = pad_before
        self.conv = torch.nn.Conv1d(channels, channels, 3, padding=0 if pad_before else 1, groups=channels)

    def forward(self, x):
        x = x.transpose(1, 2)
        return self.conv(F.pad(x, (1, 1)) if self.pad_before else x).transpose(1, 2)


class _GroupedCausalConv(torch.nn.Module):
    """A causal convolution of 3 tokens whose channels mix within 2 groups, in LFM2's form (padded by
    the convolution, its first T outputs kept)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = torch.nn.Conv1d(channels, channels, 3, padding=2, groups=2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def test_a_grouped_causal_convolution_converts_exactly(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    source.model.layers[1].mlp = _GroupedCausalConv(source.config.hidden_size)
    model = rnnify.convert(source, to="exact")
    (conv,) = [cell for cell in model.cells if cell.target == "short_conv"]
    assert conv.kernel_size == 3 and conv.groups == [2]
    ids = torch.randint(3, source.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = source(input_ids=ids, use_cache=False).logits
    assert rel_diff(decode(model, ids, 6)[0], want) < 1e-4


@pytest.mark.parametrize("pad_before", [False, True])
def test_a_convolution_that_is_not_causal_is_refused_naming_its_layer(tiny_model_dir, pad_before):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    source.model.layers[1].mlp = _CenteredConv(source.config.hidden_size, pad_before)
    with pytest.raises(UnsupportedModelError, match=r"layer 1 \(model\.layers\.1\.mlp.*not causal"):
        rnnify.convert(source, to="linear")
