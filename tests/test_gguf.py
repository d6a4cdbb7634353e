"""GGUF input: ``rnnify convert MODEL.gguf`` against transformers' own reading of the same file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from cli_support import assert_user_error
from gguf_support import CHAT_TEMPLATE, tokens, write_tiny_llama
from support import ROOT, load_script

import rnnify
from rnnify.cli import main
from rnnify.compiler.capture import load_source
from rnnify.data import load_tokenizer


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny llama whose layer matrices are Q4_1 blocks, like the quantised files on the hub."""
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf", quantize="Q4_1")


def assert_one_line_error(capsys, code: int, *words: str) -> None:
    assert_user_error(code, capsys.readouterr().err, *words)


def test_convert_gguf_matches_transformers_and_keeps_the_tokenizer(capsys, tmp_path, tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exact"
    assert main(["convert", str(tiny_gguf), "--to", "exact", "-o", str(out), "--no-compile"]) == 0, (
        capsys.readouterr().err
    )
    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    model = rnnify.load(out)
    ids = torch.randint(0, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    logits, _ = model.prefill(ids)
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-4

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "rnnify" and "quantization_config" not in config
    config = config["source_config"]
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert model.manifest.source == str(tiny_gguf.resolve())
    tokenizer = load_tokenizer(out)
    original = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    text = "hello there, tell me"
    assert tokenizer(text).input_ids == original(text).input_ids
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>"


def test_a_gguf_tokenizer_is_read_from_the_file_alone(capsys, tmp_path, tiny_gguf):
    """transformers also reads the GGUF's folder: a tokenizer_config.json there naming code of its own
    (``auto_map``) made it ask on stdin whether to run it, then leave the tokenizer out."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "download"
    folder.mkdir()
    gguf = Path(shutil.copy(tiny_gguf, folder / "model.gguf"))
    marker = tmp_path / "ran"
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "Evil", "auto_map": {"AutoTokenizer": ["evil.Evil", "evil.Evil"]}})
    )
    (folder / "evil.py").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n")
    out = tmp_path / "exact"
    assert main(["convert", str(gguf), "--to", "exact", "-o", str(out), "--no-compile"]) == 0, capsys.readouterr().err
    assert not marker.exists()
    original = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    assert load_tokenizer(out)("hello there").input_ids == original("hello there").input_ids


def test_a_gguf_source_is_the_default_original(tmp_path, tiny_gguf):
    """eval's --against, pass-key tests and distill's teacher default to the manifest's source; a GGUF
    file is one (it was refused as 'not a local directory')."""
    model = rnnify.convert(str(tiny_gguf), to="window", window=4)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    default = rnnify.evaluate(model, ids, seq_len=16, batch_size=2, layer_errors=False, cache=False)
    given = rnnify.evaluate(
        model, ids, against=str(tiny_gguf), seq_len=16, batch_size=2, layer_errors=False, cache=False
    )
    assert default.against == given.against == str(tiny_gguf.resolve()) and default.kl == given.kl > 0


def test_gguf_loaded_with_its_quantizer_attached_becomes_a_plain_model(monkeypatch, tiny_gguf):
    """transformers' default load keeps a GGUF quantizer (and refuses save_pretrained): rebuilt."""
    from transformers import AutoModelForCausalLM

    import rnnify.compiler.gguf

    monkeypatch.setattr(rnnify.compiler.gguf, "_dequantize_options", dict)
    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    assert reference.config.quantization_config is not None
    model = rnnify.convert(tiny_gguf, to="exact")
    assert "quantization_config" not in json.loads(model.files["config.json"])
    ids = torch.randint(0, reference.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    logits, _ = model.prefill(ids)
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-4


def test_gguf_without_tokenizer_loads_without_tokenizer_files(tmp_path):
    from rnnify.compiler.convert import _source_files

    path = write_tiny_llama(tmp_path / "bare.gguf", tokenizer=False)
    source = load_source(path)
    assert source.config.vocab_size == len(tokens()) and getattr(source.config, "quantization_config", None) is None
    assert set(_source_files(path, source)) == {"config.json"}  # generate --prompt then asks for --ids


def test_gguf_without_the_extra_is_one_line(capsys, monkeypatch, tmp_path, tiny_gguf):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now fails, as when it is not installed
    code = main(["convert", str(tiny_gguf), "--to", "exact", "-o", str(tmp_path / "out")])
    assert_one_line_error(capsys, code, "gguf", "pip install")
    assert not (tmp_path / "out").exists()


def test_gguf_of_an_unsupported_architecture_is_one_line(capsys, tmp_path):
    path = write_tiny_llama(tmp_path / "other.gguf", architecture="rwkv6")
    code = main(["convert", str(path), "--to", "exact", "-o", str(tmp_path / "out")])
    assert_one_line_error(capsys, code, "rwkv6", str(path))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_gguf_is_one_line(capsys, tmp_path, tiny_gguf, damage):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a gguf file at all" * 10)
    code = main(["convert", str(path), "--to", "exact", "-o", str(tmp_path / "out")])
    assert_one_line_error(capsys, code, str(path), "download it again")
    assert not (tmp_path / "out").exists()


def test_smollm2_example_saves_a_plain_directory_of_the_gguf(tiny_gguf, tmp_path, capsys):
    """examples/smollm2.py (here on the tiny file): a Hugging Face directory with the GGUF's
    tokenizer whose model computes what transformers' own GGUF reading does."""
    from transformers import AutoModelForCausalLM

    example = load_script(ROOT / "examples" / "smollm2.py")
    out = tmp_path / "models" / "smol"
    assert example.main([str(out), "--gguf", str(tiny_gguf)]) == 0
    saved = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, load_source(tiny_gguf)(ids).logits)
    from transformers import AutoTokenizer

    from_gguf = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert load_tokenizer(out)("abc")["input_ids"] == from_gguf("abc")["input_ids"]
    assert example.main([str(out), "--gguf", str(tiny_gguf)]) == 2  # never over an existing directory
    assert "exists" in capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == ["smol"]  # no temporary left behind
