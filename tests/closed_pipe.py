"""Run a command whose stdout reader is already gone, as in `lanes status | head -1` once head
has read its line: the read end of the pipe is closed before the command writes anything, so
its first write fails with EPIPE every time (no race with a reader)."""

from __future__ import annotations

import os
import subprocess


def run_into_closed_pipe(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=timeout)
    finally:
        os.close(write_end)
