"""How many torch threads a command computes with (docs/performance.md §Threads).

torch's default counts every CPU of the machine. In a container whose CPU quota is smaller, or on
hyperthreads, or on cores that other work also uses, the extra threads wait on each other at every
operation's barrier: one decode step of a small model measured 312 ms with torch's 2 threads on a
shared 2-core machine, and 4.4 ms with one. The default here is the physical cores this process may
run on, at most its CPU quota; ``OMP_NUM_THREADS`` or ``--threads`` overrides it, up to the
machine's logical CPUs (``max_threads``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from rnnify.errors import RnnifyError

__all__ = [
    "usable_cpus",
    "cpu_quota",
    "physical_cores",
    "default_threads",
    "max_threads",
    "choose_threads",
    "set_threads",
]

SYS = Path("/sys")


def usable_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity), or all of the machine's."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def cpu_quota(sysfs: Path = SYS, cgroup: str | None = None) -> float | None:
    """CPUs' worth of time the cgroup limits this process to (quota / period), or None when unlimited.

    cgroup v2: the smallest ``cpu.max`` from the process's own group (``/proc/self/cgroup``, or
    ``cgroup``) up to the root; cgroup v1: ``cpu.cfs_quota_us / cpu.cfs_period_us`` of the group
    mounted at ``fs/cgroup/cpu``, as containers see their own.
    """
    root = sysfs / "fs" / "cgroup"
    if cgroup is None:
        cgroup = _own_cgroup()
    quotas = []
    group = (root / cgroup.strip("/")) if cgroup else root
    while True:
        quotas.append(_ratio(_read(group / "cpu.max")))
        if group == root or root not in group.parents:
            break
        group = group.parent
    v1 = root / "cpu"
    quotas.append(_ratio(f"{_read(v1 / 'cpu.cfs_quota_us')} {_read(v1 / 'cpu.cfs_period_us')}"))
    limits = [q for q in quotas if q is not None]
    return min(limits) if limits else None


def physical_cores(cpus: Iterable[int], sysfs: Path = SYS) -> int:
    """How many physical cores the logical CPUs ``cpus`` lie on (hyperthreads of one core count
    once); each CPU counts as its own core where the topology is not readable."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        package, core = _read(topology / "physical_package_id"), _read(topology / "core_id")
        cores.add((package, core) if package and core else ("cpu", str(cpu)))
    return len(cores)


def default_threads(sysfs: Path = SYS, cgroup: str | None = None) -> int:
    """The physical cores of this process's CPUs, at most its CPU quota (rounded down), at least 1."""
    threads = physical_cores(usable_cpus(), sysfs)
    quota = cpu_quota(sysfs, cgroup)
    if quota is not None:
        threads = min(threads, int(quota))
    return max(1, threads)


def max_threads() -> int:
    """The most threads a command may compute with: the machine's logical CPUs. More only wait on each
    other, and tens of thousands exhaust the system's threads: ``--threads 100000`` crashed the
    process (SIGSEGV; 30,000: libgomp aborted)."""
    return os.cpu_count() or 1


def choose_threads(threads: int | None = None) -> tuple[int, str]:
    """The thread count and where it came from: ``threads`` (``--threads``), else ``OMP_NUM_THREADS``,
    else ``default_threads()``."""
    allowed = f"an integer from 1 to {max_threads()} (the logical CPUs of this machine)"
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= max_threads():
            raise RnnifyError(f"--threads must be {allowed}, got {threads!r}")
        return threads, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if not 1 <= value <= max_threads():
            raise RnnifyError(f"OMP_NUM_THREADS={env!r} is not {allowed}; set it to one, or unset it")
        return value, "OMP_NUM_THREADS"
    return default_threads(), "physical cores available"


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads as ``choose_threads`` says; returns the count."""
    import torch  # here, not above: the command line builds its --threads help from this module

    count, _ = choose_threads(threads)
    torch.set_num_threads(count)
    return count


def _own_cgroup() -> str:
    """This process's cgroup v2 path (the ``0::`` line of ``/proc/self/cgroup``), or "" if none."""
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        if line.startswith("0::"):
            return line[3:]
    return ""


def _ratio(text: str) -> float | None:
    """``"quota period"`` as CPUs, None for ``max``, -1 (v1's unlimited) or anything unreadable."""
    try:
        quota, period = text.split()
        value = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 else None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
