"""Hostile clients against the gateway in front of the real llama-server, for a bounded time.

Run from the repository root:  .venv/bin/python bench/hostile_clients.py [--small] [--out bench/hostile_results.md]

Everything is real (bench/gateway_bench.py's fleet): a nats-server, the planner and one agent in
this process running a real llama-server lane of Gemma 3 270M Q4_K_M, and `lanes gateway` as
its own process with a keys file (two tenants and an operator). Each case below is sent; what
is recorded is the answer (the status and the error code), how long the gateway took to give it
(or to drop the connection), and, around all of them, the gateway's RSS at the start and end
and whether the lane stayed healthy and still answers. A case passes when its answer is a 4xx
with a reason, a 503 with Retry-After, a 200 where the request was in fact fine, or, for a
connection that never completes its request, the connection closed by the gateway; never any
other 5xx and never a hang past the case's time.

The cases: a body over --max-body; a header over aiohttp's 8 KiB field limit; headers sent one
byte a second (slowloris) and a body sent one byte a second; invalid JSON; invalid UTF-8; huge
max_tokens, n_probs, n and logit_bias; model names with control characters, a path and 10,000
characters; 1,000 idle connections held open (then a real request must still be served); a
tenant asking for another tenant's adapter, a tenant's key at /metrics, and no key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_bench import ALIAS, Fleet  # noqa: E402

from launcher_agent.probe import find_llama_server  # noqa: E402

OPS, ALPHA, BETA = "sk-hostile-ops-000001", "sk-hostile-alpha-0001", "sk-hostile-beta-00001"
KEYS_FILE = f"""
[[keys]]
key = "{OPS}"
tenant = "operator"
role = "ops"

[[keys]]
key = "{ALPHA}"
tenant = "alpha"
models = ["{ALIAS}"]

