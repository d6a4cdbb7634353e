"""Older eager attention: the masks GPT-Neo (``where(mask, s, lowest)``, a window in its local layers),
OpenAI GPT (``s * b + -1e4 * (1 - b)``, its k^T one permute of [B, T, H, d]), XGLM (``max(s, lowest)``
after its mask), XLM (an in-place ``masked_fill_`` of the scores) and RoFormer (its sinusoidal table
read by the count of its tokens, laid out ``[None, None]``) apply. Each tiny model (random weights,
as ``benchmarks/arch_sweep.py`` builds them) converts exactly, against the original run in float64;
a non-causal variant of each, and a mask form that does not mask, is refused in one line naming the
layer (rnnify/compiler/passes/eager_attention.py, find_attention.py, find_positions.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from support import decode, original_logits, rel_diff, tiny_causal_lm
from test_biases import _Eager, _EagerLM, _find_attention
from torch import nn

import rnnify
from rnnify.compiler.passes.find_attention import sites
from rnnify.errors import UnsupportedModelError
from rnnify.runtime.agreement import tolerance

VOCAB, TOKENS, PROMPT = 256, 24, 16
SIZES = {"vocab_size": VOCAB, "max_position_embeddings": 128}

CONFIGS = {  # model type -> its config's arguments
    # a global layer, then a local one over 4 tokens (``bias`` xor its band below the window)
    "gpt_neo": dict(
        SIZES, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=4
    ),
    "openai-gpt": dict(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4),
    "xglm": dict(SIZES, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128),
    "xlm": dict(SIZES, emb_dim=64, n_layers=2, n_heads=4, causal=True),
    "roformer": dict(
        SIZES, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, is_decoder=True
    ),
}
WINDOWS = {"gpt_neo": [None, 4]}  # the cells' windows, read from GPT-Neo's mask buffer


def _build(name: str, **changes) -> transformers.PreTrainedModel:
    return tiny_causal_lm(name, **{**CONFIGS[name], **changes})


def _ids(length: int = TOKENS) -> torch.Tensor:
    """Two rows of tokens past the special ones (XLM takes its padding token for the end of a row)."""
    return torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


def _assert_exact(model: transformers.PreTrainedModel, ids: torch.Tensor, prompt: int):
    """The conversion's prefill and prefill + steps against the original in float64 (XGLM's in
    float32: its ``full((), lowest)`` is float32, and float64's lowest overflows it)."""
    converted = rnnify.convert(model, to="exact")
    reference = model if model.config.model_type == "xglm" else copy.deepcopy(model).double()
    want = original_logits(reference, ids)
    with torch.no_grad():
        prefill, _ = converted.prefill(ids)
        stepped, _ = decode(converted, ids, prompt)
    assert rel_diff(prefill, want) < 1e-4
    assert rel_diff(stepped, want) < 1e-4
    return converted


@pytest.mark.parametrize("name", list(CONFIGS))
def test_older_eager_attention_converts_exactly(name):
    converted = _assert_exact(_build(name), _ids(), PROMPT)
    assert [cell.spec.window for cell in converted.cells] == WINDOWS.get(name, [None, None])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_older_eager_attention_converts_exactly_in_bfloat16(name):
    """The masks in the model's dtype: OpenAI GPT's -1e4 is -9984 in bfloat16, and still masks."""
    model = _build(name).to(torch.bfloat16)
    converted = rnnify.convert(model, to="exact")  # checked against the original as it converts
    ids = _ids()
    assert rel_diff(decode(converted, ids, PROMPT)[0], original_logits(model, ids)) < tolerance(torch.bfloat16)


def test_a_window_past_the_probe_is_read_from_the_mask_buffer():
    """GPT-Neo's local layer over 80 tokens: wider than the probe run (64 tokens at most), and the
    config has no ``sliding_window``: only the buffer says so, and 100 tokens show it."""
    model = _build("gpt_neo", window_size=80)
    converted = _assert_exact(model, _ids(100), 90)
    assert [cell.spec.window for cell in converted.cells] == [None, 80]


def _refusal(model: transformers.PreTrainedModel) -> str:
    with pytest.raises(UnsupportedModelError) as raised:
        rnnify.convert(model, to="exact")
    message = str(raised.value)
    assert "\n" not in message
    return message


