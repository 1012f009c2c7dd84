"""Plain-text tables and byte sizes for the CLI."""

from __future__ import annotations

from collections.abc import Sequence

from planner_svc.threads import cpu_ranges
from shared.messages import LaneSpec


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def threads_text(spec: LaneSpec) -> str:
    """A lane's planned threads and pinned CPUs ("2 @ 0-1"), or "default" (every core)."""
    if spec.threads is None:
        return "default"
    return f"{spec.threads} @ {cpu_ranges(spec.cpus)}" if spec.cpus else str(spec.threads)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
