"""Several GPU-type devices on a CPU machine: ggml-rpc-server processes on loopback.

llama-server --rpc a,b,c then sees them as GPU0, GPU1, GPU2 in that order; each
reports the machine's RAM as its free memory. Used by the tests and bench/device_bench.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ggml-rpc-server on port {port} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"ggml-rpc-server on port {port} did not listen within {timeout}s")


@contextlib.contextmanager
def rpc_servers(bin_dir: str | Path, count: int, threads: int = 1) -> Iterator[list[str]]:
    """Start `count` ggml-rpc-server processes; yield their endpoints (host:port)."""
    binary = str(Path(bin_dir) / "ggml-rpc-server")
    procs: list[subprocess.Popen] = []
    endpoints = []
    try:
        for _ in range(count):
            port = _free_port()
            proc = subprocess.Popen(
                [binary, "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            procs.append(proc)
            _wait_listening(port, proc)
            endpoints.append(f"127.0.0.1:{port}")
        yield endpoints
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
