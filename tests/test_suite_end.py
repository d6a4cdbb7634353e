"""How a test run ends: a passing run under pytest-xdist ends without a traceback (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Records, in an xdist worker, how many objects are frozen when pytest collects garbage at unconfigure.
PROBE = """
import gc, os

def pytest_unconfigure(config):
    if hasattr(config, "workerinput"):
        with open(os.environ["FROZEN_OUT"], "w") as out:
            out.write(str(gc.get_freeze_count()))
"""


def test_a_worker_leaves_its_objects_out_of_pytests_last_collections(tmp_path):
    """Collecting them took seconds in a worker that ran half the suite, past the 5 s after which execnet
    sends it SIGINT: a passing run ended with a KeyboardInterrupt traceback."""
    (tmp_path / "frozen_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's worker
    env.update(PYTHONPATH=str(tmp_path), FROZEN_OUT=str(tmp_path / "frozen"))
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-n",
        "1",
        "-q",
        "-p",
        "frozen_probe",
        "-p",
        "no:cacheprovider",
        "tests/test_errors.py::test_missing_path",
    ]
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert int((tmp_path / "frozen").read_text()) > 100_000  # torch's and the test's objects, at least
