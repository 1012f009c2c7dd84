"""Models on demand: how many loads a trace costs with lanes' eviction rule against evict-oldest.

A simulation on the real planner code: `planner_svc.demand.plan_on_demand` (the planner's own
placement, memory model and eviction) is run on a simulated clock over one request trace twice,
once with `planner_svc.eviction.choose` and once with evict-oldest-on-demand (the idle lane
loaded longest ago goes first, whatever its size, priority or last use; LocalAI's and Ollama's
family of rules). Six models whose lanes need about twice the fleet's memory, two hosts, an
interleaved trace (A B A A C A B C ... with a rotating hot set) with concurrent streams. A load
takes its file size over 200 MiB/s; a request waits while its model loads or waits for room.

What it counts: loads, streams whose lane was taken away while they ran (aborted: must be 0),
failed wakes, and the p50/p95 wait a request spent before its lane was ready. No llama-server
runs: this measures the decisions, not load times (bench/RESULTS.md says so).

    .venv/bin/python bench/demand_bench.py [--requests 300] [--seed 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from planner_svc.demand import plan_on_demand  # noqa: E402
from planner_svc.demand_state import DemandState  # noqa: E402
from planner_svc.eviction import Candidate, NoRoom, Placement, covers, deficit  # noqa: E402
from shared.messages.activity import GatewayActivity, ModelActivity  # noqa: E402
from shared.messages.config import Demand, FleetConfig, Persona  # noqa: E402
from shared.messages.hosts import HostReport, ModelFacts, ServerCaps  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
RATE = 200 * MIB  # bytes per second a load reads
STEP = 0.25  # seconds of simulated time per step


def facts(name: str, weight_gib: float, n_layer: int = 16) -> ModelFacts:
    w = int(weight_gib * GIB)
    return ModelFacts(path=f"/models/{name}.gguf", name=name, architecture="llama", n_layer=n_layer, n_embd=2048,
                      n_head=32, n_head_kv=(8,) * n_layer, head_dim_k=64, head_dim_v=64, n_ctx_train=131072,
                      n_vocab=128256, n_ff=8192, weight_bytes=w, file_bytes=w + 4 * MIB)  # fmt: skip


MODELS = {"A": 0.5, "B": 0.5, "C": 1.0, "D": 0.5, "E": 1.0, "F": 0.5}  # GiB of weights


def fleet() -> list[HostReport]:
    models = tuple(facts(n, w) for n, w in MODELS.items())
    # Budget per host (RAM less headroom) 1.35 GiB: the two hold half of what the six lanes need.
    return [HostReport(host_id=h, cpu_cores=8, ram_total=4 * GIB, ram_available=int(2.05 * GIB), server=ServerCaps(),
                       models=models) for h in ("h1", "h2")]  # fmt: skip


def trace(n: int, seed: int) -> list[tuple[float, str, float]]:
    """(arrival, model, seconds it streams): A B A A C A B C ..., the hot model changing every 60 requests."""
    rng = random.Random(seed)
    names = list(MODELS)
    out, t = [], 0.0
    pattern = "ABAACABC"
    for i in range(n):
        shift = (i // 60) % len(names)
        if rng.random() < 0.7:
            name = names[(names.index(pattern[i % len(pattern)]) + shift) % len(names)]
        else:
            name = rng.choice(names)
        t += rng.expovariate(1 / 1.2)
        out.append((round(t, 2), name, round(rng.uniform(1.0, 6.0), 2)))
    return out


def evict_oldest(rooms, candidates, *, now: float, min_residency: float, **_):
    """The baseline: on the first host that can take the lane, the idle lanes loaded longest ago go
    first until enough is free (no regard to size, priority, last use or residency)."""
    possible = [r for r in rooms if r.needs is not None]
    if not possible:
        return NoRoom("cannot be placed", failed=True)
    for room in possible:
        if not deficit(room):
            return Placement(room.host_id, ())
    for room in possible:
        need = deficit(room)
        idle = sorted((c for c in candidates if c.host_id == room.host_id and not c.busy), key=lambda c: c.loaded_at)
        taken: list[Candidate] = []
        for c in idle:
            taken.append(c)
            if covers(taken, need):
                return Placement(room.host_id, tuple(c.key for c in taken))
    return NoRoom("no room")


class Sim:
    def __init__(self, chooser, config: FleetConfig) -> None:
        self.chooser, self.config = chooser, config
        self.reports = fleet()
        self.demand = Demand(personas=tuple(Persona(model=n, ctx_min=4096, ctx_max=4096) for n in MODELS))
        self.state = DemandState()
        self.plans: dict = {}
        self.ready_at: dict[tuple[str, str], float] = {}
        self.loads = self.aborted = self.failed = 0
        self.waits: list[float] = []
        self.running: list[tuple[float, str, tuple[str, str]]] = []  # (ends, model, lane)
        self.last: dict[str, float] = {}

    def lanes_of(self, name: str) -> list[tuple[str, str]]:
        return [(h, s.lane_id) for h, p in self.plans.items() for s in p.lanes if s.alias == name]

    def replan(self, now: float, waiting: list) -> None:
        busy: dict[str, int] = {}
        for _, name, _ in self.running:
            busy[name] = busy.get(name, 0) + 1
        queued: dict[str, int] = {}
        for _, name, _ in waiting:
            queued[name] = queued.get(name, 0) + 1
        act = GatewayActivity(gateway="sim", interval=1e9, models=tuple(
            ModelActivity(name=n, in_flight=busy.get(n, 0), queued=queued.get(n, 0),
                          idle_s=max(0.0, now - self.last[n]) if n in self.last else None) for n in MODELS))  # fmt: skip
        self.state, _ = self.state.note_activity(act, now)
        self.state = self.state.expire(now)
        fleet, outcome = plan_on_demand(self.reports, self.config, self.demand, self.state, now=now,
                                        previous=self.plans, chooser=self.chooser)  # fmt: skip
        self.state = self.state.apply(outcome, now)
        self.failed += len(outcome.failed)
        before = set(self.ready_at)
        self.plans = {h.host_id: h for h in fleet.hosts}
        self.state = self.state.forget_lanes(self.plans)
        now_lanes = {(h, s.lane_id): s for h, p in self.plans.items() for s in p.lanes}
        for key, spec in now_lanes.items():
            if key not in before:
                size = next(m.file_bytes for m in self.reports[0].models if m.name == spec.model)
                self.ready_at[key] = now + size / RATE
                self.loads += 1
        for key in before - set(now_lanes):
            del self.ready_at[key]
        for ends, name, lane in list(self.running):
            if lane not in now_lanes:
                self.aborted += 1
                self.running.remove((ends, name, lane))

    def run(self, requests: list[tuple[float, str, float]]) -> dict:
        pending = list(requests)
        waiting: list[tuple[float, str, float]] = []
        t, next_idle_check = 0.0, 0.0
        self.replan(0.0, [])
        while pending or waiting or self.running:
            self.running = [r for r in self.running if r[0] > t]
            for (host, lane), at in self.ready_at.items():
                if at <= t:
                    self.state = self.state.note_healthy(host, [lane], at)
            while pending and pending[0][0] <= t:
                waiting.append(pending.pop(0))
            woke = False
            for req in list(waiting):
                arrival, name, seconds = req
                ready = [k for k in self.lanes_of(name) if self.ready_at.get(k, 1e18) <= t]
                if ready:
                    lane = min(ready, key=lambda k: sum(1 for r in self.running if r[2] == k))
                    self.running.append((t + seconds, name, lane))
                    self.waits.append(t - arrival)
                    self.last[name] = t
                    waiting.remove(req)
                elif not self.lanes_of(name):
                    self.state, _ = self.state.note_wake(name, t)
                    woke = True
            if woke or t >= next_idle_check:
                self.replan(t, waiting)
                next_idle_check = t + 5.0
            t += STEP
            if t > requests[-1][0] + 3600:
                raise RuntimeError("the trace did not drain")
        waits = sorted(self.waits)
        pct = lambda q: round(waits[min(len(waits) - 1, int(q * len(waits)))], 2)  # noqa: E731
        return {"loads": self.loads, "aborted": self.aborted, "failed_wakes": self.failed, "served": len(waits),
                "wait_p50_s": pct(0.5), "wait_p95_s": pct(0.95), "wait_max_s": round(waits[-1], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--min-residency", type=float, default=30.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    requests = trace(args.requests, args.seed)
    config = FleetConfig(min_residency=args.min_residency)
    from planner_svc.planner import plan
    from planner_svc.policy import ram_budget

    roomy = [msgspec.structs.replace(r, ram_available=64 * GIB, ram_total=64 * GIB) for r in fleet()[:1]]
    alone = plan(roomy, config, Sim(None, config).demand)
    need = sum(s.memory.total_bytes for h in alone.hosts for s in h.lanes)
    budget = sum(ram_budget(r, config) for r in fleet())
    ours = Sim(None, config)
    from planner_svc.eviction import choose

    ours.chooser = choose
    result = {
        "trace": {"requests": len(requests), "models": len(MODELS), "lanes_need_gib": round(need / GIB, 2),
                  "fleet_budget_gib": round(budget / GIB, 2), "seed": args.seed,
                  "min_residency_s": args.min_residency},  # fmt: skip
        "lanes": ours.run(requests),
        "evict_oldest": Sim(evict_oldest, config).run(requests),
    }
    result["loads_ratio"] = round(result["lanes"]["loads"] / max(1, result["evict_oldest"]["loads"]), 3)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
