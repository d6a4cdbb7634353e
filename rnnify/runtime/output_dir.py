"""Writing a model directory: one writer at a time, and whole whatever kills it.

A directory is written beside its target as ``.NAME.XXXXXXXX.tmp`` and swapped into place at the
end (``install``). Three things can go wrong around that, and each is handled here:

- Two runs writing the same target (``rnnify convert -o out`` twice) would each report success for
  a directory that holds only one of them. ``claim`` takes an exclusive ``flock`` on ``.NAME.lock``
  beside the target, without waiting: the second run is refused at once, naming the first one's
  pid, before hours of converting or training rather than after. The command line claims its
  output when it starts; ``storage.save`` claims it too, re-entrantly within one thread, for
  callers of the Python API.
- Replacing a directory that exists takes two renames where the file system cannot swap two names
  in one step (the old one aside, the new one in): a run killed between them leaves the target
  missing, its old contents in ``.NAME.XXXXXXXX.old/NAME``. On Linux ``renameat2(RENAME_EXCHANGE)``
  swaps them atomically instead, so the target is never missing; where that is refused (another
  OS, a file system without it) the next ``claim`` of the target puts the old contents back; ``rnnify.load``
  of the missing target changes nothing and says where they are (``check_not_left_aside``).
- A killed run leaves its ``.tmp`` and ``.old`` directories behind. The next ``claim`` removes
  them, with a warning naming them: it holds the lock, so they are never a live run's.

The lock file is removed on release; a claimer checks that the file it locked is still the one at
that path, so a release racing a claim never leaves two holders.

A single file (a manifest rewritten in place, a checkpoint, a ``--json`` result) is replaced the same
way, whole (``replace_file``): written under a new random name beside it, created exclusively, so a
link planted in a shared directory under a name a writer would predict is never written through.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rnnify.errors import RnnifyError, RnnifyWarning

__all__ = ["check_not_left_aside", "claim", "file_in_the_way", "install", "replace_file", "scratch", "umask"]

NEW, OLD = ".tmp", ".old"  # suffixes of a directory being written, and of a replaced one being removed


@dataclass
class _Hold:
    fd: int
    thread: int
    created: list[Path]  # the folders above the target the claim made, deepest first
    depth: int = 1


_held: dict[Path, _Hold] = {}  # lock file -> this process's hold on it
_held_guard = threading.Lock()


@contextmanager
def claim(path: Path) -> Iterator[None]:
    """Hold the exclusive right to write ``path`` (creating its parent directories, removed again if
    nothing was written there): an RnnifyError naming the holder if another process, or another
    thread of this one, holds it. Nested claims by one thread share its hold; the outermost puts back
    a target a killed run left missing and removes the temporary directories killed runs left beside it."""
    path = Path(path).expanduser()
    lock = _beside(path, ".lock")
    with _held_guard:
        hold = _held.get(lock)
        if hold is not None and hold.thread != threading.get_ident():
            raise _busy(path, os.getpid())
        if hold is not None:
            hold.depth += 1
    if hold is None:
        created = [p for p in (lock.parent, *lock.parent.parents) if not p.exists()]
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            hold = _Hold(_lock(lock, path), threading.get_ident(), created)
        except OSError as exc:
            raise RnnifyError(f"cannot write {path}: {exc.strerror or exc}; choose another output directory") from exc
        with _held_guard:
            _held[lock] = hold
    try:
        if hold.depth == 1:
            _tidy(path)
        yield
    finally:
        with _held_guard:
            hold.depth -= 1
            if hold.depth == 0:
                del _held[lock]
                lock.unlink(missing_ok=True)  # before unlocking: a claimer then re-checks the path (``_lock``)
                os.close(hold.fd)
                for folder in hold.created if not path.exists() else ():
                    try:
                        folder.rmdir()  # empty, unless someone else wrote there meanwhile
                    except OSError:
                        break


def scratch(path: Path) -> Path:
    """A new empty directory beside ``path`` (mode 0700) to write its next contents into."""
    return _new_beside(path, NEW)


def install(new: Path, path: Path) -> None:
    """Put the directory ``new`` (from ``scratch``) at ``path``, replacing what is there; the caller
    holds ``claim(path)``. An existing target is swapped out atomically where the system can, else
    moved aside first (a run killed then leaves it for the next ``claim`` to put back)."""
    if not os.path.lexists(path):
        os.replace(new, path)
    elif _exchange(new, path):
        _remove(new)  # now the old contents
    else:
        aside = _new_beside(path, OLD)
        os.replace(path, aside / _name(path))
        os.replace(new, path)
        _remove(aside)


def replace_file(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` whole: ``write(file)`` fills a new file beside it, given open (never reopened by
    its name, which someone who owns the folder could point elsewhere meanwhile), which is then
    renamed over ``path`` with the mode ``open`` gives under the umask; whatever fails, no partial
    file is left."""
    fd, name = tempfile.mkstemp(prefix=f".{_name(path)}.", suffix=NEW, dir=_parent(path))
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            os.fchmod(file.fileno(), 0o666 & ~umask())
            if not _same_file(file.fileno(), Path(name)):  # not what was written: nothing of it goes in place
                raise OSError(errno.EEXIST, f"{name} was replaced while it was written")
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def file_in_the_way(path: Path) -> Path | None:
    """The file that stands where ``path`` or a folder above it would be (its nearest existing
    place, when that is not a directory), which no writer could create ``path`` through; else None."""
    place = next((p for p in (path, *path.parents) if p.exists()), None)
    return place if place is not None and not place.is_dir() else None


