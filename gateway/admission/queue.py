"""Which lane a request goes to, and how long it may wait for one.

A request whose prompt the gateway read goes where gateway/routing/affinity.py says: the lane
holding the longest prefix of it within the load bound, else the most free slots
(equals placed by the prompt's hash); one without a prompt to the most free slots
(ties rotate). A lane's load is the larger of this gateway's requests in flight there
and the busy slots its /slots last reported (other gateways and direct clients count).
With every slot of a model busy,
requests wait in a bounded queue per requested name; a slot freed, or a lane coming back,
hands a waiter its lane in the order gateway/tenants/fairness.py gives (highest priority, then the
tenant with the least decayed tokens per weight, then first come). Each priority class may
fill only its share of the queue (its ceiling): past it a request is refused with 429, or a
waiting request of a lower class is refused in its place. No sockets: asyncio futures only.

Admission owns the request counts (`LaneCounts`, gateway/admission/counts.py); the FleetView holds
only what the bus said, so the dashboard and the metrics read the fleet from one and the load from the other.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway import routing, tenants
from gateway.admission.counts import LaneCounts
from gateway.admission.lease import Lease, Waiter
from gateway.fleet import FleetView, LaneKey
from gateway.refusals import QueueFull, QueueTimeout, Refused, UnknownModel
from gateway.routing import AffinityIndex, Fingerprint, LaneLoad, budget_chunks
from gateway.tenants import Tenant, refusal_ceiling
from shared import defaults, subjects

HOT_MIN_CHUNKS = 4  # a prefix worth moving a cache for: 1 KiB of prompt, about 256 tokens


# Beyond this many routable lanes of a model, a request weighs a shortlist of them (Admission._shortlist).
SHORTLIST = 64


@dataclass
class Admission:
    view: FleetView
    max_queue: int = defaults.QUEUE_DEPTH  # waiting requests per requested model name
    max_wait: float = defaults.QUEUE_WAIT  # seconds a request may wait for a slot
    counts: LaneCounts = field(default_factory=LaneCounts)
    index: AffinityIndex = field(default_factory=AffinityIndex)
    use_affinity: bool = True  # False: most free slots only (the benchmark's baseline)
    critical_wait: float = defaults.CRITICAL_QUEUE_WAIT  # seconds a critical request may wait
    fair: bool = True  # False: first come first served (the fairness benchmark's baseline)
    ledger: tenants.Ledger = field(default_factory=tenants.Ledger)
    _arrivals: itertools.count = field(default_factory=itertools.count)
    # Told of every entry recorded or corrected (lane, model, stored, removed, reused chunks): the
    # shared view publishes them to the other gateways (gateway/sync/shared_view.py).
    on_prefix: Callable[[LaneKey, str, tuple[int, ...], tuple[int, ...], int], None] | None = None
    # Told when a request whose prompt a lane holds (source) is sent cold to another (target), the
    # source being hot: gateway/sync/hot_spots.py asks the source to spread idle conversations there.
    on_hot: Callable[[LaneKey, LaneKey], None] | None = None
    _queues: dict[str, deque[Waiter]] = field(default_factory=dict)
    _turns: itertools.count = field(default_factory=itertools.count)
    _absent: dict[LaneKey, float] = field(default_factory=dict)  # lanes out of the plan: since when
    _host_keys: dict[str, set[LaneKey]] = field(default_factory=dict)  # host token -> its lanes, at the last change
    _waited: dict[str, float] = field(default_factory=dict)  # name -> longest queue wait ended since the last report

    def __post_init__(self) -> None:
        self.view.listeners.append(self._fleet_changed)
        self._fleet_changed()  # the lanes' index budgets, for a view already filled

    def _fleet_changed(self, host: str | None = None) -> None:
        """The fleet changed (`host`: only that host's lanes, by its token; None: any)."""
        lanes = list(self.view.lanes() if host is None else self.view.host_lanes(host))
        if self.view.synced:  # (while the bucket is read, a lane not read yet has not left)
            # A lane that left the plan keeps its entries a while: one scaled down or evicted and started
            # again restores its saved slots (launcher_agent/slot_cache.py), and where it did not, its first
            # answers correct the index. Gone for longer than the shared view keeps events: forgotten.
            now = time.monotonic()
            present = {lane.key for lane in lanes}
            for key in present:
                self._absent.pop(key, None)
            if host is None:
                known = set(self.index.lanes)
            elif host in self._host_keys:
                known = self._host_keys[host]
            else:  # its first change since the fleet was read
                known = {k for k in self.index.lanes if subjects.host_token(k[0]) == host}
            for key in known - present:
                self._absent.setdefault(key, now)
            if host is not None:
                self._host_keys[host] = present
            else:
                self._host_keys = {}
                for key in present:
                    self._host_keys.setdefault(subjects.host_token(key[0]), set()).add(key)
            expired = [k for k, since in self._absent.items() if now - since > defaults.PREFIX_MAX_AGE]
            for key in expired:
                del self._absent[key]
            if host is None:
                self.index.keep_only(present | set(self._absent))
            elif expired:
                self.index.forget(expired)
        for lane in lanes:
            if lane.state != "healthy":  # a lane (re)starting holds nothing its last /slots read said
                self.counts.reported.pop(lane.key, None)
            if lane.cache_tokens > 0:
                # At the fixed characters per token, not the measured: every gateway the same budget.
                self.index.set_budget(lane.key, budget_chunks(lane.cache_tokens, routing.CHARS_PER_TOKEN,
                                                              routing.CHUNK_CHARS))  # fmt: skip
        self.poke()

    def measured(self, lease: Lease, prompt: int, cached: int, output: int = 0) -> None:
        """The lane's answer said it read `prompt` tokens, `cached` of them reused, and wrote `output`:
        correct the index (confirm the reused prefix, drop what the lane had evicted), the token
        estimate, and what the answer left in its slot (by which a spread slot is found)."""
        mark = lease.mark
        if mark is None or not mark.hashes or prompt <= 0 or not self.use_affinity:
            return
        self.index.answered(lease.lane.key, prompt + max(0, output - 1), mark.hashes)
        self.counts.note_chars(lease.lane.model, mark.chars, prompt)
        reused = int(cached * mark.chars / prompt) // routing.CHUNK_CHARS
        fix = self.index.correct(lease.lane.key, mark.hashes, lease.chunks, lease.stamp, reused)
        if self.on_prefix is not None and fix.dropped:
            self.on_prefix(lease.lane.key, lease.lane.model, (), fix.dropped, fix.confirmed)

    async def acquire(
        self, name: str, exclude: frozenset[LaneKey] = frozenset(), prompt: Fingerprint | None = None,
        who: Tenant = Tenant(),
    ) -> Lease:
        """A slot on a lane serving `name`, now or after a bounded wait."""
        if not self.view.lanes_for(name):
            raise UnknownModel(f"model {name!r} is not served by this fleet; GET /v1/models lists what is")
        if who.max_concurrent is not None and self.counts.tenant_load(who.name) >= who.max_concurrent:
            raise Refused(f"tenant {who.name!r} has {who.max_concurrent} requests under way, its max_concurrent",
                          "max_concurrent")  # fmt: skip
        loop = asyncio.get_running_loop()
        lease, choice = self._take(name, exclude, prompt, patient=True)
        if lease is not None:
            return self._lent(lease, name, who.name)
        queue = self._queues.setdefault(name, deque())
        self._make_room(name, queue, who)
        waiter = Waiter(name, exclude, loop.create_future(), prompt, since=loop.time(), tenant=who.name,
                         priority=who.priority, weight=who.weight, seq=next(self._arrivals))  # fmt: skip
        if choice.patience > 0:
            wait = min(choice.patience, self.max_wait / 2)
            waiter.patient_until, waiter.waiting_for = loop.time() + wait, choice.wait_for
            loop.call_later(wait, self.poke)
        elif choice.matched:
            wait = routing.patience(choice.matched, self._prefill_rate(name), self.max_wait)
            waiter.patient_until, waiter.waiting_for = loop.time() + wait, choice.wait_for
            loop.call_later(wait, self.poke)  # then any free lane will do
        queue.append(waiter)
        self._count(name)
        left = False  # the client hung up (cancelled): its wait is no demand
        max_wait = self.critical_wait if who.priority > 0 else self.max_wait
        try:
            async with asyncio.timeout(max_wait):
                return await waiter.future
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            # A lease handed over in the same instant as the timeout is still ours.
            if waiter.future.done() and not waiter.future.cancelled():
                if isinstance(exc, asyncio.TimeoutError):
                    return waiter.future.result()
                waiter.future.result().release()
            if isinstance(exc, asyncio.CancelledError):
                left = True
                raise
            raise QueueTimeout(f"no slot for {name!r} became free within {max_wait:g} s") from None
        finally:
            if waiter in queue:
                queue.remove(waiter)
            if not left:
                self._waited[name] = max(self._waited.get(name, 0.0), loop.time() - waiter.since)
            self._count(name)

    def _make_room(self, name: str, queue: deque[Waiter], who: Tenant) -> None:
        """Join only below the class's ceiling; at it, a waiting request of a lower class is refused
        in this one's place (the lowest class, newest first), else this one is."""
        live = [w for w in queue if not w.future.done()]
        ceiling = refusal_ceiling(who.priority, self.max_queue)
        if len(live) < ceiling:
            return
        lower = [w for w in live if w.priority < who.priority]
        if lower:
            victim = min(lower, key=lambda w: (w.priority, -w.seq))
            victim.future.set_exception(Refused(
                f"{name!r} is saturated: a request of a higher priority took this one's place in the queue",
                "shed", self._retry_after()))  # fmt: skip
            return
        if who.priority > 0 or ceiling >= self.max_queue:
            raise QueueFull(f"all slots for {name!r} are busy and {len(live)} requests already wait")
        raise Refused(f"{name!r} is saturated: {len(live)} requests wait, the ceiling for {who.klass} requests is "
                      f"{ceiling} of {self.max_queue}", "shed", self._retry_after())  # fmt: skip

    def _retry_after(self) -> int:
        return max(1, min(60, round(self.max_wait / 10)))

    def _lent(self, lease: Lease, name: str, tenant: str) -> Lease:
        lease.tenant, lease.name = tenant, name
        key = (name, tenant)
        self.counts.tenant_in_flight[key] = self.counts.tenant_in_flight.get(key, 0) + 1
        self.ledger.started(tenant)
        return lease

    def charge(self, tenant: str, prompt: int, output: int) -> float:
        """An answer's tokens, charged to its tenant's fair share; returns its weighted tokens."""
        tokens = self.ledger.tokens(prompt, output)
        self.ledger.charge(tenant, tokens, asyncio.get_running_loop().time())
        return tokens

    def take_queue_waits(self, now: float) -> dict[str, float]:
        """Per requested name: the longest queue wait since the last call, the requests still
        waiting counted at their age so far (what the planner scales lanes on). Clears the record."""
        out = dict(self._waited)
        self._waited.clear()
        for name, queue in self._queues.items():
            ages = [now - w.since for w in queue if not w.future.done()]
            if ages:
                out[name] = max(out.get(name, 0.0), max(ages))
        return out

    def _prefill_rate(self, name: str) -> float | None:
        rates = [self.counts.prefill_rate[lane.key] for lane in self.view.lanes_for(name)
                 if lane.key in self.counts.prefill_rate]  # fmt: skip
        return max(rates) if rates else None

    def _take(
        self, name: str, exclude: frozenset[LaneKey], prompt: Fingerprint | None = None, patient: bool = False,
        asking: Waiter | None = None,
    ) -> tuple[Lease | None, routing.Choice]:
        counts = self.counts
        routable = self.view.routable(name)
        waiting: dict[LaneKey, int] = {}
        for waiter in self._queues.get(name, ()):
            if waiter.waiting_for is not None and not waiter.future.done() and waiter is not asking:
                waiting[waiter.waiting_for] = waiting.get(waiter.waiting_for, 0) + 1
        if len(routable) > SHORTLIST:
            routable = self._shortlist(routable, prompt, waiting)
        loads = [LaneLoad(lane.key, lane.parallel, counts.load(lane.key), waiting.get(lane.key, 0)) for lane in routable]
        candidates = [x for x in loads if x.key not in exclude]
        hashes = prompt.hashes if prompt is not None and self.use_affinity else ()
        matched = {x.key: self.index.matched(x.key, hashes) for x in candidates} if hashes else {}
        beyond = {k: self.index.beyond(k, prompt, m) for k, m in matched.items() if m} if prompt is not None else {}
        # A prompt shorter than a chunk has no prefix worth keeping: equals rotate, as without one.
        key = prompt.key if prompt is not None and prompt.hashes and self.use_affinity else None
        held = {x.key: self.index.held(x.key) for x in candidates} if key is not None else None
        cpt = counts.cpt(routable[0].model) if routable else routing.CHARS_PER_TOKEN
        if key is not None and prompt is not None:
            by_tokens = self._by_tokens(candidates, matched, beyond, prompt, cpt, name, asking)
            choice = routing.choose_by_cost(by_tokens, round(prompt.chars / cpt), key, held, patient)
        else:
            choice = routing.choose(candidates, matched, key, next(self._turns), held=held, patient=patient)
        if choice.lane is None:
            return None, choice
        lane = next(lane for lane in routable if lane.key == choice.lane)
        lease = Lease(lane, self, since=asyncio.get_running_loop().time())
        if prompt is not None:
            lease.mark, lease.chunks = prompt, matched.get(lane.key, 0)
            lease.stamp = self.index.stamp(lane.key, prompt.hashes, lease.chunks)
            held_chars = lease.chunks * routing.CHUNK_CHARS + beyond.get(lane.key, 0)
            lease.pending = max(0, round((prompt.chars - held_chars) / cpt))
            lease.prompt_tokens = round(prompt.chars / cpt)
            counts.pending[lane.key] = counts.pending.get(lane.key, 0) + lease.pending
            self.index.record(lane.key, prompt.hashes, prompt.tail())
            if self.on_prefix is not None:
                self.on_prefix(lane.key, lane.model, prompt.hashes, (), 0)
        if choice.reason == "overflow" and matched and self.on_hot is not None:
            warm = max(matched, key=lambda k: matched[k])
            if matched[warm] >= HOT_MIN_CHUNKS and warm != lane.key:
                self.on_hot(warm, lane.key)
        counts.routes[(lane.alias, choice.reason)] = counts.routes.get((lane.alias, choice.reason), 0) + 1
        counts.in_flight[lane.key] = counts.busy(lane.key) + 1
        return lease, choice

    def _shortlist(self, routable: list, prompt: Fingerprint | None, waiting: dict[LaneKey, int]) -> list:
        """The lanes a request to a model of very many lanes weighs: those holding its prompt's first
        chunk, those a waiter waits for, and SHORTLIST more in turn (a window that moves with every
        request). Weighing every lane cost 38 ms a request at 10,000 lanes (bench/gateway_scale.py)."""
        wanted = set(waiting)
        if prompt is not None and prompt.hashes and self.use_affinity:
            wanted |= self.index.holders(prompt.hashes[0])
        start = (next(self._turns) * SHORTLIST) % len(routable)
        window = routable[start:start + SHORTLIST] + routable[:max(0, start + SHORTLIST - len(routable))]
        inside = {lane.key for lane in window}
        return [lane for lane in routable if lane.key in wanted and lane.key not in inside] + window

    def _by_tokens(self, lanes: list[LaneLoad], matched: dict[LaneKey, int], beyond: dict[LaneKey, int],
                   prompt: Fingerprint, cpt: float, name: str, asking: Waiter | None) -> list[routing.LaneTokens]:  # fmt: skip
        """Each lane's prefill ahead (sent and awaited) and its match of this prompt, in tokens
        (`beyond`: characters a lane holds past its matched chunks)."""
        counts, ahead = self.counts, dict(self.counts.pending)
        # A lane not timed yet (just started) is taken at its model's timed lanes' median speed, not
        # the fixed default: that would keep a new lane idle beside a fast warm one (or the reverse).
        timed = sorted(counts.prefill_rate[x.key] for x in lanes if x.key in counts.prefill_rate)
        prior = timed[len(timed) // 2] if timed else None
        for waiter in self._queues.get(name, ()):
            if waiter.waiting_for is not None and waiter is not asking and waiter.prompt is not None \
                    and not waiter.future.done():
                chunks = self.index.matched(waiter.waiting_for, waiter.prompt.hashes)
                done = chunks * routing.CHUNK_CHARS + self.index.beyond(waiter.waiting_for, waiter.prompt, chunks)
                ahead[waiter.waiting_for] = ahead.get(waiter.waiting_for, 0) + round(
                    max(0, waiter.prompt.chars - done) / cpt)
        return [routing.LaneTokens(
            x.key, x.slots, x.busy, x.waiting, ahead.get(x.key, 0), counts.prefill_rate.get(x.key, prior),
            counts.hold.get(x.key),
            round(min(prompt.chars, matched.get(x.key, 0) * routing.CHUNK_CHARS + beyond.get(x.key, 0)) / cpt),
            matched.get(x.key, 0)) for x in lanes]  # fmt: skip

    def release(self, key: LaneKey, lease: Lease | None = None) -> None:
        counts = self.counts
        if lease is not None and lease.name:
            tkey = (lease.name, lease.tenant)
            if counts.tenant_in_flight.get(tkey, 0) > 1:
                counts.tenant_in_flight[tkey] -= 1
            else:
                counts.tenant_in_flight.pop(tkey, None)
            self.ledger.finished(lease.tenant)
        counts.served[key] = counts.served.get(key, 0) + 1
        counts.note_ended(key, time.monotonic())
        left = counts.busy(key) - 1
        if counts.reported.get(key, 0) > left:
            counts.reported[key] -= 1  # its /slots counted this request too: the slot is free now, not at the next read
        if left > 0:
            counts.in_flight[key] = left
        else:
            counts.in_flight.pop(key, None)
        self.poke()

    def poke(self) -> None:
        """Hand free slots to the oldest waiters (after a release, a fleet change, or a waiter's
        patience for its warm lane running out); one still waiting for its warm lane lets the
        next waiter take a slot elsewhere."""
        now = asyncio.get_running_loop().time() if any(self._queues.values()) else 0.0  # waiters: a loop runs
        for name, queue in self._queues.items():
            for waiter in [w for w in queue if w.future.done()]:
                queue.remove(waiter)
            ranked = list(queue)
            if self.fair and len({(w.tenant, w.priority) for w in ranked}) > 1:
                weights = {w.tenant: w.weight for w in ranked}
                ranked = tenants.order(ranked, self.ledger, weights, now)
            for waiter in ranked:
                patient = now < waiter.patient_until
                if not patient:
                    waiter.waiting_for = None
                lease, choice = self._take(name, waiter.exclude, waiter.prompt, patient=patient, asking=waiter)
                if lease is None:
                    if choice.reason == "no_slot":
                        break
                    continue
                queue.remove(waiter)
                lease.queued = True
                waiter.future.set_result(self._lent(lease, name, waiter.tenant))
            self._count(name)

    def _count(self, name: str) -> None:
        live = [w for w in self._queues.get(name, ()) if not w.future.done()]
        if live:
            self.counts.queued[name] = len(live)
        else:
            self.counts.queued.pop(name, None)
        for key in [k for k in self.counts.tenant_queued if k[0] == name]:
            del self.counts.tenant_queued[key]
        for w in live:
            self.counts.tenant_queued[(name, w.tenant)] = self.counts.tenant_queued.get((name, w.tenant), 0) + 1
