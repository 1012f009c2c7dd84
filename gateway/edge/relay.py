"""An answer from the lane to the client: relayed chunk by chunk as it arrives, or (a plain answer
asked as a stream) put together first; a break or stall mid-answer ends it with routing's error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import structlog
from aiohttp import web

from gateway import routing
from gateway.admission import Lease
from gateway.edge import assemble
from gateway.edge.app_keys import LEFT, METRICS, SETTINGS, VIEW, WAKER
from gateway.edge.lane_stream import LaneStream, Stalled, TimeUp
from gateway.edge.openai_errors import give_up, openai_error, sse_error
from gateway.edge.tenancy import count_cut_short, count_usage
from gateway.routing import Attempt, Failure, GiveUp
from gateway.tenants import AnswerReader, output_tokens, prompt_usage

log = structlog.get_logger("lanes.gateway")

STOP_WAIT = 5.0  # the most an answer whose client left is read on, until its lane stops (b11434: 40 ms)


async def _chunks(upstream: aiohttp.ClientResponse | LaneStream, first: bytes, idle: float,
                  deadline: float) -> AsyncIterator[bytes]:  # fmt: skip
    """The lane's answer chunk by chunk, each within `idle` seconds and all before `deadline` (loop time)."""
    loop = asyncio.get_running_loop()
    if first:
        yield first
    if isinstance(upstream, LaneStream):
        upstream.watch(idle, deadline)
        while chunk := await upstream.content.readany():
            yield chunk
        return
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise TimeUp
        try:
            async with asyncio.timeout(min(idle, left)):
                chunk = await upstream.content.readany()
        except TimeoutError:
            raise (TimeUp if idle >= left else Stalled) from None
        if not chunk:
            return
        yield chunk


async def relay(
    request: web.Request, upstream: aiohttp.ClientResponse, lease: Lease, started: float, first_chunk: bytes = b"",
    resumable: bool = False, own: tuple[float, float] | None = None,
) -> web.StreamResponse:
    """Copy the lane's answer as it arrives; a break after the first byte ends the stream with an error.
    A `resumable` one (X-Conversation-Id) goes on when its client leaves: the client may come back
    for the rest (gateway/edge/conversations.py), so it is read to its end and charged whole.

    A stream that reaches the request timeout while it still flows is ended, and its lane stays in
    rotation; one whose lane sends nothing for --stream-idle-timeout marks the lane stalled.
    `own`: (the gateway's time before the lane's request was sent, when the lane's first byte
    came), where that is the gateway's own time (forward.py): observed once the byte is out.
    """
    app, lane, settings = request.app, lease.lane, request.app[SETTINGS]
    resp = web.StreamResponse(status=upstream.status)
    for header in ("Content-Type", "Content-Encoding", "Cache-Control"):
        if header in upstream.headers:
            resp.headers[header] = upstream.headers[header]
    if upstream.content_length is not None:
        resp.content_length = upstream.content_length
    resp.headers["X-Lanes-Lane"] = f"{lane.host_id}/{lane.lane_id}"
    finished = charged = broken = False
    streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
    read = AnswerReader(streamed)  # what the answer cost, in bounded memory
    counting = upstream.status == 200
    measure = not request.path.endswith("/embeddings")  # vectors: nothing cached to learn from
    deadline = asyncio.get_running_loop().time() + settings.request_timeout - (time.perf_counter() - started)
    try:
        await resp.prepare(request)
        first = True
        try:
            async for chunk in _chunks(upstream, first_chunk, settings.stream_idle_timeout, deadline):
                if first:
                    app[METRICS].ttfb.labels(lane.alias).observe(time.perf_counter() - started)
                    first = False
                if counting:
                    read.feed(chunk)  # first: a client that leaves during the write is still charged for it
                await resp.write(chunk)
                if own is not None:
                    app[METRICS].own_time.labels(lane.alias).observe(own[0] + time.perf_counter() - own[1])
                    own = None
            finished = True
            if counting:
                charged = True
                count_usage(app, lease, read.usage(), read.output(), measure)
        except (aiohttp.ClientError, asyncio.TimeoutError, Stalled, TimeUp) as exc:
            # Bytes went out: routing ends the answer with its error, whatever other lanes there are.
            broken = not isinstance(exc, TimeUp)
            end = _broken(app, lane, exc)
            if streamed:
                await resp.write(sse_error(end))
            else:
                raise  # a plain answer cut short: drop the connection, the client sees it incomplete
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        pass  # the client left: the lane is told below, and read until it stops
    finally:
        if finished:
            upstream.release()
            _done(app, lease)
        else:  # its client left, or its lane broke off: what the lane sent until it stopped is charged
            cut_short(app, lease, upstream, read if counting and not charged else None, lane_ok=not broken,
                      to_the_end=deadline if resumable else None)  # fmt: skip
    return resp