[[keys]]
key = "{BETA}"
tenant = "beta"
models = ["{ALIAS}", "{ALIAS}:beta-style"]
"""
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Say hi."}]


def _body(**fields) -> bytes:
    return json.dumps({"model": ALIAS, "messages": MESSAGES, "max_tokens": 4, **fields}).encode()


async def _raw(port: int, data: bytes, drip: bytes = b"", every: float = 1.0, limit: float = 20.0) -> dict:
    """Send `data`, then `drip` one byte per `every` seconds; what came back and when, or that
    the gateway closed the connection, within `limit` seconds."""
    began = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answer = b""
    try:
        writer.write(data)
        await writer.drain()
        for byte in drip:
            if time.monotonic() - began > limit:
                break
            try:
                answer = await asyncio.wait_for(reader.read(65536), every)
            except asyncio.TimeoutError:
                answer = b""
            if answer or reader.at_eof():
                break
            writer.write(bytes([byte]))
            await writer.drain()
        if not answer:
            try:
                answer = await asyncio.wait_for(reader.read(65536), max(0.1, limit - (time.monotonic() - began)))
            except asyncio.TimeoutError:
                pass
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    took = time.monotonic() - began
    head = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    status = int(head.split()[1]) if head.startswith("HTTP/") and len(head.split()) > 1 else None
    closed = not answer and took < limit
    return {"status": status, "code": _code(answer), "seconds": round(took, 2), "closed": closed}


def _code(raw: bytes) -> str:
    _, _, body = raw.partition(b"\r\n\r\n")
    try:
        error = json.loads(body).get("error", {})
        return str(error.get("code") or error.get("type") or "")
    except (ValueError, AttributeError):
        return body[:60].decode(errors="replace").strip()


async def _post(http: aiohttp.ClientSession, url: str, data: bytes, key: str | None, path: str = CHAT) -> dict:
    began = time.monotonic()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        async with http.post(url + path, data=data, headers=headers) as resp:
            text = await resp.text()
            try:
                error = json.loads(text).get("error") or {}
            except (ValueError, AttributeError):
                error = {}
            return {"status": resp.status, "code": str(error.get("code") or error.get("type") or ""),
                    "retry_after": resp.headers.get("Retry-After"), "seconds": round(time.monotonic() - began, 2)}  # fmt: skip
    except aiohttp.ClientError as exc:
        return {"status": None, "code": type(exc).__name__, "seconds": round(time.monotonic() - began, 2)}


def _ok(result: dict, expect: str) -> bool:
    status = result.get("status")
    if expect == "closed":
        return result.get("closed", False) or (status is not None and 400 <= status < 500)
    if status is None:
        return False
    if status == 503:
        return bool(result.get("retry_after"))
    if expect == "200":
        return status == 200
    return 400 <= status < 500


async def run(small: bool) -> dict:
    llama = find_llama_server()
    if llama is None:
        raise SystemExit("no llama-server: run `lanes install-llama`")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))  # this client holds 1,000 sockets
    # The drips outlast the gateway's --client-timeout (30 s by default; 3 s in the small run).
    idle_count, drip_limit, client_timeout = (200, 8.0, 3.0) if small else (1000, 40.0, 30.0)
    with tempfile.TemporaryDirectory(prefix="lanes-hostile-") as tmp:
        keys = Path(tmp) / "keys.toml"
        keys.write_text(KEYS_FILE)
        fleet = Fleet(Path(tmp), llama, small=True,
                      gateway_args=("--keys-file", str(keys), "--client-timeout", str(client_timeout)),
                      headers={"Authorization": f"Bearer {OPS}"})  # fmt: skip
        await fleet.start()
        try:
            await fleet.demand(1)
            gateway = psutil.Process(fleet.gateway.pid)
            port = int(fleet.gateway_url.rsplit(":", 1)[1])
            url = fleet.gateway_url
            rss_start = gateway.memory_info().rss
            results: list[dict] = []

            async def case(name: str, expect: str, result: dict) -> None:
                result.update(case=name, expect=expect, ok=_ok(result, expect))
                results.append(result)
                print(f"{name:34} {result}", file=sys.stderr, flush=True)

            connector = aiohttp.TCPConnector(limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
                await case("normal request", "200", await _post(http, url, _body(), ALPHA))
                await case("body over --max-body (17 MiB)", "4xx",
                           await _post(http, url, _body(pad="x" * (17 * 2**20)), ALPHA))
                head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALPHA}\r\n"
                        f"X-Big: {'h' * 64 * 1024}\r\nContent-Length: 2\r\n\r\n{{}}").encode()  # fmt: skip
                await case("header of 64 KiB", "4xx", await _raw(port, head, limit=10))
                start = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n".encode()
                await case(f"slow headers (1 byte/s; --client-timeout {client_timeout:g})", "closed",
                           await _raw(port, start, drip=b"X-Slow: " + b"a" * 200, limit=drip_limit))
                body = _body()
                head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALPHA}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
                await case(f"slow body (1 byte/s; --client-timeout {client_timeout:g})", "closed",
                           await _raw(port, head, drip=body, limit=drip_limit))
                await case("invalid JSON", "4xx", await _post(http, url, b'{"model": "chat", "messages": [', ALPHA))
                await case("invalid UTF-8", "4xx", await _post(http, url, b'{"model": "chat\xff\xfe"}', ALPHA))
                await case("max_tokens 10**12", "4xx", await _post(http, url, _body(max_tokens=10**12), ALPHA))
                await case("max_tokens 2**31-1 (bounded by the window)", "200",
                           await _post(http, url, _body(max_tokens=2**31 - 1, temperature=0,
                                                        messages=[{"role": "user", "content": "Count to 5."}]), ALPHA))
                await case("n_probs 1,000,000", "4xx", await _post(http, url, _body(n_probs=10**6), ALPHA))
                await case("n 1000", "4xx", await _post(http, url, _body(n=1000), ALPHA))
                await case("logit_bias of 100,000 entries", "4xx",
                           await _post(http, url, _body(logit_bias={str(i): 1 for i in range(100_000)}), ALPHA))
                for label, name in (("control characters", "chat\x00\x1b[2J"), ("a path", "../../../etc/passwd"),
                                    ("10,000 characters", "m" * 10_000)):  # fmt: skip
                    await case(f"model name: {label}", "4xx",
                               await _post(http, url, json.dumps({"model": name, "messages": MESSAGES}).encode(), ALPHA))
                await case("another tenant's adapter", "4xx",
                           await _post(http, url, json.dumps({"model": f"{ALIAS}:beta-style", "messages": MESSAGES}).encode(),
                                       ALPHA))  # fmt: skip
                await case("no key", "4xx", await _post(http, url, _body(), None))
                async with http.get(url + "/metrics", headers={"Authorization": f"Bearer {ALPHA}"}) as resp:
                    await case("a tenant's key at /metrics", "4xx", {"status": resp.status, "code": "", "seconds": 0})

                # Idle connections: held open, then a real request must still be served.
                idle = []
                began = time.monotonic()
                for _ in range(idle_count):
                    sock = socket.create_connection(("127.0.0.1", port))
                    idle.append(sock)
                opened = time.monotonic() - began
                await asyncio.sleep(2.0)
                rss_idle = gateway.memory_info().rss
                served = await _post(http, url, _body(), ALPHA)
                served["seconds_to_open"] = round(opened, 2)
                await case(f"{idle_count} idle connections, then a request", "200", served)
                for sock in idle:
                    sock.close()
                await asyncio.sleep(1.0)
                after = await _post(http, url, _body(), ALPHA)
                await case("a request after all of it", "200", after)
            lanes = await fleet.lanes()
            rss_end = gateway.memory_info().rss
            return {
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                           f"Python {platform.python_version()}",
                "when": time.strftime("%Y-%m-%d %H:%M"),
                "cases": results,
                "gateway_rss_mib": {"start": round(rss_start / 2**20, 1), f"{idle_count} idle": round(rss_idle / 2**20, 1),
                                    "end": round(rss_end / 2**20, 1)},  # fmt: skip
                "lanes_healthy_at_end": len(lanes),
                "gateway_alive": fleet.gateway.poll() is None,
            }
        finally:
            await fleet.close()


def markdown(r: dict) -> str:
    lines = [
        "## Hostile clients (`bench/hostile_clients.py`)", "",
        f"{r['machine']}, {r['when']}. Command: `.venv/bin/python bench/hostile_clients.py --out bench/hostile_results.md`",
        "", "| case | answer | code | seconds | as it should be |", "|---|---|---|---|---|",
    ]  # fmt: skip
    for c in r["cases"]:
        answer = c["status"] if c.get("status") is not None else ("closed by the gateway" if c.get("closed") else "none")
        lines.append(f"| {c['case']} | {answer} | {c.get('code', '')} | {c['seconds']} | {'yes' if c['ok'] else 'NO'} |")
    rss = ", ".join(f"{k} {v} MiB" for k, v in r["gateway_rss_mib"].items())
    lines += ["", f"Gateway RSS: {rss}. Lanes healthy at the end: {r['lanes_healthy_at_end']}; "
              f"the gateway still running: {r['gateway_alive']}.", ""]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="200 idle connections, --client-timeout 3 (tests)")
    parser.add_argument("--out", help="write the results as Markdown here (and JSON beside it)")
    args = parser.parse_args()
    result = asyncio.run(run(args.small))
    text = markdown(result)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    failed = [c["case"] for c in result["cases"] if not c["ok"]]
    if failed or not result["lanes_healthy_at_end"] or not result["gateway_alive"]:
        print(f"not as it should be: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
