"""A streamed request to a lane over a bare asyncio protocol, parsed by httptools (llhttp).

Why not aiohttp's client here: a streamed answer's connection is never reused (llama-server
closes it after the last chunk, gateway/edge/forward.py), so a pool, cookies, redirects and
tracing buy nothing on the request path, and aiohttp's client was half of the gateway's own
time to first byte (bench/door_bench.py; bench/RESULTS.md, "The door"). What stays is what
the edge reads of aiohttp's `ClientResponse`: status, headers, content length, `content.readany()`,
`read()`, `release()`, `close()` and the transport, and its errors, so a lane that refuses,
drops or breaks off is told apart exactly as before (gateway/routing/tries.py).
"""

from __future__ import annotations

import asyncio
import socket
import time
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

HIGH_WATER = 256 * 1024  # bytes read ahead of a slow client before the lane's socket is paused
DNS_TTL = 10.0  # seconds a lane's resolved address is kept (aiohttp's ttl_dns_cache, as before)


class LaneUnreachable(aiohttp.ClientConnectionError):
    """The lane's address took no connection (refused, no route, name unknown)."""


class LaneConnectTimeout(aiohttp.ClientConnectionError):
    """No connection within the connect timeout: counted as dropped, as aiohttp's was."""


class Stalled(Exception):
    """No byte from the lane for the idle timeout, mid-answer."""


class TimeUp(Exception):
    """The request's own time ran out while its answer still flowed: the lane is not to blame."""


class LaneBrokeOff(aiohttp.ClientPayloadError):
    """The lane's answer ended before its last byte (the connection closed mid-body, or bytes
    that are not HTTP)."""


# A lane whose host vanished (a cut link, a dead machine) leaves sent bytes unacknowledged
# and keepalive probes unanswered: the connection fails in seconds instead of the kernel's
# quarter of an hour, so a request sent on it is retried on another lane.
LANE_TCP_USER_TIMEOUT_MS = 5000
LANE_KEEPALIVE = {"TCP_KEEPIDLE": 5, "TCP_KEEPINTVL": 2, "TCP_KEEPCNT": 3}


def lane_socket(addr_info) -> socket.socket:
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in LANE_KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, LANE_TCP_USER_TIMEOUT_MS)
    return sock


_ADDRESSES: dict[tuple[str, int], tuple[float, list]] = {}


async def _addresses(host: str, port: int) -> list:
    """getaddrinfo's answers, kept DNS_TTL seconds: a literal address costs no thread hop."""
    now = time.monotonic()
    kept = _ADDRESSES.get((host, port))
    if kept is not None and kept[0] > now:
        return kept[1]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if len(_ADDRESSES) > 4096:  # bounded: a fleet's lanes, not every name ever seen
        _ADDRESSES.clear()
    _ADDRESSES[(host, port)] = (now + DNS_TTL, infos)
    return infos


class _Content:
    """`upstream.content`, as aiohttp's StreamReader is used by the edge."""

    def __init__(self, stream: LaneStream) -> None:
        self._stream = stream

    async def readany(self) -> bytes:
        return await self._stream._next()


class LaneStream(asyncio.Protocol):
    """One request's connection to its lane: the answer's head, then its body as it arrives."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self._head: asyncio.Future[None] = self._loop.create_future()
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._complete = False
        self._error: BaseException | None = None
        self._alarm: Exception | None = None  # the watch's Stalled or TimeUp, raised once
        self._timer: asyncio.TimerHandle | None = None
        self._idle = self._deadline = self._last = 0.0
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.content_length: int | None = None
        self.content = _Content(self)
        self.sent_at = 0.0  # perf_counter when the request was written: the gateway's own time ends there
        self._heard = False  # a byte came from the lane

    # ------------------------------------------------------------- what the edge reads

    @property
    def connection(self) -> LaneStream:
        """As aiohttp's `ClientResponse.connection`: the thing whose `.transport` it is."""
        return self

    async def read(self) -> bytes:
        parts = []
        while chunk := await self._next():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the answer: its connection is closed (never reused, see the module's docstring)."""
        self.close()

    def fresh(self) -> bool:
        """Open, and nothing sent or heard on it yet: a spare that can still carry a request."""
        return (self.transport is not None and not self.transport.is_closing() and not self._heard
                and self._error is None and self.sent_at == 0.0)  # fmt: skip

    def close(self) -> None:
        self._unwatch()
        if self.transport is not None:
            self.transport.close()

    def watch(self, idle: float, deadline: float) -> None:
        """From now on a wait for the next bytes raises Stalled after `idle` seconds without any,
        or TimeUp at `deadline` (loop time). One timer for the whole answer, re-armed only when
        it fires, where a timeout around each read costs a timer per token."""
        self._idle, self._deadline, self._last = idle, deadline, self._loop.time()
        self._arm()

    def _arm(self) -> None:
        self._timer = self._loop.call_at(min(self._last + self._idle, self._deadline), self._check)

    def _unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        if self._complete or self._error is not None:
            return
        now = self._loop.time()
        if self._paused or self._body:  # its client is slow, not the lane: the clock restarts
            self._last = now
        if now >= self._deadline:
            self._alarm = TimeUp()
        elif now - self._last >= self._idle:
            self._alarm = Stalled()
        else:
            self._arm()
            return
        self._wake()

    # ------------------------------------------------------------- the protocol

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._heard = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # a lane never upgrades
            said = f"the lane's answer is not HTTP/1.1: {type(exc).__name__} {exc}"
            # Before its head: a connection that failed (tried again); after: an answer cut short.
            self._fail(aiohttp.ServerDisconnectedError(said) if not self._head.done() else LaneBrokeOff(said))

    def eof_received(self) -> bool:
        return False  # the lane is done sending: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._unwatch()
        if not self._complete and self._error is None:
            if not self._head.done():
                self._fail(aiohttp.ServerDisconnectedError())
            elif self.content_length is None and "Transfer-Encoding" not in self.headers:
                self._complete = True  # a body that ends where the connection does
            else:
                self._fail(LaneBrokeOff(f"the lane's answer ended early ({type(exc).__name__ if exc else 'closed'})"))
        self._wake()

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in self._raw_headers)
        self.headers = CIMultiDictProxy(headers)
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._last = self._loop.time()
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._unwatch()
        self._wake()

    # ------------------------------------------------------------- inside

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: a caller that went away leaves no warning
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _next(self) -> bytes:
        """The bytes come so far, joined (b"" at the answer's end); raises how the lane broke off."""
        while not self._body:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            if self._alarm is not None:
                alarm, self._alarm = self._alarm, None  # the caller decides what follows (relay.py)
                raise alarm
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk


