"""A request's hold on a slot (Lease) and a request waiting for one (Waiter), as admission
(gateway/admission/queue.py) hands them out and queues them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from gateway.admission.counts import LaneCounts
from gateway.fleet import LaneKey, LaneRoute
from gateway.routing import Fingerprint


class Holder(Protocol):
    """What a lease is held from (the Admission): its counts, and where a freed slot goes back."""

    counts: LaneCounts

    def release(self, key: LaneKey, lease: Lease | None = None) -> None: ...


@dataclass
class Lease:
    """One request's hold on one slot of one lane; release exactly once."""

    lane: LaneRoute
    admission: Holder
    released: bool = False
    tenant: str = ""
    name: str = ""  # the requested model name
    mark: Fingerprint | None = None  # the prompt's chunk hashes
    chunks: int = 0  # of them the lane's index held when it was sent (the prediction its answer corrects)
    stamp: int = 0  # the index entry that match rested on
    pending: int = 0  # uncached prompt tokens counted on the lane until its first token
    prompt_tokens: int = 0  # its prompt's tokens as estimated then: charged for an answer cut short before it said them
    since: float = 0.0  # loop time it was given
    queued: bool = False  # it waited in the queue for its slot (none was free at once)

    def prefilled(self) -> None:
        """The first token came: its prompt is no longer prefill ahead of the lane's next request."""
        if self.pending:
            pending = self.admission.counts.pending
            left = pending.get(self.lane.key, 0) - self.pending
            pending[self.lane.key] = max(0, left)
            self.pending = 0

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.prefilled()
            if self.since:
                self.admission.counts.note_hold(self.lane.key, asyncio.get_running_loop().time() - self.since)
            self.admission.release(self.lane.key, self)


@dataclass
class Waiter:
    name: str
    exclude: frozenset[LaneKey]
    future: asyncio.Future
    prompt: Fingerprint | None = None
    patient_until: float = 0.0  # loop time until which it waits for its warm lane rather than a cold one
    waiting_for: LaneKey | None = None  # that lane, while it does
    since: float = 0.0  # loop time it joined the queue
    tenant: str = ""
    priority: int = 0
    weight: float = 1.0
    seq: int = 0  # arrival order (first come first served within a tenant)
