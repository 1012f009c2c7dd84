"""The dashboard of a 10,000-host fleet in a real browser (issue 37 point 2): first paint, a search,
the page's heap, the state's size.

Run from the repository root:  .venv/bin/python bench/dashboard_scale.py [--hosts 10000] [--runs 3] [--out F]

A gateway whose view holds the simulated fleet of tests/test_fleet_pages.py (3 lanes a host, every
lane healthy), served in process with its dashboard's push loop; headless Chromium (Debian's, as
tests/test_dashboard_browser.py uses it) opens /dashboard/. Per run: seconds from navigation to the
summary and the first 50 hosts drawn, seconds from typing a host's name to that host alone on the
page, and the page's used JS heap. Targets (issue 37): first paint under 2 s, a filtered view under 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import aiohttp  # noqa: E402
from aiohttp.test_utils import TestServer  # noqa: E402
from playwright.async_api import async_playwright, expect  # noqa: E402

from gateway.service import Gateway  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from shared import subjects  # noqa: E402
from shared.messages.wire import encode  # noqa: E402
from test_fleet_pages import _fleet  # noqa: E402

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
         "--disable-background-networking", "--disable-component-update"]  # fmt: skip


async def one(browser, base: str, hosts: int, last: str) -> dict:
    page = await browser.new_page()
    began = time.perf_counter()
    await page.goto(base)
    await expect(page.locator("#summary")).to_contain_text(f"{hosts} hosts", timeout=30_000)
    await expect(page.locator("#hosts .host")).to_have_count(min(50, hosts), timeout=30_000)
    first_paint = time.perf_counter() - began
    began = time.perf_counter()
    await page.fill("#filter-host", last)
    await expect(page.locator(f'#hosts .host[data-host="{last}"]')).to_have_count(1, timeout=30_000)
    await expect(page.locator("#hosts .host")).to_have_count(1, timeout=30_000)
    filtered = time.perf_counter() - began
    heap = await page.evaluate("performance.memory.usedJSHeapSize")
    await page.close()
    return {"first_paint_s": round(first_paint, 3), "filtered_s": round(filtered, 3), "heap_mib": round(heap / 2**20, 2)}


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("no chromium: scripts/test installs Debian's chromium package", file=sys.stderr)
        return 1
    fleet = _fleet(args.hosts)
    gw = Gateway(GatewaySettings(port=0))
    for table, key in ((fleet.plans, subjects.plan_key), (fleet.statuses, subjects.status_key),
                       (fleet.reports, subjects.report_key)):  # fmt: skip
        for host, msg in table.items():
            gw.view.apply_entry(key(host), encode(msg))
    gw.view.mark_synced()
    stop = asyncio.Event()
    pushing = asyncio.create_task(gw.dashboard.run(stop))
    server = TestServer(gw.app, host="127.0.0.1")
    await server.start_server()
    base = str(server.make_url("/dashboard/"))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "api/state", timeout=aiohttp.ClientTimeout(total=60)) as resp:
                state_bytes = len(await resp.read())
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=chromium, args=FLAGS)
            runs = [await one(browser, base, args.hosts, sorted(fleet.plans)[-1]) for _ in range(args.runs)]
            await browser.close()
    finally:
        stop.set()
        await pushing
        await server.close()
    row = {"hosts": args.hosts, "state_kib": round(state_bytes / 1024, 1), "runs": runs,
           "first_paint_s_median": statistics.median(r["first_paint_s"] for r in runs),
           "filtered_s_median": statistics.median(r["filtered_s"] for r in runs),
           "heap_mib_median": statistics.median(r["heap_mib"] for r in runs)}  # fmt: skip
    print(f"{args.hosts} hosts: first paint {row['first_paint_s_median']} s, a search {row['filtered_s_median']} s, "
          f"heap {row['heap_mib_median']} MiB, state {row['state_kib']} KiB (runs: {runs})")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": f"{platform.machine()}, {platform.python_version()}",
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "command": "bench/dashboard_scale.py " + " ".join(sys.argv[1:]),
                                        "row": row}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
