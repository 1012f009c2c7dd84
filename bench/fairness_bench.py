"""Token-fair queueing between tenants against first come first served, on real lanes.

Run from the repository root:
    .venv/bin/python bench/fairness_bench.py [--seconds 40] [--heavy 16] [--out bench/fairness_results.md]

Everything is real: a nats-server, the planner and one agent (in this process) running two
llama-server lanes of Gemma 3 270M Q4_K_M (the demo model), two slots each, and `lanes gateway`
processes with one keys file: tenant `heavy` (16 client loops, standard), tenant `light` (one
client loop, a person chatting), tenant `batch` (16 loops, sheddable). Phases, one after the
other in one run, each for --seconds:

  capacity  heavy alone (the fleet's output tokens per second when saturated)
  alone     light alone (its time to first token with every slot free)
  fifo      heavy + light through a gateway with --no-fair (the baseline)
  fair      heavy + light through a gateway as shipped
  shed      heavy + batch (sheddable) + light with priority critical, --queue-depth 16

Each client loop sends streamed chat requests (--max-tokens output tokens, ignore_eos) one after
another. Time to first token is to the first content chunk; throughput counts the output
tokens (content chunks) streamed within the phase.
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
sys.path.insert(0, str(ROOT / "bench"))

from gateway_bench import ALIAS, Fleet, _free_base, _until  # noqa: E402

from launcher_agent.probe import find_llama_server  # noqa: E402
from shared import subjects  # noqa: E402
from shared.logs import setup_logging  # noqa: E402
from shared.messages.config import Demand, Persona  # noqa: E402
from shared.messages.wire import encode  # noqa: E402

KEYS = """
[[keys]]
key = "bench-heavy-key"
tenant = "heavy"
priority = "standard"

[[keys]]
key = "bench-light-key"
tenant = "light"
priority = "{light}"

