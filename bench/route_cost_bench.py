"""What routing by tokens adds to a request's first byte: the gateway's own work per request,
in process, no sockets (the rest of the gateway's added time is HTTP and the event loop).

Run from the repository root:  .venv/bin/python bench/route_cost_bench.py [--prompt-chars 6000] [--requests 2000]

Two lanes of two slots; a trace of 64 conversations, each turn's prompt the last one plus a
turn; per request: render nothing (the prompt text is given), hash it (fingerprint), choose
and take a lane (Admission.acquire: the index match, the cost of each lane), record it in the
index, publish nothing (the shared view's outbox is one put_nowait), release. Median and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from gateway.admission.queue import Admission  # noqa: E402
from gateway.routing.chunks import fingerprint  # noqa: E402
from gateway.fleet.view import FleetView  # noqa: E402
from test_gateway_core import healthy, put_plan, put_status, spec  # noqa: E402


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-chars", type=int, default=6000)
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    view = FleetView()
    put_plan(view, "h", spec("a", "m", parallel=2, port=1), spec("b", "m", parallel=2, port=2))
    put_status(view, "h", healthy("a", 1), healthy("b", 2))
    admission = Admission(view)
    texts = [f"conversation {c} " + "x" * args.prompt_chars for c in range(64)]
    took = []
    for i in range(args.requests):
        c = i % 64
        texts[c] += f" turn {i}: a question and its answer " * 4
        began = time.perf_counter()
        mark = fingerprint("m", texts[c])
        lease = await admission.acquire("m", prompt=mark)
        took.append(time.perf_counter() - began)
        lease.prefilled()
        lease.release()
        admission.measured(lease, len(texts[c]) // 4, len(texts[c]) // 4 - 100)
    took.sort()
    print(f"{args.requests} requests, prompts of {args.prompt_chars}+ characters: routing per request "
          f"p50 {statistics.median(took) * 1e6:.0f} us, p90 {took[int(0.9 * len(took))] * 1e6:.0f} us, "
          f"p99 {took[int(0.99 * len(took))] * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