async def assembled(
    request: web.Request, upstream: aiohttp.ClientResponse, lease: Lease, started: float, first_chunk: bytes, kind: str
) -> web.Response:
    """A plain answer put together from the lane's stream: a client that leaves closes that stream
    (the lane stops generating), and a lane that breaks off or stalls is answered as an error,
    since nothing has reached the client yet."""
    app, lane, settings = request.app, lease.lane, request.app[SETTINGS]
    deadline = asyncio.get_running_loop().time() + settings.request_timeout - (time.perf_counter() - started)
    parts = assemble.Assembler(kind)
    read = AnswerReader(True)
    finished = lane_ok = False
    try:
        async for chunk in _chunks(upstream, first_chunk, settings.stream_idle_timeout, deadline):
            parts.feed(chunk)
            read.feed(chunk)
        finished = True
    except (aiohttp.ClientError, asyncio.TimeoutError, Stalled, TimeUp) as exc:
        lane_ok = isinstance(exc, TimeUp)
        return give_up(_broken(app, lane, exc), settings)
    except ValueError as exc:  # not the stream llama-server sends
        return openai_error(502, f"lane {lane.host_id}/{lane.lane_id} sent a stream that is not JSON: {exc}",
                            "lane_failed")  # fmt: skip
    except BaseException:  # its client left (the handler cancelled)
        lane_ok = True
        raise
    finally:
        if finished:
            upstream.release()
            _done(app, lease)
        else:  # its client left, or its lane broke off: what the lane sent until it stopped is charged
            cut_short(app, lease, upstream, read, lane_ok=lane_ok)
    if parts.error is not None:
        status = parts.error.get("error", {}).get("code") if isinstance(parts.error.get("error"), dict) else None
        return web.json_response(parts.error, status=status if isinstance(status, int) and 400 <= status < 600 else 500)
    body = msgspec.json.encode(parts.result())
    count_usage(app, lease, prompt_usage(body, False), output_tokens(body, False))
    app[METRICS].ttfb.labels(lane.alias).observe(time.perf_counter() - started)
    return web.Response(body=body, content_type="application/json",
                        headers={"X-Lanes-Lane": f"{lane.host_id}/{lane.lane_id}"})  # fmt: skip


def _done(app: web.Application, lease: Lease) -> None:
    lease.release()
    app[WAKER].touch(lease.lane.alias)  # the answer's end counts as use too: a long stream is not idle time


def cut_short(
    app: web.Application, lease: Lease, upstream: aiohttp.ClientResponse, read: AnswerReader | None, lane_ok: bool,
    to_the_end: float | None = None,
) -> None:
    """An answer that ended before its lane finished it. A lane that broke is let go at once;
    one whose client left (or whose time ran out) is told, and read until it stops, in the
    background: its slot stays leased and its tokens are charged once it has. A resumable one
    is not told: it is read, untold, until it ends or the loop time `to_the_end`."""
    if not lane_ok:
        upstream.close()
        if read is not None:
            count_cut_short(app, lease, read)
        _done(app, lease)
        return
    task = asyncio.get_running_loop().create_task(_until_stopped(app, lease, upstream, read, to_the_end))
    app[LEFT].add(task)
    task.add_done_callback(app[LEFT].discard)


async def _until_stopped(app: web.Application, lease: Lease, upstream: aiohttp.ClientResponse,
                         read: AnswerReader | None, to_the_end: float | None = None) -> None:  # fmt: skip
    """The gateway ends its side of the lane's connection and reads, relaying nothing, until the
    lane hangs up. llama-server sees the end at once and cancels the request (40 ms on b11434,
    where a closed connection took 1.7 s to notice), and every token it generated till then
    has been sent: the tokens charged are the tokens its /metrics count (tests/test_charging_real.py)."""
    try:
        connection = upstream.connection
        transport = connection.transport if connection is not None else None
        if to_the_end is not None or (transport is not None and transport.can_write_eof()):
            if to_the_end is None:
                transport.write_eof()
            async with asyncio.timeout_at(to_the_end) if to_the_end is not None else asyncio.timeout(STOP_WAIT):
                while chunk := await upstream.content.readany():
                    if read is not None:
                        read.feed(chunk)
    except (aiohttp.ClientError, OSError, TimeoutError):
        pass  # what came is charged; the lane is let go below
    finally:
        upstream.close()
        if read is not None:
            count_cut_short(app, lease, read)
        _done(app, lease)


async def settle_left(app: web.Application) -> None:
    """At shutdown: the answers still read until their lanes stop end now (closed, charged, released)."""
    left = list(app[LEFT])
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def _broken(app: web.Application, lane, exc: BaseException) -> GiveUp:
    """The error that ends an answer cut short, and what it says of the lane."""
    settings = app[SETTINGS]
    if isinstance(exc, TimeUp):  # a long answer, still progressing: the lane did nothing wrong
        return GiveUp(504, f"the answer did not finish within the request timeout of {settings.request_timeout:g} s",
                      "timeout")  # fmt: skip
    if isinstance(exc, Stalled):
        failed = Attempt(lane.key, Failure.STALLED, f"no byte for {settings.stream_idle_timeout:g} s mid-answer")
        app[VIEW].mark_stalled(lane.key, routing.stalled_reason(failed))
    else:
        failed = Attempt(lane.key, Failure.BROKE, f"{type(exc).__name__} {exc}")
        app[VIEW].mark_unreachable(lane.key, routing.unreachable_reason(failed))
    end = routing.decide((), [failed], request_timeout=settings.request_timeout)
    log.warning("stream broke", lane=lane.lane_id, host=lane.host_id, error=end.message)
    return end
