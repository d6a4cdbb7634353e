"""A converted directory through transformers: Auto classes, generate and pipeline, against the original."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import reseal
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

import rnnify
from rnnify.integrations.transformers import RnnifyForCausalLM
from rnnify.runtime import hf_files

PROMPT = "def read(path):"
BUNDLED = Path(__file__).resolve().parents[1] / "examples" / "models" / "stdlib-llama"


@pytest.fixture(scope="module")
def models(tiny_model_dir, converted_dir):
    """(the original Llama, the wrapper over its exact conversion, tokenizer)."""
    source = tiny_model_dir("llama")
    original = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
    wrapper = RnnifyForCausalLM.from_pretrained(converted_dir("llama", "exact"))
    return original, wrapper, AutoTokenizer.from_pretrained(source)


def _ids(tokenizer, text=PROMPT):
    return tokenizer(text, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.9},
        {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2},
        {"num_beams": 4},
        {"num_beams": 4, "num_return_sequences": 2, "length_penalty": 0.5},
    ],
    ids=["greedy", "sampling", "penalties", "beam4", "beam4-return2"],
)
def test_generate_equals_the_original_token_for_token(models, options):
    original, wrapper, tokenizer = models
    ids = _ids(tokenizer)
    outputs = []
    for model in (original, wrapper):
        torch.manual_seed(0)
        outputs.append(model.generate(ids, max_new_tokens=24, min_new_tokens=24, pad_token_id=0, **options))
    assert torch.equal(outputs[1], outputs[0])


def test_rnnify_generate_samples_with_the_defaults_of_transformers(models, converted_dir):
    """rnnify's own generate, given only do_sample and a seed, draws the original's tokens as transformers
    draws them after ``torch.manual_seed``: the same defaults (top-k 50) and the same random stream."""
    original, _, tokenizer = models
    model = rnnify.load(converted_dir("llama", "exact"))
    ids = _ids(tokenizer)
    for seed, options in [(0, {}), (1, {}), (2, {"top_k": 0})]:  # top_k 0: from every token, in both
        torch.manual_seed(seed)
        want = original.generate(ids, do_sample=True, max_new_tokens=16, eos_token_id=None, pad_token_id=0, **options)
        assert torch.equal(model.generate(ids, do_sample=True, max_new_tokens=16, seed=seed, **options), want)


def test_left_padded_batch_equals_each_prompt_alone(models):
    original, wrapper, tokenizer = models
    prompts = [PROMPT, "import os\nclass Reader(object):"]
    tokenizer.padding_side, tokenizer.pad_token = "left", tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert not bool(batch["attention_mask"].all())  # the prompts differ in length
    got = wrapper.generate(**batch, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        alone = original.generate(_ids(tokenizer, prompt), max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        assert got[row, -12:].tolist() == alone[0, -12:].tolist()


def test_without_cache_and_continuing_a_returned_cache(models):
    original, wrapper, tokenizer = models
    ids = _ids(tokenizer)
    want = original.generate(ids, max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    fixed = {"min_new_tokens": 5, "max_new_tokens": 5, "pad_token_id": 0}
    uncached = wrapper.generate(ids, use_cache=False, **{**fixed, "min_new_tokens": 10, "max_new_tokens": 10})
    assert torch.equal(uncached, want)
    first = wrapper.generate(ids, return_dict_in_generate=True, **fixed)
    assert torch.equal(wrapper.generate(first.sequences, cache=first.cache, **fixed), want)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_decode_loop_continues_the_state_under_either_name(models, name):
    """``past_key_values`` is the cache's name before transformers 5.24, which decode loops still pass."""
    original, wrapper, tokenizer = models
    ids = _ids(tokenizer)
    want = original(ids).logits[:, -1]
    out = wrapper(ids[:, :-1], use_cache=True)
    got = wrapper(ids[:, -1:], **{name: out.cache}).logits[:, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="name the same state"):
        wrapper(ids[:, -1:], cache=out.cache, past_key_values=out.cache)


def test_position_ids_other_than_the_state_s_are_refused_not_ignored(models):
    original, wrapper, tokenizer = models
    ids = _ids(tokenizer)
    length = ids.shape[1]
    torch.testing.assert_close(wrapper(ids, position_ids=torch.arange(length)[None]).logits, original(ids).logits)
    with pytest.raises(ValueError, match="numbers positions from its state"):
        wrapper(ids, position_ids=torch.arange(1, length + 1)[None])
    # a left-padded row: its real tokens count from 0, as transformers numbers them (padding: any id)
    padded, mask = (
        torch.cat([ids[:, :1], ids], 1),
        torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.ones_like(ids)], 1),
    )
    theirs = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    torch.testing.assert_close(
        wrapper(padded, attention_mask=mask, position_ids=theirs).logits[:, 1:], original(ids).logits
    )
    with pytest.raises(ValueError, match="numbers positions from its state"):
        wrapper(padded, attention_mask=mask, position_ids=torch.arange(length + 1)[None])


