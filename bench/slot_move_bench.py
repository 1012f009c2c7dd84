"""Moving a conversation's KV to another lane through NATS against prefilling it again (issue 33, point 7).

Run from the repository root:  .venv/bin/python bench/slot_move_bench.py [--tokens 4096] [--runs 3]
                                                                       [--out bench/slot_move_results.json]

Two real llama-server lanes of Gemma 3 270M Q4_K_M (the demo model, --swa-full so a slot file
reads back whole, one slot, one thread each) and one nats-server with JetStream. A prompt of
about `--tokens` tokens is prefilled on lane A; then, timed: A saves the slot to its file
(`/slots/0?action=save`), the file goes through NATS (a JetStream stream, 512 KiB messages on
the lane's own subject, published with acknowledgement, read back by direct get, as a
receiving agent whose NATS user may create no consumer would), and lane B restores it
(`action=restore`). Then the conversation's next turn on B, against the same turn on a lane
C that holds nothing (the full prefill a move saves). Medians of `--runs`, one machine.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402
import nats  # noqa: E402
from nats.js.api import StorageType, StreamConfig  # noqa: E402

from fixtures_bus import free_port_base  # noqa: E402
from lanes.demo_model import ensure_demo_model  # noqa: E402
from launcher_agent.probe import find_llama_server  # noqa: E402
from shared.natsserver import NatsServer  # noqa: E402

CHUNK = 512 * 1024
STREAM, SUBJECT = "LANES_SLOTS", "lanes.slots"
WORDS = "lane slot cache prompt token model fleet agent planner gateway restart budget host move".split()


def prompt_of(tokens: int) -> str:
    # Gemma's tokenizer: about one token per common English word and its space.
    return " ".join(WORDS[i % len(WORDS)] + str(i % 7) for i in range(int(tokens / 2.0)))


def start_lane(binary: str, model: Path, port: int, slots: Path, log) -> subprocess.Popen:
    slots.mkdir(parents=True, exist_ok=True)
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "8192", "--parallel", "1",
            "--swa-full", "--slot-save-path", str(slots), "-t", "1", "-tb", "1", "--no-warmup"]  # fmt: skip
    return subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)


async def wait_up(http: aiohttp.ClientSession, port: int) -> None:
    for _ in range(600):
        try:
            async with http.get(f"http://127.0.0.1:{port}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit(f"lane on port {port} did not come up")


async def post(http: aiohttp.ClientSession, port: int, path: str, body: dict) -> dict:
    async with http.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=aiohttp.ClientTimeout(total=900)) as r:
        answer = await r.json()
        if r.status != 200:
            raise SystemExit(f"{path} on {port}: {r.status} {answer}")
        return answer


async def turn(http, port: int, prompt: str) -> tuple[int, int, float]:
    """(tokens prefilled, tokens from cache, seconds)."""
    began = time.perf_counter()
    a = await post(http, port, "/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True})
    return a["timings"]["prompt_n"], a["timings"]["cache_n"], time.perf_counter() - began


async def ship(js, source: Path, target: Path, name: str) -> int:
    """The file through NATS: published in chunks on its own subject, read back by direct get."""
    data = source.read_bytes()
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    for n, chunk in enumerate(chunks):
        await js.publish(f"{SUBJECT}.a.{name}.{n}", chunk, stream=STREAM)
    got = bytearray()
    for n in range(len(chunks)):
        msg = await js.get_msg(STREAM, subject=f"{SUBJECT}.a.{name}.{n}", direct=True)
        got += msg.data
    target.write_bytes(bytes(got))
    return len(chunks)


async def main_async(args) -> dict:
    binary = find_llama_server()
    if binary is None:
        raise SystemExit("no llama-server: run `lanes install-llama`")
    model = ensure_demo_model(Path(tempfile.gettempdir()) / "lanes-demo-model")
    work = Path(tempfile.mkdtemp(prefix="slot-move-"))
    server = NatsServer(work / "nats").start()
    base = free_port_base()
    log = open(work / "lanes.log", "ab")
    lanes = {name: start_lane(binary, model, base + i, work / name, log) for i, name in enumerate("ABC")}
    ports = {name: base + i for i, name in enumerate("ABC")}
    nc = await nats.connect(server.url, max_reconnect_attempts=0)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[f"{SUBJECT}.>"], storage=StorageType.FILE,
                                     allow_direct=True, max_msg_size=CHUNK + 1024))  # fmt: skip
    runs = []
    try:
        async with aiohttp.ClientSession() as http:
            for port in ports.values():
                await wait_up(http, port)
            for run in range(args.runs):
                prompt = prompt_of(args.tokens) + f" run {run}"
                prefilled, _, first = await turn(http, ports["A"], prompt)
                name = f"conv{run}"
                began = time.perf_counter()
                saved = await post(http, ports["A"], "/slots/0?action=save", {"filename": f"{name}.slot"})
                t_save = time.perf_counter() - began
                began = time.perf_counter()
                chunks = await ship(js, work / "A" / f"{name}.slot", work / "B" / f"{name}.slot", name)
                t_ship = time.perf_counter() - began
                began = time.perf_counter()
                restored = await post(http, ports["B"], "/slots/0?action=restore", {"filename": f"{name}.slot"})
                t_restore = time.perf_counter() - began
                follow = prompt + " and the next message of the conversation"
                moved_n, moved_cached, t_moved = await turn(http, ports["B"], follow)
                cold_n, cold_cached, t_cold = await turn(http, ports["C"], follow)
                runs.append({"tokens": prefilled, "file_bytes": (work / "A" / f"{name}.slot").stat().st_size,
                             "chunks": chunks, "n_saved": saved["n_saved"], "n_restored": restored["n_restored"],
                             "first_prefill_s": first, "save_s": t_save, "nats_s": t_ship, "restore_s": t_restore,
                             "move_s": t_save + t_ship + t_restore, "moved_turn_s": t_moved,
                             "moved_cached": moved_cached / (moved_n + moved_cached), "cold_turn_s": t_cold,
                             "cold_cached": cold_cached / (cold_n + cold_cached)})  # fmt: skip
                for lane in "ABC":  # each run starts from empty slots
                    await post(http, ports[lane], "/slots/0?action=erase", {})
                print(json.dumps(runs[-1]), flush=True)
    finally:
        await nc.close()
        for p in lanes.values():
            p.terminate()
            p.wait()
        server.stop()
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"runs": runs, "median": med, "machine": f"{platform.machine()} {platform.node()}", "model": model.name,
            "command": "bench/slot_move_bench.py " + " ".join(sys.argv[1:])}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "slot_move_results.json"))
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    m = result["median"]
    print(f"{m['tokens']:.0f} tokens, {m['file_bytes'] / 2**20:.1f} MiB: move {m['move_s']:.2f} s (save {m['save_s']:.2f}, "
          f"NATS {m['nats_s']:.2f}, restore {m['restore_s']:.2f}); next turn moved {m['moved_turn_s']:.2f} s "
          f"(cached {m['moved_cached']:.3f}) against {m['cold_turn_s']:.2f} s cold (cached {m['cold_cached']:.3f})")  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
