"""One llama-server process: spawned from an argv list, its log file tailed, its health polled.

The lane writes to its own log file rather than a pipe, so it survives the agent
(no SIGPIPE when the agent is gone) and a restarted agent can adopt it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import deque
from pathlib import Path

import psutil

from launcher_agent.reconcile import kv_mib_from_log
from shared.buffer_lines import devices_from_lines
from shared.messages import DeviceMemory, LaneSpec

TAIL_LINES = 40
START_TIME_SLACK = 0.05  # seconds; psutil's create_time is read from /proc in clock ticks


def port_taken(host: str, port: int) -> bool:
    """Whether another program listens on the port (a lane could not bind it)."""
    import socket

    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


async def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, dict | None]:
    """A tiny HTTP/1.0 GET; (status, JSON body or None). Status 0 when nothing answers."""
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return 0, None
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    except (OSError, asyncio.TimeoutError):
        return 0, None
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def lane_environment() -> dict[str, str]:
    """The agent's environment minus LLAMA_ARG_*: llama-server reads those as flags, and
    only the plan decides flags (the official image sets LLAMA_ARG_HOST, for one)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}


class LaneProcess:
    def __init__(self, spec: LaneSpec, binary: str, log_path: Path) -> None:
        self.spec = spec
        self.binary = binary
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.adopted: psutil.Process | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.kv_lines: list[str] = []
        self.buffer_lines: list[str] = []
        self._offset = 0

    @property
    def argv(self) -> list[str]:
        return [self.binary, *self.spec.args]

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # Ctrl-C on the agent's terminal must not hit the lanes
                env=lane_environment(),
            )
        self._offset = 0

    @classmethod
    def adopt(
        cls, spec: LaneSpec, binary: str, log_path: Path, pid: int, started: float | None = None
    ) -> LaneProcess | None:
        """Take over a lane a previous agent started, if it is still that very process: same
        flags and, when recorded, the same start time (a reused pid has another)."""
        try:
            p = psutil.Process(pid)
            # Compare the flags, not argv[0]: a wrapper script may exec the real binary.
            args = list(spec.args)
            if p.cmdline()[-len(args) :] != args or p.status() == psutil.STATUS_ZOMBIE:
                return None
            if started is not None and abs(p.create_time() - started) > START_TIME_SLACK:
                return None
        except (psutil.Error, OSError):
            return None
        lane = cls(spec, binary, log_path)
        lane.adopted = p
        lane.read_log()
        return lane

    def started_at(self) -> float | None:
        """The process's start time (seconds since the epoch), recorded for adoption."""
        try:
            return psutil.Process(self.pid).create_time() if self.pid else None
        except psutil.Error:
            return None

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        return self.adopted.pid if self.adopted else None

    @property
    def returncode(self) -> int | None:
        if self.proc is not None:
            return self.proc.returncode
        if self.adopted is not None:
            try:
                if self.adopted.is_running() and self.adopted.status() != psutil.STATUS_ZOMBIE:
                    return None
            except psutil.Error:
                pass
            return -1
        return -1

    def rss(self) -> int | None:
        try:
            return psutil.Process(self.pid).memory_info().rss if self.pid else None
        except psutil.Error:
            return None

    def read_log(self) -> None:
        """Pick up new log lines: the tail for errors, and the KV size lines."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        if not chunk:
            return
        complete, _, _ = chunk.rpartition(b"\n")
        if not complete:
            return
        self._offset += len(complete) + 1
        for line in complete.decode(errors="replace").splitlines():
            self.tail.append(line)
            if "llama_kv_cache" in line or "KV self size" in line:
                self.kv_lines.append(line)
            if "buffer size =" in line or "offloaded " in line:
                self.buffer_lines.append(line)

    def printed_devices(self) -> tuple[DeviceMemory, ...]:
        """The buffers llama-server printed, per device (empty until it has loaded)."""
        return devices_from_lines(self.buffer_lines)

    def kv_bytes(self) -> int | None:
        mib = kv_mib_from_log(self.kv_lines)
        return None if mib is None else round(mib * 1024 * 1024)

    async def probe_health(self) -> tuple[str, str]:
        """("loading" | "healthy" | "mismatch", detail) from /health and /props."""
        status, _ = await http_get(self.spec.bind, self.spec.port, "/health")
        if status != 200:
            return "loading", f"/health answered {status or 'nothing'}"
        status, props = await http_get(self.spec.bind, self.spec.port, "/props")
        if status != 200 or not isinstance(props, dict):
            return "loading", f"/props answered {status or 'nothing'}"
        n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
        slots = props.get("total_slots")
        if n_ctx != self.spec.ctx_per_slot or slots != self.spec.parallel:
            return "mismatch", (
                f"llama-server serves {n_ctx} per slot x {slots} slots;"
                f" planned {self.spec.ctx_per_slot} x {self.spec.parallel}"
            )
        return "healthy", ""

    async def alive(self, timeout: float) -> bool:
        """Does the serving lane still answer /health? (Cheap: no request reaches the model.)"""
        status, _ = await http_get(self.spec.bind, self.spec.port, "/health", timeout=timeout)
        return status == 200

    async def kill(self) -> None:
        """SIGKILL: a wedged (even SIGSTOPped) process cannot be asked to stop."""
        pid = self.pid
        if pid is None or self.returncode is not None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        await self._wait(5.0)

    async def busy_slots(self) -> int | None:
        """Slots processing a request (llama-server's /slots); None when nothing answers."""
        status, slots = await http_get(self.spec.bind, self.spec.port, "/slots")
        if status == 0:
            return None
        if status != 200 or not isinstance(slots, list):
            return 1  # it answers but cannot say: count it busy, so only the drain timeout ends the wait
        return sum(1 for slot in slots if isinstance(slot, dict) and slot.get("is_processing"))

    async def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM; a second SIGTERM after a few seconds (llama-server can miss one sent just
        after start-up, and a second interrupt makes it exit at once); SIGKILL as a last resort."""
        pid = self.pid
        if pid is None or self.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                return
            if await self._wait(wait):
                return

    async def _wait(self, timeout: float) -> bool:
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
                return True
            except asyncio.TimeoutError:
                return False
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.adopted.wait, timeout)
            return True
        except (psutil.TimeoutExpired, psutil.Error):
            return isinstance(self.returncode, int)


class DryRunLane(LaneProcess):
    """A lane that is not launched: its argv is logged and it reports healthy at once.

    `lanes agent --dry-run` shows what an agent would run; the convergence benchmark
    drives hundreds of real agents with it.
    """

    def __init__(self, spec: LaneSpec, binary: str, log_path: Path) -> None:
        super().__init__(spec, binary, log_path)
        self._stopped = False

    async def start(self) -> None:
        self.tail.append("dry run: " + " ".join(self.argv))

    @property
    def pid(self) -> int | None:
        return None

    @property
    def returncode(self) -> int | None:
        return 0 if self._stopped else None

    def rss(self) -> int | None:
        return None

    def read_log(self) -> None:
        pass

    async def probe_health(self) -> tuple[str, str]:
        return "healthy", ""

    async def alive(self, timeout: float) -> bool:
        return True

    async def kill(self) -> None:
        self._stopped = True

    async def busy_slots(self) -> int | None:
        return 0

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopped = True
