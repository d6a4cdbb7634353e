"""Text in, text out: ``model.generate("text")``, ``model.stream``, ``model.chat`` and ``model.tokenizer``.

The reference for a text is the token ids ``generate`` returns for the tokenized prompt, decoded. The
tiny model is random, so its replies are arbitrary bytes: characters split over tokens and invalid
UTF-8 come up in every few tokens, which is what the stream has to decode as the whole does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from support import reseal

import rnnify
from rnnify.chat import Chat
from rnnify.runtime.text import eos_ids
from rnnify.runtime.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def read(path):"
NEW_TOKENS = 24
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
INIT = torch.nn.Module.__init__
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 3}


@pytest.fixture(scope="module")
def model(converted_dir):
    return rnnify.load(converted_dir("llama", "exact"))


@pytest.fixture(scope="module")
def chat_model(chat_dir):
    return rnnify.load(chat_dir)


@pytest.fixture(scope="module")
def chat_dir(converted_dir, tmp_path_factory):
    """The tiny converted llama with a chat template saved beside its tokenizer."""
    directory = shutil.copytree(converted_dir("llama", "exact"), tmp_path_factory.mktemp("chat") / "model")
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    reseal(directory)
    return directory


def _ids_reply(model, ids: list[int], **options) -> str:
    """What ``generate`` on token ids gives after ``ids``, decoded."""
    out = model.generate(torch.tensor([ids]), NEW_TOKENS, eos_token_id=eos_ids(model, model.tokenizer), **options)
    return model.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


@pytest.mark.parametrize("options", [{}, SAMPLING], ids=["greedy", "sampling"])
def test_text_equals_the_decoded_ids_of_generate(model, options):
    text = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, **options)
    assert text == _ids_reply(model, model.tokenizer(PROMPT).input_ids, **options)
    assert text  # the random model does not end at once; an empty text would prove nothing


@pytest.mark.parametrize(
    "call",
    [
        lambda m, **o: m.generate(PROMPT, max_new_tokens=4, **o),
        lambda m, **o: m.generate(torch.tensor([[5, 6]]), 4, **o).tolist(),
        lambda m, **o: "".join(m.stream(PROMPT, max_new_tokens=4, **o)),
        lambda m, **o: m.chat([{"role": "user", "content": "hi"}], max_new_tokens=4, **o),
        lambda m, **o: Chat(m, m.tokenizer, max_new_tokens=4, **o).send("hi").reply_ids,
    ],
    ids=["text", "ids", "stream", "chat", "Chat"],
)
def test_sampling_options_without_do_sample_are_named_in_a_warning(chat_model, call):
    """Greedy decoding reads none of them; as transformers does, say so rather than ignore them."""
    greedy = call(chat_model)
    with pytest.warns(
        rnnify.RnnifyWarning, match=r"^temperature, seed apply only with do_sample=True: decoding greedily$"
    ) as warned:
        assert call(chat_model, temperature=0.5, seed=1) == greedy
    assert warned[0].filename == __file__  # the caller's line, not rnnify's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(chat_model, do_sample=True, temperature=0.5, seed=1)


def test_stream_pieces_join_to_the_returned_text(model):
    pieces = list(model.stream(PROMPT, max_new_tokens=NEW_TOKENS, **SAMPLING))
    assert len(pieces) > 1 and all(pieces)
    assert "".join(pieces) == model.generate(PROMPT, max_new_tokens=NEW_TOKENS, **SAMPLING)


def test_stream_decodes_as_it_is_read(converted_dir, monkeypatch):
    model = rnnify.load(converted_dir("llama", "exact"))
    steps = []
    step = model.step
    monkeypatch.setattr(model, "step", lambda *args, **kwargs: steps.append(1) or step(*args, **kwargs))
    pieces = model.stream(PROMPT, max_new_tokens=NEW_TOKENS)
    assert not steps  # nothing decoded before the first piece is asked for
    next(pieces)
    pieces.close()
    assert 0 < len(steps) < NEW_TOKENS - 1


def test_a_character_split_over_tokens_comes_out_whole(model):
    """The byte-level tokenizer spells "é" and "€" in byte tokens; the stream never shows half of one."""
    from rnnify.runtime.text import _pieces

    text = "naïve café 5 €\nok"
    ids = model.tokenizer(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in model.tokenizer.decode([i]) for i in ids)  # a token that is part of a character
    pieces = list(_pieces((torch.tensor([i]) for i in ids), model.tokenizer))
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)


def test_chat_replies_through_the_saved_template(chat_dir):
    model = rnnify.load(chat_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a state?"}]
    rendered = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<assistant>")  # the directory's template, with the generation prompt
    reply = model.chat(messages, max_new_tokens=NEW_TOKENS)
    assert reply == _ids_reply(model, model.tokenizer(rendered, add_special_tokens=False).input_ids)
    assert "".join(model.stream(messages, max_new_tokens=NEW_TOKENS)) == reply


def test_chat_continues_a_last_message_of_the_assistant(chat_model):
    """As transformers' text-generation pipeline does: the turn is left open, not closed and begun anew."""
    messages = [{"role": "user", "content": "What is a state?"}, {"role": "assistant", "content": "A state is"}]
    rendered = chat_model.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered.endswith("<assistant>A state is")
    reply = chat_model.chat(messages, max_new_tokens=NEW_TOKENS)
    assert reply == _ids_reply(chat_model, chat_model.tokenizer(rendered, add_special_tokens=False).input_ids)


