"""lanes against llama.cpp's own router mode, side by side on one host (issue 35 point 1).

Run from the repository root:

    .venv/bin/python bench/router_bench.py [--ram 1.2GiB] [--json bench/router_results.json]

The same llama-server binary, the same model folder (the real Gemma 3 270M Q4_K_M file twice,
as gemma-a and gemma-b, and a generated llama model, llama-gen: another architecture), the same
memory limit and the same client for both sides:

- lanes: `lanes up --models DIR --max-ram RAM` (nats-server, planner, agent, gateway; the
  planner chooses each lane's window, slots and threads to fit RAM);
- lanes-4slots: the same, with a demand giving every model the router's slot shape (4 slots,
  one KV cache shared: `parallel = 4`, `kv_unified = true`); lanes' default is 1 slot per lane;
- router: `llama-server --models-dir DIR --models-max N`, N the number of children whose
  measured RSS fits RAM (each child with llama-server's defaults, as a router user runs it).

Each side is started fresh for each trace, and the sides alternate. The client is this script
(aiohttp, streaming chat completions with usage; aiperf and guidellm need a tokenizer from the
Hub, which this machine cannot reach). Traces:

- steady: one model (gemma-a), 48 short chats, 4 at a time;
- mix: three models, requests arriving on a seeded schedule (gemma-a half of them, gemma-b and
  llama-gen a quarter each) while memory holds two: loads and unloads on request. First both
  sides are brought to gemma-a and gemma-b loaded, then one request for llama-gen times a cold
  request (its load, with an eviction) to its first token;
- conversations: 6 conversations of 4 turns at once, every one opening with the same long
  system prompt (about 1,400 tokens), each turn carrying the history.

Per trace and side: requests answered and failed, time to first token p50/p95, output tokens per
second (all answers' tokens over the trace's wall time), cached prompt tokens over prompt tokens,
llama-server processes started (loads) and ended (unloads) during the trace, the peak RSS of the
side's whole process tree and of its llama-server processes. `ignore_eos` keeps every answer at
its max_tokens on both sides, so tokens per second compare the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from lanes.demo_model import ensure_demo_model  # noqa: E402
from launcher_agent.probe import find_llama_server  # noqa: E402
from lanes.tables import parse_size  # noqa: E402

MODELS = ("gemma-a", "gemma-b", "llama-gen")
SIZE = {"steady": 48, "mix": 40, "conversations": 6}  # requests, requests, conversations (--small: a few)
MIB = 1 << 20
PREFIX = " ".join(
    f"Rule {i}: when a traveller reaches the crossing at milestone {i * 7}, the keeper notes the hour, "
    f"the weather and the colour of the traveller's coat in the ledger kept for road {i % 5}."
    for i in range(40)
)  # about 1,400 tokens, the same for every conversation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_models(folder: Path, cache: Path) -> None:
    import tinymodels

    folder.mkdir(parents=True, exist_ok=True)
    gemma = ensure_demo_model(cache)
    for name in ("gemma-a", "gemma-b"):
        shutil.copyfile(gemma, folder / f"{name}.gguf")
    tinymodels.write_llama(folder / "llama-gen.gguf", n_layer=8, n_embd=1024, n_head=8, n_head_kv=4,
                           head_dim=128, n_ff=2816, n_ctx_train=16384)  # fmt: skip


@dataclass
class Answer:
    model: str
    ok: bool
    status: int = 0
    ttft: float = 0.0
    output: int = 0
    prompt: int = 0
    cached: int = 0
    text: str = ""
    error: str = ""


async def chat(http: aiohttp.ClientSession, base: str, model: str, messages: list[dict], max_tokens: int) -> Answer:
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}  # fmt: skip
    began = time.perf_counter()
    answer = Answer(model, False)
    try:
        async with http.post(base + "/v1/chat/completions", json=payload,
                             timeout=aiohttp.ClientTimeout(total=300)) as resp:  # fmt: skip
            answer.status = resp.status
            if resp.status != 200:
                answer.error = (await resp.text())[:200]
                return answer
            pieces = []
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if not answer.ttft:
                            answer.ttft = time.perf_counter() - began
                        pieces.append(piece)
                usage = event.get("usage")
                if usage:
                    answer.output = usage.get("completion_tokens", 0)
                    answer.prompt = usage.get("prompt_tokens", 0)
                    answer.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if event.get("error"):
                    answer.error = str(event["error"])[:200]
            answer.text = "".join(pieces)
            answer.ok = not answer.error and answer.output > 0
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:200]
    return answer


@dataclass
class TreeWatch:
    """A side's process tree sampled every 0.1 s: peak RSS, and llama-server processes seen come and go."""

    root: int
    peak_total: int = 0
    peak_servers: int = 0
    seen: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)

    def sample(self) -> set[int]:
        try:
            procs = [psutil.Process(self.root), *psutil.Process(self.root).children(recursive=True)]
        except psutil.NoSuchProcess:
            return set()
        total = servers = 0
        alive = set()
        for proc in procs:
            try:
                rss = proc.memory_info().rss
                name = proc.name()
            except psutil.Error:
                continue
            total += rss
            if name.startswith("llama-server") and proc.pid != self.root:
                servers += rss
                alive.add(proc.pid)
        self.peak_total, self.peak_servers = max(self.peak_total, total), max(self.peak_servers, servers)
        self.gone |= self.seen - alive
        self.seen |= alive
        return alive

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except asyncio.TimeoutError:
                pass