def umask() -> int:
    """The process's umask: from /proc where Linux shows it, else read by setting it and putting it
    back (for that moment, files that other threads create get the mode of a zero umask)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
        return mask


def check_not_left_aside(path: Path) -> None:
    """Refuse to read a missing ``path`` whose contents a write killed between its two renames
    (``install``) left aside, saying where they are. A reader changes nothing on disk: the next
    ``claim`` of ``path`` (a command writing it) puts them back."""
    path = Path(path).expanduser()
    if os.path.lexists(path):
        return
    aside = [p / _name(path) for p in _leftovers(path) if p.name.endswith(OLD)]
    if aside:
        raise RnnifyError(
            f"{path} is missing: an interrupted rnnify run left its contents in {aside[-1]}; move "
            f"them back, or let the next rnnify run writing {path} do it"
        )


# -- the lock ------------------------------------------------------------------------------


_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP}  # file systems without flock (Lustre mounted without it)


def _lock(lock: Path, path: Path) -> int:
    """An open descriptor of ``lock`` holding its exclusive flock, this process's pid written in it."""
    while True:
        # never through a link: a directory from elsewhere may hold one named like the lock
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RnnifyError(f"{lock} is not a plain file: remove it, or choose another output directory")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise _busy(path, int(holder) if holder.isdigit() else None) from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            warnings.warn(
                f"{lock.parent} cannot be locked ({exc.strerror}): nothing stops a second rnnify run "
                f"from writing {path} at the same time",
                RnnifyWarning,
                stacklevel=2,
            )
            return fd
        if _same_file(fd, lock):
            break
        os.close(fd)  # its holder released and removed it after we opened it: lock the file there now
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (opened.st_dev, opened.st_ino)


def _busy(path: Path, pid: int | None) -> RnnifyError:
    who = f"another rnnify run (pid {pid})" if pid is not None else "another rnnify run"
    if pid == os.getpid():
        who = "another thread of this process"
    return RnnifyError(
        f"{path}: {who} is writing this directory; wait for it to finish or choose another output directory"
    )


# -- what killed runs leave ----------------------------------------------------------------


def _leftovers(path: Path) -> list[Path]:
    """The ``scratch`` and aside directories of ``path`` (``mkdtemp``'s 8 characters between its name
    and the suffix: those of a target ``NAME.x`` beside it do not match)."""
    pattern = re.compile(rf"\.{re.escape(_name(path))}\.[a-z0-9_]{{8}}({re.escape(NEW)}|{re.escape(OLD)})")
    try:
        return sorted(p for p in _parent(path).iterdir() if pattern.fullmatch(p.name) and not p.is_symlink())
    except OSError:  # no parent yet
        return []


def _tidy(path: Path) -> None:
    """Under the claim: put back a target a killed ``install`` left missing, then remove every leftover."""
    leftovers = _leftovers(path)
    if not os.path.lexists(path):
        kept = [
            p / _name(path)
            for p in leftovers
            if p.name.endswith(OLD) and (p / _name(path)).is_dir() and not (p / _name(path)).is_symlink()
        ]
        if kept:
            newest = max(kept, key=lambda p: p.lstat().st_mtime)
            os.replace(newest, path)
            warnings.warn(
                f"{path} was missing, its contents left in {newest.parent.name} by an interrupted rnnify run: put back",
                RnnifyWarning,
                stacklevel=2,
            )
    for leftover in leftovers:
        _remove(leftover)
    if leftovers:
        names = ", ".join(p.name for p in leftovers)
        warnings.warn(f"removed what interrupted rnnify runs left beside {path}: {names}", RnnifyWarning, stacklevel=2)


def _remove(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


# -- the swap ------------------------------------------------------------------------------

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
_NOT_HERE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}  # kernel or file system without it


def _renameat2():
    """libc's ``renameat2`` (glibc 2.28+), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step; False where the system cannot (nothing changed then)."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NOT_HERE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


# -- names ---------------------------------------------------------------------------------


def _new_beside(path: Path, suffix: str) -> Path:
    """A new directory ``.NAME.XXXXXXXX<suffix>`` beside ``path`` (``mkdtemp``'s name and mode 0700)."""
    return Path(tempfile.mkdtemp(prefix=f".{_name(path)}.", suffix=suffix, dir=_parent(path)))


def _beside(path: Path, suffix: str) -> Path:
    """``.NAME<suffix>`` beside ``path``."""
    return _parent(path) / f".{_name(path)}{suffix}"


def _parent(path: Path) -> Path:
    """The directory ``path`` is in, absolute (``abspath`` does not follow a symlink at ``path``)."""
    return Path(os.path.abspath(path)).parent


def _name(path: Path) -> str:
    """The target's own name, also for ``.`` or ``out/``."""
    return Path(os.path.abspath(path)).name
