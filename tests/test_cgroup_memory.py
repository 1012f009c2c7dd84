"""The memory cgroup's limit and use, as the agent reports them (launcher_agent/cgroup_memory.py).

The texts are what Linux writes: cgroup v1 as in a Docker container on an older host (and this
test machine), v2 as in podman, systemd slices and current Docker. The live check puts a process
in a real v1 or v2 group with a limit and reads it back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_agent.cgroup_memory import GroupMemory, group_memory

GIB = 2**30
V1_PROC = "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n"
V2_PROC = "0::/user.slice/app.slice/lanes.service\n"


def reader(files: dict[str, str]):
    return lambda path: files.get(path)


def v1_stat(limit: int, inactive: int) -> str:
    return f"cache 100\nrss 200\nhierarchical_memory_limit {limit}\ninactive_file 5\ntotal_inactive_file {inactive}\n"


def test_v1_limit_and_use_less_inactive_file_pages():
    files = {"memory/docker/abc/memory.stat": v1_stat(4 * GIB, GIB // 2),
             "memory/docker/abc/memory.usage_in_bytes": str(3 * GIB),
             "memory/docker/abc/memory.limit_in_bytes": str(4 * GIB)}  # fmt: skip
    group = group_memory(V1_PROC, reader(files))
    assert group == GroupMemory(limit=4 * GIB, used=3 * GIB - GIB // 2)
    assert group.available == GIB + GIB // 2


def test_v1_a_parents_limit_binds_a_group_without_its_own():
    files = {"memory/docker/abc/memory.stat": v1_stat(2 * GIB, 0),
             "memory/docker/abc/memory.usage_in_bytes": str(GIB),
             "memory/docker/abc/memory.limit_in_bytes": "9223372036854771712"}  # fmt: skip
    assert group_memory(V1_PROC, reader(files)) == GroupMemory(limit=2 * GIB, used=GIB)


def test_v1_without_a_limit_is_none():
    files = {"memory/docker/abc/memory.stat": v1_stat(9223372036854771712, 0),
             "memory/docker/abc/memory.usage_in_bytes": str(GIB),
             "memory/docker/abc/memory.limit_in_bytes": "9223372036854771712"}  # fmt: skip
    assert group_memory(V1_PROC, reader(files)) is None


def test_v2_the_tightest_limit_on_the_way_up():
    files = {"user.slice/app.slice/lanes.service/memory.max": "max\n",
             "user.slice/app.slice/memory.max": str(6 * GIB),
             "user.slice/memory.max": str(8 * GIB),
             "user.slice/app.slice/lanes.service/memory.current": str(2 * GIB),
             "user.slice/app.slice/lanes.service/memory.stat": f"anon 1\nfile 2\ninactive_file {GIB}\nactive_file 3\n"}  # fmt: skip
    assert group_memory(V2_PROC, reader(files)) == GroupMemory(limit=6 * GIB, used=GIB)


def test_v2_a_container_sees_its_own_group_as_the_root():
    files = {"memory.max": str(3 * GIB), "memory.current": str(GIB), "memory.stat": "inactive_file 0\n"}
    assert group_memory("0::/\n", reader(files)) == GroupMemory(limit=3 * GIB, used=GIB)


@pytest.mark.parametrize("files", [{}, {"user.slice/app.slice/lanes.service/memory.max": "max\n",
                                        "user.slice/app.slice/lanes.service/memory.current": str(GIB)}])  # fmt: skip
def test_v2_without_a_limit_or_without_the_files_is_none(files):
    assert group_memory(V2_PROC, reader(files)) is None


def test_a_machine_without_cgroups_is_none():
    assert group_memory("", reader({})) is None


def _memory_group_root() -> Path | None:
    """Where this process's memory group is (v1's memory hierarchy, or v2's unified one)."""
    text = Path("/proc/self/cgroup").read_text()
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    if "0::" not in text:
        return None
    unified = Path("/sys/fs/cgroup") / text.split("0::", 1)[1].split()[0].lstrip("/")
    return unified if (unified / "memory.current").exists() else None


def limited_group(name: str, limit: int) -> tuple[Path, bool]:
    """A new memory group under this process's, with `limit`: (its folder, whether cgroup v1).
    Skipped only where none can be made (no memory controller, not root), as the network
    namespaces' tests are where namespaces cannot be."""
    root = _memory_group_root()
    if root is None:
        pytest.skip("no memory cgroup to nest in (/proc/self/cgroup names none)")
    group = root / name
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup under {root}: {exc.strerror}")
    v1 = (group / "memory.limit_in_bytes").exists()
    try:
        (group / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(limit))
    except OSError as exc:
        group.rmdir()
        pytest.skip(f"cannot limit a memory cgroup under {root}: {exc.strerror}")
    return group, v1


def test_a_process_in_a_limited_group_reports_the_groups_memory(tmp_path):
    """A real group with a 1.5 GiB limit: the agent's `hardware.ram()` inside it says that limit, and
    what it has left drops by what a child holds."""
    group, _ = limited_group(f"lanes-test-{os.getpid()}", 3 * GIB // 2)
    try:
        code = ("import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                "from launcher_agent import hardware\n"
                "before = hardware.ram()\n"
                "held = bytearray(512 * 2**20); held[::4096] = b'x' * len(range(0, len(held), 4096))\n"
                "print(before[1], before[2], hardware.ram()[2])")  # fmt: skip
        out = subprocess.run([sys.executable, "-c", code, str(group / "cgroup.procs")], capture_output=True,
                             text=True, timeout=60, cwd=Path(__file__).parent.parent)  # fmt: skip
        assert out.returncode == 0, out.stderr
        total, before, after = map(int, out.stdout.split())
        assert total == 3 * GIB // 2
        assert before <= total and 400 * 2**20 < before - after < 700 * 2**20, (before, after)
    finally:
        group.rmdir()
