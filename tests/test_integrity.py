"""A converted directory's integrity record (``rnnify.json``'s ``files`` and ``digest``,
``rnnify.runtime.integrity``): every file a load reads is checked against it, an edit of the record
itself is caught by the manifest's own digest, and only a digest from elsewhere proves where the
directory came from."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from support import reseal

import rnnify
from rnnify.cli import main
from rnnify.errors import RnnifyError


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "rnnify.json").read_text())


def _sealed(data: dict) -> dict:
    """``data`` with the digest a save gives it: sha256 of its canonical JSON without the digest."""
    rest = {key: value for key, value in data.items() if key != "digest"}
    return {
        **rest,
        "digest": hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest(),
    }


def _edit(directory: Path, **changes) -> None:
    """Change the manifest as a hand would: nothing recomputed."""
    (directory / "rnnify.json").write_text(json.dumps({**_manifest(directory), **changes}))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last tensor's data, or a text file's last character
    path.write_bytes(bytes(data))


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, " ".join(out.split()), err


def _one_line_error(code: int, err: str, *words: str) -> None:
    assert code == 2 and err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    for word in words:
        assert word in err, err


@pytest.fixture
def directory(converted_dir, tmp_path) -> Path:
    return Path(shutil.copytree(converted_dir("llama", "linear"), tmp_path / "model"))


def test_the_record_covers_every_file_and_the_manifest_seals_it(converted_dir):
    directory = converted_dir("llama", "linear")
    data = _manifest(directory)
    assert data["format_version"] == 3 and "weights_sha256" not in data
    assert data["files"] == {p.name: _sha(p) for p in directory.iterdir() if p.name != "rnnify.json"}
    assert data["digest"] == _sealed(data)["digest"]
    assert rnnify.load(directory).manifest.digest == data["digest"]


@pytest.mark.parametrize(
    "name", ["graph.json", "tokenizer.json", "config.json", "modeling_rnnify.py", "model.safetensors"]
)
def test_a_file_changed_without_its_record_is_refused(directory, name, capsys):
    path = directory / name
    if name.endswith(".json"):  # the same data, other bytes: only the record can tell
        path.write_text(json.dumps(json.loads(path.read_text()), indent=3))
    else:
        _flip_last_byte(path)
    with pytest.raises(RnnifyError, match=f"{path} does not match the sha256 recorded in rnnify.json") as error:
        rnnify.load(directory)
    assert "\n" not in str(error.value) and "--no-verify" in str(error.value)
    rnnify.load(directory, verify=False)
    code, out, _ = _cli(capsys, "verify", directory, "--tokens", "4")
    assert code == 1 and "FAIL" in out and f"{name} does not match the sha256" in out


def test_a_tokenizer_file_added_or_removed_is_refused(directory):
    (directory / "vocab.txt").write_text("added\n")
    with pytest.raises(RnnifyError, match="vocab.txt is not in the sha256 record"):
        rnnify.load(directory)
    (directory / "vocab.txt").unlink()
    (directory / "tokenizer.json").unlink()
    with pytest.raises(RnnifyError, match="tokenizer.json is missing, though .*rnnify.json records it"):
        rnnify.load(directory)


@pytest.mark.parametrize("change", [{"digest": None}, {"files": {}}, {"files": None}])
def test_a_missing_record_refuses_to_load_and_fails_verify(directory, capsys, change):
    _edit(directory, **change)
    code, _, err = _cli(capsys, "generate", directory, "--ids", "1,2", "--max-new-tokens", "1")
    _one_line_error(code, err, "no sha256 record", "--no-verify")
    code, out, err = _cli(capsys, "verify", directory, "--tokens", "4")
    if change != {"files": None}:
        assert code == 1 and "FAILED: integrity" in out
    else:  # not even a manifest: verify cannot load it to check
        _one_line_error(code, err, "corrupted manifest")


def test_a_null_file_digest_is_refused(directory, capsys):
    data = _manifest(directory)
    data["files"]["model.safetensors"] = None
    (directory / "rnnify.json").write_text(json.dumps(_sealed(data)))  # the null is all that differs
    with pytest.raises(RnnifyError, match="model.safetensors does not match the sha256"):
        rnnify.load(directory)
    code, out, _ = _cli(capsys, "verify", directory, "--tokens", "4")
    assert code != 0 and "all checks passed" not in out  # a failed check, or a manifest too malformed to load


def test_recomputing_the_weights_digest_alone_is_refused(directory, capsys):
    """The bypass of a manifest that recorded the weights' sha256 and nothing else: change the weights,
    write their new sha256 in. The manifest's own digest no longer matches."""
    _flip_last_byte(directory / "model.safetensors")
    files = {**_manifest(directory)["files"], "model.safetensors": _sha(directory / "model.safetensors")}
    _edit(directory, files=files)
    with pytest.raises(RnnifyError, match="rnnify.json does not match its own digest"):
        rnnify.load(directory)
    code, _, err = _cli(capsys, "info", directory)
    _one_line_error(code, err, "does not match its own digest", "--no-verify")


