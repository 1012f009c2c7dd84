"""Lanes restarted per hour on a host whose free RAM swings (issue 33, point 7; target 0).

Run from the repository root:  .venv/bin/python bench/plan_churn.py [--out bench/plan_churn_results.json]

A 24 GiB workstation is replanned every report interval (30 s) for one simulated hour, as the
planner service does, from reports built the way its agent builds them: the lanes' resident
memory (their buffers at `lazy` of the plan: mapped weights and compute buffers are touched
as they are used, plus what their prompt caches filled, 64 MiB more per lane each interval up
to the lane's --cache-ram), and another program that takes `swing` of the host's free RAM for
three minutes out of six. A restart is a lane whose lane key changed between two plans (the
agent restarts exactly those); a restarted lane's cache starts empty again.

Each scenario runs twice: with the agent reporting which lanes serve (today's agents) and
without (an older agent: windows are not held), so the table shows what the window rule is
worth; prompt caches are held in both (planner_svc/prompt_cache.py). Pure planner, no
processes: the figures are exact for these inputs, not timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from planner_svc.planner import plan  # noqa: E402
from planner_svc.policy import ram_pressed  # noqa: E402
from shared.lane_key import lane_key  # noqa: E402
from shared.messages.config import Demand, FleetConfig, Persona  # noqa: E402
from shared.messages.hosts import HostReport, ModelFacts, ServerCaps  # noqa: E402
from shared.messages.plans import HostPlan  # noqa: E402

GIB, MIB = 2**30, 2**20
TOTAL = 24 * GIB
OS_USED = 2 * GIB  # the desktop, before any lane or other program
INTERVAL = 30.0
HOUR = 3600.0
PERIOD = 360.0  # the other program holds its share for half of it
CACHE_FILL = 64 * MIB  # per lane and interval, up to its limit


def facts(name: str, layers: int, kv: int, weights: int, ctx_train: int, embd: int = 4096) -> ModelFacts:
    return ModelFacts(path=f"/models/{name}.gguf", name=name, architecture="llama", n_layer=layers, n_embd=embd,
                      n_head=32, n_head_kv=(kv,) * layers, head_dim_k=128, head_dim_v=128, n_ctx_train=ctx_train,
                      n_vocab=128256, n_ff=4 * embd, weight_bytes=weights)  # fmt: skip


SMALL = facts("small-1b", 16, 8, GIB, 32768, embd=2048)  # its window stops at the trained context
LARGE = facts("llama-8b", 32, 8, 5 * GIB, 131072)  # its window fills what the budget allows

SCENARIOS = {
    "two 1B lanes at their ceiling (caches take the rest)": (
        (SMALL,), (Persona(model="small-1b", parallel=2, lanes=None), Persona(model="small-1b", alias="small-b", parallel=2))),
    "one 8B lane whose window fills the budget": ((LARGE,), (Persona(model="llama-8b", parallel=1),)),
}


@dataclass
class Run:
    restarts: int = 0
    pressed_intervals: int = 0
    plans: int = 0


def report(rss: int, other: int, serving: tuple[str, ...], models) -> HostReport:
    return HostReport(host_id="ws", cpu_cores=8, ram_total=TOTAL, ram_available=max(0, TOTAL - OS_USED - other - rss),
                      lanes_rss=rss, server=ServerCaps(has_cache_idle_slots=True), models=models,
                      renders_argv=True, serving_lanes=serving)  # fmt: skip


def simulate(models, personas, *, swing: float, lazy: float, report_serving: bool) -> Run:
    config, demand = FleetConfig(), Demand(personas=personas)
    run = Run()
    prev: HostPlan | None = None
    filled: dict[str, int] = {}
    t = 0.0
    while t < HOUR:
        lanes = prev.lanes if prev else ()
        rss = sum(int(lazy * (s.memory.total_bytes - s.memory.prompt_cache_bytes)) + filled.get(s.lane_id, 0)
                  for s in lanes)  # fmt: skip
        free_before_other = TOTAL - OS_USED - rss
        other = int(swing * free_before_other) if (t // (PERIOD / 2)) % 2 else 0
        serving = tuple(sorted(lane_key(s) for s in lanes)) if report_serving else ()
        r = report(rss, other, serving, models)
        run.pressed_intervals += ram_pressed(r, config)
        hp = plan([r], config, demand, previous={"ws": prev} if prev else None).hosts[0]
        run.plans += 1
        if prev is not None:
            old = {s.lane_id: lane_key(s) for s in prev.lanes}
            for s in hp.lanes:
                if s.lane_id in old and old[s.lane_id] != lane_key(s):
                    run.restarts += 1
                    filled[s.lane_id] = 0
        for s in hp.lanes:  # the caches fill as conversations come
            filled[s.lane_id] = min((s.cache_ram_mib or 0) * MIB, filled.get(s.lane_id, 0) + CACHE_FILL)
        prev = hp
        t += INTERVAL
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "plan_churn_results.json"))
    args = parser.parse_args()
    rows = []
    cases = [(name, swing, 0.8) for name in SCENARIOS for swing in (0.25, 0.5)]
    cases.append(("one 8B lane whose window fills the budget", 0.25, 1.0))  # no slack: the swing presses the host
    for name, swing, lazy in cases:
        models, personas = SCENARIOS[name]
        for serving in (True, False):
            r = simulate(models, personas, swing=swing, lazy=lazy, report_serving=serving)
            rows.append({"scenario": name, "swing": swing, "resident": lazy, "serving_reported": serving,
                         "restarts_per_hour": r.restarts, "pressed_intervals": r.pressed_intervals, "plans": r.plans})
    print("| scenario | free RAM taken | lanes resident | agent reports serving lanes | restarts per hour | "
          "intervals pressed / plans |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['scenario']} | {row['swing']:.0%} | {row['resident']:.0%} of plan | "
              f"{'yes' if row['serving_reported'] else 'no (older agent)'} | {row['restarts_per_hour']} | "
              f"{row['pressed_intervals']} / {row['plans']} |")  # fmt: skip
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
