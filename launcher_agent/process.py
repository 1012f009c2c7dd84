"""One llama-server process: spawned from an argv list, its log file tailed, stopped.

What the log lines mean is shared.llama.logs' to say; asking the lane over HTTP is
launcher_agent.lane_http's (the probe methods here only let a dry run answer for itself).

A lane's output goes through a pipe to its log writer (launcher_agent/logpump.py), a small
process started beside it in its own session: it appends to the lane's log file and rotates
it by size, and it outlives the agent, so a lane keeps its log (no SIGPIPE when the agent is
gone) and a restarted agent can adopt it. The agent only reads the file, a bounded piece per
look, following it across a rotation like `tail -F`; an adopted lane's log is read from its
tail only (the load-time facts it printed come back from the agent's state file).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from launcher_agent import lane_http
from launcher_agent.child_env import child_environment
from launcher_agent.lane_user import LaneUser
from shared.llama.logs import (
    LOADED_FOR_GOOD,
    MIB,
    devices_from_lines,
    is_buffer_line,
    is_kv_size_line,
    is_run_start_line,
    kv_mib_from_log,
)
from shared.messages.config import LANE_LOG_FILES, LANE_LOG_MAX_BYTES
from shared.messages.plans import DeviceMemory, LaneSpec

TAIL_LINES = 40
START_TIME_SLACK = 0.05  # seconds; psutil's create_time is read from /proc in clock ticks
READ_LIMIT = 1024 * 1024  # bytes of a lane's log read per look: a chatty lane is caught up over a few
TAIL_BYTES = 256 * 1024  # what an adopted lane's log is read from: its last bytes only
LONGEST_LINE = 64 * 1024  # a line without its end longer than this is taken as it is
PUMP = Path(__file__).with_name("logpump.py")


def lane_environment(names: Iterable[str] = ()) -> dict[str, str]:
    """What a lane starts with: the allow-listed part of the agent's environment
    (launcher_agent/child_env.py) plus the variables the operator named (--lane-env)."""
    return child_environment(os.environ, names)


@dataclass(frozen=True)
class LogLimits:
    """A lane's log rotation: at max_bytes the file rotates; `files` are kept, the current one included."""

    max_bytes: int = LANE_LOG_MAX_BYTES
    files: int = LANE_LOG_FILES


def pump_argv(log_path: Path, limits: LogLimits, quiet_after: str | None = None) -> list[str]:
    """The log writer's argv: this interpreter, isolated (-I), running logpump.py by its path;
    `quiet_after`: once a line matches it, debug lines are dropped (they hold the prompts)."""
    argv = [sys.executable, "-I", str(PUMP), str(log_path), str(limits.max_bytes), str(limits.files)]
    return argv + [quiet_after] if quiet_after else argv


