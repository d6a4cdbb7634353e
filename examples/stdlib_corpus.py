"""The Python standard library's own source as a text corpus present on every machine.

    python examples/stdlib_corpus.py data/     # writes data/train/ and data/heldout/ (10 MB)

The bundled model (``train_tiny_lm.py``) trains on it and ``benchmarks/fidelity.py`` distils and
evaluates on it. Tests, GUI toolkits and vendored packages are left out (and everything under
site-packages, which differs between machines). The held-out split is by file: a file is held out
when the SHA-1 of its path relative to the stdlib is divisible by ``HELDOUT_EVERY``, so the split
does not depend on the order files are listed in, or on a seed. The files are those of the running
Python's standard library: the bundled model's numbers were measured with Python 3.11.7.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EXCLUDED_PARTS = {"site-packages", "__pycache__", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo"}
HELDOUT_EVERY = 20


def stdlib_files() -> list[str]:
    """Paths (relative to the stdlib, sorted) of the ``.py`` files in the corpus."""
    files = (p.relative_to(STDLIB) for p in STDLIB.rglob("*.py"))
    return sorted(str(p) for p in files if not EXCLUDED_PARTS & set(p.parts))


def is_heldout(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def split() -> tuple[list[str], list[str]]:
    """(train, heldout) relative paths."""
    return split_paths(stdlib_files())


def split_paths(relpaths: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout) of ``relpaths``, by ``is_heldout``; any corpus split by file uses this."""
    return [f for f in relpaths if not is_heldout(f)], [f for f in relpaths if is_heldout(f)]


def read(relpath: str) -> str:
    return (STDLIB / relpath).read_text(encoding="utf-8", errors="replace")


def write_split(directory: str | Path) -> tuple[Path, Path]:
    """Copy the split into ``directory/train`` and ``directory/heldout`` (one file per source file)."""
    return write_files(directory, split(), read)


def write_files(
    directory: str | Path, parts: tuple[list[str], list[str]], read: Callable[[str], str]
) -> tuple[Path, Path]:
    """Write ``parts`` (train and heldout relative paths) under ``directory/train`` and ``directory/heldout``,
    each file's text from ``read(relpath)``.

    Refuses to replace an existing ``train`` or ``heldout`` (``FileExistsError``); each is built in a
    temporary directory beside it and renamed into place, so an interruption leaves nothing half-written.
    """
    directory = Path(directory)
    targets = [directory / "train", directory / "heldout"]
    for target in targets:
        if target.exists():
            raise FileExistsError(f"{target} already exists: remove it or choose another directory")
    directory.mkdir(parents=True, exist_ok=True)
    for target, files in zip(targets, parts):
        tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".{target.name}-"))
        for relpath in files:
            out = tmp / relpath
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(read(relpath), encoding="utf-8")
        os.replace(tmp, target)
    return targets[0], targets[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write train/ and heldout/")
    try:
        train, heldout = write_split(parser.parse_args().directory)
    except FileExistsError as exc:
        parser.error(str(exc))
    print(f"wrote {train} and {heldout}")


if __name__ == "__main__":
    main()
