"""One prefix view for every gateway, over a JetStream stream (docs/routing.md).

Each gateway alone sees only the turns it routed; behind a load balancer a conversation's
turns alternate between gateways and each private index would miss half of them. So every
gateway publishes what it learns of a lane's prompt cache (the chunk hashes of each prompt
it sends there, and the hashes an answer showed gone) as a PrefixEvent on the lane's own
subject of stream LANES_PREFIX, and applies every gateway's events, its own too, in the
stream's order. A gateway that starts replays what the stream keeps per lane (the last
PREFIX_HISTORY events: more than the lane's budget of prefixes, so the replay is the
index's snapshot) and then follows it; one cut off from NATS resumes from the last
sequence it applied (an ordered consumer) and so converges on the same index as the rest.

Its own events are applied twice, at once when it routes (no request waits on NATS) and
again in stream order: recording a prompt again only refreshes it, so the index every
gateway ends with is the one the stream's order gives.

With `kv_events` on, the same events also go out in vLLM's KVEventBatch form (msgpack:
BlockStored / BlockRemoved) on lanes.kvevents.<host>.<lane>, for Dynamo- or llm-d-style
indexers; a chunk of CHUNK_CHARS characters stands for a block, its hash for the block's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import structlog
from nats.js.api import DeliverPolicy, StreamConfig, StorageType

from gateway.admission import Admission
from gateway.fleet import LaneKey
from gateway.routing import CHUNK_CHARS
from shared import defaults, subjects
from shared.messages.prefixes import PREFIX_EVENT_HASHES, PrefixEvent
from shared.messages.wire import decode, encode

log = structlog.get_logger("lanes.gateway.sync.shared_view")

PUBLISH_TIMEOUT = 1.0  # seconds the stream has to store an event before it is sent again
OUTBOX = 4096  # events waiting to be published; past it they are dropped (and counted)
_TOP = 2**63


def to_wire(h: int) -> int:
    """A 64-bit hash as the signed integer the message carries."""
    return h - 2**64 if h >= _TOP else h


def from_wire(v: int) -> int:
    return v % 2**64


# vLLM's KV event types (vllm/distributed/kv_events.py), for its indexers to decode.
class _KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def kv_event_batch(event: PrefixEvent, now: float) -> bytes:
    """A PrefixEvent as vLLM's KVEventBatch: stored chunks chained from the first (parent None)."""
    events: list[Any] = []
    if event.stored:
        events.append(BlockStored(list(event.stored), None, [], CHUNK_CHARS))
    if event.removed:
        events.append(BlockRemoved(list(event.removed)))
    return msgspec.msgpack.encode(KVEventBatch(now, events))


def _pieces(hashes: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [hashes[i : i + PREFIX_EVENT_HASHES] for i in range(0, len(hashes), PREFIX_EVENT_HASHES)] or [()]


@dataclass
class SharedView:
    """A gateway's side of the shared prefix view: its admission's index, kept with everyone's."""

    admission: Admission
    gateway_id: str
    kv_events: bool = False
    outbox: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(OUTBOX))
    applied: int = 0  # the stream sequence of the last event applied
    received: int = 0  # events applied, every gateway's
    dropped: int = 0  # events not published: the outbox was full (NATS away too long)

    def __post_init__(self) -> None:
        self.admission.on_prefix = self.learnt

    def learnt(self, lane: LaneKey, model: str, stored: tuple[int, ...], removed: tuple[int, ...],
               reused: int) -> None:  # fmt: skip
        """The admission recorded or corrected a lane's entries: tell the others. On the request's
        path, so it only queues; the publishing loop builds and sends the events."""
        try:
            self.outbox.put_nowait((lane, model, stored, removed, reused))
        except asyncio.QueueFull:
            self.dropped += 1

    def events(self, lane: LaneKey, model: str, stored: tuple[int, ...], removed: tuple[int, ...],
               reused: int) -> list[PrefixEvent]:  # fmt: skip
        """What one learnt change goes out as: a long removal in several events."""
        host, lane_id = lane
        return [PrefixEvent(gateway=self.gateway_id, model=model, host_id=host, lane_id=lane_id,
                            stored=tuple(to_wire(h) for h in stored) if i == 0 else (),
                            removed=tuple(to_wire(h) for h in part), reused=reused)
                for i, part in enumerate(_pieces(removed))]  # fmt: skip

    def apply(self, event: PrefixEvent, sequence: int) -> None:
        """One event of the stream, in its order, whoever published it."""
        key = (event.host_id, event.lane_id)
        index = self.admission.index
        if event.removed:
            index.drop(key, (from_wire(h) for h in event.removed))
        if event.stored:
            index.record(key, [from_wire(h) for h in event.stored])
        self.applied, self.received = max(self.applied, sequence), self.received + 1

    async def start(self, nc, replicas: int = 1) -> None:
        """Make sure the stream exists (with the cluster's replicas), replay it and follow it;
        publish until cancelled."""
        js = nc.jetstream()
        config = StreamConfig(name=subjects.PREFIX_STREAM, subjects=[subjects.ALL_PREFIX], storage=StorageType.FILE,
                              max_msgs_per_subject=defaults.PREFIX_HISTORY, max_age=defaults.PREFIX_MAX_AGE,
                              num_replicas=replicas)  # fmt: skip
        try:
            await js.add_stream(config)
        except Exception as exc:  # another gateway made it, with other limits: use it as it is
            log.info("prefix stream kept as it is", error=str(exc) or type(exc).__name__)

        async def on_msg(msg) -> None:
            try:
                event = decode(msg.data, PrefixEvent)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("bad prefix event dropped", reason=str(exc))
                return
            self.apply(event, msg.metadata.sequence.stream)

        sub = await js.subscribe(subjects.ALL_PREFIX, stream=subjects.PREFIX_STREAM, cb=on_msg, ordered_consumer=True,
                                 deliver_policy=DeliverPolicy.ALL)  # fmt: skip
        try:
            await self.publish_forever(nc)
        finally:
            if nc.is_connected:
                await sub.unsubscribe()

    async def publish_forever(self, nc) -> None:
        """Until cancelled: each event on its lane's subject (and as a KVEventBatch, if asked), in
        order, each stored by the stream before the next (an event published while NATS or its
        JetStream is away would be lost: it is sent again until the stream has it)."""
        js = nc.jetstream()
        while True:
            for event in self.events(*await self.outbox.get()):
                await self._store(js, event)
                if self.kv_events:
                    await nc.publish(subjects.kv_events_subject(event.host_id, event.lane_id),
                                     kv_event_batch(event, time.time()))  # fmt: skip

    async def _store(self, js, event: PrefixEvent) -> None:
        data = encode(event)
        while True:
            try:
                await js.publish(subjects.prefix_subject(event.host_id, event.lane_id), data,
                                 stream=subjects.PREFIX_STREAM, timeout=PUBLISH_TIMEOUT)  # fmt: skip
                return
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                log.info("prefix event not stored yet; again", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(PUBLISH_TIMEOUT)