def test_a_rewritten_record_loads_but_not_against_the_digest_given_elsewhere(directory, capsys):
    """A directory whose record was rewritten whole is consistent (the record proves integrity, not
    authorship); the digest a user got from the publisher is what refuses it."""
    original = _manifest(directory)["digest"]
    code, out, _ = _cli(capsys, "info", directory, "--expect-digest", original.upper())
    assert code == 0 and f"digest {original}" in out
    _flip_last_byte(directory / "model.safetensors")
    rewritten = reseal(directory)["digest"]
    rnnify.load(directory)
    with pytest.raises(RnnifyError, match=f"its digest is {rewritten}, not the {original} expected"):
        rnnify.load(directory, expected_digest=original)
    code, _, err = _cli(
        capsys, "generate", directory, "--ids", "1", "--max-new-tokens", "1", "--expect-digest", original
    )
    _one_line_error(code, err, "do not load it")
    code, out, _ = _cli(capsys, "verify", directory, "--tokens", "4", "--expect-digest", original)
    assert code == 1 and "FAILED: integrity" in out
    assert rnnify.load(directory, expected_digest=rewritten).manifest.digest == rewritten


def test_an_expected_digest_needs_the_checks(directory):
    with pytest.raises(RnnifyError, match="drop verify=False"):
        rnnify.load(directory, verify=False, expected_digest=_manifest(directory)["digest"])


def test_a_directory_of_an_older_rnnify_loads_only_unchecked(directory, capsys):
    data = _manifest(directory)
    weights = data.pop("files")["model.safetensors"]
    del data["digest"]
    (directory / "rnnify.json").write_text(json.dumps({**data, "format_version": 2, "weights_sha256": weights}))
    code, _, err = _cli(capsys, "generate", directory, "--ids", "1,2", "--max-new-tokens", "1")
    _one_line_error(code, err, "older rnnify (manifest format 2)", "--no-verify")
    for flag in ("--no-verify", "--no-verify-weights"):
        code, out, err = _cli(capsys, "generate", directory, "--ids", "1,2", "--max-new-tokens", "1", flag)
        assert code == 0 and out.startswith("1,2,"), err
    code, out, _ = _cli(capsys, "info", directory, "--no-verify")
    assert code == 0 and "digest none (saved by an older rnnify) (not checked)" in out
    code, out, _ = _cli(capsys, "verify", directory, "--tokens", "4")
    assert code == 1 and "FAILED: integrity" in out


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_an_unchecked_load_reads_only_regular_files(directory, kind):
    """Unchecked, a graph that is a FIFO would hang the load and one linked to /dev/zero fill the memory
    (run apart, bounded in time and memory, so that a regression fails rather than stalls the suite)."""
    import os
    import resource
    import subprocess
    import sys

    graph = directory / "graph.json"
    graph.unlink()
    if kind == "fifo":
        os.mkfifo(graph)
    else:
        graph.symlink_to("/dev/zero")

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    run = subprocess.run(
        [sys.executable, "-m", "rnnify", "info", str(directory), "--no-verify"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=bounded,
    )
    _one_line_error(run.returncode, run.stderr, "graph.json: missing or not a regular file")


def test_a_manifest_of_huge_integers_is_one_line(directory, capsys):
    text = (directory / "rnnify.json").read_text()
    (directory / "rnnify.json").write_text(text.replace('"vocab_size": ', '"vocab_size": ' + "9" * 5000 + ', "x": ', 1))
    code, _, err = _cli(capsys, "info", directory)
    _one_line_error(code, err, "corrupted manifest", "4300 digits")
