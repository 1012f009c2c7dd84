"""This host's cores as the planner splits them: physical, performance (hybrid CPUs) and one
logical CPU id per core this agent may use, for pinning lanes to disjoint sets.

Linux reads sysfs (siblings of each CPU, Intel's cpu_core/cpu_atom PMUs) within the
agent's own affinity; macOS asks sysctl for its performance level; elsewhere psutil's
counts only (no ids: no pinning).
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

SYS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class HostCores:
    logical: int
    physical: int
    performance: int | None
    cpu_ids: tuple[int, ...]


def parse_cpu_list(text: str) -> set[int]:
    """Linux's CPU list format: "0-3,8,10-11"."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def core_ids(siblings: Mapping[int, str], performance: Iterable[int] = ()) -> tuple[int, ...]:
    """The first allowed CPU of each core (by its sibling list), performance cores first (pure)."""
    perf = set(performance)
    firsts = {}
    for cpu in sorted(siblings):
        firsts.setdefault(siblings[cpu].strip(), cpu)
    return tuple(sorted(firsts.values(), key=lambda c: (bool(perf) and c not in perf, c)))


def host_cores() -> HostCores:
    logical = psutil.cpu_count(logical=True) or 1
    physical = psutil.cpu_count(logical=False) or logical
    if platform.system() == "Linux":
        try:
            return _linux(logical, physical)
        except (OSError, ValueError):
            pass
    return HostCores(logical, physical, _mac_performance() if platform.system() == "Darwin" else None, ())


def _linux(logical: int, physical: int) -> HostCores:
    allowed = sorted(os.sched_getaffinity(0))
    siblings = {}
    for cpu in allowed:
        topo = SYS_CPU / f"cpu{cpu}" / "topology"
        path = topo / "core_cpus_list" if (topo / "core_cpus_list").exists() else topo / "thread_siblings_list"
        package = (topo / "physical_package_id").read_text().strip() if (topo / "physical_package_id").exists() else ""
        siblings[cpu] = f"{package}:{path.read_text().strip()}"
    perf_file = Path("/sys/devices/cpu_core/cpus")
    hybrid = perf_file.exists() and Path("/sys/devices/cpu_atom").exists()
    perf = parse_cpu_list(perf_file.read_text()) if hybrid else set()
    ids = core_ids(siblings, perf)
    performance = sum(1 for c in ids if c in perf) if perf else None
    return HostCores(logical, physical, performance or None, ids)


def _mac_performance() -> int | None:
    try:
        out = subprocess.run(["sysctl", "-n", "hw.perflevel0.physicalcpu"], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) or None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