def test_chat_replies_at_chat_length_and_generate_continues_at_its_own(chat_model, monkeypatch):
    from rnnify.choices import CHAT_MAX_NEW_TOKENS, MAX_NEW_TOKENS

    asked = []  # what each call asks for; nothing decoded
    monkeypatch.setattr(type(chat_model), "_new_tokens", lambda self, ids, **o: asked.append(o) or iter(()))
    chat_model.chat([{"role": "user", "content": "hi"}])
    chat_model.generate(PROMPT)
    chat_model.chat([{"role": "user", "content": "hi"}], max_new_tokens=3)
    assert [o["max_new_tokens"] for o in asked] == [CHAT_MAX_NEW_TOKENS, MAX_NEW_TOKENS, 3]


def test_a_model_without_a_tokenizer_fails_with_one_line(converted_dir, tmp_path):
    directory = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).unlink()
    reseal(directory, source=str(tmp_path / "gone"))  # nor a source to take one from
    model = rnnify.load(directory)
    assert model.tokenizer is None
    with pytest.raises(rnnify.RnnifyError, match="no tokenizer") as error:
        model.generate(PROMPT)
    assert "\n" not in str(error.value)
    ids = torch.tensor([[5, 6, 7]])
    assert model.generate(ids, 4).shape == (1, 7)  # token ids need none


@pytest.mark.parametrize("named", ["pipeline", "AutoModelForCausalLM", "LlamaForCausalLM"])
@pytest.mark.parametrize("where", ["tokenizer_config.json", "a plain config.json"])
def test_a_tokenizer_class_that_names_no_tokenizer_is_refused(converted_dir, tmp_path, named, where, monkeypatch):
    """transformers resolves ``tokenizer_class`` among every attribute of its package and calls the
    result's ``from_pretrained`` on the directory: a function or a model class is refused first, from
    tokenizer_config.json or from a config.json that transformers reads itself (not rnnify's)."""
    directory = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "model")
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    if where == "tokenizer_config.json":
        tokenizer_config["tokenizer_class"] = named
    else:
        del tokenizer_config["tokenizer_class"]
        source = json.loads((directory / "config.json").read_text())["source_config"]
        (directory / "config.json").write_text(json.dumps({**source, "tokenizer_class": named}))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reseal(directory)
    built = []
    monkeypatch.setattr(torch.nn.Module, "__init__", lambda self, *a, **k: built.append(self) or INIT(self, *a, **k))
    model = rnnify.load(directory)
    built.clear()
    with pytest.raises(rnnify.RnnifyError, match=f"tokenizer_class '{named}' is not a tokenizer class"):
        model.tokenizer
    assert built == []  # no model was built from the directory on the way


@pytest.mark.parametrize("key", ["vocab", "merges", "vocab_file", "merges_file", "tokenizer_file"])
def test_a_tokenizer_reads_no_file_outside_its_directory(converted_dir, tmp_path, key):
    """tokenizer_config.json may name files by path: ``vocab`` and ``merges`` as strings, and ``*_file``
    keys that the tokenizer's class does not declare (transformers replaces only those it declares), a
    class opens wherever they point, outside the directory and its sha256 record. rnnify's load gives
    them the directory's own file of that name, or none."""
    directory = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "model")
    own = rnnify.load(directory).tokenizer.get_vocab()
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"secret": 0, "word": 1}))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config[key] = str(outside)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reseal(directory)
    assert rnnify.load(directory).tokenizer.get_vocab() == own


