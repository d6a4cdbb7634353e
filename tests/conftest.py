"""Shared fixtures: tiny random models built offline and saved to temp dirs, loaded by path."""

from __future__ import annotations

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# the tests/test_kernels*.py files run the Triton kernels on CPU tensors through the interpreter, which
# triton reads when it is first imported; other tests import it earlier (torch.export, inductor).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# pytest-xdist runs the suite in one worker per CPU (``-n auto`` in pyproject.toml): each computes
# with one thread, as two workers of two threads on two cores would wait on each other. Its workers
# also get COLUMNS=80, which the CLI would take for a terminal's width: the tests read the CLI's
# output as piped, at its own width, as they do without workers.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.pop("COLUMNS", None)
# The decode steps the tests compile go to a cache of this run's own, never the user's (even one named
# by RNNIFY_CACHE): made by the run's first process, shared with the workers it starts (so a step
# compiles once per run), removed when that process exits.
if not os.environ.get("RNNIFY_TEST_CACHE"):
    os.environ["RNNIFY_TEST_CACHE"] = tempfile.mkdtemp(prefix="rnnify-test-cache-")
    atexit.register(shutil.rmtree, os.environ["RNNIFY_TEST_CACHE"], ignore_errors=True)
os.environ["RNNIFY_CACHE"] = os.environ["RNNIFY_TEST_CACHE"]

# rnnify.convert captures each model once per worker (tests/capture_cache.py); it imports torch, so
# after the environment above.
from tests import capture_cache  # noqa: E402

capture_cache.install()

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "examples" / "make_tiny_model.py")
make_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tiny)


def pytest_sessionfinish(session):
    """An xdist worker whose tests are done freezes its objects, so that pytest's two full garbage
    collections after that (``unraisableexception``'s, at unconfigure) pass over them.

    Once the last worker reports its session finished, the controller closes every worker's channel,
    and execnet sends a worker that has not ended 5 s later SIGINT: a passing run then ended with a
    ``KeyboardInterrupt`` traceback from hypothesis' gc callback, the Python code a collection runs.
    Each collection took 0.6-1.1 s for the 0.8 million objects of a worker that ran a tenth of the
    suite here (torch, transformers, compiled graphs), and a worker runs half of it, on two shared
    cores. What a worker would find after it has reported reaches no one. The objects are unfrozen as
    the process exits, for the interpreter's last collection: extensions that count their objects then
    (triton's nanobind) report every one still frozen as leaked.
    """
    if hasattr(session.config, "workerinput"):  # an xdist worker
        gc.freeze()
        atexit.register(gc.unfreeze)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    capture_cache.new_test()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``tiny_model_dir(arch)`` -> directory of a tiny random HF model (built once per session)."""
    built: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in built:
            built[arch] = make_tiny.make_tiny_model(tmp_path_factory.mktemp(f"hf-{arch}"), arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory, tiny_model_dir):
    """``converted_dir(arch, target)`` -> directory of the converted model (converted once)."""
    import rnnify

    saved: dict[tuple, Path] = {}

    def get(arch: str = "llama", target: str = "exact") -> Path:
        if (arch, target) not in saved:
            out = tmp_path_factory.mktemp(f"rnn-{arch}-{target}") / "model"
            rnnify.convert(tiny_model_dir(arch), to=target).save(out)
            saved[arch, target] = out
        return saved[arch, target]

    return get


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """The compiled-step cache, empty for one test: another machine's, or this one's before anything
    was compiled (the session's holds what other tests compiled)."""
    monkeypatch.setenv("RNNIFY_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def compiled(converted_dir, tiny_model_dir, tmp_path_factory):
    """``compiled(target)`` -> the tiny llama converted with its step compiled ahead of time into the
    session's cache (whichever cache the asking test has set): by ``rnnify convert`` itself (its
    default) for the hybrid, by ``rnnify compile`` afterwards for the rest."""
    from rnnify.cli import main

    done = {}

    def get(target: str):
        if target not in done:
            out = tmp_path_factory.mktemp(f"aot-{target}") / "model"
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("RNNIFY_CACHE", os.environ["RNNIFY_TEST_CACHE"])
                if target == "hybrid":
                    argv = ["convert", str(tiny_model_dir("llama")), "--to", target, "-o", str(out), "--threads", "1"]
                    assert main(argv) == 0
                else:
                    shutil.copytree(converted_dir("llama", target), out)
                    assert main(["compile", str(out), "--threads", "1"]) == 0
            done[target] = out
        return done[target]

    return get
