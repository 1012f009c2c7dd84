"""Start llama-server until it has printed its buffers, then stop it: the measuring edge.

Used by the tests and the benchmarks; a lane's own lines are read by launcher_agent.process
as it runs. What the lines mean is shared.llama.logs' to say.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

from launcher_agent.process import lane_environment
from shared.llama.logs import is_loaded_line


@dataclass
class Loaded:
    rc: int | None  # None: it loaded and was stopped
    lines: list[str]
    pid: int = 0
    extra: dict | None = None  # what on_loaded measured while the process still held its memory

    @property
    def ok(self) -> bool:
        return self.rc is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_and_stop(binary: str, args: list[str], timeout: float = 120.0, on_loaded=None) -> Loaded:
    """Run `binary args` (verbosity 4 added) until the model is loaded, then SIGKILL it.

    `on_loaded(pid)` runs while the loaded process still holds its memory (e.g. to read
    nvidia-smi's per-process figure: buffers plus the CUDA context)."""
    argv = [binary, *args]
    if "--port" not in args:
        argv += ["--port", str(free_port())]
    if "--verbosity" not in args and "-lv" not in args:
        argv += ["--verbosity", "4"]
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=lane_environment(), start_new_session=True, text=True, errors="replace",
    )  # fmt: skip
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if is_loaded_line(line):
                return Loaded(None, lines, proc.pid, on_loaded(proc.pid) if on_loaded else None)
            if time.monotonic() > deadline:
                break
        return Loaded(proc.wait(timeout=10), lines, proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
