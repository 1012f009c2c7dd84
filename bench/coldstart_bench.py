"""A cold request through lanes against a bare llama-server start, and the predicted load against the measured.

Run from the repository root:  .venv/bin/python bench/coldstart_bench.py [--rounds 3] [--json out.json]

Real parts: a nats-server, the planner and one agent (this process) running the real llama-server
on Gemma 3 270M Q4_K_M, and `lanes gateway` as its own process. The model's persona has
`idle_ttl = 2`, so between rounds its lane unloads. Each round, in turn:

- lanes: with the model unloaded, one streaming chat request to the gateway; from sending it to
  the first body byte (the gateway holds it, wakes the planner, the agent starts the lane, the
  lane loads, the request goes through);
- bare: the same llama-server argv started by hand on another port; from spawning it to the first
  byte of the same request (polling /health every 20 ms, as the agent does while a lane comes up).

The page cache holds the file after the first load (nothing here drops it), so these are warm
loads. Also the planner's predicted load time (models key) against the agent's measured one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gateway_bench import MESSAGES, _free_base, _until  # noqa: E402

from lanes.demo_model import ensure_demo_model  # noqa: E402
from launcher_agent.config import AgentConfig  # noqa: E402
from launcher_agent.probe import find_llama_server, probe  # noqa: E402
from launcher_agent.service import run_agent  # noqa: E402
from planner_svc.service import run_planner  # noqa: E402
from shared import subjects  # noqa: E402
from shared.bus import connect, kv_bucket  # noqa: E402
from shared.logs import setup_logging  # noqa: E402
from shared.messages.config import Demand, Persona  # noqa: E402
from shared.messages.status import HostStatus  # noqa: E402
from shared.messages.wire import decode, encode  # noqa: E402
from shared.natsserver import NatsServer  # noqa: E402

ALIAS = "chat"
HOST = "bench"


async def first_byte(http: aiohttp.ClientSession, base: str, began: float) -> float:
    payload = {"model": ALIAS, "messages": MESSAGES, "stream": True, "max_tokens": 2}
    async with http.post(base + "/v1/chat/completions", json=payload,
                         timeout=aiohttp.ClientTimeout(total=300)) as resp:  # fmt: skip
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        await resp.content.readany()
        took = time.perf_counter() - began
        await resp.read()
    return took


async def bare(http: aiohttp.ClientSession, binary: str, argv: list[str], tmp: Path) -> float:
    port = _free_base()
    args = list(argv)
    args[args.index("--port") + 1] = str(port)
    base = f"http://127.0.0.1:{port}"
    began = time.perf_counter()
    proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL, stderr=open(tmp / "bare.log", "ab"))
    try:
        while True:
            try:
                async with http.get(base + "/health", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                    if resp.status == 200:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"bare llama-server exited {proc.returncode}")
            await asyncio.sleep(0.02)
        return await first_byte(http, base, began)
    finally:
        proc.terminate()
        proc.wait(20)


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    setup_logging("warning")
    binary = find_llama_server()
    tmp = Path(tempfile.mkdtemp(prefix="coldstart-"))
    nats = NatsServer(tmp / "nats").start()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_planner(nats.url, stop))]
    models = tmp / "models"
    model = ensure_demo_model(models)
    cfg = AgentConfig(host_id=HOST, model_dirs=[str(models)], binary=binary, caps=probe(binary),
                      data_dir=tmp / "agent", port_base=_free_base(), report_interval=5, tick=0.2)  # fmt: skip
    nc = await connect(nats.url, name="bench", retry_forever=False)
    await _until(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), 30, "planner")
    demand = Demand(personas=(Persona(model=model.stem, alias=ALIAS, parallel=1, ctx_min=4096, ctx_max=4096,
                                      idle_ttl=2.0),))  # fmt: skip
    await nc.request(subjects.DEMAND_SET, encode(demand), timeout=5)
    tasks.append(asyncio.create_task(run_agent(cfg, nats.url, stop)))
    port = _free_base()
    gateway_url = f"http://127.0.0.1:{port}"
    gateway = subprocess.Popen([str(Path(sys.executable).parent / "lanes"), "gateway", "--nats", nats.url, "--port",
                                str(port), "--load-timeout", "300"], stdout=subprocess.DEVNULL,
                               stderr=open(tmp / "gateway.log", "wb"))  # fmt: skip
    kv = await kv_bucket(nc)
    http = aiohttp.ClientSession()
    result: dict = {"rounds": []}
    try:

        async def entry() -> dict:
            async with http.get(gateway_url + "/v1/models") as resp:
                return next(m for m in (await resp.json())["data"] if m["id"] == ALIAS)

        async def argv() -> list[str]:
            status = decode((await kv.get(subjects.status_key(HOST))).value, HostStatus)
            lane = next(lane for lane in status.lanes if lane.state == "healthy")
            return list(lane.argv[1:])

        await _until(lambda: _state_is(entry, "ready"), 300, "the first load")
        lane_argv = await argv()
        async def gone() -> bool:
            """Unloaded and its process stopped (a lane still draining would be revived, not loaded)."""
            status = decode((await kv.get(subjects.status_key(HOST))).value, HostStatus)
            return not status.lanes and await _state_is(entry, "unloaded")

        for i in range(args.rounds):
            await _until(gone, 120, "the lane unloaded after its idle_ttl")
            before = await entry()
            cold = await first_byte(http, gateway_url, time.perf_counter())
            after = await _until(lambda: _measured(entry), 30, "the load measured")
            # the lane's own load, then the bare server (the lane unloads meanwhile: one at a time)
            await _until(gone, 120, "the lane unloaded")
            plain = await bare(http, binary, lane_argv, tmp)
            result["rounds"].append({"lanes_ttfb_s": round(cold, 3), "bare_ttfb_s": round(plain, 3),
                                     "predicted_load_s": before.get("predicted_load_s"),
                                     "measured_load_s": after})  # fmt: skip
            print(json.dumps(result["rounds"][-1]), flush=True)
        lanes_m = statistics.median(r["lanes_ttfb_s"] for r in result["rounds"])
        bare_m = statistics.median(r["bare_ttfb_s"] for r in result["rounds"])
        result.update(lanes_ttfb_median_s=lanes_m, bare_ttfb_median_s=bare_m, ratio=round(lanes_m / bare_m, 3),
                      argv=lane_argv, binary=binary)  # fmt: skip
        print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        await http.close()
        gateway.terminate()
        gateway.wait(20)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()
        nats.stop()
    return 0


async def _state_is(entry, state: str) -> bool:
    return (await entry())["state"] == state


async def _measured(entry):
    got = await entry()
    return got.get("measured_load_s") if got["state"] == "ready" else None


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
