"""Bad input: each mistake gets an RnnifyError that names the problem and what to do."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, T5Config, T5ForConditionalGeneration

import rnnify
from rnnify.errors import PositionError, RnnifyError, StateError, UnsupportedModelError


def test_missing_path(tmp_path):
    with pytest.raises(RnnifyError, match="no such directory"):
        rnnify.convert(tmp_path / "nope")
    with pytest.raises(RnnifyError, match="no such directory"):
        rnnify.load(tmp_path / "nope")


def test_hub_id_offline_says_to_pass_a_local_directory():
    with pytest.raises(RnnifyError, match="local directory"):
        rnnify.convert("someone/some-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(RnnifyError, match="no config.json"):
        rnnify.convert(tmp_path)


def test_encoder_decoder_is_rejected(tmp_path):
    T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        rnnify.convert(tmp_path)


class _MLPConfig(PretrainedConfig):
    model_type = "rnnify-test-mlp"


class _MLPLanguageModel(PreTrainedModel):
    """A causal LM with no attention at all: each token sees only itself."""

    config_class = _MLPConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, 16)
        self.head = nn.Linear(16, config.vocab_size)

    def forward(self, input_ids, position_ids=None, use_cache=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=self.head(torch.relu(self.embed(input_ids))))


def test_model_without_attention_is_rejected():
    with pytest.raises(UnsupportedModelError, match="no attention"):
        rnnify.convert(_MLPLanguageModel(_MLPConfig(vocab_size=32)))


def test_corrupted_weights(converted_dir, tmp_path):
    broken = shutil.copytree(converted_dir("llama", "linear"), tmp_path / "m")
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(RnnifyError, match="model.safetensors does not match the sha256"):
        rnnify.load(broken)
    with pytest.raises(RnnifyError, match="corrupted weights"):
        rnnify.load(broken, verify=False)


def test_manifest_from_a_newer_format(converted_dir, tmp_path):
    newer = shutil.copytree(converted_dir("llama", "linear"), tmp_path / "m")
    manifest = json.loads((newer / "rnnify.json").read_text())
    manifest["format_version"] = 999
    (newer / "rnnify.json").write_text(json.dumps(manifest))
    with pytest.raises(RnnifyError, match="newer rnnify"):
        rnnify.load(newer)


def test_state_of_wrong_batch_or_other_model(converted_dir):
    model = rnnify.load(converted_dir("llama", "linear"))
    other = rnnify.load(converted_dir("llama", "exact"))
    _, state = model.prefill(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    with pytest.raises(StateError, match="2 sequences but input_ids has 1"):
        model.step(torch.tensor([[7]]), state)
    with pytest.raises(StateError, match="another model"):
        other.step(torch.tensor([[7], [8]]), state)


def test_learned_positions_cannot_be_exceeded(converted_dir):
    model = rnnify.load(converted_dir("gpt2", "linear"))
    limit = model.manifest.positions["limit"]
    _, state = model.prefill(torch.zeros(1, limit, dtype=torch.long))
    with pytest.raises(PositionError, match=f"past the {limit} learned positions"):
        model.step(torch.tensor([[1]]), state)


def test_bad_token_ids(converted_dir):
    model = rnnify.load(converted_dir("llama", "linear"))
    with pytest.raises(RnnifyError, match="token ids must be in"):
        model.prefill(torch.tensor([[model.manifest.vocab_size]]))
    with pytest.raises(RnnifyError, match="one token per row"):
        model.step(torch.tensor([[1, 2]]), model.init_state(1))


def test_unknown_target(tiny_model_dir):
    with pytest.raises(RnnifyError, match="unknown target"):
        rnnify.convert(tiny_model_dir("llama"), to="quantum")
    with pytest.raises(RnnifyError, match="feature map"):
        rnnify.convert(tiny_model_dir("llama"), to="linear", feature_map="nope")
    # the README's targets table lists auto: in Python it is its own call, and the error says which
    with pytest.raises(RnnifyError, match=r"call rnnify\.auto\.auto_convert\(model, data, \.\.\.\)"):
        rnnify.convert(tiny_model_dir("llama"), to="auto")


def test_a_composite_config_without_its_own_vocab_size_is_refused():
    """A vision-language model keeps ``vocab_size`` in its text config: refused by name (it crashed with
    an AttributeError), not converted from the whole model, which came out wrong for Gemma 3."""
    from transformers import Gemma3Config

    from rnnify.compiler.capture import vocab_size
    from rnnify.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="Gemma3Config names no vocab_size of its own .*composite"):
        vocab_size(Gemma3Config())


@pytest.mark.parametrize(
    "call",
    [
        lambda d, device: rnnify.load(d, device=device),
        lambda d, device: rnnify.evaluate(d, torch.ones(1, 8, dtype=torch.long), device=device),
        lambda d, device: rnnify.distill(rnnify.convert(d.parent / "linear-source", to="linear"), [], device=device),
    ],
    ids=["load", "evaluate", "distill"],
)
@pytest.mark.parametrize("device", ["gpu", "cuda:0"], ids=["unknown", "cuda"])
def test_an_unusable_device_is_one_line(converted_dir, tiny_model_dir, tmp_path, call, device):
    """A device torch does not know, or CUDA where there is none: one line, not torch's error at the
    first tensor moved there."""
    if device == "cuda:0" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    directory = tmp_path / "model"
    shutil.copytree(converted_dir("llama", "linear"), directory)
    (tmp_path / "linear-source").symlink_to(tiny_model_dir("llama"))
    said = {
        "gpu": "device 'gpu' is not a device; use cpu, cuda or cuda:N",
        "cuda:0": "device 'cuda:0': no CUDA device is available; use cpu",
    }
    with pytest.raises(RnnifyError) as error:
        call(directory, device)
    assert str(error.value) == said[device]
