"""Writing a model directory: one writer at a time, whole whatever kills it, and what killed runs
leave put right by the next (``rnnify.runtime.output_dir``)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cli_support import STAGE_LINE, assert_user_error, run

import rnnify
from rnnify.errors import RnnifyError, RnnifyWarning
from rnnify.runtime import output_dir

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def beside(path: Path) -> list[str]:
    """What lies beside ``path`` in its directory, ``path`` itself included."""
    return sorted(p.name for p in path.parent.iterdir())


@pytest.fixture
def holder(tmp_path):
    """``holder(path)``: another process holding ``claim(path)`` until the test ends; returns its pid."""
    started = []

    def hold(path: Path) -> int:
        code = (
            "import sys; from rnnify.runtime.output_dir import claim\n"
            "with claim(sys.argv[1]):\n    print('held', flush=True); sys.stdin.read()"
        )
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV
        )
        started.append(child)
        assert child.stdout.readline() == "held\n"
        return child.pid

    yield hold
    for child in started:
        child.communicate("", timeout=30)  # its stdin closed: it releases and exits


def test_a_second_convert_on_the_same_output_is_refused_before_it_loads_anything(
    capsys, monkeypatch, tmp_path, tiny_model_dir, holder
):
    out = tmp_path / "out"
    pid = holder(out)
    monkeypatch.setattr(rnnify, "convert", lambda *a, **k: pytest.fail("converted while another run writes -o"))
    code, _, err = run(capsys, "convert", tiny_model_dir("llama"), "--to", "exact", "-o", out, "--no-compile")
    assert_user_error(
        code, err, f"{out}: another rnnify run (pid {pid}) is writing this directory", "choose another output directory"
    )


def test_a_second_distill_on_the_same_output_is_refused(capsys, monkeypatch, tmp_path, converted_dir, holder):
    out = tmp_path / "out"
    pid = holder(out)
    monkeypatch.setattr(rnnify, "load", lambda *a, **k: pytest.fail("loaded while another run writes -o"))
    code, _, err = run(capsys, "distill", converted_dir("llama", "exact"), "--data", tmp_path, "-o", out)
    assert_user_error(code, err, f"another rnnify run (pid {pid}) is writing this directory")


def test_save_waits_for_no_one_and_leaves_only_the_model(converted_dir, tmp_path, holder):
    model = rnnify.load(converted_dir("llama", "linear"))
    holder(tmp_path / "busy")
    with pytest.raises(RnnifyError, match="another rnnify run"):
        model.save(tmp_path / "busy")
    model.save(tmp_path / "free")
    model.save(tmp_path / "free")  # replacing it: swapped, the old contents removed
    assert beside(tmp_path / "free") == [".busy.lock", "free"]  # .busy.lock: the holder's, still held


def test_claims_nest_within_a_thread_and_refuse_other_threads(converted_dir, tmp_path):
    model = rnnify.load(converted_dir("llama", "linear"))
    out = tmp_path / "out"
    refused = []

    def other_thread() -> None:
        try:
            with output_dir.claim(out):
                pass
        except RnnifyError as exc:
            refused.append(str(exc))

    with output_dir.claim(out):
        model.save(out)  # the CLI's claim, then save's own
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert refused and "another thread of this process" in refused[0]
    assert beside(out) == ["out"]
    with output_dir.claim(out):  # released: free again
        pass


def test_what_killed_runs_left_is_removed_by_the_next_run(capsys, tmp_path, tiny_model_dir, converted_dir):
    out = shutil.copytree(converted_dir("llama", "linear"), tmp_path / "out")
    (tmp_path / ".out.k1ll3d_1.tmp").mkdir()
    (tmp_path / ".out.k1ll3d_1.tmp" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".out.k1ll3d_2.old" / "out").mkdir(parents=True)
    (tmp_path / ".out.v2.k1ll3d_3.tmp").mkdir()  # another target's (out.v2): not this run's to remove
    code, _, err = run(
        capsys, "convert", tiny_model_dir("llama"), "--to", "exact", "-o", out, "--no-compile", "--overwrite"
    )
    assert code == 0, err
    assert [line for line in err.splitlines() if not STAGE_LINE.fullmatch(line)] == [
        f"warning: removed what interrupted rnnify runs left beside {out}: .out.k1ll3d_1.tmp, .out.k1ll3d_2.old"
    ]
    assert beside(out) == [".out.v2.k1ll3d_3.tmp", "out"]
    assert rnnify.load(out).target == "exact"


# A save killed at the dangerous point: after swapping the new directory in, before removing the old
# one; or, where the system cannot swap, between moving the old one aside and the new one in.
KILLED_SAVE = """
import os, sys
import rnnify
from rnnify.runtime import output_dir

