"""Plain-text tables and byte sizes for the CLI."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """8GiB, 8G, 512MiB, 1.5g or plain bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    try:
        return int(float(match.group(1)) * _UNITS[match.group(2)])
    except (AttributeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 8GiB or 512MiB") from None


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
