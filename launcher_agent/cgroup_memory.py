"""The memory limit of the cgroup the agent runs in (a container's `mem_limit`, a systemd slice's
MemoryMax, a Kubernetes pod's limit), and what the group uses against it.

psutil reports the machine's RAM; inside a limited group the kernel's OOM killer acts at the
group's limit, whatever the machine has free. So the agent reports the smaller of the two: its
lanes (children of the agent, in its group) are planned within the limit, and the host counts as
pressed when the group, not the machine, runs short. Used memory is what the group holds less its
inactive file pages (the kernel reclaims those before it kills anything), as the kubelet's
working set and `docker stats` count it. cgroup v2 and v1 both; no limit: None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
NO_LIMIT = 2**60  # v1 writes "no limit" as a page-rounded 2^63-1; anything above this is none


@dataclass(frozen=True)
class GroupMemory:
    limit: int  # bytes the group may hold
    used: int  # bytes it holds that the kernel would not reclaim first

    @property
    def available(self) -> int:
        return max(0, self.limit - self.used)


def _stat(text: str | None, key: str) -> int | None:
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _number(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) < NO_LIMIT else None


def group_memory(proc_cgroup: str, read: Callable[[str], str | None]) -> GroupMemory | None:
    """From /proc/self/cgroup's text and a reader of files under /sys/fs/cgroup (a relative path
    -> its text, None when absent): the group's limit and use, None when no limit applies."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "" and line.startswith("0::"):
            v2 = path
    if v1 is not None:
        base = "memory" + v1.rstrip("/")
        stat = read(f"{base}/memory.stat")
        # hierarchical_memory_limit: the tightest limit on the way up (a nested group's own may be none).
        limit = _stat(stat, "hierarchical_memory_limit") or _number(read(f"{base}/memory.limit_in_bytes"))
        usage = _number(read(f"{base}/memory.usage_in_bytes"))
        if limit is None or limit >= NO_LIMIT or usage is None:
            return None
        return GroupMemory(limit, max(0, usage - (_stat(stat, "total_inactive_file") or 0)))
    if v2 is not None:
        parts = [p for p in v2.split("/") if p]
        limits = [_number(read("/".join([*parts[:n], "memory.max"]))) for n in range(len(parts), -1, -1)]
        known = [x for x in limits if x is not None]
        base = "/".join(parts)
        usage = _number(read(f"{base}/memory.current" if base else "memory.current"))
        if not known or usage is None:
            return None
        stat = read(f"{base}/memory.stat" if base else "memory.stat")
        return GroupMemory(min(known), max(0, usage - (_stat(stat, "inactive_file") or 0)))
    return None


def _read(relative: str) -> str | None:
    try:
        return (ROOT / relative).read_text()
    except OSError:
        return None


def this_group() -> GroupMemory | None:
    """The limit of the group this process runs in, read now; None outside one (or not Linux)."""
    try:
        proc = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    return group_memory(proc, _read)