source, out, how = sys.argv[1:]
if how == "exchange":
    output_dir._remove = lambda path: os._exit(9)
else:
    output_dir._exchange = lambda a, b: False
    replace = os.replace
    os.replace = lambda src, dst: os._exit(9) if str(dst) == out else replace(src, dst)  # the new one in
rnnify.load(source).save(out)
"""


@pytest.mark.parametrize("how", ["exchange", "two renames"])
def test_a_save_killed_halfway_leaves_a_loadable_model(converted_dir, tmp_path, how):
    if how == "exchange":
        (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
        if not output_dir._exchange(tmp_path / "a", tmp_path / "b"):
            pytest.skip(f"{tmp_path} cannot swap two names in one step")
        (tmp_path / "a").rmdir(), (tmp_path / "b").rmdir()
    out = shutil.copytree(converted_dir("llama", "linear"), tmp_path / "out")
    argv = [sys.executable, "-c", KILLED_SAVE, str(converted_dir("llama", "exact")), str(out), how]
    assert subprocess.run(argv, env=ENV, timeout=300).returncode == 9
    leftovers = [name for name in beside(out) if name.endswith((".tmp", ".old"))]
    if how == "exchange":  # swapped atomically: the new model is in place, the old one beside it
        assert rnnify.load(out).target == "exact" and [n[-4:] for n in leftovers] == [".tmp"]
        with pytest.warns(RnnifyWarning, match="removed what interrupted rnnify runs left"):
            rnnify.load(out).save(out)
    else:  # the window two renames leave: the target is missing; a reader says where, the next writer puts it back
        assert not out.exists() and sorted(n[-4:] for n in leftovers) == [".old", ".tmp"]
        with pytest.raises(RnnifyError, match="is missing: an interrupted rnnify run left its contents in"):
            rnnify.load(out)
        assert sorted(n[-4:] for n in beside(out) if n.endswith((".tmp", ".old"))) == [".old", ".tmp"]  # untouched
        with (
            pytest.warns(RnnifyWarning, match="was missing, its contents left in .* put back"),
            pytest.warns(RnnifyWarning, match="removed what interrupted rnnify runs left"),
        ):
            with output_dir.claim(out):
                pass
        assert rnnify.load(out).target == "linear"
    assert beside(out) == ["out"]


def test_a_lock_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    """A directory from elsewhere may hold ``.NAME.lock`` as a link to a file of the user's: claiming
    the target must not open, truncate or write through it."""
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    (tmp_path / ".out.lock").symlink_to(precious)
    with pytest.raises((RnnifyError, OSError)):
        with output_dir.claim(tmp_path / "out"):
            pass
    assert precious.read_text() == "keep me"


def test_install_moves_aside_where_the_system_cannot_swap(monkeypatch, tmp_path):
    monkeypatch.setattr(output_dir, "_exchange", lambda a, b: False)
    target = tmp_path / "out"
    for contents in ("old", "new"):
        with output_dir.claim(target):
            new = output_dir.scratch(target)
            (new / "file").write_text(contents)
            output_dir.install(new, target)
    assert (target / "file").read_text() == "new" and beside(target) == ["out"]


def test_a_file_system_without_flock_saves_with_a_warning(converted_dir, tmp_path, monkeypatch):
    """Lustre mounted without ``-o flock`` answers ENOSYS: saving there still works, unguarded."""

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(output_dir.fcntl, "flock", no_flock)
    with pytest.warns(RnnifyWarning, match="cannot be locked .* nothing stops a second rnnify run"):
        rnnify.load(converted_dir("llama", "linear")).save(tmp_path / "out")
    assert beside(tmp_path / "out") == ["out"]


def test_a_manifest_rewritten_in_place_never_writes_through_a_planted_link(converted_dir, tmp_path):
    """``rnnify compile --ship`` rewrites the manifest of a directory someone else made: links planted
    there under the names an earlier writer used (its pid's, its own) point at the user's files."""
    from rnnify.runtime.manifest import MANIFEST_FILE, Manifest

    directory = Path(shutil.copytree(converted_dir("llama", "linear"), tmp_path / "model"))
    victim = tmp_path / "victim"
    victim.write_text("the user's")
    for name in (f".{MANIFEST_FILE}.{os.getpid()}.tmp", f".{MANIFEST_FILE}.tmp"):
        (directory / name).symlink_to(victim)
    old = os.umask(0o022)
    try:
        Manifest.read(directory).write(directory)
    finally:
        os.umask(old)
    assert victim.read_text() == "the user's"
    written = directory / MANIFEST_FILE
    assert not written.is_symlink() and written.stat().st_mode & 0o777 == 0o644 and rnnify.load(directory)


def test_a_file_replaced_whole_leaves_nothing_when_writing_fails(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("before")

    def fail(file) -> None:
        file.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        output_dir.replace_file(path, fail)
    assert path.read_text() == "before" and beside(path) == ["result.json"]
    output_dir.replace_file(path, lambda file: file.write(b"after"))
    assert path.read_text() == "after" and beside(path) == ["result.json"]


def test_the_umask_is_read_without_changing_it(tmp_path):
    """Setting the umask to read it would give other threads' files a zero umask meanwhile."""
    old = os.umask(0o027)
    try:
        seen = []
        real = os.umask
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "umask", lambda mask: seen.append(mask) or real(mask))
            assert output_dir.umask() == 0o027
        assert seen == []
    finally:
        os.umask(old)