def test_the_wrapper_refuses_another_dtype_and_keeps_its_own(models):
    _, wrapper, _ = models
    with pytest.raises(rnnify.RnnifyError, match="converted in float32 and runs in it"):
        wrapper.to(torch.bfloat16)
    assert wrapper.rnn.graph.lm_head.weight.dtype == torch.float32


def test_stop_strings_and_streamer(models):
    original, wrapper, tokenizer = models
    ids = _ids(tokenizer)
    full = original.generate(ids, max_new_tokens=30, min_new_tokens=30, pad_token_id=0)
    text = tokenizer.decode(full[0, ids.shape[1] :])
    stop = text[len(text) // 3 : len(text) // 3 + 2]  # a string the original produces a third of the way in

    class Collect:
        def __init__(self):
            self.tokens: list[int] = []

        def put(self, value):
            self.tokens.extend(value.flatten().tolist())

        def end(self):
            self.tokens.append(-1)

    streamer = Collect()
    got = wrapper.generate(
        ids, max_new_tokens=30, stop_strings=[stop], tokenizer=tokenizer, streamer=streamer, pad_token_id=0
    )
    new = tokenizer.decode(got[0, ids.shape[1] :])
    assert new.endswith(stop) and text.startswith(new) and len(new) < len(text)
    assert streamer.tokens == got[0].tolist() + [-1]


def test_pipeline_gives_the_originals_text(models):
    original, wrapper, tokenizer = models
    texts = [
        pipeline("text-generation", model=model, tokenizer=tokenizer)(PROMPT, max_new_tokens=16, do_sample=False)
        for model in (original, wrapper)
    ]
    assert texts[1] == texts[0]


@pytest.mark.parametrize(
    "options, match",
    [
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive_search cannot run"),
        ({"prompt_lookup_num_tokens": 3}, "assisted_generation cannot run"),
        ({"cache_implementation": "static"}, "cache_implementation='static'"),
        ({"prefill_chunk_size": 4}, "prefill_chunk_size"),
        ({"dola_layers": "low"}, "dola_generation cannot run"),
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0}, "group_beam_search cannot run"),
        ({"cache": DynamicCache()}, "cache must be a RecurrentCache .*, got DynamicCache"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions=True: .* logits only"),
        ({"output_hidden_states": True, "return_dict_in_generate": True}, "output_hidden_states=True"),
    ],
)
def test_modes_that_need_past_keys_are_refused(models, options, match):
    _, wrapper, tokenizer = models
    with pytest.raises(ValueError, match=match):
        wrapper.generate(_ids(tokenizer), max_new_tokens=4, **options)


def test_an_rnnify_model_as_assistant_is_refused_before_it_drafts(models):
    """Assisted decoding crops the assistant's cache where the main model rejects its drafts: the
    wrapper failed mid-generation then, from transformers' code, and only when a draft was rejected."""
    original, wrapper, tokenizer = models
    with pytest.raises(ValueError, match="an rnnify model cannot be an assistant_model"):
        original.generate(_ids(tokenizer), assistant_model=wrapper, max_new_tokens=8, pad_token_id=0)


def test_a_right_padded_batch_is_refused(models):
    """transformers only warns that the decoding starts from the padding; rnnify's own generate refuses."""
    _, wrapper, tokenizer = models
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.padding_side, tokenizer.pad_token = "right", tokenizer.eos_token
    batch = tokenizer([PROMPT, "import os"], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="a row ends in padding.*pad on the left"):
        wrapper.generate(**batch, max_new_tokens=4, pad_token_id=0)


def test_the_default_cache_implementation_is_the_recurrent_state(models):
    """``cache_implementation="dynamic"`` (transformers' default cache), given or from the model's generation
    config, decodes over the recurrent state as if unset."""
    _, wrapper, tokenizer = models
    ids, fixed = _ids(tokenizer), {"max_new_tokens": 6, "min_new_tokens": 6, "pad_token_id": 0}
    want = wrapper.generate(ids, **fixed)
    assert torch.equal(wrapper.generate(ids, cache_implementation="dynamic", **fixed), want)
    config = copy.deepcopy(wrapper.generation_config)
    config.update(cache_implementation="dynamic", **fixed)
    assert torch.equal(wrapper.generate(ids, generation_config=config), want)


