"""Hot prompts across a rolling restart: the next turn of each conversation, with and without saved slots.

Run from the repository root:
    .venv/bin/python bench/slot_bench.py [--model llama8|gemma] [--convs 4] [--chars 1500] [--out bench/slot_results.json]

Everything is real and in this process: a nats-server, the planner, one agent running two
llama-server lanes of one model (two slots each) and a gateway. `--convs` conversations take
turns through the gateway without pause (each turn adds a short message to its prompt); after
three turns each, `config set threads=N` restarts both lanes one at a time (the KV layout is
kept), between two rounds of turns (`--load rounds`: as between a user's turns; `--load
continuous`: while the turns go on, so a draining lane's conversations go cold to the other
lane anyway). Measured: the cached-token ratio (timings.cache_n over
cache_n + prompt_n) of the first turn of each conversation that starts once both lanes serve
again, and that turn's time, with saved slots (slot_cache_bytes at its default) and without
(slot_cache_bytes=0, as before them); each mode on a fresh fleet.

Models: `llama8`, a generated llama (8 layers, 512 wide, one token per byte, no sliding window);
`gemma`, Gemma 3 270M (sliding-window attention: its lanes get --swa-full while slots are saved, so
their saved slots read back whole; without saved slots they run without it; docs/slot-cache.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tinymodels import write_llama  # noqa: E402

from gateway.service import Gateway, run_gateway  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
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

HOST = "bench"
WARM_TURNS = 3  # turns of each conversation before the rollout
WORDS = "lane slot cache prompt token model fleet agent planner gateway restart budget river stone".split()


def _text(rng: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + " "
    return out[:chars]


async def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = check()
            if asyncio.iscoroutine(got):
                got = await got
            if got:
                return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"timed out: {what}")


async def run_mode(tmp: Path, llama: str, model: Path, args, save: bool) -> dict:
    nats = NatsServer(tmp / "nats").start()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_planner(nats.url, stop))]
    cfg = AgentConfig(host_id=HOST, model_dirs=[str(model.parent)], binary=llama, caps=probe(llama),
                      data_dir=tmp / "agent", port_base=20000 + random.randrange(0, 2000) * 16, report_interval=5,
                      tick=0.2)  # fmt: skip
    tasks.append(asyncio.create_task(run_agent(cfg, nats.url, stop)))
    gw = Gateway(GatewaySettings(port=0, queue_wait=600, request_timeout=600))
    tasks.append(asyncio.create_task(run_gateway(nats.url, stop, gateway=gw)))
    nc = await connect(nats.url, name="bench", retry_forever=False)
    try:
        await _until(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), 30, "planner")
        kv = await kv_bucket(nc)
        if not save:
            await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"slot_cache_bytes": 0})), timeout=5)
        persona = Persona(model=model.stem, alias="m", lanes=2, parallel=2, ctx_min=args.ctx, ctx_max=args.ctx)
        await nc.request(subjects.DEMAND_SET, encode(Demand(personas=(persona,))), timeout=5)

        async def lanes() -> list:
            status = decode((await kv.get(subjects.status_key(HOST))).value, HostStatus)
            return [lane for lane in status.lanes if lane.state == "healthy" and not lane.draining]

        await _until(lambda: len(gw.view.routable("m")) == 2, 600, "two lanes routable")
        threads = {m.group(1) for x in await lanes() if (m := re.search(r"--threads (\d+)", " ".join(x.argv)))}
        new_threads = 2 if threads == {"1"} else 1
        rng = random.Random(args.seed)
        prompts = [f"conversation {i}\nsystem: " + _text(rng, args.chars) for i in range(args.convs)]
        turns: list[dict] = []
        restarted_at: list[float] = []
        done = asyncio.Event()

        async def conversation(i: int, http: aiohttp.ClientSession) -> None:
            k = 0
            while not done.is_set():
                prompts[i] += "\nuser: " + _text(rng, 60)
                body = {"model": "m", "prompt": prompts[i], "max_tokens": args.max_tokens, "temperature": 0}
                started = time.monotonic()
                async with http.post(gw.url + "/v1/completions", json=body) as resp:
                    answer = await resp.json()
                t = answer["timings"]
                turns.append({"conv": i, "turn": k, "start": started, "seconds": time.monotonic() - started,
                              "prompt_n": t["prompt_n"], "cache_n": t["cache_n"]})  # fmt: skip
                k += 1
                if restarted_at and started > restarted_at[0]:
                    return  # its first turn after the rollout is in
                if args.load == "rounds":  # the next turn once every conversation had this one
                    await _until(lambda: restarted_at or (k < WARM_TURNS and min(
                        sum(1 for t in turns if t["conv"] == j) for j in range(args.convs)) >= k), 900, "the round")

        async def rollout() -> None:
            await _until(lambda: all(sum(1 for t in turns if t["conv"] == i) >= WARM_TURNS for i in range(args.convs)), 900,
                         "three turns each")  # fmt: skip
            await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"threads": new_threads})), timeout=5)

            async def back() -> bool:
                found = await lanes()
                return len(found) == 2 and all(f"--threads {new_threads}" in " ".join(x.argv) for x in found) \
                    and len(gw.view.routable("m")) == 2

            await _until(back, 600, "both lanes restarted")
            restarted_at.append(time.monotonic())

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
            await asyncio.gather(rollout(), *(conversation(i, http) for i in range(args.convs)))
        done.set()
        after = [next(t for t in turns if t["conv"] == i and t["start"] > restarted_at[0]) for i in range(args.convs)]
        before = [t for t in turns if t["turn"] >= 1 and t["start"] < restarted_at[0]]

        def ratio(ts: list[dict]) -> float:
            return sum(t["cache_n"] for t in ts) / max(1, sum(t["cache_n"] + t["prompt_n"] for t in ts))

        return {
            "next_turn_cached_ratio": round(ratio(after), 3),
            "next_turn_seconds_median": round(statistics.median(t["seconds"] for t in after), 3),
            "next_turn_prompt_tokens": sum(t["cache_n"] + t["prompt_n"] for t in after),
            "later_turns_before_cached_ratio": round(ratio(before), 3),
            "turns": len(turns),
            "saved_slot_files": len(list((tmp / "agent" / "slots").glob("*.slot"))),
        }
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await nc.close()
        nats.stop()


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("llama8", "gemma"), default="llama8")
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--chars", type=int, default=1500, help="characters of each system prompt")
    ap.add_argument("--ctx", type=int, default=4096, help="tokens per slot")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--load", choices=("rounds", "continuous"), default="rounds",
                    help="rounds: every conversation takes a turn, then the next round (the rollout runs between "
                         "rounds, as between a user's turns); continuous: no pause, the rollout under way")
    ap.add_argument("--out", default=str(ROOT / "bench" / "slot_results.json"))
    args = ap.parse_args()
    setup_logging("warning")
    llama = find_llama_server()
    if llama is None:
        print("no llama-server: run `lanes install-llama`", file=sys.stderr)
        return 2
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "when": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}  # fmt: skip
    for mode, save in (("saved_slots", True), ("no_saved_slots", False)):
        with tempfile.TemporaryDirectory(prefix="lanes-slot-bench-") as tmp:
            models = Path(tmp) / "models"
            if args.model == "gemma":
                model = ensure_demo_model(models)
            else:
                models.mkdir()
                model = write_llama(models / "llama8.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=8, head_dim=64,
                                    n_ctx_train=32768)  # fmt: skip
            results[mode] = await run_mode(Path(tmp), llama, Path(model), args, save)
            print(mode, json.dumps(results[mode]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
