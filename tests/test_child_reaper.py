"""The processes a guarded block starts end with the process that started them (``child_reaper``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="Linux only (/proc)")

# Starts a shell that starts a sleep (a child and a grandchild, as g++ runs cc1plus), prints their
# pids, then ends as told: killed by the test while it waits, by an exception, or normally.
GUARDED = """
import subprocess, sys, time
from rnnify.runtime.child_reaper import reaping_children

with reaping_children():
    shell = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    print(shell.pid, shell.stdout.readline().strip(), flush=True)
    if sys.argv[1] == "raise":
        raise SystemExit(3)
    if sys.argv[1] == "wait":
        time.sleep(600)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (one killed but not yet reaped by its new parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start(end: str) -> tuple[subprocess.Popen, list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    guarded = subprocess.Popen([sys.executable, "-c", GUARDED, end], stdout=subprocess.PIPE, text=True, env=env)
    started = [int(pid) for pid in guarded.stdout.readline().split()]
    assert len(started) == 2 and all(running(pid) for pid in started)
    return guarded, started


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(running(pid) for pid in pids)


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("end", ["SIGKILL", "SIGTERM", "raise"])
def test_what_the_block_started_dies_when_it_ends_abnormally(end):
    guarded, started = start("wait" if end.startswith("SIG") else end)
    try:
        if end.startswith("SIG"):
            guarded.send_signal(getattr(signal, end))
        guarded.wait(timeout=60)
        assert gone_within(started, 5)
    finally:
        kill([guarded.pid, *started])


def test_a_block_that_ends_normally_leaves_its_processes_alone():
    """What it started and left running is its own business (a worker pool kept for later, say)."""
    guarded, started = start("finish")
    try:
        assert guarded.wait(timeout=60) == 0
        assert not gone_within(started, 0.5)
    finally:
        kill(started)


def descendants(pid: int) -> dict[int, str]:
    """The processes below ``pid``, with their command lines."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # gone
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(child)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_the_compiler_dies_with_a_killed_convert(tmp_path, tiny_model_dir, sig):
    """Without the guard, cc1plus compiled on for seconds after ``kill -9`` or ``kill -TERM`` of convert."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "RNNIFY_CACHE": str(tmp_path / "steps"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    argv = [
        sys.executable,
        "-m",
        "rnnify",
        "convert",
        str(tiny_model_dir("llama")),
        "--to",
        "exact",
        "-o",
        str(tmp_path / "out"),
        "--compile",
    ]
    convert = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not any("cc1plus" in line and " -E " not in line for line in descendants(convert.pid).values()):
            assert convert.poll() is None and time.monotonic() < deadline, "convert never compiled"
            time.sleep(0.05)
        compilers = [pid for pid, line in descendants(convert.pid).items() if "child_reaper" not in line]
        convert.send_signal(getattr(signal, sig))
        convert.wait(timeout=60)
        assert gone_within(compilers, 2)
    finally:
        kill([convert.pid, *descendants(convert.pid)])
