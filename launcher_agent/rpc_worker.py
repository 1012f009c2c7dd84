"""The worker side of a span lane: ggml-rpc-server processes this host runs for other hosts' lanes.

Only an agent started with --rpc-worker runs them, and only those its own plan names
(HostPlan.rpc_workers), bound to the address the operator gave (--advertise) on a port of
its --rpc-worker-ports range: ggml-rpc-server has no authentication, so nothing else may
reach it. `decide` is pure (which servers to start, which to stop); `RpcWorkers` runs them
(argv lists only), restarts one that exited, and stops those no span needs any more.
Each runs with its local tensor cache (-c, under the agent's data folder): weights a
serving host sent once are loaded from disk the next time. Each starts with the allow-listed
environment lanes get (launcher_agent/child_env.py) and logs through the same rotating writer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import structlog

from launcher_agent.process import LogLimits, lane_environment, pump_argv
from shared.messages.plans import RpcWorkerSpec
from shared.messages.status import RpcWorkerStatus

log = structlog.get_logger("lanes.agent")
RESTART_AFTER = 2.0  # seconds before an exited ggml-rpc-server is started again
STOP_WAIT = 5.0  # seconds a stopped ggml-rpc-server is given before SIGKILL


@dataclass(frozen=True)
class WorkerSettings:
    binary: str
    address: str  # the only address a ggml-rpc-server may bind
    port_base: int
    port_count: int
    cache_dir: Path
    threads: int = 1
    env_names: tuple[str, ...] = ()  # the operator's --lane-env names
    log_limits: LogLimits = LogLimits()


def spec_problem(spec: RpcWorkerSpec, settings: WorkerSettings) -> str | None:
    """Why this agent must not run the server a plan asks for, or None."""
    if spec.bind != settings.address:
        return f"asks to bind {spec.bind}, but this worker binds only its --advertise address {settings.address}"
    if not settings.port_base <= spec.port < settings.port_base + settings.port_count:
        return (f"port {spec.port} is outside this worker's range "
                f"{settings.port_base}..{settings.port_base + settings.port_count - 1}")  # fmt: skip
    return None


def worker_argv(spec: RpcWorkerSpec, settings: WorkerSettings) -> list[str]:
    argv = [settings.binary, "-H", spec.bind, "-p", str(spec.port), "-t", str(settings.threads), "-c"]
    if spec.device and spec.device != "CPU":
        argv += ["-d", spec.device]
    return argv


@dataclass(frozen=True)
class Running:
    spec: RpcWorkerSpec
    alive: bool
    exited_at: float | None = None


def decide(
    desired: Sequence[RpcWorkerSpec], running: Mapping[int, Running], now: float
) -> tuple[list[RpcWorkerSpec], list[int]]:
    """(servers to start, ports whose server to stop). One server per port; a server whose
    spec changed is stopped and started again; one that exited is started after RESTART_AFTER."""
    wanted = {s.port: s for s in desired}
    stops = sorted(p for p, r in running.items() if p not in wanted or r.spec != wanted[p])
    starts = []
    for port, spec in sorted(wanted.items()):
        r = running.get(port)
        if r is None or port in stops:
            starts.append(spec)
        elif not r.alive and (r.exited_at is None or now - r.exited_at >= RESTART_AFTER):
            stops.append(port)
            starts.append(spec)
    return starts, sorted(set(stops))


@dataclass
class _Proc:
    spec: RpcWorkerSpec
    pid: int
    popen: subprocess.Popen | None = None
    pump: subprocess.Popen | None = None  # its log writer (launcher_agent/logpump.py)
    exited_at: float | None = None
    restarts: int = 0

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            p = psutil.Process(self.pid)
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


async def _until_exited(proc: _Proc, timeout: float, every: float = 0.05) -> bool:
    """Whether the process exited (and was reaped, if ours) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while proc.alive():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(every)
    return True