class LaneProcess:
    def __init__(self, spec: LaneSpec, binary: str, log_path: Path, args: Sequence[str], env_names: Iterable[str] = (),
                 log_limits: LogLimits = LogLimits(), run_as: LaneUser | None = None) -> None:  # fmt: skip
        self.spec = spec
        self.binary = binary
        self.args = tuple(args)  # the argv tail, rendered from the spec by the agent that launched it
        self.log_path = log_path
        self.env_names = tuple(env_names)  # the operator's --lane-env names
        self.log_limits = log_limits
        self.run_as = run_as  # the unprivileged user it runs as (launcher_agent/lane_user.py); None: the agent's
        self.proc: asyncio.subprocess.Process | None = None
        self.pump: asyncio.subprocess.Process | None = None  # its log writer (launcher_agent/logpump.py)
        self.adopted: psutil.Process | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.kv_lines: list[str] = []
        self.buffer_lines: list[str] = []
        self._log = None  # the log file as this lane reads it (kept open: followed across a rotation)
        self._partial = b""  # the start of a line whose end is not written yet
        self._recorded = False  # the load's lines are known (an adopting agent's facts): the log's are not taken

    @property
    def argv(self) -> list[str]:
        return [self.binary, *self.args]

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab"):
            pass
        self._follow(tail=0)  # this run's lines only: the file holds the previous runs' too
        env = lane_environment(self.env_names)
        read, write = os.pipe()
        try:
            self.pump = await asyncio.create_subprocess_exec(
                *pump_argv(self.log_path, self.log_limits, LOADED_FOR_GOOD),
                stdin=read,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=write,
                stderr=write,
                start_new_session=True,  # Ctrl-C on the agent's terminal must not hit the lanes
                env=env,
                **(self.run_as.spawn_args() if self.run_as else {}),
            )
        finally:
            # The pipe's ends live on in the two children only: the writer ends with the lane.
            os.close(read)
            os.close(write)

    @classmethod
    def adopt(
        cls, spec: LaneSpec, args: Sequence[str], binary: str, log_path: Path, pid: int, started: float | None = None,
        facts: Iterable[str] = (), **kw,
    ) -> LaneProcess | None:
        """Take over a lane a previous agent started, if it is still that very process: the
        flags it was launched with (`args`, as recorded) and, when recorded, the same start
        time (a reused pid has another). Its log is read from its last TAIL_BYTES; `facts` are
        the KV and buffer lines it printed at load, as the previous agent saved them."""
        try:
            p = psutil.Process(pid)
            # The process's own flags, not argv[0]: a wrapper script may exec the real binary.
            launched = list(args)
            if not launched or p.cmdline()[-len(launched) :] != launched or p.status() == psutil.STATUS_ZOMBIE:
                return None
            if started is not None and abs(p.create_time() - started) > START_TIME_SLACK:
                return None
        except (psutil.Error, OSError):
            return None
        lane = cls(spec, binary, log_path, launched, **kw)
        lane.adopted = p
        lane._take_lines(facts)
        # The tail may hold the very lines the facts are (a young lane's whole log): read for the
        # tail only, unless it shows this run's start, from which its own lines stand.
        lane._recorded = bool(facts)
        lane._follow(tail=TAIL_BYTES)
        lane.read_log()
        lane._recorded = False
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

    async def drained(self, timeout: float = 2.0) -> None:
        """After the lane exited: wait until its writer has written its last lines (the error),
        and read on to the end of its log (its last TAIL_BYTES, if far behind)."""
        if self.pump is not None and self.pump.returncode is None:
            try:
                await asyncio.wait_for(self.pump.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        if self._log is not None:
            try:
                behind = os.fstat(self._log.fileno()).st_size - self._log.tell()
            except (OSError, ValueError):
                return
            if behind > READ_LIMIT:
                self._log.seek(-TAIL_BYTES, os.SEEK_END)
                self._log.readline(LONGEST_LINE)
                self._partial = b""

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def facts(self) -> list[str]:
        """The lines an adopting agent needs again (KV size, buffers): saved in its state file."""
        return [*self.kv_lines, *self.buffer_lines]

    def _follow(self, tail: int | None = None) -> None:
        """Open the log for reading: from its start (None), or its last `tail` bytes (a partial
        first line skipped; 0: from its end)."""
        self._partial = b""
        try:
            self._log = open(self.log_path, "rb")
        except OSError:
            self._log = None
            return
        if tail is None:
            return
        size = os.fstat(self._log.fileno()).st_size
        self._log.seek(max(0, size - tail))
        if 0 < tail < size:
            self._log.readline(LONGEST_LINE)

    def read_log(self) -> None:
        """Pick up new log lines (at most READ_LIMIT bytes): the tail for errors, and the KV size
        and buffer lines. A rotated file is read to its end before the new one."""
        for _ in range(2):
            if self._log is None:
                self._follow()  # a new file: from its start
                if self._log is None:
                    return
            chunk = self._log.read(READ_LIMIT)
            if chunk:
                self._take(chunk)
                return
            try:  # at its end: has the writer moved on to a new file under the name?
                if os.stat(self.log_path).st_ino == os.fstat(self._log.fileno()).st_ino:
                    if self._log.tell() > os.fstat(self._log.fileno()).st_size:  # truncated (one file kept)
                        self._log.seek(0)
                    return
            except OSError:
                return
            self._log.close()
            self._log = None

    def _take(self, chunk: bytes) -> None:
        data = self._partial + chunk
        complete, newline, rest = data.rpartition(b"\n")
        if not newline:
            complete, rest = (data, b"") if len(data) > LONGEST_LINE else (b"", data)
        self._partial = rest
        if complete:
            self._take_lines(complete.decode(errors="replace").splitlines())

    def _take_lines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.tail.append(line)
            if is_run_start_line(line):  # the log file holds earlier runs too: only the last one's lines count
                self.kv_lines, self.buffer_lines, self._recorded = [], [], False
            if self._recorded:
                continue
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

    async def probe_health(self, key: str | None) -> tuple[str, str]:
        """("loading" | "healthy" | "mismatch", detail) from /health and /props."""
        return await lane_http.readiness(self.spec, key)

    async def alive(self, key: str | None, timeout: float) -> bool:
        return await lane_http.alive(self.spec, key, timeout)

    async def busy_slots(self, key: str | None) -> int | None:
        return await lane_http.busy_slots(self.spec, key)

    async def loop_work(self, key: str | None, timeout: float):
        return await lane_http.loop_work(self.spec, key, timeout)

    async def slots_read(self, key: str | None, timeout: float):
        return await lane_http.slots_read(self.spec, key, timeout)

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
            except asyncio.TimeoutError:
                return False
            if self.pump is not None:  # its log writer ends with it (the end of its input)
                try:
                    await asyncio.wait_for(self.pump.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass
            return True
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

    def __init__(self, spec: LaneSpec, binary: str, log_path: Path, args: Sequence[str], **kw) -> None:
        super().__init__(spec, binary, log_path, args, **kw)
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

    async def probe_health(self, key: str | None) -> tuple[str, str]:
        return "healthy", ""

    async def alive(self, key: str | None, timeout: float) -> bool:
        return True

    async def kill(self) -> None:
        self._stopped = True

    async def busy_slots(self, key: str | None) -> int | None:
        return 0

    async def loop_work(self, key: str | None, timeout: float):
        return ()

    async def slots_read(self, key: str | None, timeout: float):
        return ("busy", 0, ())

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopped = True
