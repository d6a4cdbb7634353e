"""Where a load's compiled decode step comes from (``rnnify.runtime.step_cache``): this machine's
cache, found by what the step was compiled for, and never native code that came with a directory
unless the user trusts it and it matches the directory's manifest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from support import reseal

import rnnify
from rnnify.cli import main
from rnnify.errors import RnnifyError, RnnifyWarning
from rnnify.runtime.aot import STEP_PACKAGE, fingerprint, model_key
from rnnify.runtime.step_cache import cache_root, describe

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("RNNIFY_TEST_MARKER"), "w");
    if (f) { fputs("ran\n", f); fclose(f); }
}
"""


def _logits(model) -> torch.Tensor:
    """A prompt's logits, then three one-token calls' (the calls a compiled step runs)."""
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    logits, state = model.prefill(ids[:, :3])
    out = [logits]
    for t in range(3, 6):
        step, state = model.step(ids[:, t : t + 1], state)
        out.append(step)
    return torch.cat(out, 1)


def _session_entry(model) -> Path:
    return Path(os.environ["RNNIFY_TEST_CACHE"]) / "steps" / fingerprint(model) / STEP_PACKAGE


def _repack(package: Path, out: Path, replace: dict[str, bytes] = {}, add: dict[str, bytes] = {}) -> Path:
    """``package``'s zip with the entries ending as ``replace``'s keys swapped and ``add``'s added."""
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            swap = next((data for end, data in replace.items() if info.filename.endswith(end)), None)
            target.writestr(info, swap if swap is not None else source.read(info))
        for name, data in add.items():
            target.writestr(name, data)
    return out


def _torch_opens(package: Path, marker: Path) -> None:
    """Open ``package`` with torch's own loader in another process, as loads did before this cache."""
    code = f"import torch\ntry:\n    torch._C._aoti.AOTIModelPackageLoader({str(package)!r}, 'model', False, 1, -1)\nexcept RuntimeError:\n    pass"
    subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "RNNIFY_TEST_MARKER": str(marker)},
        check=False,
        capture_output=True,
        timeout=300,
    )


