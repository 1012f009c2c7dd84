"""A gateway's own cost as the fleet in its view grows (issue 37 point 4): memory, a host's change,
routing decisions per second, and one probe round, at 100, 1,000 and 10,000 simulated hosts.

Run from the repository root:  .venv/bin/python bench/gateway_scale.py [--hosts 100 1000 10000] [--out F]

In process, no sockets: the same fleet as tests/test_fleet_pages.py (the planner's plans for
bench/planner_bench.py's hosts, three lanes each, every lane healthy), folded into a gateway's
FleetView and Admission as its KV watch would. Measured per fleet size:
- the memory the view and admission hold (tracemalloc, after the whole fleet is read);
- one host's status change: the KV entry folded in, then the next request's view of the
  lanes (the cost every status an agent puts brings each gateway);
- routing decisions per second for one model: acquire and release a slot, no prompt, as fast as
  the loop allows for 3 s (every lane of that model is a candidate);
- one probe round: how many lanes the gateway's own /health probe asks (GatewaySettings.probe_budget).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import msgspec  # noqa: E402

from gateway.admission.queue import Admission  # noqa: E402
from gateway.fleet.view import FleetView  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from shared import subjects  # noqa: E402
from shared.messages.wire import encode  # noqa: E402
from test_fleet_pages import _fleet  # noqa: E402


def entries(hosts: int) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
    """The fleet's KV entries (plans, statuses, reports), and one changed status per host."""
    fleet = _fleet(hosts)
    kv = [(subjects.plan_key(h), encode(p)) for h, p in fleet.plans.items()]
    kv += [(subjects.status_key(h), encode(s)) for h, s in fleet.statuses.items()]
    kv += [(subjects.report_key(h), encode(r)) for h, r in fleet.reports.items()]
    changed = [(subjects.status_key(h), encode(msgspec.structs.replace(s, lanes=tuple(
        msgspec.structs.replace(lane, rss_bytes=(lane.rss_bytes or 0) + 1) for lane in s.lanes))))
        for h, s in list(fleet.statuses.items())[:200]]  # fmt: skip
    return kv, changed


async def measure(hosts: int) -> dict:
    kv, changed = entries(hosts)
    tracemalloc.start()
    view = FleetView()
    admission = Admission(view)
    for key, value in kv:
        view.apply_entry(key, value)
    view.mark_synced()
    lanes = view.lanes()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    model = lanes[0].model
    per_change = []
    for key, value in changed:  # a status put, then the next request's look at the lanes
        began = time.perf_counter()
        view.apply_entry(key, value)
        view.routable(model)
        per_change.append(time.perf_counter() - began)
    decisions, began = 0, time.perf_counter()
    while time.perf_counter() - began < 3.0:
        lease = await admission.acquire(model)
        lease.release()
        decisions += 1
    rate = decisions / (time.perf_counter() - began)
    try:
        from gateway.fleet import this_round
    except ImportError:  # a gateway before the probe budget (the "before" side of a comparison) probes all
        probed = view.probe_targets()
    else:
        try:
            probed, _ = this_round(*view.probe_groups(), 0, GatewaySettings().probe_budget)
        except AttributeError:  # a gateway before the groups were kept with the view
            probed, _ = this_round(view.probe_targets(), lambda lane: bool(lane.unreachable), 0,
                                   GatewaySettings().probe_budget)  # fmt: skip
    return {"hosts": hosts, "lanes": len(lanes), "lanes_of_model": len(view.lanes_for(model)),
            "view_mib": round(held / 2**20, 1), "status_change_ms_p50": round(statistics.median(per_change) * 1e3, 3),
            "status_change_ms_p99": round(sorted(per_change)[int(0.99 * (len(per_change) - 1))] * 1e3, 3),
            "routing_decisions_per_s": round(rate, 1), "lanes_probed_per_round": len(probed)}  # fmt: skip


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, nargs="+", default=[100, 1000, 10_000])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for n in args.hosts:
        row = await measure(n)
        rows.append(row)
        print(f"{n:6d} hosts, {row['lanes']:6d} lanes ({row['lanes_of_model']} of one model): view {row['view_mib']} MiB, "
              f"a status change {row['status_change_ms_p50']} ms (p99 {row['status_change_ms_p99']}), "
              f"{row['routing_decisions_per_s']} routing decisions/s, {row['lanes_probed_per_round']} probes a round")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": f"{platform.machine()}, {platform.python_version()}",
                                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "command": "bench/gateway_scale.py " + " ".join(sys.argv[1:]),
                                        "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
