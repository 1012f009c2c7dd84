"""NATS connection and the KV bucket, shared by every process (the only NATS plumbing)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats
import structlog
from nats.aio.client import Client
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType, StreamConfig
from nats.js.kv import KeyValue
from nats.micro.request import Request, ServiceError

from shared import defaults, subjects
from shared.nats_auth import NatsAuth
from shared.subjects import BUCKET, kv_subject
from shared.supervise import cancel_and_wait, running

log = structlog.get_logger("lanes.bus")
T = TypeVar("T")
STORE_LAG_TRIES = 8  # reads of a key, 10 ms apart and growing, until it holds a write just seen
STORE_LAG_RETRIES = 10  # ... then again once a second this many times before the write is taken as refused


async def connect(
    servers: str | list[str],
    *,
    name: str,
    auth: NatsAuth = NatsAuth(),
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    retry_forever: bool = True,
    inbox_prefix: str | None = None,
    give_up_after: float = 10.0,
) -> Client:
    """Connect and keep reconnecting forever: a service outlives NATS restarts. A short-lived client
    (retry_forever=False: the CLI, tests) still keeps trying for `give_up_after` seconds, so a command
    run while a container or a NATS node is restarting waits for it, then names the last error seen."""
    last_error: list[str] = []

    async def error_cb(exc: Exception) -> None:
        last_error[:] = [str(exc) or type(exc).__name__]
        if isinstance(exc, (nats.errors.Error, OSError, asyncio.TimeoutError)):
            log.warning("nats error", error=str(exc) or type(exc).__name__)
        else:  # a subscription callback raised: nats-py hands it here, and it must not vanish
            log.error("nats callback failed", error=str(exc) or type(exc).__name__, exc_info=exc)

    async def reconnected_cb() -> None:
        log.info("nats reconnected")
        if on_reconnect:
            await on_reconnect()

    async def disconnected_cb() -> None:
        log.warning("nats disconnected")
        if on_disconnect:
            await on_disconnect()

    if isinstance(servers, str):
        servers = [s.strip() for s in servers.split(",") if s.strip()]
    deadline = asyncio.get_running_loop().time() + give_up_after
    while True:
        try:
            return await _connect_once(servers, name, retry_forever, inbox_prefix, auth,
                                       error_cb, reconnected_cb, disconnected_cb)  # fmt: skip
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as exc:
            refused = any(word in (last_error or [""])[0].lower() for word in ("authorization", "authentication"))
            if retry_forever or refused or asyncio.get_running_loop().time() >= deadline:
                detail = f" (last error: {last_error[0]})" if last_error and last_error[0] != str(exc) else ""
                raise ConnectionError(f"{exc or type(exc).__name__}{detail}") from exc
            await asyncio.sleep(0.5)


async def _connect_once(servers, name, retry_forever, inbox_prefix, auth, error_cb, reconnected_cb,
                        disconnected_cb) -> Client:  # fmt: skip
    return await nats.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1 if retry_forever else 3,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        connect_timeout=3,
        error_cb=error_cb,
        reconnected_cb=reconnected_cb,
        disconnected_cb=disconnected_cb,
        # A per-user prefix lets permissions give each user its own replies only.
        **({"inbox_prefix": inbox_prefix} if inbox_prefix else {}),
        **auth.connect_options(),
    )


async def kv_bucket(nc: Client, *, create: bool = False, replicas: int = 1) -> KeyValue:
    """The lanes bucket; only the planner creates it (agents may lack the permission)."""
    js = nc.jetstream()
    if create:
        try:
            # direct: agents read their own plan with DIRECT.GET, which permissions can scope per key.
            return await js.create_key_value(
                KeyValueConfig(bucket=BUCKET, history=5, storage=StorageType.FILE, replicas=replicas, direct=True)
            )
        except Exception as exc:  # already exists with other settings, or no permission
            log.info("kv bucket exists or cannot be created", error=str(exc))
    return await js.key_value(BUCKET)


async def secrets_bucket(nc: Client, *, create: bool = False, replicas: int = 1) -> KeyValue:
    """Bucket lanes-secrets: each lane's API key, put by its agent, read by gateways alone
    (docker/nats/auth.conf). In memory: a key is new at every start of a lane, and agents put
    theirs again after a loss. The planner makes it; an agent may, where it is missing."""
    js = nc.jetstream()
    if create:
        try:
            return await js.create_key_value(KeyValueConfig(
                bucket=subjects.SECRETS_BUCKET, history=1, storage=StorageType.MEMORY, replicas=replicas))  # fmt: skip
        except Exception as exc:
            log.info("secrets bucket exists or cannot be created", error=str(exc))
    return await js.key_value(subjects.SECRETS_BUCKET)


SLOT_CHUNK_BYTES = 512 * 1024
SLOTS_MAX_AGE = 600.0  # seconds an offered slot's pieces are kept: its receiver reads them at once


async def slots_stream(nc: Client, *, max_bytes: int, replicas: int = 1) -> None:
    """Stream LANES_SLOTS: the pieces of slot files moving between lanes (shared/messages/slots.py).
    On disk, bounded (the fleet's slot_cache_bytes: the oldest pieces go first) and short-lived;
    direct gets, so a receiving agent reads pieces with no consumer of its own. The planner makes it."""
    js = nc.jetstream()
    config = StreamConfig(name=subjects.SLOTS_STREAM, subjects=[subjects.SLOT_CHUNKS], storage=StorageType.FILE,
                          num_replicas=replicas, max_bytes=max(max_bytes, 64 * SLOT_CHUNK_BYTES), max_age=SLOTS_MAX_AGE,
                          discard=DiscardPolicy.OLD, allow_direct=True, max_msg_size=SLOT_CHUNK_BYTES + 4096)  # fmt: skip
    try:
        await js.add_stream(config)
    except Exception:  # made before: its limits follow the config
        await js.update_stream(config)


async def until_made(make: Callable[[], Awaitable[T]], what: str, stop: asyncio.Event,
                     give_up_after: float | None = None) -> T | None:
    """`make()` again until it succeeds: a bucket or stream a service makes at its start. A cluster
    that passes its health check may still be electing JetStream's leader, and what failed then was
    never made after (no lane key ever reached a gateway: test_compose_live in CI). None: stopped,
    or still failing after `give_up_after` seconds (logged)."""
    delay, began = 0.5, time.monotonic()
    while running(stop):
        try:
            return await make()
        except Exception as exc:
            error = str(exc) or type(exc).__name__
            if give_up_after is not None and time.monotonic() - began >= give_up_after:
                log.warning(f"{what} not made; going on without it", error=error)
                return None
            log.warning(f"{what} not made yet; trying again", error=error, after_s=delay)
            await _sleep_or(stop, delay)
            delay = min(2 * delay, 5.0)
    return None


def leader_view(kv: KeyValue) -> KeyValue:
    """The same bucket read without direct gets: a get is then answered by the stream's leader,
    never by a replica still catching up after a restart (a direct get may return a value
    minutes old from one: nats-server#4162, #6557)."""
    return KeyValue(name=kv._name, stream=kv._stream, pre=kv._pre, js=kv._js, direct=False)


async def watch_was_empty(watcher) -> bool:
    """Whether a watch's first message, nats-py's caught-up marker (None), means what it says.
    nats-py sends it first when its consumer, asked after it was made, had nothing pending and
    nothing had arrived yet; in a cluster the entries can arrive after that answer (about 1 watch in
    6 on a 3-node cluster, tests/test_bus_cluster.py), and the marker comes before the whole bucket.
    A consumer that delivered nothing had nothing; one that did sends its last entry with delta 0.
    (A marker after an entry is sound: nats-py sends it after the entry nothing followed.)"""
    info = await watcher._sub.consumer_info()  # nats-py keeps the subscription private; no other way in
    return not (info.delivered and info.delivered.consumer_seq)


async def read_all(kv: KeyValue, keys: str = ">", timeout: float = 30.0) -> dict[str, bytes]:
    """Every key's last value (deleted keys left out), read by one watch to its end: where a key
    listing (kv.keys) would end at an early caught-up marker (watch_was_empty)."""
    values: dict[str, bytes] = {}
    watcher = await kv.watch(keys)
    try:
        seen = False
        while True:
            entry = await watcher.updates(timeout=timeout)  # raises when the bucket stops answering
            if entry is None:
                if seen or await watch_was_empty(watcher):
                    return values
                continue
            seen = True
            if entry.operation in ("DEL", "PURGE") or entry.value is None:
                values.pop(entry.key, None)
            else:
                values[entry.key] = entry.value
            if entry.delta == 0:
                return values
    finally:
        await watcher.stop()


async def watch_forever(
    kv: KeyValue,
    keys: str,
    on_entry: Callable[[str, bytes | None, int], Awaitable[None]],
    *,
    resync: asyncio.Event,
    stop: asyncio.Event,
    on_caught_up: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """A KV watch that survives NATS restarts.

    nats-py's watcher silently stops delivering after the server restarts, so the
    watch is re-created whenever `resync` is set (from reconnected_cb) or it fails.
    Each new watch starts with a full snapshot, which suits level-triggered reconciling.
    on_entry gets (key, value or None when deleted, revision).
    """
    while running(stop):
        resync.clear()
        watcher = None
        try:
            watcher = await kv.watch(keys)
            caught_up = seen = False
            while running(stop) and not resync.is_set():
                try:
                    entry = await watcher.updates(timeout=1.0)
                except nats.errors.TimeoutError:
                    continue
                if entry is None:  # after an entry: the end of the snapshot; before any: maybe early
                    if not caught_up and (seen or await watch_was_empty(watcher)):
                        caught_up = True
                        if on_caught_up:
                            await on_caught_up()
                    continue
                seen = True
                deleted = entry.operation in ("DEL", "PURGE")
                await on_entry(entry.key, None if deleted else entry.value, entry.revision)
                if not caught_up and entry.delta == 0:  # the last of the watch's snapshot
                    caught_up = True
                    if on_caught_up:
                        await on_caught_up()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("kv watch failed; retrying", keys=keys, error=str(exc) or type(exc).__name__)
            await _sleep_or(stop, 1.0)
        finally:
            if watcher is not None:
                try:
                    await asyncio.wait_for(watcher.stop(), 2)
                except Exception:
                    pass


async def follow_key(
    nc: Client,
    kv: KeyValue,
    key: str,
    on_entry: Callable[[str, bytes | None], Awaitable[None]],
    *,
    resync: asyncio.Event,
    stop: asyncio.Event,
    every: float = defaults.KEY_REREAD,
) -> None:
    """Follow one KV key with no JetStream consumer: a plain subscription on the key's
    subject says when it is written, and a direct get reads what the bucket holds then
    (a write the stream refused, a lost compare-and-set, is never taken for the value).
    The key is also read at the start, after every reconnect (`resync`) and every
    `every` seconds.

    A user allowed only this key's subject and its direct get can follow it; it needs
    no right to create (or delete) consumers. on_entry gets (key, value or None).
    """
    written = asyncio.Event()
    last_write: list[bytes] = []  # the latest write seen on the subject

    async def on_msg(msg) -> None:
        last_write[:] = [msg.data]
        written.set()

    async def read() -> tuple[bytes | None, bool]:
        """The value, and whether it is the write last seen on the subject (or none was seen).
        Subscribers hear of a write a moment before the stream has stored it: read again until
        the bucket holds what was written."""
        for attempt in range(STORE_LAG_TRIES):
            try:
                value = (await kv.get(key)).value or b""  # nats-py reads an empty value as None
            except nats.js.errors.KeyNotFoundError:
                value = None
            if not last_write or value == last_write[0]:
                return value, True
            if attempt < STORE_LAG_TRIES - 1:
                await asyncio.sleep(0.01 * (attempt + 1))
        return value, False

    sub = await nc.subscribe(kv_subject(key), cb=on_msg)
    unsettled = 0  # reads in a row that did not find the write seen on the subject
    try:
        while running(stop):
            resync.clear()
            written.clear()
            try:
                value, settled = await read()
                await on_entry(key, value)
            except Exception as exc:
                log.info("key read failed; retrying", key=key, error=str(exc) or type(exc).__name__)
                await _sleep_or(stop, 1.0)
                continue
            # A write not stored yet (a stream behind by more than the reads' 0.36 s: a thousand
            # agents' puts at once, bench/convergence_bench.py) is read again in a second, a few
            # times, then taken as refused: else the agent missed its plan until the next re-read.
            unsettled = 0 if settled else unsettled + 1
            loop = asyncio.get_running_loop()
            until = loop.time() + (every if settled or unsettled > STORE_LAG_RETRIES else 1.0)
            while running(stop) and not resync.is_set() and not written.is_set() and loop.time() < until:
                try:
                    await asyncio.wait_for(written.wait(), min(1.0, max(0.01, until - loop.time())))
                except TimeoutError:
                    continue
    finally:
        try:
            await asyncio.wait_for(sub.unsubscribe(), 2)
        except Exception:
            pass


def logged_endpoint(handler: Callable[[Request], Awaitable[None]], name: str) -> Callable[[Request], Awaitable[None]]:
    """A micro endpoint's handler whose unexpected failure is logged with its traceback (nats-py
    answers the requester 500 and logs nothing); a ServiceError is an answer, not a failure."""

    async def run(req: Request) -> None:
        try:
            await handler(req)
        except ServiceError:
            raise
        except Exception:
            log.exception("endpoint failed", endpoint=name)
            raise

    return run


def quietly(step: Callable[[], Awaitable[object]], timeout: float = 2.0) -> Callable[[], Awaitable[None]]:
    """A shutdown step that may neither hang nor fail the exit: NATS may be gone by then."""

    async def run() -> None:
        try:
            await asyncio.wait_for(step(), timeout)
        except Exception as exc:
            log.info(
                "shutdown step skipped",
                step=getattr(step, "__qualname__", "step"),
                error=str(exc) or type(exc).__name__,
            )

    return run


async def run_until(stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
    """Wait for `stop`, then cancel the tasks. Cancelled from outside, the tasks go too.

    A task that fails first (a supervised loop that gave up, shared.supervise) ends the wait:
    the others are cancelled and its exception is raised, so the service exits non-zero."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending | {stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stopping in done:
                return
            pending.discard(stopping)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()
        await stopping
    finally:
        stopping.cancel()
        await cancel_and_wait(tasks)


async def _sleep_or(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        pass