@pytest.mark.parametrize(
    "device_map",
    [None, "cpu", "auto", {"": "cpu"}, {"model": "cpu", "lm_head": "cpu"}, torch.device("cpu")],
    ids=["none", "cpu", "auto", "all-cpu", "each-cpu", "torch-device"],
)
def test_device_maps_to_one_device_are_accepted(converted_dir, device_map):
    """lm-eval's ``hf`` model passes ``{"": device}``; "auto" is the CPU where there is no GPU."""
    if device_map == "auto" and torch.cuda.is_available():
        pytest.skip("'auto' is CUDA here")
    model = RnnifyForCausalLM.from_pretrained(converted_dir("llama", "exact"), device_map=device_map)
    assert model.rnn.device == torch.device("cpu")


@pytest.mark.parametrize("device_map", [{"model": "cpu", "lm_head": "cuda:0"}, {"": "disk"}, {}, "disk"])
def test_device_maps_over_several_devices_are_refused(converted_dir, device_map):
    with pytest.raises(rnnify.RnnifyError, match=r"^device_map=.*: an rnnify model runs on one device; give one"):
        RnnifyForCausalLM.from_pretrained(converted_dir("llama", "exact"), device_map=device_map)


def test_forward_loss_and_logits_equal_the_original(models):
    original, wrapper, tokenizer = models
    ids = _ids(tokenizer, PROMPT + " return open(path).read()")
    with torch.no_grad():
        want, got = original(ids, labels=ids), wrapper(ids, labels=ids)
    assert torch.allclose(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    assert abs(float(got.loss) - float(want.loss)) < 1e-4


def test_loss_is_transformers_causal_lm_loss_and_equals_the_shifted_cross_entropy(models):
    """The loss is ``loss_function`` (ForCausalLMLoss): equal to the shifted cross-entropy the wrapper computed
    before, with ignored (-100) labels, over a batch, and summed over ``num_items_in_batch`` when given."""
    _, wrapper, tokenizer = models
    ids = torch.cat([_ids(tokenizer, PROMPT + " return open(path).read()")] * 2)
    labels = ids.clone()
    labels[0, :3] = labels[1, -2:] = -100
    with torch.no_grad():
        got = wrapper(ids, labels=labels)
        summed = wrapper(ids, labels=labels, num_items_in_batch=torch.tensor(7))
    flat_logits, flat_labels = got.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten()
    before = torch.nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=-100)
    assert abs(float(got.loss) - float(before)) < 1e-6
    total = torch.nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
    assert abs(float(summed.loss) - float(total) / 7) < 1e-5


