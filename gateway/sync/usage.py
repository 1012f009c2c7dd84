"""Tenants' token usage shared between gateways over NATS (the adapter of gateway/tenants/quota.py).

KV bucket lanes-usage, key usage.<tenant>.<gateway>: each gateway writes its own keys (every
USAGE_SYNC_INTERVAL, only the tenants that used tokens since) and watches everyone's. A
restarted gateway with the same id reads its own keys back before writing, so its counts go
on where they stopped; one with a new id leaves its old keys, still counted, to expire with
the bucket's max age. Other gateways' growth is charged to the local fair-share ledger too,
so a tenant busy through one gateway waits its turn at another.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog
from nats.js.api import KeyValueConfig, StorageType

from gateway.admission import Admission
from gateway.tenants import UsageBook
from shared import defaults, subjects
from shared.bus import watch_forever
from shared.messages.activity import TenantUsage
from shared.messages.wire import decode, encode
from shared.supervise import cancel_and_wait, running

log = structlog.get_logger("lanes.gateway")

USAGE_MAX_AGE = 2 * 86400.0  # a key untouched this long holds no current day


async def usage_bucket(nc, replicas: int = 1):
    """The bucket, made by the first gateway with the cluster's replicas (those of the lanes bucket)."""
    js = nc.jetstream()
    try:
        return await js.key_value(subjects.USAGE_BUCKET)
    except Exception:
        return await js.create_key_value(KeyValueConfig(bucket=subjects.USAGE_BUCKET, history=1, ttl=USAGE_MAX_AGE,
                                                        storage=StorageType.FILE, replicas=replicas))  # fmt: skip


async def share_usage(nc, book: UsageBook, admission: Admission, gateway: str, stop: asyncio.Event,
                      replicas: int = 1) -> None:  # fmt: skip
    book.gateway = gateway
    kv = await usage_bucket(nc, replicas)
    caught_up = asyncio.Event()

    async def on_entry(key: str, value: bytes | None, revision: int) -> None:
        if value is None:
            return
        try:
            u = decode(value, TenantUsage)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("bad usage entry dropped", key=key, reason=str(exc))
            return
        if u.gateway == book.gateway:
            if not caught_up.is_set():
                book.restore(u, time.time())  # before a restart: go on from there
            return
        grew = book.merge(u)
        if grew and caught_up.is_set():
            admission.ledger.charge(u.tenant, grew, asyncio.get_running_loop().time())

    async def on_caught_up() -> None:
        caught_up.set()
        book.synced = True

    watch = asyncio.create_task(watch_forever(kv, subjects.USAGE_KEYS, on_entry, resync=asyncio.Event(), stop=stop,
                                              on_caught_up=on_caught_up))  # fmt: skip
    try:
        while running(stop):
            if caught_up.is_set():
                for u in book.take_dirty():
                    await kv.put(subjects.usage_key(u.tenant, u.gateway), encode(u))
            try:
                await asyncio.wait_for(stop.wait(), defaults.USAGE_SYNC_INTERVAL)
            except asyncio.TimeoutError:
                pass
        for u in book.take_dirty():  # the last counts, for the next start
            await kv.put(subjects.usage_key(u.tenant, u.gateway), encode(u))
    finally:
        await cancel_and_wait([watch])