def _head_line(name: str, value: str) -> str:
    if any(c in name or c in value for c in "\r\n\0"):
        raise ValueError(f"header {name!r} holds a line break")
    return f"{name}: {value}\r\n"


def lane_address(url: str) -> tuple[str, int]:
    split = urlsplit(url)
    return split.hostname or "", split.port or 80


async def connect(host: str, port: int, connect_timeout: float) -> LaneStream:
    """A connection to the lane, its protocol ready for one request. Raises LaneUnreachable
    (refused, no route, name unknown) or LaneConnectTimeout."""
    loop = asyncio.get_running_loop()
    try:
        infos = await _addresses(host, port)
    except OSError as exc:
        raise LaneUnreachable(f"cannot resolve {host}: {exc}") from exc
    sock, last = None, None
    try:
        async with asyncio.timeout(connect_timeout):
            for info in infos:
                try:
                    sock = lane_socket(info)
                    sock.setblocking(False)
                    await loop.sock_connect(sock, info[4])
                    break
                except OSError as exc:
                    if sock is not None:
                        sock.close()
                    sock, last = None, exc
    except TimeoutError:
        if sock is not None:
            sock.close()
        raise LaneConnectTimeout(f"no connection to {host}:{port} within {connect_timeout:g} s") from None
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if sock is None:
        raise LaneUnreachable(f"cannot connect to {host}:{port}: {last}")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        _, stream = await loop.create_connection(LaneStream, sock=sock)
    except BaseException:
        sock.close()
        raise
    return stream


async def open_stream(
    url: str, path: str, body: bytes, headers: dict[str, str], connect_timeout: float,
    spare: LaneStream | None = None,
) -> LaneStream:  # fmt: skip
    """POST `body` to the lane at `url` + `path` and wait for its answer's head. Raises
    LaneUnreachable (no connection), LaneConnectTimeout, aiohttp.ServerDisconnectedError (closed
    before answering) or LaneBrokeOff (not HTTP); a caller that is cancelled leaves no socket open.
    `spare`: a connection opened to this lane ahead of time (gateway/edge/lane_spares.py); one the
    lane closed before it heard the request is replaced by a new connection, once."""
    host, port = lane_address(url)
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        head = f"POST {path} HTTP/1.1\r\n{_head_line('Host', authority)}" + "".join(
            _head_line(k, v) for k, v in headers.items() if k.lower() not in ("host", "content-length")
        ) + f"Content-Length: {len(body)}\r\n\r\n"
    except ValueError:  # a header with a line break: nothing is sent, and the spare is not kept open
        if spare is not None:
            spare.close()
        raise
    if spare is not None and not spare.fresh():
        spare.close()
        spare = None
    stream = spare or await connect(host, port, connect_timeout)
    # Stamped before the write: the send wakes the lane, which may take the CPU from this process
    # for its whole prefill on a small host, and that is the lane's time, not the gateway's.
    stream.sent_at = time.perf_counter()
    # A client's header values came decoded as UTF-8 with surrogate escapes (aiohttp's server):
    # encoded back the same way, the lane gets the client's bytes as they were sent.
    stream.transport.write(head.encode("utf-8", "surrogateescape") + body)
    try:
        await stream._head
    except aiohttp.ServerDisconnectedError:
        stream.close()
        if spare is None or stream._heard:
            raise
        # Closed before a byte of answer (the lane restarted, or timed the idle connection out
        # as it was taken): the lane never read the request, so it is sent again, once.
        return await open_stream(url, path, body, headers, connect_timeout)
    except BaseException:
        stream.close()
        raise
    return stream
