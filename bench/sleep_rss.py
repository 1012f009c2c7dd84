"""Does a sleeping llama-server give its memory back? (issue 16, must-have 4)

Starts the real llama-server on the real Gemma 3 270M file with `--sleep-idle-seconds`, serves
one request, waits past the sleep, and reads the process's memory with psutil at each step:
RSS, USS (its private pages: what another lane could really get back) and the swap-free
anonymous part. Then one more request, timed (the wake-up cost), and the memory again.

    .venv/bin/python bench/sleep_rss.py [--sleep 3] [--ctx 8192] [--no-mmap] [--poll /health,/slots]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from lanes.demo_model import ensure_demo_model
from launcher_agent.probe import find_llama_server

MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


def chat(base: str) -> float:
    body = json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        r.read()
    return time.perf_counter() - started


def memory(proc: psutil.Process) -> dict[str, float]:
    full = proc.memory_full_info()
    return {"rss_mib": round(full.rss / MIB, 1), "uss_mib": round(full.uss / MIB, 1),
            "shared_mib": round(full.shared / MIB, 1)}  # fmt: skip


def sleeping(base: str) -> bool | None:
    try:
        return get(base + "/props")[1].get("is_sleeping")
    except Exception:
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sleep", type=float, default=3.0)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--no-mmap", action="store_true", help="-lm none (this build has no --no-mmap)")
    ap.add_argument("--poll", default="", help="paths to read every 0.5 s while idle, as lanes does: /health,/slots")
    args = ap.parse_args()
    model = ensure_demo_model(Path(tempfile.gettempdir()) / "lanes-sleep-bench")
    binary = find_llama_server()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(args.ctx),
            "-np", "1", "--sleep-idle-seconds", str(int(args.sleep))]  # fmt: skip
    if args.no_mmap:
        argv += ["-lm", "none"]
    log = open(Path(tempfile.gettempdir()) / "lanes-sleep-bench.log", "w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    proc = psutil.Process(server.pid)
    rows = []
    try:
        started = time.perf_counter()
        while True:
            try:
                if get(base + "/health", 1)[0] == 200:
                    break
            except Exception:
                pass
            if server.poll() is not None:
                raise SystemExit(f"llama-server exited {server.returncode}")
            time.sleep(0.1)
        load_s = time.perf_counter() - started
        rows.append(("loaded", memory(proc), sleeping(base), round(load_s, 2)))
        rows.append(("after one request", memory(proc), sleeping(base), round(chat(base), 2)))
        idle_until = time.monotonic() + args.sleep + 3.0
        while time.monotonic() < idle_until:
            if args.poll:
                for path in args.poll.split(","):
                    try:
                        get(base + path, 2)
                    except Exception:
                        pass
            time.sleep(0.5)
        rows.append((f"{args.sleep + 3:g} s idle", memory(proc), sleeping(base), None))
        wake_s = round(chat(base), 2)
        rows.append(("woken by a request", memory(proc), sleeping(base), wake_s))
    finally:
        server.terminate()
        server.wait(30)
    print(f"model {model.name} ({model.stat().st_size / MIB:.0f} MiB), -c {args.ctx}, "
          f"--sleep-idle-seconds {int(args.sleep)}{' --no-mmap' if args.no_mmap else ''}"
          f"{f', {args.poll} read every 0.5 s' if args.poll else ''}")  # fmt: skip
    print("| step | RSS MiB | USS MiB | shared MiB | is_sleeping | seconds |")
    print("|---|---|---|---|---|---|")
    for step, mem, asleep, secs in rows:
        print(f"| {step} | {mem['rss_mib']} | {mem['uss_mib']} | {mem['shared_mib']} | {asleep} | "
              f"{'' if secs is None else secs} |")  # fmt: skip


if __name__ == "__main__":
    main()