def test_auto_classes_refuse_without_trust_remote_code_and_load_with_it(converted_dir, monkeypatch):
    """As in a program that never imported rnnify (its classes unregistered): never the original model."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from rnnify.integrations.transformers import RnnifyConfig

    monkeypatch.delitem(CONFIG_MAPPING._extra_content, "rnnify")
    monkeypatch.delitem(MODEL_FOR_CAUSAL_LM_MAPPING._extra_content, RnnifyConfig)
    monkeypatch.setattr("sys.stdin", io.StringIO())  # transformers asks on a terminal; here it must refuse
    directory = converted_dir("llama", "exact")
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    assert type(model).__name__ == "RnnifyForCausalLM"
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, rnnify.load(directory).prefill(ids)[0])


def test_rnnify_reads_the_tokenizer_without_asking_about_remote_code(converted_dir, tiny_model_dir, monkeypatch):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from rnnify.data import load_tokenizer

    monkeypatch.delitem(CONFIG_MAPPING._extra_content, "rnnify")
    monkeypatch.setattr("builtins.input", lambda *args: pytest.fail(f"transformers asked: {args}"))
    text = "def read(path):\n    return open(path).read()"
    got = load_tokenizer(converted_dir("llama", "exact"))(text)["input_ids"]
    assert got == AutoTokenizer.from_pretrained(tiny_model_dir("llama"))(text)["input_ids"]


def test_config_names_rnnify_and_keeps_the_source_config(converted_dir, tiny_model_dir):
    config = json.loads((converted_dir("llama", "exact") / "config.json").read_text())
    source = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    assert config["model_type"] == "rnnify" and config["architectures"] == ["RnnifyForCausalLM"]
    assert config["source_config"] == source


def test_config_names_the_source_fields_by_their_common_names(converted_dir, tiny_model_dir):
    """GPT-2 names its table length ``n_positions`` and its width ``n_embd``; ``config.json`` gives the
    length as ``max_position_embeddings`` (what lm-eval and vLLM read), and vLLM's config reads the
    sizes by their common names, its pages' from the exact sites."""
    from rnnify.integrations.vllm.config import RnnifyVllmConfig

    directory = converted_dir("gpt2", "exact")
    source = json.loads((tiny_model_dir("gpt2") / "config.json").read_text())
    config = json.loads((directory / "config.json").read_text())
    assert "max_position_embeddings" not in source and config["max_position_embeddings"] == source["n_positions"]
    served = RnnifyVllmConfig.from_pretrained(directory, name_or_path=str(directory))  # as vLLM reads it
    sizes = (served.hidden_size, served.num_hidden_layers, served.num_attention_heads, served.max_position_embeddings)
    assert sizes == (source["n_embd"], source["n_layer"], source["n_head"], source["n_positions"])
    assert (served.head_dim, served.num_key_value_heads) == (source["n_embd"] // source["n_head"], source["n_head"])


def test_vllm_pages_hold_the_kv_heads_the_exact_sites_keep(tmp_path):
    """Where only kv head 0 of each layer stays exact (the rest linear or windowed), vLLM's pages hold
    one kv head a token, not the model's two; their width is the sites' head size."""
    from rnnify.integrations.vllm.config import RnnifyVllmConfig

    layers = "0:heads(0=exact;1=linear),1:heads(0=exact;1=window(window=8))"
    directory = rnnify.convert(BUNDLED, to="window", window=16, layers=layers).save(tmp_path / "heads")
    served = RnnifyVllmConfig.from_pretrained(directory, name_or_path=str(directory))
    source = json.loads((BUNDLED / "config.json").read_text())
    assert source["num_key_value_heads"] == 2 and served.num_key_value_heads == 1
    assert served.head_dim == source["hidden_size"] // source["num_attention_heads"]
    assert served.architectures == [hf_files.PAGED_ARCHITECTURE]


def test_directories_with_the_source_config_still_load(converted_dir, tiny_model_dir, tmp_path):
    """Directories saved before config.json named rnnify: rnnify.load and the wrapper read them."""
    old = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "old")
    shutil.copy(tiny_model_dir("llama") / "config.json", old / "config.json")
    (old / hf_files.MODELING_FILE).unlink()
    reseal(old)  # saved so: the files are all that differs
    ids = torch.arange(3, 19)[None]
    expected, _ = rnnify.load(converted_dir("llama", "exact")).prefill(ids)
    loaded = rnnify.load(old)
    assert loaded.files["config.json"] == (tiny_model_dir("llama") / "config.json").read_bytes()
    assert torch.equal(loaded.prefill(ids)[0], expected)
    with torch.no_grad():
        assert torch.equal(RnnifyForCausalLM.from_pretrained(old)(ids).logits, expected)


def test_modeling_file_asks_for_a_newer_rnnify(monkeypatch):
    monkeypatch.setattr(rnnify, "__version__", "0.0.9")
    with pytest.raises(ImportError, match=r"needs rnnify >= 0\.1\.0, found 0\.0\.9: pip install -U rnnify"):
        exec(compile(hf_files.modeling_file(), hf_files.MODELING_FILE, "exec"), {})


def test_converting_a_converted_directory_is_refused(converted_dir):
    with pytest.raises(rnnify.RnnifyError, match="already converted"):
        rnnify.convert(converted_dir("llama", "exact"), to="exact")


def test_pipeline_with_trust_remote_code_in_a_fresh_process_generates_rnnify_s_tokens(converted_dir, tmp_path):
    """``pipeline(model=dir, trust_remote_code=True)`` in a process that never imported rnnify: the directory's
    ``modeling_rnnify.py`` loads the model, its tokenizer loads without a question or a warning, and greedy
    decoding gives ``rnnify.load(dir).generate``'s tokens. (With stdin at EOF a question would not wait, so
    its text is what shows one was asked.)"""
    from rnnify.runtime.text import eos_ids

    directory = converted_dir("llama", "exact")
    script = (
        "import json, sys\n"
        "from transformers import pipeline\n"
        "assert 'rnnify' not in sys.modules\n"
        f"generator = pipeline('text-generation', model={str(directory)!r}, trust_remote_code=True)\n"
        f"out = generator({PROMPT!r}, max_new_tokens=16, do_sample=False, return_tensors=True)\n"
        "print(json.dumps(out[0]['generated_token_ids']))\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "TRANSFORMERS_VERBOSITY": "warning"}
    done = subprocess.run(
        [sys.executable, "-c", script], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "custom code" not in said and "`rnnify`" not in said, said
    got = json.loads(done.stdout.splitlines()[-1])
    model = rnnify.load(directory)
    prompt = model.tokenizer(PROMPT).input_ids
    want = model.generate(torch.tensor([prompt]), 16, eos_token_id=eos_ids(model, model.tokenizer))
    assert got == want[0].tolist()
