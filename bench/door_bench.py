"""What the gateway adds at the door, on a real lane: time to first byte at 1 stream, and
throughput at 8 and 64 streams, through the gateway against straight to the lane (issue 35).

Run from the repository root:  .venv/bin/python bench/door_bench.py [--small] [--out bench/door_results.json]

Everything is real: a nats-server (the wheel's), the planner and one agent running one real
llama-server lane of Gemma 3 270M Q4_K_M (8 slots), and `lanes gateway` as its own process, as
deployed (bench/gateway_bench.py's Fleet). The client (aiohttp, streaming chat, a new
connection per request on both paths) alternates direct and gateway in one run, the order
flipped each round, so both see the same machine:

- 1 stream, max_tokens 1, four paths in each round (order rotated): straight to the lane; a bare
  TCP relay in Python (the floor: what any user-space hop costs on this host, here two more
  process wake-ups and no HTTP); the gateway with a new connection per request, as the direct
  path needs (llama-server closes a streamed answer's connection); and the gateway with a pooled
  client connection, as SDKs keep one. Added time = each round's path minus its direct one: p50
  and p99 over the rounds. The gateway's own share, from its `lanes_gateway_own_seconds`.
- 8 streams (max_tokens 128) and 64 streams (max_tokens 32; they queue in the lane or in the
  gateway's admission): generated tokens per second of each path, the ratio gateway / direct as
  the median of the per-pair ratios, and the gateway process's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gateway_bench import HEADERS, Fleet, stream, wave  # noqa: E402
from launcher_agent.probe import find_llama_server  # noqa: E402
from measure import free_port  # noqa: E402
from shared.logs import setup_logging  # noqa: E402


IDLE_S = 10.0  # seconds the gateway's own CPU is read with no request in flight


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


RELAY = """
import asyncio, sys
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except OSError:
        pass
    finally:
        w.close()
async def handle(cr, cw):
    ur, uw = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    await asyncio.gather(pipe(cr, uw), pipe(ur, cw))
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


async def first_bytes(fresh, pooled, paths: dict[str, str], rounds: int) -> dict:
    """Rounds of one stream, max_tokens 1, every path once per round: the added time is per round."""
    names = list(paths)
    got: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            http = pooled if name == "gateway_pooled" else fresh
            got[name].append((await stream(http, paths[name], 1))[0])
    ms = 1000.0
    out: dict = {"rounds": rounds}
    for name in names:
        out[f"{name}_p50_ms"] = statistics.median(got[name]) * ms
        out[f"{name}_p99_ms"] = pct(got[name], 0.99) * ms
        if name != "direct":
            added = [t - d for t, d in zip(got[name], got["direct"])]
            out[f"{name}_added_p50_ms"] = statistics.median(added) * ms
            out[f"{name}_added_p99_ms"] = pct(added, 0.99) * ms
            # The tail of each path against direct's tail: paired differences at p99 are the lane's
            # own jitter between two requests as much as the hop's.
            out[f"{name}_p99_over_direct_p99_ms"] = (pct(got[name], 0.99) - pct(got["direct"], 0.99)) * ms
    return out