[[keys]]
key = "bench-batch-key"
tenant = "batch"
priority = "sheddable"
"""


async def ask(http, base: str, key: str, max_tokens: int, n: int, end: float) -> dict:
    payload = {"model": ALIAS, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
               "messages": [{"role": "user", "content": f"Request {n}: tell a long story about a river."}],
               "stream_options": {"include_usage": True}}  # fmt: skip
    began = time.perf_counter()
    ttft, tokens, within = None, 0, 0
    async with http.post(base + "/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            await resp.read()
            return {"status": resp.status, "retry_after": float(resp.headers.get("Retry-After", "1"))}
        pending = b""
        async for chunk in resp.content.iter_any():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    now = time.perf_counter()
                    ttft = now - began if ttft is None else ttft
                    within += now <= end  # a content chunk is one token: those streamed within the phase
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return {"status": 200, "ttft": ttft if ttft is not None else time.perf_counter() - began, "tokens": tokens,
            "within": within}


async def phase(http, base: str, loops: dict[str, int], seconds: float, max_tokens: int) -> dict:
    began = time.perf_counter()
    end = began + seconds
    got: dict[str, list[dict]] = {t: [] for t in loops}

    async def client(tenant: str, i: int) -> None:
        n = 0
        while time.perf_counter() < end:
            r = await ask(http, base, f"bench-{tenant}-key", max_tokens, i * 10000 + n, end)
            r["done"] = time.perf_counter()
            got[tenant].append(r)
            n += 1
            if r["status"] != 200:
                await asyncio.sleep(min(1.0, r["retry_after"]))

    await asyncio.gather(*(client(t, i) for t, count in loops.items() for i in range(count)))
    out = {}
    for tenant, rows in got.items():
        ok = [r for r in rows if r["status"] == 200]
        ttfts = sorted(r["ttft"] for r in ok)
        out[tenant] = {
            "requests": len(ok), "refused": sum(r["status"] == 429 for r in rows),
            "other_errors": sum(r["status"] not in (200, 429) for r in rows),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else None,
            "tokens_per_s": sum(r["within"] for r in ok) / seconds,
        }  # fmt: skip
    return out


def start_gateway(fleet: Fleet, tmp: Path, name: str, keys: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _free_base()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "lanes"), "gateway", "--nats", fleet.nats.url, "--port", str(port),
         "--keys-file", str(keys), "--queue-wait", "300", "--gateway-id", name, *extra],
        stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "wb"),
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--heavy", type=int, default=16, help="client loops of the heavy tenant (and of batch)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "fairness_results.md"))
    args = ap.parse_args()
    setup_logging("warning")
    llama = find_llama_server()
    if llama is None:
        print("no llama-server: run `lanes install-llama`", file=sys.stderr)
        return 2
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "when": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lanes-fairness-bench-") as tmp_name:
        tmp = Path(tmp_name)
        standard, critical = tmp / "keys.toml", tmp / "keys-critical.toml"
        standard.write_text(KEYS.format(light="standard"))
        critical.write_text(KEYS.format(light="critical"))
        fleet = Fleet(tmp, llama, False)
        await fleet.start()
        procs = []
        try:
            persona = Persona(model="gemma-3-270m-q4_k_m", alias=ALIAS, lanes=args.lanes, parallel=args.slots,
                              ctx_min=1024, ctx_max=1024)  # fmt: skip
            reply = await fleet.nc.request(subjects.DEMAND_SET, encode(Demand(personas=(persona,))), timeout=10)
            assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
            gateways = {}
            for name, keys, extra in (("fifo", standard, ("--no-fair", "--queue-depth", "256")),
                                      ("fair", standard, ("--queue-depth", "256")),
                                      ("shed", critical, ("--queue-depth", "16"))):  # fmt: skip
                proc, url = start_gateway(fleet, tmp, name, keys, *extra)
                procs.append(proc)
                gateways[name] = url

            async def ready(url: str) -> bool:
                async with fleet.http.get(url + "/v1/models", headers={"Authorization": "Bearer bench-heavy-key"}) as resp:
                    data = (await resp.json())["data"]
                return any(m["id"] == ALIAS and m["lanes"]["ready"] == args.lanes for m in data)

            for url in gateways.values():
                await _until(lambda url=url: ready(url), 600, "lanes routable")
            results["lane_args"] = [list(lane.argv) for lane in await fleet.lanes()]
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
                await phase(http, gateways["fair"], {"heavy": args.lanes * args.slots}, 5, args.max_tokens)  # warm-up
                plan = (("capacity", "fair", {"heavy": args.heavy}), ("alone", "fair", {"light": 1}),
                        ("fifo", "fifo", {"heavy": args.heavy, "light": 1}),
                        ("fair", "fair", {"heavy": args.heavy, "light": 1}),
                        ("shed", "shed", {"heavy": args.heavy, "batch": args.heavy, "light": 1}))  # fmt: skip
                for name, gateway, loops in plan:
                    results[name] = await phase(http, gateways[gateway], loops, args.seconds, args.max_tokens)
                    print(name, json.dumps(results[name]), flush=True)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(20)
            await fleet.close()
    judge(results)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=2))
    Path(args.out).write_text(render(results))
    print(render(results))
    return 0


def judge(r: dict) -> None:
    fifo, fair, alone = r["fifo"]["light"]["ttft_p95_s"], r["fair"]["light"]["ttft_p95_s"], r["alone"]["light"]["ttft_p95_s"]
    capacity, light_use = r["capacity"]["heavy"]["tokens_per_s"], r["fair"]["light"]["tokens_per_s"]
    heavy = r["fair"]["heavy"]["tokens_per_s"]
    r["checks"] = {
        "light p95 TTFT fair / fifo (<= 0.5)": fair / fifo,
        "light p95 TTFT fair / alone (<= 3)": fair / alone,
        "heavy tokens/s / (capacity - light's) (>= 0.9)": heavy / max(1e-9, capacity - light_use),
        "critical refusals with sheddable batch (0)": r["shed"]["light"]["refused"],
        "sheddable refusals": r["shed"]["batch"]["refused"],
    }


def render(r: dict) -> str:
    args = r["args"]
    cmd = f".venv/bin/python bench/fairness_bench.py --seconds {args['seconds']:g} --heavy {args['heavy']}"
    rows = []
    for name in ("capacity", "alone", "fifo", "fair", "shed"):
        for tenant, x in r[name].items():
            p50 = f"{x['ttft_p50_s']:.3f}" if x["ttft_p50_s"] is not None else "-"
            p95 = f"{x['ttft_p95_s']:.3f}" if x["ttft_p95_s"] is not None else "-"
            rows.append(f"| {name} | {tenant} | {x['requests']} | {x['refused']} | {p50} | {p95} | {x['tokens_per_s']:.1f} |")
    checks = [f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in r["checks"].items()]
    return "\n".join([
        "# Token-fair queueing against first come first served (bench/fairness_bench.py)",
        "",
        f"{r['when']}, {r['machine']}; `{cmd}`",
        f"{args['lanes']} lanes x {args['slots']} slots of Gemma 3 270M Q4_K_M, {args['max_tokens']} output tokens per"
        f" answer, {args['seconds']:g} s per phase; heavy and batch: {args['heavy']} client loops each, light: 1.",
        "",
        "| phase | tenant | answered | refused (429) | TTFT p50 s | TTFT p95 s | output tokens/s |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        *checks,
        "",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
