"""The gateway's event-loop lag while it relays many concurrent streams.

Run from the repository root:

    .venv/bin/python bench/gateway_loop_lag.py [--streams 64] [--seconds 20] [--token-rate 20]

Three processes, so that only the gateway's own work lands on its loop:
- lanes: stand-in lanes (aiohttp, one process, 8 lanes of 8 slots), each answering a chat
  request with a server-sent-events stream of `--tokens` chunks paced at `--token-rate` per
  second (llama-server's chunk shape), and /health and /slots as the gateway polls them;
- clients: `--streams` client loops that each open a streaming chat through the gateway,
  read it to its end and start the next, for `--seconds`;
- this process: the real gateway (gateway.service.run_gateway, with its /health probes,
  /slots polls and demand loop running, API keys on), its fleet view fed the lanes directly
  (a nats-server runs for its bus side, with no bucket), and a probe that asks the loop for
  a 10 ms sleep over and over and records how late it wakes: the event-loop lag.

The lag is reported idle (no streams) and under load, as p50, p99 and max, with the chunks
per second the gateway relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KEY = "sk-bench-loop-lag"
LANES, SLOTS = 8, 8
PROBE_SLEEP = 0.010


# ------------------------------------------------------------------ role: lanes


def serve_lanes(base_port: int, tokens: int, rate: float) -> None:
    async def main() -> None:
        runners = []
        for i in range(LANES):
            busy = [0]

            async def chat(request: web.Request, busy=busy) -> web.StreamResponse:
                await request.read()
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                busy[0] += 1
                try:
                    await resp.prepare(request)
                    for n in range(tokens):
                        await asyncio.sleep(1 / rate)
                        chunk = {"choices": [{"index": 0, "delta": {"content": f" w{n}"}, "finish_reason": None}],
                                 "object": "chat.completion.chunk", "model": "chat"}  # fmt: skip
                        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                finally:
                    busy[0] -= 1
                return resp

            async def health(_: web.Request) -> web.Response:
                return web.json_response({"status": "ok"})

            async def slots(_: web.Request, busy=busy) -> web.Response:
                return web.json_response([{"id": s, "id_task": -1, "is_processing": s < busy[0]} for s in range(SLOTS)])

            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            app.router.add_get("/health", health)
            app.router.add_get("/slots", slots)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", base_port + i).start()
            runners.append(runner)
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# ------------------------------------------------------------------ role: clients


def run_clients(url: str, streams: int, seconds: float) -> None:
    async def main() -> dict:
        done, failed, chunks = 0, 0, 0
        end = time.monotonic() + seconds

        async def loop(http: aiohttp.ClientSession) -> None:
            nonlocal done, failed, chunks
            while time.monotonic() < end:
                try:
                    async with http.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                                         json={"model": "chat", "stream": True, "messages": [
                                             {"role": "user", "content": "hi"}]}) as resp:  # fmt: skip
                        if resp.status != 200:
                            failed += 1
                            continue
                        async for line in resp.content:
                            chunks += line.startswith(b"data: ")
                    done += 1
                except aiohttp.ClientError:
                    failed += 1

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
            await asyncio.gather(*(loop(http) for _ in range(streams)))
        return {"streams_done": done, "failed": failed, "chunks": chunks}

    print(json.dumps(asyncio.run(main())), flush=True)


# ------------------------------------------------------------------ this process: the gateway


async def lag_probe(stop: asyncio.Event, out: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        began = loop.time()
        await asyncio.sleep(PROBE_SLEEP)
        out.append(loop.time() - began - PROBE_SLEEP)


def _summary(lags: list[float]) -> dict:
    ms = sorted(x * 1000 for x in lags)
    return {"samples": len(ms), "p50_ms": round(statistics.median(ms), 2),
            "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2), "max_ms": round(ms[-1], 2)}  # fmt: skip


async def bench(args: argparse.Namespace) -> dict:
    from fixtures_bus import free_port_base  # tests/ helper: a run of free ports

    from gateway.service import Gateway, run_gateway
    from gateway.settings import GatewaySettings
    from shared import subjects
    from shared.logs import setup_logging
    from shared.messages.plans import HostPlan, LaneSpec
    from shared.messages.status import HostStatus, LaneStatus
    from shared.messages.wire import encode
    from shared.natsserver import NatsServer

    setup_logging("error")
    base = free_port_base(LANES)
    argv = [sys.executable, __file__, "--role", "lanes", "--port", str(base), "--tokens", str(args.tokens),
            "--token-rate", str(args.token_rate)]  # fmt: skip
    lanes = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    tmp = Path(tempfile.mkdtemp(prefix="lanes-loop-lag-"))
    server = NatsServer(tmp / "nats").start()
    stop = asyncio.Event()
    gw = Gateway(GatewaySettings(port=0, api_keys=(KEY,), queue_depth=256))
    try:
        assert lanes.stdout.readline().strip() == "ready"
        specs = tuple(LaneSpec(lane_id=f"chat-{i}", model="chat", model_path="/m/chat.gguf", alias="chat",
                               port=base + i, ctx_total=4096 * SLOTS, ctx_per_slot=4096, parallel=SLOTS)
                      for i in range(LANES))  # fmt: skip
        gw.view.apply_entry(subjects.plan_key("bench"), encode(HostPlan(host_id="bench", lanes=specs)))
        status = HostStatus(host_id="bench", lanes=tuple(LaneStatus(lane_id=s.lane_id, state="healthy", port=s.port)
                                                          for s in specs))  # fmt: skip
        gw.view.apply_entry(subjects.status_key("bench"), encode(status))
        gw.view.synced = True
        task = asyncio.create_task(run_gateway(server.url, stop, gateway=gw))
        await asyncio.wait_for(gw.started.wait(), 10)
        await asyncio.sleep(2)  # its probes have run once
        idle: list[float] = []
        probing = asyncio.Event()
        probe = asyncio.create_task(lag_probe(probing, idle))
        await asyncio.sleep(5)
        probing.set()
        await probe
        loaded: list[float] = []
        probing = asyncio.Event()
        clients = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--role", "clients", "--url", gw.url, "--streams", str(args.streams),
            "--seconds", str(args.seconds), stdout=subprocess.PIPE)  # fmt: skip
        await asyncio.sleep(2)  # every stream open
        in_flight = sum(gw.admission.counts.in_flight.values())
        probe = asyncio.create_task(lag_probe(probing, loaded))
        out, _ = await clients.communicate()
        probing.set()
        await probe
        served = json.loads(out)
        stop.set()
        await asyncio.wait_for(task, 20)
    finally:
        lanes.terminate()
        lanes.wait(10)
        server.stop()
    return {
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "streams": args.streams, "in_flight_seen": in_flight, "seconds": args.seconds,
        "token_rate": args.token_rate, "tokens": args.tokens,
        "idle": _summary(idle), "loaded": _summary(loaded), **served,
        "chunks_per_second": round(served["chunks"] / args.seconds, 1),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("bench", "lanes", "clients"), default="bench")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=100, help="chunks per stand-in answer")
    ap.add_argument("--token-rate", type=float, default=20.0, help="chunks per second of each stream")
    ap.add_argument("--port", type=int)
    ap.add_argument("--url")
    ap.add_argument("--out", help="also write the result as JSON here")
    args = ap.parse_args()
    if args.role == "lanes":
        return serve_lanes(args.port, args.tokens, args.token_rate)
    if args.role == "clients":
        return run_clients(args.url, args.streams, args.seconds)
    sys.path.insert(0, str(ROOT / "tests"))
    result = asyncio.run(bench(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