@pytest.fixture
def planted(compiled, tmp_path, monkeypatch):
    """``(directory, marker)``: a copy of the compiled hybrid whose step-cpu.pt2 holds, under the real
    package's entry names, a shared object whose constructor writes ``marker``, with a step-cpu.json
    (the record older rnnify trusted) saying it was compiled for the model."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the planted shared object")
    (tmp_path / "planted.c").write_text(PLANTED)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(tmp_path / "planted.so"), str(tmp_path / "planted.c")], check=True
    )
    directory = shutil.copytree(compiled("hybrid"), tmp_path / "model")
    model = rnnify.load(directory, aot_step=False)
    _repack(_session_entry(model), directory / STEP_PACKAGE, replace={".so": (tmp_path / "planted.so").read_bytes()})
    (directory / "step-cpu.json").write_text(
        json.dumps({"fingerprint": fingerprint(model), "torch": torch.__version__})
    )
    marker = tmp_path / "marker"
    monkeypatch.setenv("RNNIFY_TEST_MARKER", str(marker))
    return directory, marker


@pytest.fixture(scope="module")
def shipped(compiled, tmp_path_factory):
    """The compiled hybrid with its step shipped in the directory (``rnnify compile --ship``): copy it."""
    directory = shutil.copytree(compiled("hybrid"), tmp_path_factory.mktemp("shipped") / "model")
    with pytest.MonkeyPatch.context() as patch:  # compiled into the session's cache, whatever a test set
        patch.setenv("RNNIFY_CACHE", os.environ["RNNIFY_TEST_CACHE"])
        assert main(["compile", str(directory), "--ship", "--threads", "1"]) == 0
    return directory


def test_the_test_cache_is_not_the_users():
    root = cache_root().resolve()
    assert root == Path(os.environ["RNNIFY_TEST_CACHE"]).resolve()
    assert not root.is_relative_to(Path.home().resolve() / ".cache")


def test_a_converted_model_decodes_with_the_step_its_machine_compiled(compiled, tiny_model_dir, tmp_path, capsys):
    """``rnnify convert`` then a load, on one machine: compiled with no flag, kept in the cache (private
    to the user), nothing written into the directory, the eager step's numbers. (The session compiles
    this model once, ``compiled``: the convert here finds that step in the cache.)"""
    compiled("hybrid")
    out = tmp_path / "model"
    assert main(["convert", str(tiny_model_dir("llama")), "--to", "hybrid", "-o", str(out), "--threads", "1"]) == 0
    assert "decode step: compiled ahead of time" in capsys.readouterr().out
    assert not [p.name for p in out.iterdir() if p.name.startswith(("step-cpu", "."))]
    model = rnnify.load(out)
    assert model.step_package is not None and not model.step_package.shipped
    entry = model.step_package.path
    assert entry == cache_root() / "steps" / fingerprint(model) / STEP_PACKAGE
    assert entry.stat().st_mode & 0o777 == 0o600 and entry.parent.stat().st_mode & 0o777 == 0o700
    torch.testing.assert_close(_logits(model), _logits(rnnify.load(out, aot_step=False)), rtol=1e-4, atol=1e-4)


def test_a_directory_from_another_machine_decodes_eagerly(compiled, tmp_path, monkeypatch):
    compiled_model = rnnify.load(compiled("hybrid"))
    assert compiled_model.step_package is not None
    monkeypatch.setenv("RNNIFY_CACHE", str(tmp_path / "other-machine"))
    model = rnnify.load(compiled("hybrid"))
    assert model.step_package is None
    assert not (tmp_path / "other-machine").exists()  # a load writes nothing
    torch.testing.assert_close(_logits(model), _logits(compiled_model), rtol=1e-4, atol=1e-4)


def test_a_planted_package_never_runs_without_trust(planted, tmp_path, capsys, monkeypatch):
    """The regression: a directory's step-cpu.pt2 holding a shared object with a constructor, and a
    record beside it that matches the model, ran on every CPU load. Torch's loader does run it (the
    first check); no load, command or transformers route of rnnify opens it."""
    directory, marker = planted
    _torch_opens(directory / STEP_PACKAGE, marker)
    assert marker.is_file()  # the plant is live
    marker.unlink()

    model = rnnify.load(directory)
    assert model.step_package is None or not model.step_package.shipped
    assert main(["info", str(directory)]) == 0
    assert "ships a step-cpu.pt2, not used without --trust-compiled-step" in " ".join(capsys.readouterr().out.split())
    assert main(["generate", str(directory), "--ids", "1,2", "--max-new-tokens", "3"]) == 0
    from transformers import AutoModelForCausalLM

    from rnnify.integrations.transformers import RnnifyForCausalLM  # noqa: F401 - registers the auto classes

    AutoModelForCausalLM.from_pretrained(directory)
    monkeypatch.setenv("RNNIFY_CACHE", str(tmp_path / "other-machine"))  # and where no cache entry is found
    assert rnnify.load(directory).step_package is None
    assert not marker.exists()


def test_a_planted_package_is_refused_with_trust(planted, shipped, tmp_path, capsys):
    """Trusted, a package runs only with the sha256 the manifest recorded: an older directory has
    none, and a package swapped after ``rnnify compile --ship`` does not match."""
    directory, marker = planted
    with pytest.raises(RnnifyError, match=r"no sha256 in rnnify.json .*run `rnnify compile") as error:
        rnnify.load(directory, trust_compiled_step=True)
    assert "\n" not in str(error.value)
    plant = (directory / STEP_PACKAGE).read_bytes()
    directory = shutil.copytree(shipped, tmp_path / "shipped")
    assert rnnify.load(directory, trust_compiled_step=True).step_package.shipped  # the real one, recorded
    (directory / STEP_PACKAGE).write_bytes(plant)
    with pytest.raises(RnnifyError, match="does not match the sha256 recorded in rnnify.json"):
        rnnify.load(directory, trust_compiled_step=True)
    capsys.readouterr()
    assert main(["info", str(directory), "--trust-compiled-step"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1 and "sha256" in err
    assert not marker.exists()


def test_a_package_that_climbs_out_of_its_folder_is_refused_even_when_recorded(compiled, tmp_path):
    """A zip entry ``step-cpu/.../../../x`` is written where it points by torch's loader (the first
    check); recorded in the manifest, sealed and trusted, the package is still refused, unopened."""
    directory = shutil.copytree(compiled("hybrid"), tmp_path / "model")
    escaped = tmp_path / "escaped.json"
    climb = "step-cpu/data/aotinductor/model/" + "../" * 32 + str(escaped).lstrip("/")
    package = _repack(
        _session_entry(rnnify.load(directory, aot_step=False)), tmp_path / STEP_PACKAGE, add={climb: b"{}"}
    )
    _torch_opens(package, tmp_path / "unused")
    assert escaped.is_file()  # torch's loader writes outside its folder
    escaped.unlink()
    shutil.copy(package, directory / STEP_PACKAGE)
    model = rnnify.load(directory, aot_step=False)
    reseal(directory, shipped_step=fingerprint(model))  # the package's sha256 recorded, the manifest sealed
    with pytest.raises(RnnifyError, match=r"entry .* is not a file under step-cpu/"):
        rnnify.load(directory, trust_compiled_step=True)
    assert not escaped.exists()


def test_a_shipped_step_runs_only_when_trusted(shipped, tmp_path, capsys, empty_cache):
    directory = shutil.copytree(shipped, tmp_path / "model")
    manifest = json.loads((directory / "rnnify.json").read_text())
    assert manifest["files"][STEP_PACKAGE] == hashlib.sha256((directory / STEP_PACKAGE).read_bytes()).hexdigest()
    trusted = rnnify.load(directory, trust_compiled_step=True)
    assert trusted.step_package.shipped and trusted.step_package.path == directory / STEP_PACKAGE
    torch.testing.assert_close(_logits(trusted), _logits(rnnify.load(directory, aot_step=False)), rtol=1e-4, atol=1e-4)
    capsys.readouterr()
    assert main(["info", str(directory), "--trust-compiled-step"]) == 0
    assert "shipped in DIR, trusted" in capsys.readouterr().out
    assert main(["verify", str(directory), "--trust-compiled-step", "--tokens", "8"]) == 0  # the package is recorded
    assert f"{len(manifest['files'])} files match" in " ".join(capsys.readouterr().out.split())
    assert rnnify.load(directory).step_package is None  # untrusted, on a machine without the step in its cache


def test_a_shipped_step_for_another_machine_is_not_used(shipped, tmp_path, monkeypatch):
    import rnnify.runtime.aot as aot

    directory = shutil.copytree(shipped, tmp_path / "model")
    monkeypatch.setattr(aot, "_cpu_flags", lambda: "another cpu")
    with (
        pytest.warns(RnnifyWarning, match="compiled for another model, rnnify source, torch version or CPU"),
        pytest.warns(RnnifyWarning, match="this machine compiled its decode step for another rnnify"),  # the cache's
    ):
        assert rnnify.load(directory, trust_compiled_step=True).step_package is None


def test_a_cache_others_can_write_to_is_not_used(compiled, tmp_path, monkeypatch):
    model = rnnify.load(compiled("hybrid"), aot_step=False)
    cache = tmp_path / "cache"
    shutil.copytree(_session_entry(model).parent, cache / "steps" / fingerprint(model))
    monkeypatch.setenv("RNNIFY_CACHE", str(cache))
    (cache / "steps").chmod(0o700)
    assert rnnify.load(compiled("hybrid")).step_package is not None
    (cache / "steps").chmod(0o777)
    (cache / "models").mkdir(mode=0o700)
    (cache / "models" / model_key(model)).touch()  # compiled here: the entry itself is what is wrong
    with pytest.warns(RnnifyWarning, match="writable by others"):
        loaded = rnnify.load(compiled("hybrid"))
    assert loaded.step_package is None and "another rnnify" not in describe(loaded, trusted=False)


def test_ship_refuses_unchecked_or_old_directories(converted_dir, tmp_path, capsys):
    directory = shutil.copytree(converted_dir("llama", "linear"), tmp_path / "model")
    assert main(["compile", str(directory), "--ship", "--no-verify"]) == 2
    assert "drop --no-verify" in capsys.readouterr().err
    data = json.loads((directory / "rnnify.json").read_text())
    (directory / "rnnify.json").write_text(json.dumps({**data, "format_version": 2}))
    from rnnify.runtime.step_cache import ship

    with pytest.raises(RnnifyError, match="older rnnify"):
        ship(rnnify.load(directory, verify=False), directory)
    assert not (directory / STEP_PACKAGE).exists()