class RpcWorkers:
    """The running ggml-rpc-servers of one host, kept as the plan asks."""

    def __init__(self, settings: WorkerSettings, state_file: Path):
        self.settings = settings
        self.state_file = state_file
        self.procs: dict[int, _Proc] = {}

    async def apply(self, desired: Sequence[RpcWorkerSpec], now: float) -> None:
        ok = []
        for spec in desired:
            problem = spec_problem(spec, self.settings)
            if problem:
                log.warning("rpc worker refused", lane=spec.lane_id, port=spec.port, reason=problem)
                continue
            ok.append(spec)
        for proc in self.procs.values():
            if proc.exited_at is None and not proc.alive():
                proc.exited_at = now
                log.warning("ggml-rpc-server exited", port=proc.spec.port, lane=proc.spec.lane_id)
        running = {p: Running(x.spec, x.alive(), x.exited_at) for p, x in self.procs.items()}
        starts, stops = decide(ok, running, now)
        restarts = {p: x.restarts + 1 for p, x in self.procs.items() if not x.alive()}
        for port in stops:
            await self._stop(port)
        for spec in starts:
            self._start(spec, restarts=restarts.get(spec.port, 0))
        if starts or stops:
            self._save()

    def _start(self, spec: RpcWorkerSpec, restarts: int = 0) -> None:
        self.settings.cache_dir.mkdir(parents=True, exist_ok=True)
        argv = worker_argv(spec, self.settings)
        # ggml-rpc-server keeps its cache under $LLAMA_CACHE/rpc: the agent's data folder.
        env = dict(lane_environment(self.settings.env_names), LLAMA_CACHE=str(self.settings.cache_dir))
        log_path = self.settings.cache_dir.parent / f"rpc-worker-{spec.port}.log"
        read, write = os.pipe()
        try:
            pump = subprocess.Popen(pump_argv(log_path, self.settings.log_limits), stdin=read,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    env=env)  # fmt: skip
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=write, stderr=write, env=env,
                                     start_new_session=True)  # fmt: skip
        except OSError as exc:
            log.error("could not start ggml-rpc-server", argv=argv, error=str(exc))
            return
        finally:
            os.close(read)  # the writer ends with the server (the end of its input)
            os.close(write)
        self.procs[spec.port] = _Proc(spec, popen.pid, popen, pump, restarts=restarts)
        log.info("ggml-rpc-server started", port=spec.port, lane=spec.lane_id, serving=spec.serving_host, pid=popen.pid)

    async def _stop(self, port: int) -> None:
        """SIGTERM, then SIGKILL after STOP_WAIT seconds; waits without blocking the event loop."""
        proc = self.procs.pop(port, None)
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not proc.alive():
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            await _until_exited(proc, STOP_WAIT)
        if proc.pump is not None:
            await _until_exited(_Proc(proc.spec, proc.pump.pid, proc.pump), STOP_WAIT)
        log.info("ggml-rpc-server stopped", port=port, lane=proc.spec.lane_id)

    async def stop_all(self) -> None:
        for port in list(self.procs):
            await self._stop(port)
        self._save()

    def status(self) -> tuple[RpcWorkerStatus, ...]:
        return tuple(
            RpcWorkerStatus(lane_id=p.spec.lane_id, serving_host=p.spec.serving_host, port=port, pid=p.pid,
                            running=p.alive(), restarts=p.restarts)
            for port, p in sorted(self.procs.items())
        )  # fmt: skip

    def rss(self) -> int:
        total = 0
        for proc in self.procs.values():
            try:
                total += psutil.Process(proc.pid).memory_info().rss
            except psutil.Error:
                pass
        return total

    def _save(self) -> None:
        import msgspec

        data = [{"pid": p.pid, "spec": msgspec.to_builtins(p.spec)} for p in self.procs.values()]
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(data))

    def adopt(self) -> None:
        """A restarted agent takes back the servers its last run left (same argv, still alive)."""
        import msgspec

        try:
            saved = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return
        for entry in saved:
            try:
                spec = msgspec.convert(entry["spec"], RpcWorkerSpec)
                cmdline = psutil.Process(int(entry["pid"])).cmdline()
            except (msgspec.ValidationError, KeyError, TypeError, ValueError, psutil.Error):
                continue
            if cmdline == worker_argv(spec, self.settings):
                self.procs[spec.port] = _Proc(spec, int(entry["pid"]))
                log.info("ggml-rpc-server adopted", port=spec.port, pid=entry["pid"])