def test_a_class_that_declares_no_vocab_file_reads_none_from_outside(converted_dir, tmp_path):
    """The red team's case: GemmaTokenizer declares only ``tokenizer_file``, so transformers left
    ``vocab_file`` and ``merges_file`` as the config gave them, and built the vocabulary from there."""
    directory = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "model")
    model = json.loads((directory / "tokenizer.json").read_text())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = (m if isinstance(m, str) else " ".join(m) for m in model["merges"])
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (directory / "tokenizer.json").unlink()
    tokenizer_config = {"tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>"}
    tokenizer_config.update(vocab_file=str(tmp_path / "vocab.json"), merges_file=str(tmp_path / "merges.txt"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reseal(directory)
    try:
        tokenizer = rnnify.load(directory).tokenizer
    except rnnify.RnnifyError:
        return  # no vocabulary of its own: refused, also fine
    assert len(tokenizer) < len(model["vocab"])


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_versioned_tokenizer_file_is_refused(converted_dir, tmp_path, where):
    """``fast_tokenizer_files`` (a list) names the tokenizer file for each transformers version by any
    path: transformers opened ``../elsewhere/tokenizer.1.0.json`` in place of the recorded tokenizer.json;
    rnnify writes no such file, so an unrecorded one inside is refused as well."""
    directory = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "model")
    place = tmp_path / "elsewhere" if where == "outside" else directory
    place.mkdir(exist_ok=True)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][0], "id": 4096, "content": "SECRET"})
    (place / "tokenizer.1.0.json").write_text(json.dumps(tokenizer))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["fast_tokenizer_files"] = [os.path.relpath(place / "tokenizer.1.0.json", directory)]
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reseal(directory)
    with pytest.raises(rnnify.RnnifyError, match="fast_tokenizer_files .* names files rnnify never writes"):
        rnnify.load(directory).tokenizer
    source = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "source")  # not converted: bare names only
    (source / "rnnify.json").unlink()
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if where == "outside":
        with pytest.raises(rnnify.RnnifyError, match="fast_tokenizer_files .* names files outside the directory"):
            load_tokenizer(source)


def test_chat_templates_added_beside_a_saved_one_are_refused(chat_dir, tmp_path):
    """transformers reads every ``additional_chat_templates/*.jinja`` (links followed) as a chat template,
    ``default.jinja`` in place of the saved one; the folder needs no reseal, since no record covers it."""
    directory = shutil.copytree(chat_dir, tmp_path / "model")
    secret = tmp_path / "secret.txt"
    secret.write_text("API_KEY=hunter2")
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "default.jinja").symlink_to(secret)
    model = rnnify.load(directory, expected_digest=rnnify.load(chat_dir).manifest.digest)
    with pytest.raises(rnnify.RnnifyError, match="additional_chat_templates: rnnify writes no such folder"):
        model.chat([{"role": "user", "content": "hi"}], max_new_tokens=1)


def test_a_tokenizer_file_the_tokenizers_library_refuses_is_one_line(converted_dir, tmp_path):
    """The tokenizers library raises a plain Exception for a merge of tokens outside its vocabulary."""
    directory = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "model")
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["model"]["merges"] = [["Zq", "Xw"], *tokenizer["model"]["merges"]]
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    reseal(directory)
    with pytest.raises(rnnify.RnnifyError, match="cannot load a tokenizer from .*out of vocabulary"):
        rnnify.load(directory).tokenizer


