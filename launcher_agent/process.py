"""One llama-server process: spawned from an argv list, its log file tailed, stopped.

What the log lines mean is shared.llama.logs' to say; asking the lane over HTTP is
launcher_agent.lane_http's (the probe methods here only let a dry run answer for itself).

The lane writes to its own log file rather than a pipe, so it survives the agent
(no SIGPIPE when the agent is gone) and a restarted agent can adopt it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import deque
from pathlib import Path

import psutil

from launcher_agent import lane_http
from shared.llama.logs import (
    MIB,
    devices_from_lines,
    is_buffer_line,
    is_kv_size_line,
    kv_mib_from_log,
)
from shared.messages import DeviceMemory, LaneSpec

TAIL_LINES = 40
START_TIME_SLACK = 0.05  # seconds; psutil's create_time is read from /proc in clock ticks


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
        """Pick up new log lines: the tail for errors, and the KV size and buffer lines."""
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
            if is_kv_size_line(line):
                self.kv_lines.append(line)
            if is_buffer_line(line):
                self.buffer_lines.append(line)

    def printed_devices(self) -> tuple[DeviceMemory, ...]:
        """The buffers llama-server printed, per device (empty until it has loaded)."""
        return devices_from_lines(self.buffer_lines)

    def kv_bytes(self) -> int | None:
        mib = kv_mib_from_log(self.kv_lines)
        return None if mib is None else round(mib * MIB)

    async def probe_health(self) -> tuple[str, str]:
        """("loading" | "healthy" | "mismatch", detail) from /health and /props."""
        return await lane_http.readiness(self.spec)

    async def alive(self, timeout: float) -> bool:
        return await lane_http.alive(self.spec, timeout)

    async def busy_slots(self) -> int | None:
        return await lane_http.busy_slots(self.spec)

    async def loop_work(self, timeout: float):
        return await lane_http.loop_work(self.spec, timeout)

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

    async def loop_work(self, timeout: float):
        return ()

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopped = True
