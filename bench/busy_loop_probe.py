"""How the real llama-server answers its endpoints while its inference loop is busy with a long prefill.

One lane of the real Gemma 3 270M file (the demo model), one slot. A long prompt is sent
as a stream; meanwhile /health, /props, /slots and /metrics are each asked every 0.1 s
(each on its own connection, a 60 s timeout) and every answer's latency is recorded by
phase: idle (before), prefill (sent, no token yet), generation (tokens flowing). The
largest latency of each endpoint per phase is what the gateway and the agent must allow
for before they call a lane stalled; whether an endpoint blocks at all decides which one
tells a stalled loop from a busy one.

    .venv/bin/python bench/busy_loop_probe.py [--prompt-tokens 6000] [--out bench/busy_loop.json]

The result is written as JSON (the figures tests/fake_llama_server.py repeats in its
'stall' mode: tests/llama_busy_loop.json) and summarised on stdout as a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lanes.demo_model import ensure_demo_model  # noqa: E402
from launcher_agent.probe import find_llama_server  # noqa: E402

ENDPOINTS = ("/health", "/props", "/slots", "/metrics")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _ask(http: aiohttp.ClientSession, url: str) -> tuple[float, int, object]:
    began = time.perf_counter()
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            body = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return time.perf_counter() - began, 0, None
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    return time.perf_counter() - began, status, data


async def measure(binary: str, model: Path, prompt_tokens: int, threads: int) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    ctx = 2 * prompt_tokens + 1024  # room for the tokenizer's count, whatever the words become
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx), "-np", "1",
            "--slots", "--metrics", "-t", str(threads), "--no-webui"]  # fmt: skip
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    phase = "starting"
    t0 = time.perf_counter()
    seen: dict[str, dict[str, list[float]]] = {}
    failed: dict[str, dict[str, int]] = {}
    slot_samples: list[dict] = []
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                _, status, _ = await _ask(http, base + "/health")
                if status == 200:
                    break
                if proc.poll() is not None:
                    raise SystemExit(f"llama-server exited: {Path(log.name).read_text()[-2000:]}")
                await asyncio.sleep(0.2)
            stop = asyncio.Event()

            async def poll(path: str) -> None:
                while not stop.is_set():
                    at = phase
                    took, status, data = await _ask(http, base + path)
                    seen.setdefault(path, {}).setdefault(at, []).append(took)
                    if status != 200:
                        failed.setdefault(path, {}).setdefault(at, 0)
                        failed[path][at] += 1
                    if path == "/slots" and isinstance(data, list) and data:
                        slot = data[0]
                        slot_samples.append({"phase": at, "took": round(took, 3),
                                             "is_processing": slot.get("is_processing"),
                                             "id_task": slot.get("id_task"), "at": round(time.perf_counter() - t0, 2),
                                             "n_prompt_tokens": slot.get("n_prompt_tokens"),
                                             "n_prompt_tokens_processed": slot.get("n_prompt_tokens_processed"),
                                             "next_token": slot.get("next_token"),
                                             "keys": sorted(slot),
                                             "slot": {k: v for k, v in slot.items() if k != "params"}})  # fmt: skip
                    await asyncio.sleep(0.1)

            phase = "idle"
            pollers = [asyncio.create_task(poll(p)) for p in ENDPOINTS]
            await asyncio.sleep(2)
            # A prompt of about `prompt_tokens` tokens, as the lane's own tokenizer counts them.
            words = " ".join(f"w{i % 997}" for i in range(prompt_tokens))
            async with http.post(base + "/tokenize", json={"content": words}) as resp:
                per_word = len((await resp.json())["tokens"]) / prompt_tokens
            words = " ".join(f"w{i % 997}" for i in range(int(prompt_tokens / per_word)))
            body = {"messages": [{"role": "user", "content": words + "\nSay ok."}], "stream": True,
                    "max_tokens": 64, "ignore_eos": True, "timings_per_token": True}  # fmt: skip
            phase = "prefill"
            sent = time.perf_counter()
            first = first_byte = None
            timings = None
            async with http.post(base + "/v1/chat/completions", json=body,
                                 timeout=aiohttp.ClientTimeout(total=1800)) as resp:  # fmt: skip
                headers_after = time.perf_counter() - sent
                if resp.status != 200:
                    raise SystemExit(f"the lane answered {resp.status}: {(await resp.text())[:500]}")
                async for line in resp.content:
                    if first_byte is None and line.strip():
                        first_byte = time.perf_counter() - sent
                    if line.startswith(b"data: ") and b"[DONE]" not in line:
                        chunk = json.loads(line[6:])
                        if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                            first = time.perf_counter() - sent
                            phase = "generation"
                        timings = chunk.get("timings") or timings
            done = time.perf_counter() - sent
            phase = "after"
            await asyncio.sleep(1)
            stop.set()
            await asyncio.gather(*pollers)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    table = {path: {at: {"n": len(v), "max_s": round(max(v), 3), "median_s": round(sorted(v)[len(v) // 2], 3),
                         "failed": failed.get(path, {}).get(at, 0)}
                    for at, v in phases.items()} for path, phases in seen.items()}  # fmt: skip
    return {
        "binary": version[:2],
        "machine": f"{platform.machine()} {platform.processor() or ''} threads={threads}".strip(),
        "model": model.name,
        "prompt_tokens": (timings or {}).get("prompt_n"),
        "prefill_tokens_per_second": round((timings or {}).get("prompt_per_second") or 0, 1),
        "n_batch": 2048,
        "headers_after_s": round(headers_after, 3),
        "first_token_s": round(first or 0, 3),
        "first_body_byte_s": round(first_byte or 0, 3),
        "answer_s": round(done, 3),
        "endpoints": table,
        "slot_fields": slot_samples[-1]["keys"] if slot_samples else [],
        "slot_samples": _spread([s for s in slot_samples if s["phase"] in ("prefill", "generation")], 40),
    }


def _spread(items: list, n: int) -> list:
    """n of the items, evenly spread from first to last."""
    if len(items) <= n:
        return items
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def _markdown(result: dict) -> str:
    lines = [f"llama-server {' '.join(result['binary'])}; {result['model']}; {result['machine']}; prompt "
             f"{result['prompt_tokens']} tokens at {result['prefill_tokens_per_second']} tok/s; "
             f"stream headers after {result['headers_after_s']} s, first body byte after "
             f"{result['first_body_byte_s']} s, first token after {result['first_token_s']} s", "",
             "| endpoint | idle: max s | prefill: max s (median) | generation: max s | failed |",
             "|---|---|---|---|---|"]
    for path in ENDPOINTS:
        row = result["endpoints"].get(path, {})
        cell = lambda at: row.get(at, {})  # noqa: E731
        lines.append(f"| {path} | {cell('idle').get('max_s', '-')} | {cell('prefill').get('max_s', '-')} "
                     f"({cell('prefill').get('median_s', '-')}) | {cell('generation').get('max_s', '-')} | "
                     f"{sum(v.get('failed', 0) for v in row.values())} |")  # fmt: skip
    return "\n".join(lines)


def fake_table(result: dict) -> dict:
    """What tests/fake_llama_server.py repeats: which endpoints waited for the loop during the prefill
    (their longest answer there at least 0.5 s and 5 times their longest idle one), with the figures."""
    by_loop, by_thread = [], []
    for path in ENDPOINTS:
        row = result["endpoints"].get(path, {})
        idle, prefill = row.get("idle", {}).get("max_s", 0), row.get("prefill", {}).get("max_s", 0)
        (by_loop if prefill >= 0.5 and prefill >= 5 * idle else by_thread).append(path)
    return {"answered_by_loop": by_loop, "answered_by_http_thread": by_thread,
            "recorded": {k: result[k] for k in ("binary", "machine", "model", "prompt_tokens",
                                                "prefill_tokens_per_second", "first_token_s")},
            "longest_answer_during_prefill_s": {p: result["endpoints"].get(p, {}).get("prefill", {}).get("max_s")
                                                for p in ENDPOINTS},
            # A busy slot as /slots showed it mid-prefill, between two batches: what a stuck loop leaves.
            "slot_during_prefill": next((s["slot"] for s in reversed(result["slot_samples"])
                                         if s["phase"] == "prefill" and s.get("slot")), None)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "busy_loop.json"))
    ap.add_argument("--llama-server")
    ap.add_argument("--fake-table", help="also write what the fake repeats (tests/llama_busy_loop.json)")
    args = ap.parse_args()
    binary = args.llama_server or find_llama_server()
    if binary is None:
        raise SystemExit("no llama-server: run `lanes install-llama`")
    model = ensure_demo_model(Path(tempfile.gettempdir()) / "lanes-demo-model")
    result = asyncio.run(measure(binary, model, args.prompt_tokens, args.threads))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.fake_table:
        Path(args.fake_table).write_text(json.dumps(fake_table(result), indent=1) + "\n")
    print(_markdown(result))


if __name__ == "__main__":
    main()