def test_a_tokenizer_whose_backend_is_not_installed_is_one_line(converted_dir, tmp_path):
    if importlib.util.find_spec("mistral_common") is not None:
        pytest.skip("mistral-common is installed here")
    directory = shutil.copytree(converted_dir("llama", "exact"), tmp_path / "model")
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "MistralCommonBackend"  # mistral-common is not a dependency
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    reseal(directory)
    with pytest.raises(rnnify.RnnifyError, match="requires the mistral-common library") as error:
        rnnify.load(directory).tokenizer
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.stream(PROMPT, max_tokens=4), "unknown option 'max_tokens'; a text prompt takes max_new_tokens"),
        (lambda m: m.generate(PROMPT, attention_mask=torch.ones(1, 4)), "attention_mask applies to token-id"),
        (lambda m: m.stream(PROMPT, top_k=-1), "top_k must be >= 0"),
        (lambda m: m.stream(""), "the prompt is empty"),
        (lambda m: m.stream(42), "a string or a list of messages"),
        (lambda m: m.chat(PROMPT), "chat takes a list of messages"),
        (lambda m: m.chat([{"role": "user", "content": "hi"}]), "no chat template"),
        (lambda m: m.generate(PROMPT, repetition_penalty=1.3), "unknown option 'repetition_penalty'.*AutoModelFor"),
        (
            lambda m: m.generate(torch.tensor([[5, 6]]), num_beams=2),
            "unknown option 'num_beams'; generate takes .*streamer",
        ),
        (lambda m: m.generate(123), "a string or token ids .*got int"),
        (lambda m: m.generate(["a", "b"]), "texts of a batch go as ids, left-padded, with attention_mask"),
        (lambda m: m.generate(PROMPT, streamer=object()), "model.stream"),
        (lambda m: m.generate(torch.tensor([5, 6, 7])), "shape \\[batch, length\\]"),
        (
            lambda m: m.generate(torch.tensor([[5, 6], [5, 0]]), attention_mask=torch.tensor([[1, 1], [1, 0]])),
            "a row ends in padding.*padding_side = 'left'",
        ),
        (lambda m: m.to(torch.bfloat16), "converted in float32 and runs in it; .*--dtype bfloat16"),
        (lambda m: m.half(), "converted in float32 .*--dtype float16"),
    ],
    ids=[
        "unknown-option",
        "ids-only-option",
        "bad-sampling",
        "empty",
        "not-text",
        "chat-text",
        "no-template",
        "transformers-option",
        "transformers-option-ids",
        "not-a-prompt",
        "texts",
        "text-streamer",
        "one-dimensional-ids",
        "right-padding",
        "to-dtype",
        "half",
    ],  # fmt: skip
)
def test_mistakes_are_one_line_errors_before_decoding(model, call, match):
    with pytest.raises(rnnify.RnnifyError, match=match) as error:
        call(model)
    assert "\n" not in str(error.value)


def test_readme_python_api_runs(chat_dir, tmp_path, monkeypatch, capsys):
    """Every ```python block of README.md's "## Python API" section, in order, as a reader would run them
    from the repository's root; the chat model it names is the tiny one with a chat template."""
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Python API\n(.*?)^## ", readme, flags=re.S | re.M).group(1)
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) >= 3 and "model.chat(" in section and "model.stream(" in section
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "smol-int8").symlink_to(chat_dir)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md (Python API)", "exec"), namespace)
    assert namespace["run"].results and capsys.readouterr().out


def test_auto_tokenizer_loads_a_converted_directory_after_rnnify_s_integration_is_imported(converted_dir, tmp_path):
    """Issue 43 item 4. ``AutoTokenizer.from_pretrained(dir)`` builds ``config.json`` with ``AutoConfig`` before it
    reads ``tokenizer_config.json`` (transformers 5), so no file rnnify writes can stop its remote-code question
    while ``AutoModelForCausalLM(dir, trust_remote_code=True)`` still finds rnnify's config class through
    ``auto_map`` (docs/interop.md §Tokenizers). What that page offers instead, checked in a fresh process with
    stdin closed (a question would not wait, so its text is what shows one was asked): importing
    ``rnnify.integrations.transformers`` first registers the ``rnnify`` config, and the tokenizer loads with
    neither a question nor transformers' "model of type `rnnify`" warning."""
    import json
    import os
    import subprocess
    import sys

    directory = converted_dir("llama", "exact")
    script = (
        "import json, sys\n"
        "import rnnify.integrations.transformers\n"
        "from transformers import AutoTokenizer\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(directory)!r})\n"
        f"print(json.dumps(tokenizer({PROMPT!r}).input_ids))\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "TRANSFORMERS_VERBOSITY": "warning"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "custom code" not in said and "trust_remote_code" not in said and "`rnnify`" not in said, said
    assert json.loads(done.stdout.splitlines()[-1]) == rnnify.load(directory).tokenizer(PROMPT).input_ids
