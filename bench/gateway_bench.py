"""The gateway's cost and what it buys: time to first byte and throughput through it against
straight to the lane, two lanes against one, and failed requests during fleet-wide changes.

Run from the repository root:  .venv/bin/python bench/gateway_bench.py [--small] [--out bench/gateway_results.md]

Everything is real: a nats-server (the wheel's), the planner and one agent (in this
process) running real llama-server lanes of Gemma 3 270M Q4_K_M (the demo model), and
`lanes gateway` as its own process, as deployed; clients are aiohttp streaming chat
requests (SSE) from this process, measured from the request's start to the first body
byte (TTFB) and to the end.

1. One lane (8 slots). TTFB at 1 and 8 concurrent streams: rounds alternate direct and
   gateway (order flipped every round), so both see the same machine noise; p50 of each
   and the median of the per-round differences. Throughput (generated tokens per second)
   at 8 streams, direct and through the gateway, interleaved the same way.
2. Two lanes against one through the gateway: 16 concurrent streams, same config.
3. A fleet-wide config change (kv_cache_type q8_0 + flash_attn on, then back) under
   continuous load (8 client loops): with two lanes, then with one; failed requests,
   served requests and the slowest request during the change.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.demo_model import ensure_demo_model  # noqa: E402
from launcher_agent.config import AgentConfig  # noqa: E402
from launcher_agent.probe import find_llama_server, probe  # noqa: E402
from launcher_agent.service import run_agent  # noqa: E402
from planner_svc.service import run_planner  # noqa: E402
from shared import subjects  # noqa: E402
from shared.bus import connect, kv_bucket  # noqa: E402
from shared.logs import setup_logging  # noqa: E402
from shared.messages.config import Demand, Persona  # noqa: E402
from shared.messages.replies import ConfigSet  # noqa: E402
from shared.messages.status import HostStatus  # noqa: E402
from shared.messages.wire import decode, encode  # noqa: E402
from shared.natsserver import NatsServer  # noqa: E402

ALIAS = "chat"
HOST = "bench"
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
TTFB_TOKENS = 2  # TTFB rounds: as little generation as possible, so the lane's own time is short
TP_TOKENS = 32


HEADERS: dict[str, dict[str, str]] = {}  # base URL -> what opens it (a lane answers its key only)


async def stream(http: aiohttp.ClientSession, base: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFB s, total s, generated tokens) of one streaming chat request; raises on any failure."""
    payload = {"model": ALIAS, "messages": MESSAGES, "stream": True, "max_tokens": max_tokens, "ignore_eos": True}
    began = time.perf_counter()
    first = None
    tokens = 0
    pending = b""
    async with http.post(base + "/v1/chat/completions", json=payload, headers=HEADERS.get(base, {})) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for chunk in resp.content.iter_any():
            if first is None:
                first = time.perf_counter() - began
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error'].get('message')}")
                choices = event.get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    tokens += 1
    return first or 0.0, time.perf_counter() - began, tokens


async def wave(http, base: str, concurrency: int, max_tokens: int) -> tuple[list[float], float, int]:
    """`concurrency` streams at once: their TTFBs, the wall time, the tokens."""
    began = time.perf_counter()
    results = await asyncio.gather(*(stream(http, base, max_tokens) for _ in range(concurrency)))
    return [r[0] for r in results], time.perf_counter() - began, sum(r[2] for r in results)


def p50(values: list[float]) -> float:
    return statistics.median(values)


