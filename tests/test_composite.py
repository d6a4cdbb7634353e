"""Composite (vision- and audio-language) models: rnnify converts their language model.

The reference is the whole model on text, never the language model rnnify takes out of it: a
conversion that took the wrong decoder or head, or a whole whose text path is not its language
model alone, must fail here."""

import json
import sys
from pathlib import Path

import pytest
import torch
from cli_support import assert_user_error, run

import rnnify
from rnnify.auto.graph_probe import probe_runner
from rnnify.compiler import composite
from rnnify.errors import RnnifyError, RnnifyWarning
from rnnify.runtime.agreement import tolerance
from tests.support import decode, original_logits, rel_diff

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from arch_configs import build  # noqa: E402

STEPS = 6


def whole(model_type: str):
    return build(model_type)[0]


def text_ids(model, length: int = 14) -> torch.Tensor:
    """Ids no config field names (image, audio and boundary tokens stay out of a text prompt)."""
    config = model.config.to_dict()
    named = {v for k, v in config.items() if "token" in k and isinstance(v, int)}
    named |= {v for k, v in config["text_config"].items() if "token" in k and isinstance(v, int)}
    vocab = model.config.get_text_config().vocab_size
    ordinary = torch.tensor([i for i in range(3, vocab) if i not in named])
    return ordinary[torch.randint(0, len(ordinary), (2, length), generator=torch.Generator().manual_seed(1))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(model_type)`` -> (the whole model, its directory), saved once per module."""
    cache = {}

    def make(model_type: str):
        if model_type not in cache:
            model = whole(model_type)
            directory = tmp_path_factory.mktemp(model_type)
            model.save_pretrained(directory)
            cache[model_type] = model, directory
        return cache[model_type]

    return make


@pytest.mark.parametrize(
    ("model_type", "text_type"),
    [
        ("gemma3", "gemma3_text"),  # Gemma3ForCausalLM: the final softcap after the decoder
        ("llava", "llama"),
        ("mistral3", "mistral"),
        ("qwen2_vl", "qwen2_vl_text"),  # no causal LM class: TextPath, multimodal RoPE on 2-D positions
        ("cohere2_vision", "cohere2"),  # Cohere2ForCausalLM scales logits, the whole does not: TextPath
        ("granite_docling", "granite_docling_text"),  # the whole divides its logits by logits_scaling
        ("muse_spark", "muse_spark_text"),  # the whole multiplies them by output_multiplier, then caps
        # a window or'ed with the prompt (all of it, without a cache), a mask transformers builds with vmap
        ("unlimited_ocr", "unlimited_ocr_text"),
    ],
)
def test_a_composite_directory_converts_to_its_language_model_exactly(saved, tmp_path, model_type, text_type):
    model, directory = saved(model_type)
    with pytest.warns(RnnifyWarning, match="composite model: rnnify converts its language model"):
        converted = rnnify.convert(directory, to="exact")
    ids = text_ids(model)
    assert rel_diff(converted.prefill(ids)[0], original_logits(model, ids)) < 1e-4
    assert rel_diff(decode(converted, ids, ids.shape[1] - STEPS)[0], original_logits(model, ids)) < 1e-4
    out = converted.save(tmp_path / "out")
    source = json.loads((out / "config.json").read_text())["source_config"]
    assert source["model_type"] == text_type  # the text config: what the converted model is
    assert rel_diff(rnnify.load(out).prefill(ids)[0], original_logits(model, ids)) < 1e-4


def test_a_whole_that_transformers_loads_as_its_text_model_saves_the_text_config(tmp_path):
    import transformers

    text = whole("qwen3_5").config  # transformers loads a Qwen 3.5 directory as its text causal LM itself
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)
    ).eval()
    model.save_pretrained(tmp_path / "whole")
    converted = rnnify.convert(tmp_path / "whole", to="exact")
    ids = text_ids(model)
    assert rel_diff(decode(converted, ids, 8)[0], original_logits(model, ids)) < 1e-4
    saved = json.loads((converted.save(tmp_path / "out") / "config.json").read_text())
    assert saved["source_config"]["model_type"] == "qwen3_5_text" and "vision_config" not in saved["source_config"]


def test_a_composite_loaded_from_its_directory_keeps_its_files(saved, tmp_path):
    import transformers

    _, directory = saved("llava")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "max_new_tokens": 9}))
    model = transformers.AutoModelForImageTextToText.from_pretrained(directory)
    with pytest.warns(RnnifyWarning):
        out = rnnify.convert(model, to="exact").save(tmp_path / "out")
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 9


def test_a_loaded_composite_converts_to_its_language_model():
    model = whole("gemma4")
    with pytest.warns(RnnifyWarning, match=r"Gemma4ForConditionalGeneration .*\(Gemma4ForCausalLM\)"):
        converted = rnnify.convert(model, to="exact")
    ids = text_ids(model)
    assert rel_diff(decode(converted, ids, 4)[0], original_logits(model, ids)) < 1e-4


def test_the_auto_probe_scores_a_composite_by_its_language_model():
    model = whole("llava")
    ids = text_ids(model)[:1]
    with pytest.warns(RnnifyWarning):
        runner, specs = probe_runner(model, torch.float32, ids)
    assert sorted(specs) == list(range(model.config.text_config.num_hidden_layers))
    assert rel_diff(runner.logits(ids), original_logits(model, ids)[0]) < 1e-4


def test_a_composite_that_cannot_convert_is_refused_in_one_line(capsys, saved, tmp_path):
    _, directory = saved("paligemma")  # a prefix LM: the prompt reads itself both ways
    capsys.readouterr()  # what saving the whole printed
    code, _, err = run(capsys, "convert", directory, "--to", "exact", "-o", tmp_path / "out")
    errors = "\n".join(line for line in err.splitlines() if not line.startswith("warning: "))
    assert_user_error(code, errors, "bidirectional attention")
    assert not (tmp_path / "out").exists()


def test_the_cli_converts_and_verifies_a_composite(capsys, saved, tmp_path):
    _, directory = saved("gemma3")
    capsys.readouterr()
    code, _, err = run(capsys, "convert", directory, "--to", "exact", "-o", tmp_path / "out", "--threads", "1")
    assert code == 0, err
    assert err.count("warning: Gemma3ForConditionalGeneration is a composite model") == 1
    code, out, err = run(capsys, "verify", tmp_path / "out", "--against", directory)
    assert code == 0, out + err
    assert "vs original" in out and "all checks passed" in out


def test_a_composite_whose_text_path_differs_from_every_language_model_is_refused():
    model = whole("llava")
    forward = model.forward

    def doubled(*args, **kwargs):  # a whole that computes something after its head
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    model.forward = doubled
    with pytest.raises(RnnifyError, match=r"LlamaForCausalLM: relative difference .*; TextPath: relative difference"):
        rnnify.convert(model, to="exact")


def test_the_text_path_closest_to_the_whole_is_taken_not_the_first_within_tolerance():
    """Mistral Large 4's whole caps its logits (30 tanh(logits / 30)) with no causal LM class for its
    text config: with its head scaled down the cap barely bends the logits, so the uncapped
    ``TextPath`` passes the tolerance too, and the capped one, closer, is still the one taken."""
    whole, _ = build("mistral_large4")
    with torch.no_grad():
        whole.lm_head.weight.mul_(0.05)
    ids, want = composite._whole_on_text(whole)
    decoder, head = whole.get_decoder(), whole.get_output_embeddings()
    config = whole.config.get_text_config(decoder=True)
    got, _ = composite._logits(composite._text_path_class()(config, decoder, head).eval(), ids)
    uncapped, _ = composite._difference(got, want)
    assert uncapped <= tolerance(want.dtype)
    runs = []
    decoder.register_forward_hook(lambda *_: runs.append(1))
    with pytest.warns(RnnifyWarning):
        text = composite.language_model(whole)
    assert text.softcap == config.final_logit_softcapping
    assert len(runs) == 2  # the whole's, then one for both finishes of the text path
