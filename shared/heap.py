"""Freed heap handed back to the system after a bulk read.

A gateway's first read of a large fleet (tens of thousands of KV entries) holds the raw
messages while it decodes them; once read, glibc keeps the freed blocks, which sit between
live ones, as the process's memory: 105 of a 10,000-host gateway's 282 MiB
(bench/gateway_idle.py). `malloc_trim` returns those pages, as Dask does for its workers'
"unmanaged memory". Where the C library has no malloc_trim (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache


@cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):
        return None


def give_back_freed() -> bool:
    """Whether pages were handed back (False also where the C library cannot)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
