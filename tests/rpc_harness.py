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
from collections.abc import Iterator
from pathlib import Path

from waiting import eventually_blocking


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    def listening() -> bool:
        assert proc.poll() is None, f"ggml-rpc-server on port {port} exited with {proc.returncode}"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    eventually_blocking(listening, timeout=timeout, interval=0.05, what=f"ggml-rpc-server to listen on {port}")


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