def _attends_to_all(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """GPT-Neo's and OpenAI GPT's mask buffers set to allow every key."""
    for module in model.modules():
        if isinstance(getattr(module, "bias", None), torch.Tensor) and module.bias.dim() == 4:
            module.bias.fill_(1)
    return model


def test_a_buffer_that_allows_every_key_converts_where_another_mask_is_causal():
    """GPT-Neo adds its causal mask after the buffer's: the two together are what the cells apply."""
    converted = _assert_exact(_attends_to_all(_build("gpt_neo")), _ids(), PROMPT)
    assert [cell.spec.window for cell in converted.cells] == [None, None]


def test_a_non_causal_variant_of_each_mask_form_is_refused(monkeypatch):
    bidirectional = transformers.masking_utils.create_bidirectional_mask
    for modeling in (transformers.models.gpt_neo.modeling_gpt_neo, transformers.models.xglm.modeling_xglm):
        monkeypatch.setattr(modeling, "create_causal_mask", bidirectional)
    assert "layer 0 (transformer.h.0.attn.attention): attention is not causal" in _refusal(
        _attends_to_all(_build("gpt_neo"))
    )
    assert "layer 0 (transformer.h.0.attn): attention is not causal" in _refusal(_attends_to_all(_build("openai-gpt")))
    assert "layer 0 (model.layers.0.self_attn): attention is not causal" in _refusal(_build("xglm"))
    xlm = transformers.models.xlm.modeling_xlm
    masks = xlm.get_masks  # XLM's mask read both ways where its config says causal (which convert checks first)
    monkeypatch.setattr(
        xlm, "get_masks", lambda length, lengths, causal, padding_mask=None: masks(length, lengths, False)
    )
    assert "layer 0 (transformer.attentions.0): attention is not causal" in _refusal(_build("xlm"))
    assert "layer 0 (roformer.encoder.layer.0.attention.self): attention is not causal" in _refusal(
        _build("roformer", is_decoder=False)
    )


class _Masked(_Eager):
    """test_biases's attention op by op, masked as ``mode`` says."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) * self.head_dim**-0.5
        i = torch.arange(t, device=x.device)
        causal = i[None, :] <= i[:, None]
        lowest = torch.finfo(s.dtype).min
        if self.mode == "where":
            s = torch.where(causal, s, torch.tensor(lowest))
        elif self.mode == "where_masked":  # the scores as the value where the mask is False
            s = torch.where(~causal, torch.tensor(lowest), s)
        elif self.mode == "multiply":
            s = s * causal + -1e4 * (~causal).float()
        elif self.mode == "masked_fill_":
            s.masked_fill_(~causal, lowest)
        elif self.mode == "max":
            s = torch.max(s + torch.where(causal, 0.0, float("-inf")), torch.full((), lowest))
        elif self.mode == "where_zero":  # masked scores become 0: attended
            s = torch.where(causal, s, torch.tensor(0.0))
        elif self.mode == "multiply_only":  # masked scores become 0: attended
            s = s * causal
        elif self.mode == "multiply_small":  # masked scores become -100: barely attended, still attended
            s = s * causal + -100.0 * (~causal).float()
        elif self.mode == "where_small":  # the same by a where
            s = torch.where(causal, s, torch.tensor(-100.0))
        elif self.mode == "multiply_by_two":  # a factor, not a mask
            s = s * (2.0 * causal) + -1e4 * (~causal).float()
        elif self.mode == "max_zero":  # max with 0 changes every negative score
            s = torch.max(s + torch.where(causal, 0.0, float("-inf")), torch.zeros(()))
        else:
            raise ValueError(self.mode)
        return self.out((F.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, t, -1))


def _masked_lm(modes: list[str]) -> nn.Module:
    """test_biases's toy LM, its layers masked as ``modes`` say."""
    model = _EagerLM(modes)
    model.layers = nn.ModuleList(_Masked(mode) for mode in modes)
    return model


def test_each_mask_form_is_found_causal():
    modes = ["where", "where_masked", "multiply", "masked_fill_", "max"]
    found = [site for _, site in sites(_find_attention(_masked_lm(modes)))]
    assert [(s.layer, s.window, s.alibi_slopes, s.scale) for s in found] == [
        (layer, None, None, pytest.approx(8**-0.5)) for layer in range(len(modes))
    ]


# the mask forms that do not mask (modes of ``_Masked``), and what their refusal says
NOT_MASKS = {
    "where_zero": "putting a value that is no mask's",
    "multiply_only": "multiplies scores by 0 without masking them",
    "multiply_small": "multiplies scores by 0 without masking them",
    "where_small": "putting a value that is no mask's",
    "multiply_by_two": "multiplies its scores by a factor not 0 or 1",
    "max_zero": "of the scores and more than the lowest value",
}


@pytest.mark.parametrize("mode", list(NOT_MASKS))
def test_a_mask_form_that_does_not_mask_is_refused_naming_the_layer(mode):
    with pytest.raises(UnsupportedModelError, match=rf"layer 1 \(layers\.1\): .*{NOT_MASKS[mode]}"):
        _find_attention(_masked_lm(["where", mode]))
