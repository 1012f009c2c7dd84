"""Connections opened to a lane ahead of its next streamed request.

llama-server closes a streamed answer's connection after its last chunk (gateway/edge/forward.py),
so every stream needs a new one, and a new connection waits for the lane's HTTP server to accept
it and hand it to a worker thread: 2.5 ms of the lane's time to first byte on a quiet 2-core host,
against a connection accepted beforehand (bench/RESULTS.md, "The door"). So after each stream
to a lane the gateway opens the next connection to it in the background, and the next request
takes it. A spare holds one of the lane's HTTP threads while it waits (llama-server keeps
n_parallel + 4 and starts more on demand), so each lane gets at most `per_lane` from a gateway,
and a spare not taken within `ttl` seconds is closed, well before llama-server's own 5 s
keep-alive timeout would close it: an idle gateway holds none.
"""

from __future__ import annotations

import asyncio
from collections import deque

import aiohttp

from gateway.edge.lane_stream import LaneStream, connect

Address = tuple[str, int]

SPARE_TTL = 2.0  # seconds a spare waits to be taken
MOST_SPARES = 1024  # spares held at once, across every lane


class Spares:
    def __init__(self, per_lane: int, connect_timeout: float, ttl: float = SPARE_TTL) -> None:
        self.per_lane, self.connect_timeout, self.ttl = per_lane, connect_timeout, ttl
        self._idle: dict[Address, deque[tuple[float, LaneStream]]] = {}
        self._opening: dict[Address, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._held = 0
        self._closed = False
        self.taken = self.stale = 0  # spares that carried a request; spares found closed or timed out

    def take(self, address: Address) -> LaneStream | None:
        """A spare connection to the lane, still open; None when there is none."""
        waiting = self._idle.get(address)
        now = asyncio.get_running_loop().time()
        while waiting:
            born, stream = waiting.popleft()
            self._held -= 1
            if stream.fresh() and now - born < self.ttl:
                self.taken += 1
                return stream
            self.stale += 1
            stream.close()
        self._idle.pop(address, None)
        return None

    def refill(self, address: Address) -> None:
        """Open a spare to the lane in the background, unless it has its share already."""
        have = len(self._idle.get(address, ())) + self._opening.get(address, 0)
        if self._closed or have >= self.per_lane or self._held + sum(self._opening.values()) >= MOST_SPARES:
            return
        self._opening[address] = self._opening.get(address, 0) + 1
        task = asyncio.create_task(self._open(address), name=f"lane spare {address[0]}:{address[1]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, address: Address) -> None:
        try:
            stream = await connect(*address, self.connect_timeout)
        except (OSError, aiohttp.ClientError):  # the lane is away: a request finds out and says so
            return
        finally:
            self._opening[address] -= 1
            if not self._opening[address]:
                del self._opening[address]
        if self._closed:
            stream.close()
            return
        loop = asyncio.get_running_loop()
        entry = (loop.time(), stream)
        self._idle.setdefault(address, deque()).append(entry)
        self._held += 1
        loop.call_later(self.ttl, self._expire, address, entry)

    def _expire(self, address: Address, entry: tuple[float, LaneStream]) -> None:
        waiting = self._idle.get(address)
        if waiting is not None and entry in waiting:  # not taken meanwhile
            waiting.remove(entry)
            self._held -= 1
            entry[1].close()
            if not waiting:
                del self._idle[address]

    @property
    def held(self) -> int:
        return self._held

    async def close(self) -> None:
        """Every spare closed and no more opened (the gateway stops)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for waiting in self._idle.values():
            for _, stream in waiting:
                stream.close()
        self._idle.clear()
        self._held = 0
