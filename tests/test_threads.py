"""The thread count a command computes with: the default from affinity, topology and CPU quota
(fake /sys trees), what overrides it, and ``--threads`` on every command that computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rnnify.cli as cli
from rnnify.errors import RnnifyError
from rnnify.runtime import threads


def fake_sys(
    root: Path,
    cores: dict[int, tuple[int, int]],
    cgroups: dict[str, str] | None = None,
    v1: tuple[int, int] | None = None,
) -> Path:
    """A /sys tree: logical CPU -> (package, core), cgroup v2 ``cpu.max`` per group, v1 quota and period."""
    for cpu, (package, core) in cores.items():
        topology = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    for group, text in (cgroups or {}).items():
        directory = root / "fs" / "cgroup" / group.strip("/")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpu.max").write_text(text + "\n")
    if v1 is not None:
        directory = root / "fs" / "cgroup" / "cpu"
        directory.mkdir(parents=True)
        (directory / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (directory / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
    return root


@pytest.fixture
def affinity(monkeypatch):
    def set_to(cpus: set[int]) -> None:
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(cpus))

    return set_to


# 8 logical CPUs: hyperthread pairs (0, 4), (1, 5), (2, 6), (3, 7) on 4 cores of one package
SMT = {cpu: (0, cpu % 4) for cpu in range(8)}


@pytest.mark.parametrize(
    "cpus, cgroups, v1, cgroup, want",
    [
        ({0, 1, 2, 3, 4, 5, 6, 7}, {}, None, "", 4),  # hyperthreads count once
        ({0, 4}, {}, None, "", 1),  # both hyperthreads of one core
        ({0, 1, 4}, {}, None, "", 2),
        ({0, 1, 2, 3}, {"": "250000 100000"}, None, "", 2),  # 2.5 CPUs of quota: 2 threads
        ({0, 1, 2, 3}, {"": "50000 100000"}, None, "", 1),  # half a CPU: still one thread
        ({0, 1, 2, 3}, {"": "max 100000"}, None, "", 4),  # no limit
        # the smallest quota on the way from the process's group up to the root
        ({0, 1, 2, 3}, {"a": "300000 100000", "a/b": "max 100000"}, None, "/a/b", 3),
        ({0, 1, 2, 3}, {"a": "max 100000", "a/b": "100000 100000"}, None, "/a/b", 1),
        ({0, 1, 2, 3}, {}, (200000, 100000), "", 2),  # cgroup v1
        ({0, 1, 2, 3}, {}, (-1, 100000), "", 4),  # v1's unlimited
    ],
)
def test_default_threads_from_affinity_topology_and_quota(tmp_path, affinity, cpus, cgroups, v1, cgroup, want):
    affinity(cpus)
    sysfs = fake_sys(tmp_path, SMT, cgroups, v1)
    assert threads.default_threads(sysfs, cgroup) == want


def test_default_threads_counts_logical_cpus_without_topology(tmp_path, affinity):
    affinity({0, 2, 5})
    assert threads.default_threads(tmp_path, "") == 3


def test_flag_then_environment_then_default(monkeypatch):
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)  # whatever this machine has
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose_threads(2) == (2, "--threads")
    assert threads.choose_threads() == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "default_threads", lambda: 7)
    assert threads.choose_threads() == (7, "physical cores available")
    for bad in (0, -1, True, 1.5, 5):
        with pytest.raises(RnnifyError, match="--threads"):
            threads.choose_threads(bad)
    for bad in ("many", "5"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(RnnifyError, match="OMP_NUM_THREADS"):
            threads.choose_threads()


# the fewest arguments each command that computes parses with (its handler is replaced)
COMMANDS = {
    "convert": ["convert", "m", "--to", "exact", "-o", "out"],
    "verify": ["verify", "d"],
    "generate": ["generate", "d", "--ids", "1"],
    "chat": ["chat", "d"],
    "bench": ["bench", "d"],
    "compile": ["compile", "d"],
    "eval": ["eval", "d", "--data", "."],
    "distill": ["distill", "d", "--data", ".", "-o", "out"],
}


def test_every_command_but_info_computes():
    parser = cli.build_parser()
    names = set(parser._subparsers._group_actions[0].choices)
    assert names - {"info"} == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_threads_flag_sets_torch_threads_inside_the_command(monkeypatch, name):
    monkeypatch.setattr(threads, "max_threads", lambda: 4)  # whatever this machine has
    seen = []
    monkeypatch.setattr(f"rnnify.cli.{name}.run", lambda args, console: seen.append(torch.get_num_threads()) or 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    assert cli.main([*COMMANDS[name], "--threads", "3"]) == 0
    assert cli.main(COMMANDS[name]) == 0
    assert seen == [3, 2]  # the flag, then OMP_NUM_THREADS
    assert torch.get_num_threads() == before  # restored: main may run in-process


def test_bad_threads_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(cli.generate, "run", lambda args, console: pytest.fail("ran with bad --threads"))
    assert cli.main(["generate", "d", "--ids", "1", "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --threads") and len(err.splitlines()) == 1


def test_info_has_no_threads_flag(capsys):
    assert cli.main(["info", "d", "--threads", "2"]) == 2
    assert "--threads" in capsys.readouterr().err
