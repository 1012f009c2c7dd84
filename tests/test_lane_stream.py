"""The gateway's bare client for streamed answers (gateway/edge/lane_stream.py), against real
sockets: a scripted server that sends exactly the bytes each case needs, and the gateway in
front of a stub lane that stalls or outlives the request's time mid-answer."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from gateway.edge import lane_stream
from gateway.edge.app_keys import METRICS
from gateway.edge.lane_stream import LaneBrokeOff, LaneUnreachable, Stalled, TimeUp, open_stream
from gateway.service import Gateway
from gateway.settings import GatewaySettings
from test_gateway_core import healthy, put_plan, put_status, spec

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Scripted:
    """A TCP server that reads one request head and plays `script` (bytes, or seconds to wait)."""

    def __init__(self, *script) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
        self.requests.append(head + await reader.readexactly(length))
        try:
            for step in self.script:
                if step == "hold":  # say nothing, keep the connection
                    break
                if isinstance(step, bytes):
                    writer.write(step)
                    await writer.drain()
                else:
                    await asyncio.sleep(step)
            if not self.script or self.script[-1] != "hold":
                writer.close()
        except ConnectionError:
            pass
        if await reader.read() == b"":
            self.closed_by_client.set()


async def test_a_streamed_answer_arrives_as_it_is_sent_with_its_head_and_request_as_asked():
    async with Scripted(HEAD, chunk(b"data: 1\n\n"), 0.05, chunk(b"data: 2\n\n"), b"0\r\n\r\n") as url:
        stream = await open_stream(url, "/v1/chat/completions", b'{"a":1}',
                                   {"Accept": "text/event-stream", "Authorization": "Bearer k"}, 1.0)  # fmt: skip
        assert stream.status == 200 and stream.headers["content-type"] == "text/event-stream"
        assert stream.content_length is None
        assert await stream.content.readany() == b"data: 1\n\n"
        assert await stream.content.readany() == b"data: 2\n\n"
        assert await stream.content.readany() == b""
        stream.release()


async def test_the_request_carries_its_headers_body_and_length_and_refuses_a_line_break():
    server = Scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    async with server as url:
        stream = await open_stream(url, "/v1/completions", b'{"x":"y"}', {"Authorization": "Bearer k"}, 1.0)
        assert stream.content_length == 2 and await stream.read() == b"ok"
        with pytest.raises(ValueError, match="line break"):
            await open_stream(url, "/v1/completions", b"{}", {"X-Evil": "a\r\nHost: elsewhere"}, 1.0)
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions HTTP/1.1"
    assert b"Authorization: Bearer k" in lines and b"Content-Length: 9" in lines and body == b'{"x":"y"}'
    assert len(server.requests) == 1  # the refused one never left


async def test_a_lane_that_takes_no_connection_is_unreachable_and_one_that_hangs_up_is_dropped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(LaneUnreachable) as refused:
            await open_stream(f"http://127.0.0.1:{port}", "/v1/chat/completions", b"{}", {}, 1.0)
    assert isinstance(refused.value, aiohttp.ClientConnectionError)
    async with Scripted() as url:  # reads the request, closes without a word
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0)
    async with Scripted(b"SSH-2.0-OpenSSH\r\n\r\n") as url:  # not HTTP: as a dropped connection, tried again
        with pytest.raises(aiohttp.ServerDisconnectedError, match="not HTTP"):
            await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0)


async def test_an_answer_cut_mid_body_is_a_payload_error_and_one_delimited_by_close_is_whole():
    async with Scripted(HEAD, chunk(b"data: 1\n\n")) as url:  # closed before the last chunk
        stream = await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0)
        assert await stream.content.readany() == b"data: 1\n\n"
        with pytest.raises(LaneBrokeOff) as cut:
            await stream.content.readany()
        assert isinstance(cut.value, aiohttp.ClientPayloadError)  # what relay.py ends a stream on
    async with Scripted(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it") as url:
        stream = await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0)
        assert await stream.read() == b"all of it"


async def test_the_watch_says_stalled_after_the_idle_time_and_time_up_at_the_deadline_once_each():
    async with Scripted(HEAD, chunk(b"a"), 0.5, chunk(b"b"), b"0\r\n\r\n") as url:
        stream = await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0)
        loop = asyncio.get_running_loop()
        stream.watch(idle=0.15, deadline=loop.time() + 10)
        assert await stream.content.readany() == b"a"
        with pytest.raises(Stalled):
            await stream.content.readany()
        assert await stream.content.readany() == b"b"  # raised once: the caller decides what follows
        stream.close()
    async with Scripted(HEAD, chunk(b"a"), 0.1, chunk(b"b"), 0.1, chunk(b"c"), 0.1, chunk(b"d"), b"0\r\n\r\n") as url:
        stream = await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0)
        stream.watch(idle=5.0, deadline=asyncio.get_running_loop().time() + 0.15)
        got = b""
        with pytest.raises(TimeUp):
            while chunk_ := await stream.content.readany():
                got += chunk_
        assert got in (b"a", b"ab")  # bytes kept coming: the request's time, not a stall
        stream.close()


async def test_a_slow_reader_pauses_the_lane_and_is_never_called_stalled(monkeypatch):
    monkeypatch.setattr(lane_stream, "HIGH_WATER", 64 * 1024)
    big = b"x" * 32768
    async with Scripted(HEAD, *[chunk(big) for _ in range(64)], b"0\r\n\r\n") as url:
        stream = await open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0)
        stream.watch(idle=0.1, deadline=asyncio.get_running_loop().time() + 30)
        await asyncio.sleep(0.4)  # four idle times without reading
        assert stream._paused and stream._buffered < 64 * 1024 + 2 * 65536  # bounded: the socket was paused
        total = 0
        while part := await stream.content.readany():
            total += len(part)
        assert total == 64 * len(big)


async def test_a_caller_cancelled_while_waiting_for_the_head_closes_its_connection():
    server = Scripted("hold")
    async with server as url:
        task = asyncio.create_task(open_stream(url, "/v1/chat/completions", b"{}", {}, 1.0))
        while not server.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.closed_by_client.wait(), 2.0)


# ------------------------------------------------------------------ through the gateway


async def _through_gateway(lane: web.Application, **settings):
    runner = web.AppRunner(lane, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    gw = Gateway(GatewaySettings(port=0, **settings))
    put_plan(gw.view, "h", spec("a", "m", parallel=1, port=port))
    put_status(gw.view, "h", healthy("a", port))
    gw.view.mark_synced()
    front = web.AppRunner(gw.app, access_log=None)
    await front.setup()
    await web.TCPSite(front, "127.0.0.1", 0).start()
    return gw, f"http://127.0.0.1:{front.addresses[0][1]}", (front, runner)


def _lane(pause: float, tokens: int, first_after: float = 0.0) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(first_after)  # its prefill
        for i in range(tokens):
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
            await asyncio.sleep(pause if i == 0 else 0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.parametrize("case", ["stalled", "time_up"])
async def test_a_stream_that_stalls_marks_its_lane_and_one_past_the_request_time_leaves_it_routable(case):
    if case == "stalled":  # silent for 1 s after its first token, with an idle timeout of 0.3 s
        gw, url, runners = await _through_gateway(_lane(1.0, 3), stream_idle_timeout=0.3)
    else:  # a token every 50 ms, for longer than the request's 0.6 s
        gw, url, runners = await _through_gateway(_lane(0.05, 40), request_timeout=0.6)
    try:
        payload = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/chat/completions", json=payload) as resp:
            assert resp.status == 200
            body = await resp.text()
        assert body.count('"content":"x"') >= 1
        last = body.strip().splitlines()[-1]
        if case == "stalled":
            assert '"stalled"' in last or "no byte for 0.3 s" in last, last
            assert ("h", "a") in gw.view.stalled
        else:
            assert '"timeout"' in last, last
            assert not gw.view.stalled and not gw.view.unreachable
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_the_gateways_own_time_is_measured_for_requests_that_waited_for_nothing():
    gw, url, runners = await _through_gateway(_lane(0.01, 2, first_after=0.3))  # one slot: the second queues
    try:
        payload = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}

        async def one(http: aiohttp.ClientSession) -> None:
            async with http.post(url + "/v1/chat/completions", json=payload) as resp:
                assert resp.status == 200
                await resp.read()

        async with aiohttp.ClientSession() as http:
            await one(http)
            await asyncio.gather(one(http), one(http))
        own = gw.app[METRICS].own_time.labels("m").collect()[0].samples
        count = next(s.value for s in own if s.name.endswith("_count"))
        total = next(s.value for s in own if s.name.endswith("_sum"))
        assert count == 2  # the queued one is not the gateway's own time
        assert 0 < total < 2 * 0.3  # the lane's 0.3 s to its first token is not in it
        ttfb = gw.app[METRICS].ttfb.labels("m").collect()[0].samples
        assert next(s.value for s in ttfb if s.name.endswith("_sum")) > 3 * 0.3  # ... where it is in this one
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_header_the_client_sent_in_any_bytes_reaches_the_lane_as_it_was_sent():
    """aiohttp's server decodes header values as UTF-8 with surrogate escapes; the lane gets the
    client's own bytes back (not a 500 for a value outside Latin-1)."""
    seen: list[bytes] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers["Accept"].encode("utf-8", "surrogateescape"))
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    lane = web.Application()
    lane.router.add_post("/v1/chat/completions", chat)
    gw, url, runners = await _through_gateway(lane)
    try:
        body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Accept: t\xc3\xa9xt/event-stream \xff\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))  # fmt: skip
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert seen == [b"t\xc3\xa9xt/event-stream \xff"]
    finally:
        for runner in runners:
            await runner.cleanup()
