"""Where the gateway's added time to first byte goes: paired rounds and a profile, in process.

Run from the repository root:  .venv/bin/python bench/ttfb_profile.py [--rounds 400] [--prompt-chars 2000]

A stub lane (aiohttp, SSE: its first chunk at once, then the last chunk with llama-server's
`timings`) and the gateway's own app (gateway/edge/app.py, routing by tokens, no NATS: the view
is filled by hand) in one process, one stream at a time, max_tokens 1. Rounds alternate
direct and through the gateway (the order flipped each round); the added time is the median
of the per-round differences of time to first byte. Then the gateway's rounds again under
cProfile: the functions of the gateway and of aiohttp's client and server by their own time.
No model runs, so this is the gateway's cost alone (the issue's +1.97 ms was measured with a
real lane, bench/gateway_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gateway.service import Gateway  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from test_gateway_core import healthy, put_plan, put_status, spec  # noqa: E402

LAST = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"timings":'
        b'{"prompt_n":12,"cache_n":500,"prompt_per_second":900.0}}\n\ndata: [DONE]\n\n')  # fmt: skip


TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'


async def stub_chat(request: web.Request) -> web.StreamResponse:
    asked = msgspec.json.decode(await request.read())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(asked.get("max_tokens") or 1):
        await resp.write(TOKEN)
        await asyncio.sleep(0)  # one chunk per token, as a lane sends them
    await resp.write(LAST)
    return resp


async def stub_ok(request: web.Request) -> web.Response:
    return web.json_response([] if request.path == "/slots" else {"status": "ok"})


async def ttfb(http: aiohttp.ClientSession, url: str, payload: dict) -> float:
    began = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=payload) as resp:
        await resp.content.readany()
        first = time.perf_counter() - began
        await resp.read()
    return first


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--prompt-chars", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=32, help="tokens per answer in the CPU rounds")
    args = ap.parse_args()
    lane = web.Application()
    lane.router.add_post("/v1/chat/completions", stub_chat)
    lane.router.add_get("/health", stub_ok)
    lane.router.add_get("/slots", stub_ok)
    lane_runner = web.AppRunner(lane, access_log=None)
    await lane_runner.setup()
    await web.TCPSite(lane_runner, "127.0.0.1", 0).start()
    port = lane_runner.addresses[0][1]
    gw = Gateway(GatewaySettings(port=0))
    put_plan(gw.view, "h", spec("a", "m", parallel=1, port=port))  # a 4096-token window: no count first
    put_status(gw.view, "h", healthy("a", port))
    gw.view.mark_synced()  # the bucket "read": a request waits for that first (gateway/edge/app.py)
    runner = web.AppRunner(gw.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    direct, through = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{runner.addresses[0][1]}"
    payload = {"model": "m", "stream": True, "max_tokens": 1,
               "messages": [{"role": "user", "content": "y" * args.prompt_chars}]}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        for _ in range(20):  # warm both connection pools
            await ttfb(http, direct, payload), await ttfb(http, through, payload)
        pairs = []
        for i in range(args.rounds):
            order = (direct, through) if i % 2 else (through, direct)
            got = {url: await ttfb(http, url, payload) for url in order}
            pairs.append((got[direct], got[through]))
        added = statistics.median(t - d for d, t in pairs)
        print(f"{args.rounds} rounds, one stream, max_tokens 1, prompt of {args.prompt_chars} characters: "
              f"TTFB p50 direct {statistics.median(d for d, _ in pairs) * 1e3:.3f} ms, through the gateway "
              f"{statistics.median(t for _, t in pairs) * 1e3:.3f} ms; added (median of paired differences) "
              f"{added * 1e3:.3f} ms")  # fmt: skip
        long = payload | {"max_tokens": args.tokens}
        cpu = {}
        for url in (direct, through, direct, through):
            began = time.process_time()
            for _ in range(args.rounds // 4):
                await ttfb(http, url, long)
            cpu.setdefault(url, []).append((time.process_time() - began) / (args.rounds // 4))
        d, t = min(cpu[direct]), min(cpu[through])
        print(f"this process's CPU per request of {args.tokens} tokens: direct {d * 1e3:.3f} ms, through the gateway "
              f"{t * 1e3:.3f} ms: the gateway's own {(t - d) * 1e3:.3f} ms")  # fmt: skip
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.rounds):
            await ttfb(http, through, payload)
        profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out).sort_stats(__import__("os").environ.get("SORT", "tottime"))
    stats.print_stats(__import__("os").environ.get("PAT", r"gateway/|aiohttp/|msgspec|json"), int(__import__("os").environ.get("TOP", "25")))
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
    await runner.cleanup()
    await lane_runner.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
