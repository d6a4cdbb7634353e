"""The Python documentation's reStructuredText sources as an English long-context corpus.

    python examples/python_docs_corpus.py data/pydocs   # writes data/pydocs/train/ and heldout/ (12 MB)

A real model (SmolLM2 and the like) is measured on English prose, not on the Python code of
``stdlib_corpus.py``: these are the ``.rst.txt`` sources of Python 3.11's documentation (about
500 files) from Debian's ``python3.11-doc`` package. When ``/usr/share/doc/python3.11/html/_sources``
is installed they are read from there; otherwise the package is fetched with ``apt-get download``
into a temporary directory and unpacked with ``dpkg -x`` (no root needed). The held-out split is
``stdlib_corpus.py``'s: by the SHA-1 of each file's path relative to ``_sources``, 1 in
``stdlib_corpus.HELDOUT_EVERY``.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from stdlib_corpus import split_paths, write_files

PACKAGE = "python3.11-doc"
SOURCES = Path("usr/share/doc/python3.11/html/_sources")  # inside the package, and installed under /
SUFFIX = ".rst.txt"


def docs_files(root: Path) -> list[str]:
    """Paths (relative to ``root``, sorted) of the ``.rst.txt`` files under it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(f"*{SUFFIX}") if p.is_file())


def fetch(scratch: Path) -> Path:
    """The ``_sources`` directory: the installed one, else ``PACKAGE`` downloaded and unpacked into ``scratch``."""
    installed = Path("/") / SOURCES
    if installed.is_dir():
        return installed
    _run(["apt-get", "download", PACKAGE], scratch)
    debs = sorted(scratch.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download left no {PACKAGE}_*.deb in {scratch}")
    _run(["dpkg", "-x", str(debs[0]), str(scratch / "root")], scratch)
    return scratch / "root" / SOURCES


def _run(command: list[str], cwd: Path) -> None:
    try:
        subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError(
            f"{command[0]} is not installed: this script needs a Debian-like system (or {PACKAGE} installed)"
        ) from None
    except subprocess.CalledProcessError as exc:
        last = (exc.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(
            f"{' '.join(command)} failed ({last}); check the apt sources, or install {PACKAGE}"
        ) from None


def write_split(directory: str | Path, sources: Path) -> tuple[Path, Path, list[str], list[str]]:
    """Split the ``.rst.txt`` files under ``sources`` into ``directory/train`` and ``directory/heldout``."""
    files = docs_files(sources)
    if not files:
        raise RuntimeError(f"no *{SUFFIX} files under {sources}")
    train, heldout = split_paths(files)

    def read(relpath: str) -> str:
        return (sources / relpath).read_text(encoding="utf-8", errors="replace")

    return (*write_files(directory, (train, heldout), read), train, heldout)


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write train/ and heldout/")
    directory = Path(parser.parse_args().directory)
    for part in ("train", "heldout"):  # before any download
        if (directory / part).exists():
            parser.error(f"{directory / part} already exists: remove it or choose another directory")
    with tempfile.TemporaryDirectory() as scratch:
        try:
            train_dir, heldout_dir, train, heldout = write_split(directory, fetch(Path(scratch)))
        except (RuntimeError, FileExistsError) as exc:
            parser.error(str(exc))
    for name, path, files in (("train", train_dir, train), ("heldout", heldout_dir, heldout)):
        print(f"{name}: {len(files)} files, {_bytes(path):,} bytes in {path}")


if __name__ == "__main__":
    main()
