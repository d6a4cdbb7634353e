"""Where a load's compiled decode step comes from: this machine's cache, or a package the user trusts.

A step compiled ahead of time (``runtime.aot``) is native code, and a converted directory is data
that travels: a package found in a directory and run because a record beside it says it fits would
run whatever anyone put there. So the steps a load runs by default are the ones this user's own
machine compiled, kept in a private cache (``cache_root``) under the model's ``aot.fingerprint``:
the package takes the model's weights at load, so every model of the same graph, cells, weight
shapes and layouts on the same CPU, torch and rnnify (the same model converted again, a distilled
copy) finds the entry, and a directory copied to another machine decodes eagerly until ``rnnify
compile`` runs there. Nothing is written into the model's directory.

A directory may still ship its package for machines like the one that compiled it (``ship``,
``rnnify compile --ship``): its sha256 and fingerprint go into the manifest, and a load opens it only
when the user says they trust it (``trust_compiled_step``), its bytes match that record and its zip
stays inside its folder (``aot.check_archive``).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from rnnify.errors import RnnifyError, RnnifyWarning
from rnnify.runtime import output_dir
from rnnify.runtime.aot import (
    STEP_PACKAGE,
    StepPackage,
    compile_package,
    fingerprint,
    load_package,
    model_key,
    refusal,
)
from rnnify.runtime.integrity import sha256_file
from rnnify.runtime.manifest import MANIFEST_FILE, MANIFEST_FORMAT_VERSION, Manifest

if TYPE_CHECKING:
    from rnnify.runtime.model import RecurrentModel

__all__ = ["cache_root", "cached", "compile_into_cache", "describe", "find_step", "ship"]

CACHE_ENV = "RNNIFY_CACHE"


def cache_root() -> Path:
    """This user's rnnify cache: ``$RNNIFY_CACHE``, else ``$XDG_CACHE_HOME/rnnify``, else ``~/.cache/rnnify``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "rnnify"


def _entry(key: str) -> Path:
    return cache_root() / "steps" / key / STEP_PACKAGE


def _compiled_mark(model: RecurrentModel) -> Path:
    """A file that says this machine compiled ``model``'s step once, whatever rnnify, torch or CPU
    compiled it: a load that finds no entry for its own then says why it decodes eagerly."""
    return cache_root() / "models" / model_key(model)


_STALE = (
    "this machine compiled its decode step for another rnnify, torch or CPU, not this one: decoding eagerly "
    "until `rnnify compile {directory}` compiles it again"
)


def _private(package: Path) -> bool:
    """Are ``package`` and the cache's folders it lies in (its key's, ``steps``) this user's and
    writable by no one else? Otherwise someone else could have put code there: one who replaced a
    folder owns the new one. (Where there are no user ids, Windows, a home folder's cache is the
    user's own.)"""
    if not hasattr(os, "getuid"):
        return True
    paths = [package, package.parent, package.parent.parent, cache_root()]
    try:  # lstat: a link in the cache is refused, whoever owns what it points to
        return all(
            not stat.S_ISLNK(p.lstat().st_mode) and p.lstat().st_uid == os.getuid() and not p.lstat().st_mode & 0o022
            for p in paths
        )
    except OSError:
        return False


def cached(model: RecurrentModel) -> Path | None:
    """This machine's compiled step for ``model``, if the cache holds one of this user's own (``_private``)."""
    package = _entry(fingerprint(model))
    return package if package.is_file() and _private(package) else None


def compile_into_cache(model: RecurrentModel) -> Path:
    """Compile ``model``'s step into this machine's cache (folders 0700, the file replaced whole)."""
    package, mark = _entry(fingerprint(model)), _compiled_mark(model)
    try:
        for folder in (package.parents[2], package.parents[1], package.parent, mark.parent):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise RnnifyError(
            f"cannot create the step cache {folder}: {exc.strerror or exc}; set {CACHE_ENV} to a folder of your own"
        ) from exc
    built = compile_package(model, package)
    mark.touch()
    return built


