"""One active planner: a lease in the lanes bucket, taken and renewed by compare-and-set.

No clocks are compared across machines: the holder renews every ttl/3 and counts
itself active only while its last renewal is younger than ttl/2; a stand-by takes
over once the entry has not changed for a whole ttl on its own clock. A holder that
stops cleanly deletes the entry, so a stand-by takes over at its next look.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec
import structlog
from nats.js.errors import KeyNotFoundError, KeyValueError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared import defaults, subjects
from shared.messages.activity import PlannerLease
from shared.messages.wire import encode
from shared.supervise import running

log = structlog.get_logger("lanes.planner")
DEFAULT_TTL = defaults.LEASE_TTL


@dataclass
class Lease:
    kv: KeyValue
    holder: str
    ttl: float = DEFAULT_TTL
    clock: object = time.monotonic
    on_change: object = None  # async callable(active: bool)
    on_holder: object = None  # callable(holder id), each time a stand-by reads the lease
    rev: int = 0  # the entry's revision this holder last wrote
    renewed_at: float = -1e18
    seen_rev: int = -1  # a stand-by's view: the entry's revision and when it last changed
    seen_at: float = 0.0
    seen_holder: str = ""
    _active: bool = field(default=False)

    def holds(self) -> bool:
        """Whether this planner may write plans now."""
        return self._active and self.clock() - self.renewed_at < self.ttl / 2

    @property
    def value(self) -> bytes:
        return encode(PlannerLease(holder=self.holder, ttl=self.ttl))

    async def step(self) -> None:
        """One look at the lease: renew it, watch it, or take it over."""
        now = self.clock()
        try:
            if self._active:
                self.rev = await self.kv.update(subjects.LEASE_KEY, self.value, last=self.rev)
                self.renewed_at = now
                return
            try:
                entry = await self.kv.get(subjects.LEASE_KEY)
            except KeyNotFoundError:
                entry = None
            if entry is None or entry.value is None:
                rev = await self.kv.create(subjects.LEASE_KEY, self.value)
                await self._won(rev, now, "no planner held the lease")
                return
            ttl = self._ttl_of(entry.value)
            if entry.revision != self.seen_rev:
                self.seen_rev, self.seen_at = entry.revision, now
                return
            if now - self.seen_at >= ttl:
                rev = await self.kv.update(subjects.LEASE_KEY, self.value, last=entry.revision)
                await self._won(rev, now, f"{self.seen_holder or 'the active planner'} went silent for {ttl:.1f} s")
        except (KeyWrongLastSequenceError, KeyValueError) as exc:
            await self._lost(f"another planner holds the lease ({exc})")
        except Exception as exc:  # NATS away: stop planning once the lease may have passed on
            if self._active and self.clock() - self.renewed_at >= self.ttl / 2:
                await self._lost(f"lease not renewed: {str(exc) or type(exc).__name__}")

    def _ttl_of(self, value: bytes) -> float:
        try:
            lease = msgspec.json.decode(value, type=PlannerLease)
            self.seen_holder = lease.holder
            if self.on_holder:
                self.on_holder(lease.holder)
            return lease.ttl
        except (msgspec.ValidationError, msgspec.DecodeError):
            return self.ttl

    async def _won(self, rev: int, now: float, why: str) -> None:
        self.rev, self.renewed_at, self._active = rev, now, True
        log.info("planner is active", holder=self.holder, reason=why)
        if self.on_change:
            await self.on_change(True)

    async def _lost(self, why: str) -> None:
        was = self._active
        self._active, self.seen_rev = False, -1
        if was:
            log.warning("planner stands by", holder=self.holder, reason=why)
            if self.on_change:
                await self.on_change(False)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while running(stop):
                await self.step()
                try:
                    await asyncio.wait_for(stop.wait(), self.ttl / 3)
                except TimeoutError:
                    pass
        finally:
            if self._active:
                self._active = False
                try:  # hand over at once rather than after a ttl
                    await asyncio.wait_for(self.kv.delete(subjects.LEASE_KEY, last=self.rev), 2)
                except Exception:
                    pass
