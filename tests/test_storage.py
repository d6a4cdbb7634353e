"""Saving and loading: every tensor round-trips, offline, without the source, atomically."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat

import pytest
import torch

import rnnify
from rnnify.runtime import saving, storage


@pytest.mark.parametrize("target", ["exact", "linear"])
def test_load_works_after_source_is_deleted(target, tiny_model_dir, tmp_path):
    source = shutil.copytree(tiny_model_dir("gpt2"), tmp_path / "source")
    model = rnnify.convert(source, to=target)
    ids = torch.randint(0, model.manifest.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    expected, _ = model.prefill(ids)
    model.save(tmp_path / "out")
    shutil.rmtree(source)
    loaded = rnnify.load(tmp_path / "out")
    got, _ = loaded.prefill(ids)
    assert torch.equal(got, expected)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json",
        "generation_config.json",
        "graph.json",
        "model.safetensors",
        "modeling_rnnify.py",
        "rnnify.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_manifest_records_what_was_done(converted_dir, tiny_model_dir):
    manifest = json.loads((converted_dir("llama", "linear") / "rnnify.json").read_text())
    assert manifest["format_version"] == 3 and manifest["target"] == "linear" and manifest["kernels"] == "auto"
    assert manifest["source"] == str(tiny_model_dir("llama"))
    assert set(manifest["versions"]) == {"rnnify", "torch", "transformers"}
    assert [c["layer"] for c in manifest["cells"]] == [0, 1]
    assert manifest["cells"][0]["spec"]["num_kv_heads"] == 2


def test_every_tensor_is_saved_once(converted_dir):
    """GPT-2 ties lm_head to wte: stored once, restored as the same tensor."""
    from safetensors.torch import load_file

    directory = converted_dir("gpt2", "exact")
    stored = load_file(directory / "model.safetensors")
    model = rnnify.load(directory)
    names = set(model.graph.state_dict())
    manifest = model.manifest
    assert names == set(stored) | set(manifest.aliases)
    assert not (set(stored) & set(manifest.aliases))


def test_state_is_interchangeable_with_the_reloaded_model(converted_dir):
    a = rnnify.load(converted_dir("llama", "linear"))
    b = rnnify.load(converted_dir("llama", "linear"))
    ids = torch.tensor([[3, 4, 5, 6]])
    _, state = a.prefill(ids[:, :3])
    assert torch.equal(a.step(ids[:, 3:], state)[0], b.step(ids[:, 3:], state)[0])


@pytest.mark.parametrize("target", ["gated-delta", "hybrid"])
def test_load_keeps_saved_dtypes_under_another_default_dtype(converted_dir, target):
    """vLLM builds models under ``torch.set_default_dtype(bfloat16)``: a cell's own layers (the
    gated delta rule's gate and beta projections, the hybrid's memory) built there must still hold
    the saved float32 weights, not a bfloat16 rounding of them."""
    directory = converted_dir("llama", target)
    want = rnnify.load(directory)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = rnnify.load(directory)
    finally:
        torch.set_default_dtype(before)
    assert {t.dtype for t in got.graph.state_dict().values() if t.is_floating_point()} == {torch.float32}
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    assert torch.equal(got.prefill(ids)[0], want.prefill(ids)[0])


def test_failed_save_leaves_nothing(converted_dir, tmp_path, monkeypatch):
    model = rnnify.load(converted_dir("llama", "linear"))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(saving, "write_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        model.save(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_a_model_but_not_other_directories(converted_dir, tmp_path):
    model = rnnify.load(converted_dir("llama", "linear"))
    model.save(tmp_path / "out")
    model.save(tmp_path / "out")  # replacing an rnnify directory is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(rnnify.RnnifyError, match="not an rnnify model directory"):
        model.save(tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me"


def test_weights_digest_is_recorded(converted_dir):
    directory = converted_dir("llama", "exact")
    want = hashlib.sha256((directory / storage.WEIGHTS_FILE).read_bytes()).hexdigest()
    assert rnnify.load(directory).manifest.files[storage.WEIGHTS_FILE] == want


def test_saving_a_format_1_model_writes_format_3(converted_dir, tmp_path):
    """A format-1 directory (no fused ops, the weights' sha256 alone) loads unchecked and is saved
    with every file's sha256, which the next load checks."""
    old = shutil.copytree(converted_dir("llama", "linear"), tmp_path / "old")
    manifest = json.loads((old / "rnnify.json").read_text())
    del manifest["kernels"], manifest["files"], manifest["digest"]
    for cell in manifest["cells"]:
        del cell["kernels"]
    weights_sha256 = hashlib.sha256((old / storage.WEIGHTS_FILE).read_bytes()).hexdigest()
    (old / "rnnify.json").write_text(json.dumps({**manifest, "format_version": 1, "weights_sha256": weights_sha256}))
    rnnify.load(old, verify=False).save(tmp_path / "new")
    saved = json.loads((tmp_path / "new" / "rnnify.json").read_text())
    assert saved["format_version"] == 3 and saved["kernels"] == "none" and "weights_sha256" not in saved
    new_weights = (tmp_path / "new" / storage.WEIGHTS_FILE).read_bytes()
    assert saved["files"][storage.WEIGHTS_FILE] == hashlib.sha256(new_weights).hexdigest()
    rnnify.load(tmp_path / "new")


def test_kernels_none_is_a_choice_and_none_keeps_the_recorded_one(tiny_model_dir, tmp_path, capsys):
    from rnnify.cli import main

    model = rnnify.convert(tiny_model_dir("llama"), to="linear", kernels="none")
    assert model.kernels == "none" and {cell.kernels for cell in model.cells} == {None}
    model.save(tmp_path / "none")
    assert main(["info", str(tmp_path / "none")]) == 0
    assert "none: every cell runs its own PyTorch forms" in capsys.readouterr().out
    model.use_kernels("reference").save(tmp_path / "m")
    assert rnnify.load(tmp_path / "m").kernels == "reference"  # None: as recorded
    assert {cell.kernels for cell in rnnify.load(tmp_path / "m", kernels="none").cells} == {None}
    with pytest.raises(rnnify.RnnifyError, match="unknown kernels None; choose from: auto, triton, reference, none"):
        model.use_kernels(None)


def test_moving_a_model_moves_the_device_constants_of_its_graph(converted_dir):
    def devices(model) -> set:
        found = set()
        keep = lambda value: found.add(value) if isinstance(value, torch.device) else None  # noqa: E731
        for node in model.graph.graph.nodes:
            torch.fx.node.map_aggregate((node.args, node.kwargs), keep)
        return found

    model = rnnify.load(converted_dir("llama", "exact"))
    assert devices(model) == {torch.device("cpu")}  # the rotary table's to(device=cpu), from export
    model.to("meta")
    assert devices(model) == {torch.device("meta")} and model.device == torch.device("meta")


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_saved_directory_and_files_follow_the_umask(converted_dir, tmp_path, umask):
    model = rnnify.load(converted_dir("llama", "linear"))
    old = os.umask(umask)
    try:
        model.save(tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask
    assert storage.WEIGHTS_FILE in modes and modes == dict.fromkeys(modes, 0o666 & ~umask)


def _flip_two_bytes(path) -> None:
    """Change two bytes of the last tensor's data (the header stays valid, so the file still parses)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    data[-2] ^= 0x01
    path.write_bytes(bytes(data))


def test_load_refuses_altered_weights_unless_told_not_to_check(converted_dir, tmp_path):
    directory = shutil.copytree(converted_dir("llama", "linear"), tmp_path / "m")
    _flip_two_bytes(directory / storage.WEIGHTS_FILE)
    with pytest.raises(rnnify.RnnifyError, match="does not match the sha256 recorded in rnnify.json"):
        rnnify.load(directory)
    altered = rnnify.load(directory, verify_weights=False)  # the earlier name of verify=False
    original = rnnify.load(converted_dir("llama", "linear"))
    changed = [n for n, t in altered.graph.state_dict().items() if not torch.equal(t, original.graph.state_dict()[n])]
    assert len(changed) == 1  # it did load the altered weights