def ship(model: RecurrentModel, directory: Path) -> Path:
    """Copy ``model``'s step from the cache (compiled into it first if it is not there) into
    ``directory`` (which ``model`` was loaded from, checked), recording its sha256 and fingerprint in the manifest: users of machines like this
    one may then run it with ``trust_compiled_step``. The directory is held against writers meanwhile
    (``output_dir.claim``)."""
    if Manifest.read(directory).format_version < MANIFEST_FORMAT_VERSION:
        raise RnnifyError(
            f"{directory} was saved by an older rnnify, whose manifest cannot record a shipped step: "
            "save it again with this one first"
        )
    built = cached(model) or compile_into_cache(model)
    shipped = directory / STEP_PACKAGE
    try:
        with output_dir.claim(directory):
            manifest = Manifest.read(directory)  # as it is now, under the claim
            with tempfile.TemporaryDirectory(dir=directory, prefix=".step-") as scratch:
                copy = Path(scratch) / STEP_PACKAGE
                shutil.copyfile(built, copy)
                manifest.files[STEP_PACKAGE] = sha256_file(copy)
                os.replace(copy, shipped)
            manifest.shipped_step = fingerprint(model)
            manifest.write(directory)  # last: until then a trusted load refuses the new package's sha256
    except OSError as exc:
        raise RnnifyError(f"cannot write the compiled step into {directory}: {exc.strerror or exc}") from exc
    return shipped


def find_step(model: RecurrentModel, directory: Path, trust: bool) -> StepPackage | None:
    """The compiled step a load of ``directory`` runs: the one it ships, when ``trust`` (checked, and
    refused by ``RnnifyError`` if it does not match the manifest), compiled for this model and machine;
    else this machine's cache entry for the model; None (eager) without either, or off a CPU."""
    if refusal(model) is not None:
        return None
    key = fingerprint(model)
    if trust and (directory / STEP_PACKAGE).is_file():
        package = _shipped(model, directory, key)
        if package is not None:
            return package
    package = _entry(key)
    if not package.is_file():
        if _compiled_mark(model).is_file():
            warnings.warn(_STALE.format(directory=directory), RnnifyWarning, stacklevel=3)
        return None
    if not _private(package):
        warnings.warn(
            f"{package} is not used: it, or a folder of the cache above it, belongs to another user or "
            f"is writable by others; decoding eagerly (set {CACHE_ENV} to a folder of your own)",
            RnnifyWarning,
            stacklevel=3,
        )
        return None
    try:
        return load_package(model, package)
    except RnnifyError as exc:  # a damaged entry: the model runs without it
        warnings.warn(
            f"{exc}; decoding eagerly (`rnnify compile {directory}` compiles it again)", RnnifyWarning, stacklevel=3
        )
        return None


def _shipped(model: RecurrentModel, directory: Path, key: str) -> StepPackage | None:
    """``directory``'s shipped step, checked against its manifest; None, warned, when it was compiled
    for another model or machine."""
    package = directory / STEP_PACKAGE
    recorded = model.manifest.files.get(STEP_PACKAGE)
    if recorded is None:
        raise RnnifyError(
            f"{package} has no sha256 in {MANIFEST_FILE} (an older rnnify wrote it, or it was put there "
            f"since): not loaded; run `rnnify compile {directory}` here and load without "
            "--trust-compiled-step"
        )
    if sha256_file(package) != recorded:
        raise RnnifyError(
            f"{package} does not match the sha256 recorded in {MANIFEST_FILE}: it was changed since it "
            f"was shipped; not loaded. Run `rnnify compile {directory}` here and load without "
            "--trust-compiled-step"
        )
    if model.manifest.shipped_step != key:
        warnings.warn(
            f"{package} was compiled for another model, rnnify source, torch version or CPU: not used (`rnnify "
            f"compile {directory}` compiles the step for this machine)",
            RnnifyWarning,
            stacklevel=4,
        )
        return None
    return load_package(model, package, shipped=True)


def describe(model: RecurrentModel, trusted: bool) -> str:
    """How ``model``'s one-token calls run, in words (``rnnify info``)."""
    package = model.step_package
    if package is None:  # stale: compiled here, but not for the running versions
        stale = refusal(model) is None and not _entry(fingerprint(model)).is_file() and _compiled_mark(model).is_file()
        line = (
            "eager: " + _STALE.format(directory="DIR")
            if stale
            else "eager (rnnify compile DIR compiles it ahead of time into this machine's cache, for CPUs)"
        )
    elif package.shipped:
        line = f"compiled ahead of time ({STEP_PACKAGE} shipped in DIR, trusted with --trust-compiled-step)"
    else:
        line = f"compiled ahead of time (this machine's cache: {package.path})"
    if not trusted and model.path is not None and (model.path / STEP_PACKAGE).is_file():
        line += f"; DIR ships a {STEP_PACKAGE}, not used without --trust-compiled-step"
    return line
