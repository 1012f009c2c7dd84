"""What gateways' reads cost a busy lane, as the number of gateways grows (issue 37 point 4).

Run from the repository root:
  .venv/bin/python bench/slots_read_cost.py [--gateways 0 20 100 400] [--seconds 20] [--designs poll agent]

Two designs, side by side:
- poll (lanes before 2026-12-06): each gateway reads every lane's /slots twice a second to see its
  busy slots, and probes its /health once a second; 20 gateways read each lane 60 times a second.
- agent (now): the lane's agent reads /slots twice a second (launcher_agent/load_feed.py, the
  real reads and fold) and publishes the load for every gateway over NATS; each gateway only
  probes /health once a second (the HTTP thread: no task reaches the inference loop).

One real llama-server lane of Gemma 3 270M (the demo model, 4 slots, two threads) generates for
four streams at once while N simulated gateways read it so (one persistent connection each, as
aiohttp pools them). Measured per design and N: the tokens per second the four streams get, the
/slots answer time (p50/p99), and the lane process's CPU seconds; alternating in rounds so that
drift spreads evenly.
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
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fixtures_bus import free_port_base  # noqa: E402
from lanes.demo_model import ensure_demo_model  # noqa: E402
from launcher_agent import lane_http  # noqa: E402
from launcher_agent.load_feed import LoadFeed, Read  # noqa: E402
from launcher_agent.probe import find_llama_server  # noqa: E402
from shared import defaults  # noqa: E402
from shared.messages.plans import LaneSpec  # noqa: E402

READS_PER_SECOND = round(1 / defaults.LOAD_INTERVAL)  # /slots reads a second: each gateway's (poll) or the agent's


async def stream(http: aiohttp.ClientSession, url: str, tokens: int) -> int:
    body = {"prompt": "Write a long story about lanes and slots.", "max_tokens": tokens, "temperature": 0.8,
            "ignore_eos": True}  # fmt: skip
    async with http.post(url + "/v1/completions", json=body) as resp:
        answer = await resp.json()
    return int(answer["usage"]["completion_tokens"])


async def poller(http: aiohttp.ClientSession, url: str, stop: asyncio.Event, times: list[float],
                 slots: bool) -> None:  # fmt: skip
    """One gateway's reads of the lane: its own /health probe once a second, and with `slots`
    (the poll design) /slots twice a second."""
    tick = 0
    while not stop.is_set():
        if slots:
            began = time.perf_counter()
            async with http.get(url + "/slots") as resp:
                await resp.read()
            times.append(time.perf_counter() - began)
        tick += 1
        if not slots or tick % READS_PER_SECOND == 0:
            async with http.get(url + "/health") as resp:
                await resp.read()
        try:
            await asyncio.wait_for(stop.wait(), 1 / READS_PER_SECOND if slots else 1.0)
        except asyncio.TimeoutError:
            pass


async def agent_reads(spec: LaneSpec, stop: asyncio.Event, times: list[float], sent: list[int]) -> None:
    """The agent's reads of the lane and its feed's fold, as launcher_agent/service.py runs them."""
    feed = LoadFeed("bench")
    while not stop.is_set():
        began = time.perf_counter()
        said = await lane_http.slots_read(spec, None, 2.0)
        times.append(time.perf_counter() - began)
        sent.append(feed.fold([Read(spec.lane_id, None, time.monotonic(), said)], time.monotonic()) is not None)
        try:
            await asyncio.wait_for(stop.wait(), defaults.LOAD_INTERVAL)
        except asyncio.TimeoutError:
            pass


async def one(url: str, proc: psutil.Process, gateways: int, seconds: float, design: str) -> dict:
    stop, times, sent = asyncio.Event(), [], []
    connector = aiohttp.TCPConnector(limit=0)
    port = int(url.rsplit(":", 1)[1])
    spec = LaneSpec(lane_id="bench-0", model="gemma", model_path="/m", alias="gemma", port=port, bind="127.0.0.1",
                    ctx_total=8192, ctx_per_slot=2048, parallel=4)  # fmt: skip
    async with aiohttp.ClientSession(connector=connector) as polls, aiohttp.ClientSession() as http:
        pollers = [asyncio.create_task(poller(polls, url, stop, times, design == "poll")) for _ in range(gateways)]
        if design == "agent":
            pollers.append(asyncio.create_task(agent_reads(spec, stop, times, sent)))
        cpu0, began, made = sum(proc.cpu_times()[:2]), time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            made += sum(await asyncio.gather(*(stream(http, url, 64) for _ in range(4))))
        took, cpu = time.perf_counter() - began, sum(proc.cpu_times()[:2]) - cpu0
        stop.set()
        await asyncio.gather(*pollers)
    times.sort()
    return {"design": design, "gateways": gateways, "tokens_per_second": round(made / took, 2), "reads": len(times),
            "load_messages": sum(sent),
            "read_ms_p50": round(statistics.median(times) * 1e3, 3) if times else None,
            "read_ms_p99": round(times[int(0.99 * (len(times) - 1))] * 1e3, 3) if times else None,
            "lane_cpu_seconds_per_second": round(cpu / took, 3)}  # fmt: skip


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateways", type=int, nargs="+", default=[0, 20, 100, 400])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--designs", nargs="+", choices=("poll", "agent"), default=["poll", "agent"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: run `lanes install-llama`", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        model = ensure_demo_model(Path(tmp) / "model")
        port = free_port_base(1)
        log = open(Path(tmp) / "lane.log", "wb")  # noqa: SIM115  (closed below)
        lane = subprocess.Popen([binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "8192",
                                 "--parallel", "4", "-t", "2", "-tb", "2", "--no-warmup"],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(600):
                    try:
                        async with http.get(url + "/health") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
            proc = psutil.Process(lane.pid)
            cases = [(d, n) for n in args.gateways for d in args.designs]
            runs: dict[tuple[str, int], list[dict]] = {case: [] for case in cases}
            for r in range(args.rounds):
                for design, n in cases if r % 2 == 0 else list(reversed(cases)):
                    runs[(design, n)].append(await one(url, proc, n, args.seconds, design))
        finally:
            lane.terminate()
            lane.wait(30)
            log.close()
    rows = []
    base = statistics.median(x["tokens_per_second"] for x in runs[cases[0]])
    for (design, n), found in runs.items():
        tps = statistics.median(x["tokens_per_second"] for x in found)
        reads = n * READS_PER_SECOND if design == "poll" else READS_PER_SECOND
        row = {"design": design, "gateways": n, "reads_per_second": reads, "tokens_per_second": tps,
               "ratio": round(tps / base, 3) if base else None,
               "read_ms_p50": statistics.median(x["read_ms_p50"] or 0 for x in found),
               "read_ms_p99": statistics.median(x["read_ms_p99"] or 0 for x in found),
               "lane_cpu": statistics.median(x["lane_cpu_seconds_per_second"] for x in found)}  # fmt: skip
        rows.append(row)
        print(f"{design:5s} {n:4d} gateways ({reads:4d} /slots reads/s): {tps:7.2f} tokens/s "
              f"(x{row['ratio']}), /slots p50 {row['read_ms_p50']} ms p99 {row['read_ms_p99']} ms, "
              f"lane CPU {row['lane_cpu']} s/s")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs",
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "args": vars(args) | {"out": str(args.out)}, "rows": rows,
                                        "runs": {f"{d} {n}": v for (d, n), v in runs.items()}}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