class Fleet:
    def __init__(self, tmp: Path, llama: str, small: bool, gateway_args: tuple[str, ...] = (),
                 headers: dict[str, str] | None = None):  # fmt: skip
        self.tmp, self.llama, self.small = tmp, llama, small
        self.gateway_args = gateway_args  # more of `lanes gateway`'s options (a keys file: bench/hostile_clients.py)
        self.headers = headers or {}  # what this fleet's own requests to the gateway carry (an ops key)
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.nats = NatsServer(self.tmp / "nats").start()
        url = self.nats.url
        self.tasks.append(asyncio.create_task(run_planner(url, self.stop)))
        models = self.tmp / "models"
        ensure_demo_model(models)
        cfg = AgentConfig(host_id=HOST, model_dirs=[str(models)], binary=self.llama, caps=probe(self.llama),
                          data_dir=self.tmp / "agent", port_base=_free_base(), report_interval=5, tick=0.2)  # fmt: skip
        self.tasks.append(asyncio.create_task(run_agent(cfg, url, self.stop)))
        port = _free_base()
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.gateway = subprocess.Popen(
            [str(Path(sys.executable).parent / "lanes"), "gateway", "--nats", url, "--port", str(port),
             "--queue-wait", "120", "--queue-depth", "256", *self.gateway_args],
            stdout=subprocess.DEVNULL, stderr=open(self.tmp / "gateway.log", "wb"),
        )  # fmt: skip
        self.nc = await connect(url, name="bench", retry_forever=False)
        await _until(lambda: self.nc.request(subjects.CONFIG_GET, b"", timeout=1), 30, "planner")
        self.kv = await kv_bucket(self.nc)
        self.http = aiohttp.ClientSession(headers=self.headers)
        await _until(self._gateway_ready, 30, "gateway ready")

    async def _gateway_ready(self) -> bool:
        async with self.http.get(self.gateway_url + "/ready") as resp:
            return resp.status == 200

    async def routable(self) -> int:
        async with self.http.get(self.gateway_url + "/v1/models") as resp:
            models = (await resp.json())["data"]
        running = len(await self.lanes())
        return next((m["lanes"]["ready"] for m in models if m["id"] == ALIAS and m["lanes"]["total"] == running), 0)

    async def lanes(self) -> list:
        try:
            status = decode((await self.kv.get(subjects.status_key(HOST))).value, HostStatus)
        except Exception:
            return []
        return [lane for lane in status.lanes if lane.state == "healthy" and not lane.draining]

    async def demand(self, lanes: int) -> None:
        persona = Persona(model="gemma-3-270m-q4_k_m", alias=ALIAS, lanes=lanes, parallel=8, ctx_min=1024, ctx_max=1024)
        await self._request(subjects.DEMAND_SET, encode(Demand(personas=(persona,))))
        await self.settle(lanes)

    async def settle(self, lanes: int, want=lambda lane: True) -> None:
        async def ready():
            found = await self.lanes()
            ours = all(_has("--alias", ALIAS)(lane) and _has("--parallel", "8")(lane) for lane in found)
            return len(found) == lanes and ours and all(want(lane) for lane in found) and await self.routable() == lanes

        try:
            await _until(ready, 600, f"{lanes} lane(s) serving")
        except RuntimeError:
            async with self.http.get(self.gateway_url + "/v1/models") as resp:
                models = await resp.text()
            raise RuntimeError(f"{lanes} lane(s) not serving: status {await self.lanes()!r}; gateway {models}; "
                               f"gateway log {(self.tmp / 'gateway.log').read_text()[-2000:]}") from None

    async def config(self, **changes) -> None:
        await self._request(subjects.CONFIG_SET, encode(ConfigSet(changes=changes)))

    async def _request(self, subject: str, body: bytes) -> None:
        reply = await self.nc.request(subject, body, timeout=10)
        if (reply.headers or {}).get("Nats-Service-Error"):
            raise RuntimeError(reply.headers["Nats-Service-Error"])

    async def close(self) -> None:
        await self.http.close()
        self.gateway.terminate()
        try:
            self.gateway.wait(20)
        except subprocess.TimeoutExpired:
            self.gateway.kill()
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.nc.close()
        self.nats.stop()


def _free_base() -> int:
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 60000, 16)
        try:
            for port in range(base, base + 16):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


async def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = check()
            if asyncio.iscoroutine(got):
                got = await got
            if got:
                return got
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