def test_a_failed_convert_leaves_no_folders_it_made_for_its_output(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "new1" / "new2" / "model"
    code, _, err = run(
        capsys, "convert", tiny_model_dir("llama"), "--to", "window", "--window", "8", "--keep-softmax", "9", "-o", out
    )
    assert_user_error(code, err, "--keep-softmax")
    assert not (tmp_path / "new1").exists()
    code, _, err = run(capsys, "convert", tiny_model_dir("llama"), "--to", "exact", "-o", out, "--no-compile")
    assert code == 0 and (out / "rnnify.json").is_file(), err


def test_a_file_swapped_for_a_link_while_it_is_written_is_not_put_in_place(tmp_path, monkeypatch):
    """Whoever owns the folder can rename a link over the new file's random name while it is written:
    the write goes to the file rnnify created, and the link is not renamed into place."""
    victim = tmp_path / "victim"
    victim.write_text("the user's")
    victim.chmod(0o600)
    path = tmp_path / "shared" / "rnnify.json"
    path.parent.mkdir()

    def write_then_swap(file) -> None:
        file.write(b"{}")
        (link := path.parent / "link").symlink_to(victim)
        link.rename(next(p for p in path.parent.iterdir() if p.name.startswith(".rnnify.json.")))

    with pytest.raises(OSError, match="was replaced while it was written"):
        output_dir.replace_file(path, write_then_swap)
    assert victim.read_text() == "the user's" and victim.stat().st_mode & 0o777 == 0o600 and not path.exists()
