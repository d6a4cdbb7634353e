"""Shared fixtures: tiny random models built offline and saved to temp dirs, loaded by path."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# tests/test_kernels.py runs the Triton kernels on CPU tensors through the interpreter, which
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

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "examples" / "make_tiny_model.py")
make_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tiny)


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
