"""Connections opened to a lane ahead of its next stream (gateway/edge/lane_spares.py), against a
real TCP server that records when it accepted each connection and what came on it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from gateway.edge.lane_spares import Spares
from gateway.edge.lane_stream import lane_address, open_stream
from test_lane_stream import Scripted

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"


class Lane(Scripted):
    """Answers each request on a connection once, then closes it, as llama-server does a stream.
    `idle_close`: seconds after which a connection that sent nothing is closed by the server."""

    def __init__(self, idle_close: float | None = None) -> None:
        self.idle_close = idle_close
        self.accepted: list[float] = []  # loop time of each accept
        self.requests: list[tuple[float, bytes]] = []  # (loop time, the request head), per connection
        self.closed_idle = 0
        self.open = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        self.accepted.append(loop.time())
        self.open += 1
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_close)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                self.closed_idle += 1
                return
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            self.requests.append((loop.time(), head))
            writer.write(ANSWER)
            await writer.drain()
        finally:
            self.open -= 1
            writer.close()


async def _stream(url: str, spares: Spares) -> bytes:
    address = lane_address(url)
    stream = await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0, spares.take(address))
    spares.refill(address)
    body = await stream.read()
    stream.release()
    return body


async def _until(check, seconds: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not check():
        assert loop.time() < end, "not in time"
        await asyncio.sleep(0.01)


async def test_the_next_stream_goes_on_a_connection_opened_before_it_was_asked():
    lane = Lane()
    spares = Spares(per_lane=2, connect_timeout=1.0)
    async with lane as url:
        assert await _stream(url, spares) == b"hello"  # no spare yet: a new connection, then one opened behind it
        await _until(lambda: spares.held == 1)
        await asyncio.sleep(0.05)
        assert await _stream(url, spares) == b"hello"
        assert spares.taken == 1 and spares.stale == 0
        # The second request came on the connection accepted before it was sent.
        assert len(lane.requests) == 2 and lane.accepted[1] < lane.requests[1][0] - 0.04
        await spares.close()
        await _until(lambda: lane.open == 0)
    assert spares.held == 0


async def test_a_spare_the_lane_closed_is_replaced_and_the_request_sent_once_on_a_new_connection():
    lane = Lane(idle_close=0.1)  # the lane lets idle connections go sooner than the spare's time
    spares = Spares(per_lane=1, connect_timeout=1.0, ttl=5.0)
    async with lane as url:
        await _stream(url, spares)
        await _until(lambda: spares.held == 1)
        await _until(lambda: lane.closed_idle == 1)  # the spare is closed by the lane while it waits
        await asyncio.sleep(0.05)
        assert await _stream(url, spares) == b"hello"
        assert spares.taken == 0 and spares.stale == 1  # seen closed: never written to
        assert len(lane.requests) == 2  # the request reached the lane once
        await spares.close()


def _threaded_lane(plan: list[str], done: list[str]) -> tuple[socket.socket, threading.Thread]:
    """A lane in its own thread, so it closes a connection while the gateway's loop sees nothing:
    for each connection in turn, "answer" (read a request, answer, close) or "close" (close it
    when the test says so, unread)."""
    listener = socket.create_server(("127.0.0.1", 0))
    go = threading.Event()

    def serve() -> None:
        for step in plan:
            conn, _ = listener.accept()
            with conn:
                if step == "close":
                    go.wait(5)
                else:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    conn.sendall(ANSWER)
            done.append(step)

    thread = threading.Thread(target=serve, daemon=True)
    thread.go = go  # type: ignore[attr-defined]
    thread.start()
    return listener, thread


async def test_a_spare_closed_as_the_request_is_written_is_sent_again_once():
    done: list[str] = []
    listener, thread = _threaded_lane(["close", "answer"], done)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    spares = Spares(per_lane=1, connect_timeout=1.0, ttl=5.0)
    spares.refill(lane_address(url))
    await _until(lambda: spares.held == 1)
    spare = spares.take(lane_address(url))
    thread.go.set()  # the lane closes it; this loop does not run until the request is written
    deadline = time.monotonic() + 5
    while not done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert done == ["close"] and spare.fresh()  # closed, and the gateway cannot know yet
    stream = await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0, spare)
    assert await stream.read() == b"hello"
    assert spare.sent_at > 0 and not spare.fresh()  # it was written to, and went down
    thread.join(5)
    assert done == ["close", "answer"]  # then a new connection carried the request, once
    listener.close()
    await spares.close()


async def test_a_request_refused_for_its_headers_closes_the_spare_it_was_given():
    lane = Lane()
    spares = Spares(per_lane=1, connect_timeout=1.0)
    async with lane as url:
        spares.refill(lane_address(url))
        await _until(lambda: spares.held == 1)
        spare = spares.take(lane_address(url))
        with pytest.raises(ValueError, match="line break"):
            await open_stream(url, "/v1/chat/completions", b"{}", {"X-Evil": "a\r\nHost: elsewhere"}, 1.0, spare)
        await _until(lambda: lane.closed_idle == 1)  # closed by the gateway, nothing sent on it
        assert lane.requests == [] and len(lane.accepted) == 1
        await spares.close()


async def test_spares_are_bounded_per_lane_and_closed_unused_after_their_time():
    lane = Lane()
    spares = Spares(per_lane=2, connect_timeout=1.0, ttl=0.3)
    async with lane as url:
        address = lane_address(url)
        for _ in range(5):
            spares.refill(address)
        await _until(lambda: spares.held == 2)
        await asyncio.sleep(0.1)
        assert len(lane.accepted) == 2
        await _until(lambda: spares.held == 0 and lane.open == 0, 2.0)  # the gateway closed them
        assert lane.requests == [] and spares.stale == 0
        await spares.close()


async def test_no_spares_when_switched_off_and_none_to_a_lane_that_is_away():
    lane = Lane()
    off = Spares(per_lane=0, connect_timeout=1.0)
    async with lane as url:
        await _stream(url, off)
        await _stream(url, off)
        await asyncio.sleep(0.1)
        assert len(lane.accepted) == 2 and off.held == 0
    away = Spares(per_lane=2, connect_timeout=0.5)
    away.refill(lane_address(url))  # the lane's port is closed now: refused, nothing kept, nothing raised
    await asyncio.sleep(0.2)
    assert away.held == 0
    await away.close()
    await off.close()


def test_lane_spares_is_a_gateway_option_and_zero_switches_them_off():
    from lanes.cli import build_parser
    from lanes.online import gateway_settings

    parser = build_parser()
    assert gateway_settings(parser.parse_args(["gateway"])).lane_spares == 2
    assert gateway_settings(parser.parse_args(["gateway", "--lane-spares", "0"])).lane_spares == 0
    assert gateway_settings(parser.parse_args(["gateway", "--lane-spares", "5"])).lane_spares == 5
