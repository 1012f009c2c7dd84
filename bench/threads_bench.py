"""Threads planned per lane against llama-server's default (every core per lane): N lanes of
the real Gemma on one host, through the gateway, against one bare llama-server with all
cores and the same total slots.

Run from the repository root:
    .venv/bin/python bench/threads_bench.py [--seconds 20] [--repeats 2] [--lanes 1,2,3] [--variants]

Everything is real (see bench/gateway_bench.py, whose fleet this reuses): a nats-server, the
planner and one agent in this process running llama-server lanes of Gemma 3 270M Q4_K_M
(4 slots each, 1024 tokens per slot), `lanes gateway` as its own process. For each N, and
each repeat (the order of the cells rotates every repeat, so all see the same noise):

- bare: one llama-server, default threads, 4N slots, straight to it;
- planned: N lanes with the planner's threads (config threads unset), through the gateway;
- default: the same N lanes with no thread flags (config threads 0: today's behaviour).

A cell is closed-loop: 4N clients (one per slot) send streaming chats of 32 tokens for
`--seconds`; tokens/s counts the tokens of requests that finished inside the window.
Ratios are of medians over the repeats. `--variants` adds, at N = 2: planned threads with
pinning (cpu_pinning), and with poll 0 and 100 (llama-server's default is 50).
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

from gateway_bench import ALIAS, MESSAGES, Fleet, _free_base, _until  # noqa: E402

from lanes.demo_model import ensure_demo_model  # noqa: E402
from launcher_agent.probe import find_llama_server  # noqa: E402
from shared import subjects  # noqa: E402
from shared.logs import setup_logging  # noqa: E402
from shared.messages.config import Demand, Persona  # noqa: E402
from shared.messages.wire import encode  # noqa: E402

SLOTS = 4
WINDOW = 1024
TOKENS = 32
MODEL = "gemma-3-270m-q4_k_m"


class ThreadsFleet(Fleet):
    async def lanes_of(self, n: int, want) -> None:
        persona = Persona(model=MODEL, alias=ALIAS, lanes=n, parallel=SLOTS, ctx_min=WINDOW, ctx_max=WINDOW)
        await self._request(subjects.DEMAND_SET, encode(Demand(personas=(persona,))))

        async def ready():
            found = await self.lanes()
            return len(found) == n and all(want(lane) for lane in found) and await self.routable() == n

        await _until(ready, 600, f"{n} lane(s) serving")


def _argv_has(**flags):
    """A lane check: each flag given (value) or absent (None)."""

    def check(lane) -> bool:
        argv = list(lane.argv)
        if list(argv[argv.index("--parallel") + 1 : argv.index("--parallel") + 2]) != [str(SLOTS)]:
            return False
        for flag, value in flags.items():
            flag = "--" + flag.replace("_", "-")
            if value is None and flag in argv:
                return False
            if value is not None and (flag not in argv or (value is not True and argv[argv.index(flag) + 1] != value)):
                return False
        return True

    return check


async def counted_stream(http, base: str, end: float, tokens: list[int]) -> None:
    """One streaming chat; each token counts as it arrives, until `end` (then it is dropped)."""
    payload = {"model": ALIAS, "messages": MESSAGES, "stream": True, "max_tokens": TOKENS, "ignore_eos": True}
    async with http.post(base + "/v1/chat/completions", json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        async for line in resp.content:
            if time.perf_counter() > end:
                return
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                tokens[0] += bool((choices[0].get("delta") or {}).get("content"))


async def closed_loop(http, base: str, clients: int, seconds: float) -> float:
    """Tokens per second streamed to `clients` looping chats during `seconds` (a closed loop:
    each client sends its next request when the last ends, so every slot stays busy)."""
    tokens, failed = [0], [0]
    end = time.perf_counter() + seconds

    async def client():
        while time.perf_counter() < end:
            try:
                await counted_stream(http, base, end, tokens)
            except Exception:
                failed[0] += 1
                await asyncio.sleep(0.1)

    await asyncio.gather(*(client() for _ in range(clients)))
    if failed[0]:
        print(f"  {failed[0]} failed requests against {base}", file=sys.stderr)
    return tokens[0] / seconds


class Bare:
    """One llama-server with every default (threads included) and the same total slots."""

    def __init__(self, llama: str, model: Path, slots: int, log: Path):
        self.port = _free_base()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [llama, "--model", str(model), "--alias", ALIAS, "--host", "127.0.0.1", "--port", str(self.port),
             "--parallel", str(slots), "--ctx-size", str(WINDOW * slots)],
            stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
        )  # fmt: skip

    async def ready(self, http) -> None:
        async def up():
            async with http.get(self.url + "/health") as resp:
                return resp.status == 200

        await _until(up, 120, "bare llama-server")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lanes", default="1,2,3")
    ap.add_argument("--variants", action="store_true", help="also pinning and poll levels at N = 2")
    ap.add_argument("--out", default=str(ROOT / "bench" / "threads_results.json"))
    args = ap.parse_args()
    setup_logging("warning")
    llama = find_llama_server()
    if llama is None:
        print("no llama-server: run `lanes install-llama`", file=sys.stderr)
        return 2
    counts = [int(n) for n in args.lanes.split(",")]
    results: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs",
        "when": time.strftime("%Y-%m-%d %H:%M"), "seconds": args.seconds, "repeats": args.repeats,
        "load_at_start": load(), "cells": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lanes-threads-bench-") as tmp:
        fleet = ThreadsFleet(Path(tmp), llama, False)
        await fleet.start()
        model = ensure_demo_model(Path(tmp) / "models")  # Fleet.start put it there
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as http:
                await fleet.config(max_restarts_per_host=8, drain_timeout=5)
                for n in counts:
                    bare = Bare(llama, model, SLOTS * n, Path(tmp) / f"bare-{n}.log")
                    await bare.ready(http)
                    cells = {
                        "bare": ({}, None),
                        "planned": ({"threads": None, "cpu_pinning": False, "poll": None}, _argv_has(threads=True)),
                        "default": ({"threads": 0, "cpu_pinning": False, "poll": None}, _argv_has(threads=None)),
                    }
                    if args.variants and n == 2:
                        cells["pinned"] = ({"threads": None, "cpu_pinning": True, "poll": None}, _argv_has(cpu_range=True))
                        cells["poll 0"] = ({"threads": None, "cpu_pinning": False, "poll": 0}, _argv_has(poll="0"))
                        cells["poll 100"] = ({"threads": None, "cpu_pinning": False, "poll": 100}, _argv_has(poll="100"))
                    names = list(cells)
                    for r in range(args.repeats):
                        order = names[r % len(names):] + names[: r % len(names)]
                        for name in order:
                            changes, want = cells[name]
                            if name != "bare":
                                await fleet.config(**changes)
                                await fleet.lanes_of(n, want)
                            base = bare.url if name == "bare" else fleet.gateway_url
                            await closed_loop(http, base, SLOTS * n, 2.0)  # warm
                            before = load()
                            tps = await closed_loop(http, base, SLOTS * n, args.seconds)
                            cell = {"lanes": n, "cell": name, "repeat": r, "tokens_per_s": tps,
                                    "load_before": before, "load_after": load()}  # fmt: skip
                            results["cells"].append(cell)
                            print(json.dumps(cell), flush=True)
                    bare.close()
        finally:
            await fleet.close()
    results["summary"] = summarize(results["cells"])
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(render(results))
    return 0


def summarize(cells: list[dict]) -> list[dict]:
    out = []
    for n in sorted({c["lanes"] for c in cells}):
        med = {}
        for name in dict.fromkeys(c["cell"] for c in cells if c["lanes"] == n):
            med[name] = statistics.median(c["tokens_per_s"] for c in cells if c["lanes"] == n and c["cell"] == name)
        row = {"lanes": n, "median_tokens_per_s": med}
        row["ratios_to_bare"] = {k: v / med["bare"] for k, v in med.items() if k != "bare" and med["bare"]}
        out.append(row)
    return out


def render(results: dict) -> str:
    names = list(dict.fromkeys(k for row in results["summary"] for k in row["ratios_to_bare"]))
    lines = ["| N lanes x 4 slots | bare tokens/s | " + " | ".join(f"{k} tokens/s (ratio)" for k in names) + " |",
             "|---|---|" + "---|" * len(names)]  # fmt: skip
    for row in results["summary"]:
        med, ratio = row["median_tokens_per_s"], row["ratios_to_bare"]
        cells = [f"{med[k]:.1f} ({ratio[k]:.2f})" if k in med else "-" for k in names]
        lines.append(f"| {row['lanes']} | {med['bare']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nload average at start: {results['load_at_start']}\n"


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