class Side:
    def __init__(self, name: str, binary: str, models: Path, ram: int, models_max: int, work: Path,
                 config: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.name, self.binary, self.models, self.ram, self.models_max, self.work = name, binary, models, ram, models_max, work
        self.config = config  # lanes config set KEY=VALUE ... once lanes is up
        self.proc: subprocess.Popen | None = None
        self.base = self.nats = ""

    def argv(self) -> list[str]:
        if self.name == "router":
            port = free_port()
            self.base = f"http://127.0.0.1:{port}"
            return [self.binary, "--models-dir", str(self.models), "--models-max", str(self.models_max),
                    "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        gateway, nats = free_port(), free_port()
        self.base, self.nats = f"http://127.0.0.1:{gateway}", f"nats://127.0.0.1:{nats}"
        data = Path(tempfile.mkdtemp(prefix="lanes-", dir=self.work))
        return [str(ROOT / ".venv" / "bin" / "lanes"), "up", "--models", str(self.models), "--data", str(data),
                "--llama-server", self.binary, "--max-ram", str(self.ram), "--nats-port", str(nats),
                "--port-base", str(free_port()), "--gateway-port", str(gateway), "--host-id", "bench"]  # fmt: skip

    async def start(self, http: aiohttp.ClientSession) -> None:
        await self._start(http)
        if self.name != "router" and self.config:
            subprocess.run([str(ROOT / ".venv" / "bin" / "lanes"), "config", "set", "--nats", self.nats, *self.config],
                           check=True, capture_output=True, timeout=60)  # fmt: skip
        if self.name == "lanes-4slots":
            await self._four_slots(http)

    async def _four_slots(self, http: aiohttp.ClientSession) -> None:
        """The router's slot shape (4 slots, one KV cache shared) for every model, by a demand."""
        demand = self.work / "four-slots.toml"
        demand.write_text('kind = "demand"\n' + "".join(
            f'[[personas]]\nmodel = "{m}"\nparallel = 4\nkv_unified = true\n' for m in MODELS))
        subprocess.run([str(ROOT / ".venv" / "bin" / "lanes"), "demand", "set", "--nats", self.nats, str(demand)],
                       check=True, capture_output=True, timeout=60)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            argvs = await asyncio.to_thread(self._server_argvs)
            if argvs and all("--parallel" in a and a[a.index("--parallel") + 1] == "4" for a in argvs):
                if await self._lanes_settled(http):
                    return
            await asyncio.sleep(0.5)
        raise RuntimeError("lanes did not apply the 4-slot demand in 120 s")

    def _server_argvs(self) -> list[list[str]]:
        out = []
        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if proc.name().startswith("llama-server"):
                    out.append(proc.cmdline())
            except psutil.Error:
                pass
        return out

    async def _start(self, http: aiohttp.ClientSession) -> None:
        log = open(self.work / f"{self.name}.log", "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: see {self.work / (self.name + '.log')}")
            try:
                async with http.get(self.base + "/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        listed = {m["id"] for m in (await resp.json())["data"]}
                        if set(MODELS) <= listed and (self.name == "router" or await self._lanes_settled(http)):
                            return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready in 120 s")

    async def _lanes_settled(self, http: aiohttp.ClientSession) -> bool:
        """lanes up loads what its plan places at start: wait until no model is still loading."""
        async with http.get(self.base + "/v1/models") as resp:
            states = [m.get("state") for m in (await resp.json())["data"]]
        return "loading" not in states and "ready" in states

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def user_text(i: int) -> str:
    topics = ("the sea", "a mountain", "a library", "the moon", "a market", "a train", "winter", "a garden")
    return f"Request {i}: write three sentences about {topics[i % len(topics)]} seen at dawn."


async def steady(http: aiohttp.ClientSession, base: str) -> list[Answer]:
    await chat(http, base, "gemma-a", [{"role": "user", "content": "warm up"}], 2)
    queue = list(range(SIZE["steady"]))
    answers: list[Answer] = []

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            answers.append(await chat(http, base, "gemma-a", [{"role": "user", "content": user_text(i)}], 48))

    await asyncio.gather(*(worker() for _ in range(4)))
    return answers


async def mix(http: aiohttp.ClientSession, base: str, extra: dict) -> list[Answer]:
    for model in ("gemma-a", "gemma-b"):
        await chat(http, base, model, [{"role": "user", "content": "warm up"}], 2)
    cold = await chat(http, base, "llama-gen", [{"role": "user", "content": "cold"}], 2)
    extra["cold_ttft_s"] = round(cold.ttft, 3) if cold.ok else None
    rng = random.Random(7)
    at, schedule = 0.0, []
    for i in range(SIZE["mix"]):
        at += rng.expovariate(1 / 1.5)
        schedule.append((at, rng.choices(MODELS, weights=(2, 1, 1))[0], i))
    began = time.perf_counter()

    async def one(when: float, model: str, i: int) -> Answer:
        await asyncio.sleep(max(0.0, began + when - time.perf_counter()))
        return await chat(http, base, model, [{"role": "user", "content": user_text(i)}], 16)

    return list(await asyncio.gather(*(one(*s) for s in schedule)))


async def conversations(http: aiohttp.ClientSession, base: str) -> list[Answer]:
    await chat(http, base, "gemma-a", [{"role": "user", "content": "warm up"}], 2)
    answers: list[Answer] = []

    async def conversation(c: int) -> None:
        history = [{"role": "system", "content": PREFIX}]
        for turn in range(4):
            history.append({"role": "user", "content": f"Conversation {c}, turn {turn}: " + user_text(c * 4 + turn)})
            answer = await chat(http, base, "gemma-a", history, 24)
            answers.append(answer)
            history.append({"role": "assistant", "content": answer.text or "..."})

    await asyncio.gather(*(conversation(c) for c in range(SIZE["conversations"])))
    return answers


SIDES = ("lanes", "lanes-4slots", "router")
TRACES = {"steady": steady, "mix": mix, "conversations": conversations}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


async def run_trace(side: Side, trace: str, http: aiohttp.ClientSession) -> dict:
    await side.start(http)
    watch = TreeWatch(side.proc.pid)
    stop = asyncio.Event()
    at_start = await asyncio.to_thread(watch.sample)
    watching = asyncio.create_task(watch.run(stop))
    extra: dict = {}
    try:
        began = time.perf_counter()
        answers = await (mix(http, side.base, extra) if trace == "mix" else TRACES[trace](http, side.base))
        wall = time.perf_counter() - began
    finally:
        stop.set()
        await watching
        side.stop()
    ok = [a for a in answers if a.ok]
    prompt = sum(a.prompt for a in ok)
    return {
        "side": side.name, "trace": trace, "answered": len(ok), "failed": len(answers) - len(ok),
        "errors": sorted({a.error or f"HTTP {a.status}" for a in answers if not a.ok})[:3],
        "ttft_p50_s": pct([a.ttft for a in ok], 0.5), "ttft_p95_s": pct([a.ttft for a in ok], 0.95),
        "output_tok_s": round(sum(a.output for a in ok) / wall, 1), "wall_s": round(wall, 1),
        "cached_ratio": round(sum(a.cached for a in ok) / prompt, 3) if prompt else None,
        "loads": len(watch.seen - at_start), "unloads": len(watch.gone),
        "peak_rss_mib": round(watch.peak_total / MIB), "peak_llama_rss_mib": round(watch.peak_servers / MIB),
        **extra,
    }  # fmt: skip


async def router_child_rss(binary: str, models: Path, work: Path, http: aiohttp.ClientSession) -> int:
    """Peak RSS of one router child with defaults after a request: what --models-max is sized by."""
    side = Side("router", binary, models, 0, 1, work)
    await side.start(http)
    try:
        watch = TreeWatch(side.proc.pid)
        await chat(http, side.base, "gemma-a", [{"role": "user", "content": PREFIX}], 8)
        await asyncio.to_thread(watch.sample)
        return watch.peak_servers
    finally:
        side.stop()


async def main(args: argparse.Namespace) -> list[dict]:
    binary = find_llama_server(None)
    work = Path(tempfile.mkdtemp(prefix="router-bench-"))
    models = work / "models"
    prepare_models(models, work / "demo")
    ram = parse_size(args.ram)
    rows = []
    async with aiohttp.ClientSession() as http:
        child = await router_child_rss(binary, models, work, http)
        models_max = max(1, int(ram // child))
        print(f"router child RSS {child / MIB:.0f} MiB: --models-max {models_max} for {args.ram}", flush=True)
        for n, trace in enumerate(args.traces):
            for name in (args.sides if n % 2 == 0 else args.sides[::-1]):
                row = await run_trace(Side(name, binary, models, ram, models_max, work, tuple(args.lanes_config)), trace, http)
                row["models_max"] = models_max if name == "router" else None
                print(json.dumps(row), flush=True)
                rows.append(row)
    shutil.rmtree(work, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    cols = ("trace", "side", "answered", "failed", "ttft_p50_s", "ttft_p95_s", "output_tok_s", "cached_ratio",
            "loads", "unloads", "peak_rss_mib", "peak_llama_rss_mib", "cold_ttft_s")  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join("" if row.get(c) is None else str(row[c]) for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ram", default="1.2GiB", help="memory both sides may use (lanes --max-ram)")
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES))
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    parser.add_argument("--lanes-config", nargs="*", default=[], metavar="KEY=VALUE",
                        help="lanes config set this on the lanes sides, e.g. min_residency=2")
    parser.add_argument("--small", action="store_true", help="a few requests per trace (tests)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.small:
        SIZE.update(steady=4, mix=4, conversations=2)
    rows = asyncio.run(main(args))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"ram": args.ram, "lanes_config": args.lanes_config, "rows": rows}, indent=1) + "\n")
