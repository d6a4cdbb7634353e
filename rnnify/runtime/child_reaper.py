"""The processes a compile starts end with the process that started them, however it ends.

AOTInductor compiles the decode step by running the C++ compiler (``g++``, which runs ``cc1plus``,
``as`` and ``ld``) and short ``python -c`` probes as children of the process that compiles; no
worker pool (measured with ``rnnify convert``, torch 2.13, also with 4 compile threads). Killed
with SIGKILL, or with SIGTERM or SIGHUP (whose default ends Python at once), that process leaves
the compiler running on, orphaned, to the end of its file: 5 s of a tiny model's after
``kill -9`` and ``kill -TERM`` alike, minutes for a large model's. Only Ctrl-C reaches it, as the
terminal signals its whole foreground group; ``kill -INT`` of the process alone leaves ``cc1plus``
(``subprocess.run`` kills the ``g++`` it waited on, not that one's children).

``reaping_children`` marks every process started inside it with an environment variable, which
children inherit and pass on, and starts a watchdog process that reads a pipe from this one. When
the block ends normally this process writes that it did; when the pipe closes without that word
(this process died, or the block raised) the watchdog SIGKILLs every process carrying the mark.
Linux only (``/proc/PID/environ``); elsewhere the block runs unguarded.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["reaping_children"]

MARK = "RNNIFY_REAP"  # environment variable naming the guard a process was started under
DONE = b"done"  # what the guarded process writes when its block ended normally
PROC = Path("/proc")
INSTALLED = Path(__file__).resolve().parents[2]  # the folder holding the rnnify package


@contextmanager
def reaping_children() -> Iterator[None]:
    """Run the block with a watchdog that kills, if this process dies or the block raises, every
    process the block started (and their children)."""
    if not (PROC / "self" / "environ").is_file():
        yield
        return
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    # started before the mark is set (not marked itself), in the folder rnnify is installed from: ``-m``
    # puts the working folder first on the path, and a working folder may be a directory from elsewhere
    watchdog = subprocess.Popen(
        [sys.executable, "-m", __name__, token], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=INSTALLED
    )
    before = os.environ.get(MARK)
    os.environ[MARK] = token
    finished = False
    try:
        yield
        finished = True
    finally:
        if before is None:
            os.environ.pop(MARK, None)
        else:
            os.environ[MARK] = before
        try:
            watchdog.stdin.write(DONE if finished else b"")
            watchdog.stdin.close()
        except OSError:  # the watchdog is gone (killed with us by the terminal): nothing left to tell it
            pass
        watchdog.wait()


def marked(token: str, proc: Path = PROC) -> list[int]:
    """The processes whose environment carries ``MARK=token`` (those of other users unreadable: not ours)."""
    entry = f"{MARK}={token}".encode()
    found = []
    for directory in proc.iterdir():
        if not directory.name.isdigit() or int(directory.name) == os.getpid():
            continue
        try:
            environ = (directory / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if entry in environ.split(b"\0"):
            found.append(int(directory.name))
    return found


def _watch(token: str) -> None:
    """The watchdog: wait for the guarded process to end its block or die, then kill what it left."""
    # Ctrl-C and a closed terminal signal the whole foreground group, this process too: outlive them.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    if sys.stdin.buffer.read() == DONE:
        return
    for _ in range(50):  # a compiler killed halfway may have started its next child meanwhile
        pids = marked(token)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)


if __name__ == "__main__":
    _watch(sys.argv[1])
