"""Prefix affinity against most free slots: a multi-turn trace through two gateways on the same lanes.

Run from the repository root:
    .venv/bin/python bench/affinity_bench.py [--convs 16] [--turns 6] [--system-words 2000] [--out bench/affinity_results.md]

Everything is real: a nats-server, the planner and one agent (in this process) running two
llama-server lanes of Gemma 3 270M Q4_K_M (the demo model), two slots each, and two
`lanes gateway` processes on that fleet, one as shipped (prefix affinity) and one with
--no-affinity (most free slots, today's choice before affinity). The same trace runs through
each in turn, in one run: `--convs` conversations, each with its own system prompt of
`--system-words` words and a growing history, `--turns` turns each, sent by as many client
loops as the fleet has slots, in a shuffled order (a conversation's next turn waits for its
previous answer). Each mode gets its own system prompts (the same lengths), so neither
warms the other's cache.

Measured per mode, from the lanes' own answers (streamed, `include_usage`): the cached-token
ratio (sum of cached over sum of prompt tokens) of the turns after the first and of all turns;
time to first token (the first content chunk) at p50 for the later turns; requests per lane
(max over mean); wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
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

WORDS = ("lane slot cache prompt model token window host memory queue river stone cloud market garden "
         "engine signal harbor letter winter summer forest valley bridge lantern copper violet orbit").split()  # fmt: skip


def system_prompt(mode: str, i: int, words: int, rng: random.Random, shared: str = "") -> str:
    """A conversation's own system prompt; with `shared` (the hot-spot trace) one long text every
    conversation starts with, and only a short line of its own after it."""
    if shared:
        return f"{shared} You are assistant {i}."
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are assistant {i} of the {mode} run. Keep answers short. Background notes: {body}"


async def ask(http: aiohttp.ClientSession, base: str, messages: list, max_tokens: int) -> dict:
    payload = {"model": ALIAS, "messages": messages, "stream": True, "max_tokens": max_tokens,
               "stream_options": {"include_usage": True}}  # fmt: skip
    began = time.perf_counter()
    ttft, text, usage, pending = None, [], None, b""
    async with http.post(base + "/v1/chat/completions", json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        lane = resp.headers.get("X-Lanes-Lane", "")
        async for chunk in resp.content.iter_any():
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"].get("message"))
                for choice in event.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        ttft = ttft if ttft is not None else time.perf_counter() - began
                        text.append(content)
                usage = event.get("usage") or usage
    if usage is None:
        raise RuntimeError("no usage in the stream")
    return {"lane": lane, "ttft": ttft if ttft is not None else time.perf_counter() - began, "text": "".join(text),
            "prompt": usage["prompt_tokens"], "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}  # fmt: skip


async def route_choices(http, bases: list[str]) -> dict[str, float]:
    """The gateways' route choices so far, by reason, summed."""
    choices: dict[str, float] = {}
    for base in bases:
        async with http.get(base + "/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            if line.startswith("lanes_gateway_route_choices_total{"):
                reason = line.split('reason="')[1].split('"')[0]
                choices[reason] = choices.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return choices


async def run_trace(http, bases: list[str], mode: str, args, workers: int) -> dict:
    """The trace through `bases` (gateways): a conversation's turns alternate between them."""
    rng = random.Random(args.seed)
    shared = ""
    if args.hot_spot:
        shared = f"You serve the {mode} run. Keep answers short. Notes: " + " ".join(
            rng.choice(WORDS) for _ in range(args.system_words))
    convs = [[{"role": "system", "content": system_prompt(mode, i, args.system_words, rng, shared)}]
             for i in range(args.convs)]  # fmt: skip
    order = [i for i in range(args.convs) for _ in range(args.turns)]
    rng.shuffle(order)
    busy: set[int] = set()
    done = [0] * args.convs
    results: list[dict] = []
    lock = asyncio.Lock()
    before = await route_choices(http, bases)  # a gateway may have served an earlier mode
    began = time.perf_counter()

    async def next_conv() -> int | None:
        while True:
            async with lock:
                if not order:
                    return None
                pick = next((k for k, i in enumerate(order) if i not in busy), None)
                if pick is not None:
                    i = order.pop(pick)
                    busy.add(i)
                    return i
            await asyncio.sleep(0.01)

    async def client() -> None:
        while (i := await next_conv()) is not None:
            turn = done[i]
            convs[i].append({"role": "user", "content": f"Question {turn + 1}: say something about {rng.choice(WORDS)}."})
            got = await ask(http, bases[(i + turn) % len(bases)], convs[i], args.max_tokens)
            convs[i].append({"role": "assistant", "content": got["text"]})
            results.append({"conv": i, "turn": turn, **{k: v for k, v in got.items() if k != "text"}})
            done[i] += 1
            busy.discard(i)

    await asyncio.gather(*(client() for _ in range(workers)))
    wall = time.perf_counter() - began
    after = await route_choices(http, bases)
    choices = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}  # this run's
    later = [r for r in results if r["turn"] > 0]
    per_lane: dict[str, int] = {}
    for r in results:
        per_lane[r["lane"]] = per_lane.get(r["lane"], 0) + 1
    moved = sum(1 for r in later if r["lane"] != next(x["lane"] for x in results if x["conv"] == r["conv"] and x["turn"] == r["turn"] - 1))
    return {
        "requests": len(results),
        "cached_ratio_later_turns": sum(r["cached"] for r in later) / max(1, sum(r["prompt"] for r in later)),
        "cached_ratio_all": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
        "ttft_p50_later_s": statistics.median(r["ttft"] for r in later),
        "ttft_p50_first_s": statistics.median(r["ttft"] for r in results if r["turn"] == 0),
        "prompt_tokens_later": sum(r["prompt"] for r in later),
        "turns_moved_lane": moved,
        "per_lane": per_lane,
        "max_over_mean_load": max(per_lane.values()) / (len(results) / len(per_lane)),
        "wall_s": wall,
        "route_choices": choices,
    }


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=2000, help="words of each system prompt (about a token each)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="tokens per slot")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="baseline,affinity,two",
                    help="baseline (most free slots), affinity (one gateway), two (two gateways, turns alternating)")
    ap.add_argument("--hot-spot", action="store_true",
                    help="one long system prompt shared by every conversation (a short line of its own after it)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "affinity_results.md"))
    args = ap.parse_args()
    setup_logging("warning")
    llama = find_llama_server()
    if llama is None:
        print("no llama-server: run `lanes install-llama`", file=sys.stderr)
        return 2
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "when": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="lanes-affinity-bench-") as tmp:
        fleet = Fleet(Path(tmp), llama, False)
        await fleet.start()
        port = _free_base()
        baseline_url = f"http://127.0.0.1:{port}"
        baseline = subprocess.Popen(
            [str(Path(sys.executable).parent / "lanes"), "gateway", "--nats", fleet.nats.url, "--port", str(port),
             "--queue-wait", "600", "--queue-depth", "256", "--no-affinity"],
            stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "baseline.log", "wb"),
        )  # fmt: skip
        second_url = f"http://127.0.0.1:{port + 1}"
        second = subprocess.Popen(
            [str(Path(sys.executable).parent / "lanes"), "gateway", "--nats", fleet.nats.url, "--port", str(port + 1),
             "--queue-wait", "600", "--queue-depth", "256"],
            stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "second.log", "wb"),
        )  # fmt: skip
        try:
            persona = Persona(model="gemma-3-270m-q4_k_m", alias=ALIAS, lanes=args.lanes, parallel=args.slots,
                              ctx_min=args.ctx, ctx_max=args.ctx)  # fmt: skip
            reply = await fleet.nc.request(subjects.DEMAND_SET, encode(Demand(personas=(persona,))), timeout=10)
            assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers

            async def ready(url: str) -> bool:
                async with fleet.http.get(url + "/v1/models") as resp:
                    data = (await resp.json())["data"]
                return any(m["id"] == ALIAS and m["lanes"]["ready"] == args.lanes for m in data)

            await _until(lambda: ready(fleet.gateway_url), 600, "lanes routable (affinity gateway)")
            for url, name in ((baseline_url, "baseline"), (second_url, "second")):
                try:
                    await _until(lambda: ready(url), 60, f"lanes routable ({name} gateway)")
                except RuntimeError:  # say what that gateway said (it timed out once in CI, unexplained)
                    log_tail = (Path(tmp) / f"{name}.log").read_bytes()[-3000:].decode(errors="replace")
                    print(f"{name} gateway's log, its end:\n{log_tail}", file=sys.stderr)
                    raise
            results["lane_args"] = [list(lane.argv) for lane in await fleet.lanes()]
            timeout = aiohttp.ClientTimeout(total=900)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                workers = args.lanes * args.slots
                runs = {"baseline": ("most_free_slots", [baseline_url]), "affinity": ("affinity", [fleet.gateway_url]),
                        "two": ("two_gateways", [fleet.gateway_url, second_url])}  # fmt: skip
                for mode in args.modes.split(","):
                    name, bases = runs[mode]
                    results[name] = await run_trace(http, bases, mode, args, workers)
                    print(f"{name}:", json.dumps(results[name]), flush=True)
        finally:
            for process in (baseline, second):
                process.terminate()
                process.wait(20)
            await fleet.close()
    b = results.get("most_free_slots")
    for name in ("affinity", "two_gateways"):
        if b and name in results:
            results[f"ttft_later_speedup_{name}"] = b["ttft_p50_later_s"] / results[name]["ttft_p50_later_s"]
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=2))
    Path(args.out).write_text(render(results))
    print(render(results))
    return 0