async def interleaved(http, direct: str, gateway: str, concurrency: int, rounds: int, max_tokens: int) -> dict:
    ttfb = {"direct": [], "gateway": []}
    tps = {"direct": [], "gateway": []}
    diffs = []
    for i in range(rounds):
        order = [("direct", direct), ("gateway", gateway)]
        if i % 2:
            order.reverse()
        p = {}
        for name, base in order:
            firsts, wall, tokens = await wave(http, base, concurrency, max_tokens)
            ttfb[name] += firsts
            tps[name].append(tokens / wall)
            p[name] = p50(firsts)
        diffs.append(p["gateway"] - p["direct"])
    return {
        "concurrency": concurrency,
        "rounds": rounds,
        "ttfb_p50_direct_ms": p50(ttfb["direct"]) * 1000,
        "ttfb_p50_gateway_ms": p50(ttfb["gateway"]) * 1000,
        "added_ttfb_p50_ms": (p50(ttfb["gateway"]) - p50(ttfb["direct"])) * 1000,
        "added_ttfb_median_of_rounds_ms": p50(diffs) * 1000,
        "tokens_per_s_direct": p50(tps["direct"]),
        "tokens_per_s_gateway": p50(tps["gateway"]),
        "throughput_ratio": p50(tps["gateway"]) / p50(tps["direct"]),
    }


async def change_under_load(fleet: Fleet, http, gateway: str, lanes: int, changes: dict, want) -> dict:
    done = asyncio.Event()
    served, failed, slowest, errors = [0], [0], [0.0], []

    async def client():
        while not done.is_set():
            try:
                _, total, _ = await stream(http, gateway, 16)
                served[0] += 1
                slowest[0] = max(slowest[0], total)
            except Exception as exc:
                failed[0] += 1
                errors.append(str(exc)[:200])

    clients = [asyncio.create_task(client()) for _ in range(8)]
    await asyncio.sleep(3)
    served[0], failed[0], slowest[0] = 0, 0, 0.0
    began = time.perf_counter()
    await fleet.config(**changes)
    await fleet.settle(lanes, want)
    took = time.perf_counter() - began
    done.set()
    await asyncio.gather(*clients)
    return {"lanes": lanes, "change": changes, "rollout_s": took, "served": served[0], "failed": failed[0],
            "slowest_request_s": slowest[0], "errors": errors[:3]}  # fmt: skip


def _has(flag: str, value: str | None):
    def check(lane) -> bool:
        argv = list(lane.argv)
        return (flag in argv and argv[argv.index(flag) + 1] == value) if value else flag not in argv

    return check


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="few rounds (a smoke run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "gateway_results.md"))
    args = ap.parse_args()
    setup_logging("warning")
    llama = find_llama_server()
    if llama is None:
        print("no llama-server: run `lanes install-llama`", file=sys.stderr)
        return 2
    rounds1, rounds8, rounds_tp, rounds_lanes = (3, 2, 2, 1) if args.small else (30, 12, 4, 2)
    with tempfile.TemporaryDirectory(prefix="lanes-gw-bench-") as tmp:
        fleet = Fleet(Path(tmp), llama, args.small)
        await fleet.start()
        results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                    f"Python {platform.python_version()}", "when": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
        try:
            # A new connection per request on both paths: llama-server drops reused keep-alive
            # connections now and then ("Server disconnected"), which the client would count
            # as failures of the direct path. The gateway pools its own and retries those.
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
                await fleet.demand(1)
                lane = (await fleet.lanes())[0]
                direct, gateway = f"http://127.0.0.1:{lane.port}", fleet.gateway_url
                key = (Path(tmp) / "agent" / "lanes" / f"{lane.lane_id}.key").read_text().strip()
                HEADERS[direct] = {"Authorization": f"Bearer {key}"}  # its agent's key, as a gateway sends it
                await wave(http, direct, 8, 4)  # warm both paths
                await wave(http, gateway, 8, 4)
                results["ttfb_1"] = await interleaved(http, direct, gateway, 1, rounds1, TTFB_TOKENS)
                results["ttfb_8"] = await interleaved(http, direct, gateway, 8, rounds8, TTFB_TOKENS)
                results["throughput_8"] = await interleaved(http, direct, gateway, 8, rounds_tp, TP_TOKENS)
                one = [await wave(http, gateway, 16, TP_TOKENS) for _ in range(rounds_lanes)]
                await fleet.demand(2)
                two = [await wave(http, gateway, 16, TP_TOKENS) for _ in range(rounds_lanes)]
                results["lanes_2_vs_1"] = {
                    "tokens_per_s_one_lane": p50([t / w for _, w, t in one]),
                    "tokens_per_s_two_lanes": p50([t / w for _, w, t in two]),
                }
                r = results["lanes_2_vs_1"]
                r["ratio"] = r["tokens_per_s_two_lanes"] / r["tokens_per_s_one_lane"]
                results["change_two_lanes"] = await change_under_load(
                    fleet, http, gateway, 2, {"kv_cache_type": "q8_0", "flash_attn": "on"}, _has("--cache-type-k", "q8_0"))
                await fleet.demand(1)
                results["change_one_lane"] = await change_under_load(
                    fleet, http, gateway, 1, {"kv_cache_type": None, "flash_attn": None}, _has("--cache-type-k", None))
        finally:
            await fleet.close()
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=2))
    Path(args.out).write_text(render(results, args))
    print(render(results, args))
    return 0


