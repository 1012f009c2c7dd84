"""Supervised loops: no long-running task of the planner, agent or gateway dies in silence.

A loop that raises (or returns while its service still runs) is logged with its
traceback, counted in `lanes_loop_restarts_total{service,loop}` and started again after
an exponential backoff; `lanes_loop_failing{service,loop}` is 1 from its failure until it has
run a whole `window` since its last restart, so an alert on it does not clear while the loop
still fails now and then. `lanes_service_start_time_seconds{service}` changes with every new
process: a service that keeps giving up and being restarted shows there. One that keeps failing (RestartPolicy: max_failures within
`window` seconds) raises LoopGaveUp out of the service's run, and the process exits
non-zero so its own supervisor (systemd, compose) restarts it whole. A clean stop
cancels the loops and counts nothing.

The decision is pure (`after_failure`); `Loops.run` only applies it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = structlog.get_logger("lanes.loops")


@dataclass(frozen=True)
class RestartPolicy:
    base: float = 0.5  # seconds before the first restart; doubles with each failure in the window
    cap: float = 30.0  # the backoff never exceeds this
    max_failures: int = 5  # this many failures within `window` seconds: give up, the service exits
    window: float = 300.0


DEFAULT_POLICY = RestartPolicy()  # the one place the defaults live (tests swap it for a faster one)


def cancel_requested() -> bool:
    """True once this task was asked to cancel, even when the request got lost on the way.

    On Python 3.11, asyncio.wait_for returns its inner result and drops a cancel that lands
    as that result arrives (gh-86296, fixed in 3.12); every NATS request is such a wait. A
    loop that checked only its stop event then ran on after its service was stopped: a
    killed planner kept its lease loop alive and its stop hung."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def running(stop: asyncio.Event) -> bool:
    """The condition of every long-running loop: not stopped, and not asked to cancel."""
    return not stop.is_set() and not cancel_requested()


async def cancel_and_wait(tasks: list[asyncio.Task], every: float = 1.0) -> None:
    """Cancel the tasks and wait for them all; cancel again those still running after `every`
    seconds, so that a cancel lost in a wait_for (see cancel_requested) cannot hang a stop."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
    await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class Verdict:
    failures: tuple[float, ...]  # failure times still inside the window, this one last
    delay: float  # seconds to wait before the restart
    give_up: bool


def after_failure(failures: tuple[float, ...], now: float, policy: RestartPolicy) -> Verdict:
    """What to do after a loop failed at `now`, given its earlier failure times."""
    recent = tuple(t for t in failures if now - t < policy.window) + (now,)
    delay = min(policy.cap, policy.base * 2 ** (len(recent) - 1))
    return Verdict(recent, delay, len(recent) >= policy.max_failures)


class LoopGaveUp(RuntimeError):
    """A supervised loop kept failing: the service stops and its process exits non-zero."""


class Loops(Collector):
    """The supervised loops of one service and how often each was restarted; register it
    on the service's Prometheus registry for `lanes_loop_restarts_total`."""

    def __init__(self, service: str, policy: RestartPolicy | None = None) -> None:
        self.service = service
        self.policy = policy or DEFAULT_POLICY
        self.restarts: dict[str, int] = {}
        self.last_failure: dict[str, float] = {}  # loop -> monotonic time of its last failure
        self.started_at = time.time()  # this process's start, for lanes_service_start_time_seconds

    def failing(self, name: str, now: float | None = None) -> bool:
        """Failed, and not yet run a whole window since (it may fail again at any moment)."""
        last = self.last_failure.get(name)
        return last is not None and (time.monotonic() if now is None else now) - last < self.policy.window

    def task(self, name: str, start: Callable[[], Awaitable[object]], stop: asyncio.Event) -> asyncio.Task:
        return asyncio.create_task(self.run(name, start, stop), name=f"{self.service}:{name}")

    async def run(self, name: str, start: Callable[[], Awaitable[object]], stop: asyncio.Event) -> None:
        """Run `start()` until `stop`; restart it when it fails, give up when it keeps failing."""
        self.restarts.setdefault(name, 0)
        failures: tuple[float, ...] = ()
        while True:
            try:
                await start()
                if cancel_requested():
                    raise asyncio.CancelledError
                if stop.is_set():
                    return
                log.error("loop ended while its service runs", service=self.service, loop=name)
            except asyncio.CancelledError:
                raise
            except Exception:
                if cancel_requested():
                    raise asyncio.CancelledError from None
                if stop.is_set():
                    log.info("loop failed while stopping", service=self.service, loop=name, exc_info=True)
                    return
                log.exception("loop failed", service=self.service, loop=name)
            verdict = after_failure(failures, time.monotonic(), self.policy)
            failures = verdict.failures
            self.last_failure[name] = failures[-1]
            if verdict.give_up:
                why = f"{self.service} loop {name!r} failed {len(failures)} times within {self.policy.window:g} s"
                log.error("loop keeps failing; the service exits", service=self.service, loop=name, reason=why)
                raise LoopGaveUp(why)
            self.restarts[name] += 1
            log.warning("loop restarts", service=self.service, loop=name, after_s=verdict.delay,
                        failures=len(failures))  # fmt: skip
            try:
                await asyncio.wait_for(stop.wait(), verdict.delay)
                return
            except TimeoutError:
                pass

    def collect(self):
        restarts = CounterMetricFamily("lanes_loop_restarts", "Restarts of a service's loop after it failed",
                                       labels=["service", "loop"])  # fmt: skip
        failing = GaugeMetricFamily("lanes_loop_failing", "1 from a loop's failure until it has run a whole "
                                    "restart window (300 s) since", labels=["service", "loop"])  # fmt: skip
        now = time.monotonic()
        for name, n in sorted(self.restarts.items()):
            restarts.add_metric([self.service, name], n)
            failing.add_metric([self.service, name], 1.0 if self.failing(name, now) else 0.0)
        yield restarts
        yield failing
        started = GaugeMetricFamily("lanes_service_start_time_seconds", "When this service's process started "
                                    "(Unix time): it changes at every restart", labels=["service"])  # fmt: skip
        started.add_metric([self.service], self.started_at)
        yield started