async def own_buckets(http, gateway: str) -> dict[float, float]:
    """The gateway's lanes_gateway_own_seconds buckets (le -> cumulative count), from its /metrics."""
    async with http.get(gateway + "/metrics") as resp:
        text = await resp.text()
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("lanes_gateway_own_seconds_bucket{"):
            bound = float(line.split('le="')[1].split('"')[0])  # float("+Inf") is inf
            out[bound] = out.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])  # every model's, summed
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """As Prometheus' histogram_quantile over the counts between two reads (linear in a bucket)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, low, below = q * counts[-1], 0.0, 0.0
    for bound, cumulative in zip(bounds, counts):
        if cumulative >= rank:
            if bound == float("inf"):
                return low
            return low + (bound - low) * (rank - below) / max(cumulative - below, 1e-12)
        low, below = bound, cumulative
    return None


async def throughput(http, direct: str, gateway: str, streams: int, rounds: int, gateway_proc: psutil.Process,
                     tokens: int) -> dict:  # fmt: skip
    """Paired waves of `streams` streams: tokens per second of each path, and the gateway's CPU."""
    rates: dict[str, list[float]] = {"direct": [], "gateway": []}
    cpu = []
    for i in range(rounds):
        order = [("direct", direct), ("gateway", gateway)]
        if i % 2:
            order.reverse()
        for name, base in order:
            before = gateway_proc.cpu_times()
            _, wall, made = await wave(http, base, streams, tokens)
            after = gateway_proc.cpu_times()
            rates[name].append(made / wall)
            if name == "gateway":
                cpu.append((after.user + after.system - before.user - before.system) / streams)
    ratios = [g / d for d, g in zip(rates["direct"], rates["gateway"])]
    return {
        "streams": streams,
        "rounds": rounds,
        "max_tokens": tokens,
        "tokens_per_s_direct": statistics.median(rates["direct"]),
        "tokens_per_s_gateway": statistics.median(rates["gateway"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "gateway_cpu_ms_per_request": statistics.median(cpu) * 1000,
    }


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="few rounds (a smoke run)")
    ap.add_argument("--rounds", type=int, default=400, help="paired rounds at 1 stream")
    ap.add_argument("--out", help="where the JSON goes (default: bench/door_results.json; none for --small)")
    ap.add_argument("--lane-threads", type=int, default=None,
                    help="the lane's threads (the fleet's `threads`); default: planned from the host's cores (all of them)")
    ap.add_argument("--lane-spares", type=int, default=None, help="the gateway's --lane-spares (default: its own)")
    args = ap.parse_args()
    llama = find_llama_server() or sys.exit("no llama-server: run `lanes install-llama`")
    setup_logging("warning")
    rounds1, rounds8, rounds64 = (20, 2, 1) if args.small else (args.rounds, 6, 5)
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                     "when": time.strftime("%Y-%m-%d %H:%M"), "lane_threads": args.lane_threads,
                     "lane_spares": args.lane_spares,
                     "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                              text=True).stdout.strip()}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lanes-door-") as tmp:
        spares = () if args.lane_spares is None else ("--lane-spares", str(args.lane_spares))
        fleet = Fleet(Path(tmp), llama, args.small, gateway_args=spares)
        await fleet.start()
        try:
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            relay_port = free_port()
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http, \
                    aiohttp.ClientSession(timeout=timeout) as pooled:  # fmt: skip
                if args.lane_threads is not None:
                    await fleet.config(threads=args.lane_threads)
                await fleet.demand(1)
                lane = (await fleet.lanes())[0]
                direct, gateway = f"http://127.0.0.1:{lane.port}", fleet.gateway_url
                relay = subprocess.Popen([sys.executable, "-c", RELAY, str(relay_port), str(lane.port)])
                floor = f"http://127.0.0.1:{relay_port}"
                key = (Path(tmp) / "agent" / "lanes" / f"{lane.lane_id}.key").read_text().strip()
                HEADERS[direct] = HEADERS[floor] = {"Authorization": f"Bearer {key}"}
                try:
                    await wave(http, direct, 8, 4)
                    await wave(http, gateway, 8, 4)
                    await wave(http, floor, 2, 4)
                    await wave(pooled, gateway, 2, 4)
                    proc = psutil.Process(fleet.gateway.pid)
                    before = proc.cpu_times()
                    await asyncio.sleep(IDLE_S)
                    after = proc.cpu_times()
                    idle = after.user + after.system - before.user - before.system
                    results["gateway_idle_cpu_percent"] = idle / IDLE_S * 100
                    own_before = await own_buckets(http, gateway)
                    paths = {"direct": direct, "floor": floor, "gateway": gateway, "gateway_pooled": gateway}
                    results["one_stream"] = one = await first_bytes(http, pooled, paths, rounds1)
                    own_after = await own_buckets(http, gateway)
                    for q in (0.5, 0.99):
                        value = bucket_quantile(own_before, own_after, q)
                        one[f"gateway_own_p{round(q * 100)}_ms"] = None if value is None else value * 1000
                    print(json.dumps(one, indent=1), flush=True)
                    results["streams_8"] = await throughput(http, direct, gateway, 8, rounds8, proc, 128)
                    print(json.dumps(results["streams_8"], indent=1), flush=True)
                    results["streams_64"] = await throughput(http, direct, gateway, 64, rounds64, proc, 32)
                    print(json.dumps(results["streams_64"], indent=1), flush=True)
                finally:
                    relay.terminate()
                    relay.wait()
        finally:
            await fleet.close()
    out = args.out or (None if args.small else ROOT / "bench" / "door_results.json")
    if out is not None:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