def render(r: dict, args) -> str:
    t1, t8, tp, l2 = r["ttfb_1"], r["ttfb_8"], r["throughput_8"], r["lanes_2_vs_1"]
    rows = [
        "| streams | rounds | TTFB p50 direct | TTFB p50 gateway | added (p50s) | added (median of rounds) |",
        "|---|---|---|---|---|---|",
    ]
    for t in (t1, t8):
        rows.append(f"| {t['concurrency']} | {t['rounds']} | {t['ttfb_p50_direct_ms']:.1f} ms | "
                    f"{t['ttfb_p50_gateway_ms']:.1f} ms | {t['added_ttfb_p50_ms']:+.2f} ms | "
                    f"{t['added_ttfb_median_of_rounds_ms']:+.2f} ms |")  # fmt: skip
    changes = ["| lanes | change | rollout | served | failed | slowest request |", "|---|---|---|---|---|---|"]
    for key in ("change_two_lanes", "change_one_lane"):
        c = r[key]
        what = ", ".join(f"{k}={v}" for k, v in c["change"].items())
        changes.append(f"| {c['lanes']} | {what} | {c['rollout_s']:.1f} s | {c['served']} | **{c['failed']}** | "
                       f"{c['slowest_request_s']:.2f} s |")  # fmt: skip
    return f"""# Gateway benchmark

`.venv/bin/python bench/gateway_bench.py{' --small' if args.small else ''}` ({r['when']}; {r['machine']}).
Real llama-server lanes of Gemma 3 270M Q4_K_M (8 slots, 1024 tokens each), the planner, one
agent and the gateway over a real nats-server; aiohttp streaming chat clients. Direct and
gateway rounds alternate (order flipped each round) in the same run.

## Time to first byte ({TTFB_TOKENS} tokens per stream)

{chr(10).join(rows)}

## Throughput at 8 streams ({TP_TOKENS} tokens each)

direct {tp['tokens_per_s_direct']:.1f} tokens/s, through the gateway {tp['tokens_per_s_gateway']:.1f} tokens/s:
ratio **{tp['throughput_ratio']:.3f}** (median of {tp['rounds']} interleaved rounds).

## Two lanes against one, through the gateway (16 streams, {TP_TOKENS} tokens each)

one lane {l2['tokens_per_s_one_lane']:.1f} tokens/s, two lanes {l2['tokens_per_s_two_lanes']:.1f} tokens/s: ratio
**{l2['ratio']:.2f}**. (Both lanes share the same CPU cores here: a second lane adds slots, not compute.)

## Fleet-wide config change under load (8 client loops, 16 tokens per request)

{chr(10).join(changes)}

Errors seen: {r['change_two_lanes']['errors'] + r['change_one_lane']['errors'] or 'none'}.
"""


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