def render(r: dict) -> str:
    args = r["args"]
    cmd = (f".venv/bin/python bench/affinity_bench.py --convs {args['convs']} --turns {args['turns']}"
           f" --system-words {args['system_words']} --lanes {args['lanes']} --slots {args['slots']}"
           f" --modes {args['modes']}{' --hot-spot' if args['hot_spot'] else ''}")  # fmt: skip
    names = [n for n in ("most_free_slots", "affinity", "two_gateways") if n in r]
    heads = {"most_free_slots": "most free slots", "affinity": "by tokens, one gateway",
             "two_gateways": "by tokens, two gateways alternating"}  # fmt: skip
    rows = [
        ("cached-token ratio, turns 2+", lambda x: f"{x['cached_ratio_later_turns']:.3f}"),
        ("cached-token ratio, all turns", lambda x: f"{x['cached_ratio_all']:.3f}"),
        ("p50 time to first token, turns 2+", lambda x: f"{x['ttft_p50_later_s']:.3f} s"),
        ("p50 time to first token, first turns", lambda x: f"{x['ttft_p50_first_s']:.3f} s"),
        ("later turns on another lane than the turn before", lambda x: str(x["turns_moved_lane"])),
        ("requests per lane, max / mean", lambda x: f"{x['max_over_mean_load']:.2f}"),
        ("wall time", lambda x: f"{x['wall_s']:.1f} s"),
        ("route choices", lambda x: ", ".join(f"{k} {int(v)}" for k, v in sorted(x["route_choices"].items()))),
    ]
    lines = [
        "# Routing by tokens against most free slots (bench/affinity_bench.py)",
        "",
        f"{r['when']}, {r['machine']}; `{cmd}`",
        f"{args['lanes']} lanes x {args['slots']} slots of Gemma 3 270M Q4_K_M, {args['ctx']} tokens per slot,"
        f" {args['convs']} conversations x {args['turns']} turns, {args['max_tokens']} tokens per answer,"
        f" {args['lanes'] * args['slots']} client loops{'; one system prompt shared by all (hot spot)' if args['hot_spot'] else ''};"
        f" lane argv: `{' '.join(r['lane_args'][0][1:]) if r['lane_args'] else '-'}`",
        "",
        "| | " + " | ".join(heads[n] for n in names) + " |",
        "|---" * (len(names) + 1) + "|",
        *[f"| {label} | " + " | ".join(f(r[n]) for n in names) + " |" for label, f in rows],
        "",
    ]
    for name in ("affinity", "two_gateways"):
        if f"ttft_later_speedup_{name}" in r:
            lines.append(f"p50 time to first token of the later turns, {heads[name]}: "
                         f"{r[f'ttft_later_speedup_{name}']:.2f}x better than most free slots.")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
