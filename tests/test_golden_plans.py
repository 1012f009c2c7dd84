"""The planner's decisions for a recorded set of host reports, demands, previous plans and
feedback (tests/golden/, written by tests/record_golden_plans.py) stay exactly as recorded.

A refactor must leave every recorded field of every plan as it was: the same lanes, windows,
devices, flags, argv, predicted buffers and reasons. A field added since the recording is
allowed (older readers ignore it); a changed or missing one is not.

The recorded plans carry each lane's argv (`args`), as planners then rendered it. A plan for an
agent that renders argv itself carries none: its argv is rendered here from the spec with the
host's recorded capabilities, by the agent's one renderer, and must equal the recorded one.
"""

from __future__ import annotations

import msgspec
import pytest
from record_golden_plans import OUTPUTS, Scenario, load_inputs, run

from shared.llama.flags import lane_args

SCENARIOS = load_inputs()
RECORDED = msgspec.json.decode(OUTPUTS.read_bytes())


def _differences(recorded, now, path: str = "") -> list[str]:
    """Where `now` departs from `recorded`, ignoring keys the recording does not have."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        out = []
        for key, value in recorded.items():
            if key not in now:
                out.append(f"{path}.{key}: missing")
            else:
                out += _differences(value, now[key], f"{path}.{key}")
        return out
    if isinstance(recorded, list) and isinstance(now, list):
        if len(recorded) != len(now):
            return [f"{path}: {len(recorded)} entries recorded, {len(now)} now"]
        return [d for i, (a, b) in enumerate(zip(recorded, now)) for d in _differences(a, b, f"{path}[{i}]")]
    return [] if recorded == now else [f"{path}: recorded {recorded!r}, now {now!r}"]


def test_every_scenario_was_recorded():
    assert sorted(RECORDED) == sorted(s.name for s in SCENARIOS)
    assert sum(len(h["lanes"]) for p in RECORDED.values() for h in p["hosts"]) > 100


def _as_agents_render(s: Scenario) -> dict:
    """The scenario with agents that render argv themselves, and its plan with each lane's argv
    rendered from its spec as that host's agent does (every lane counted in RENDERED)."""
    reports = tuple(msgspec.structs.replace(r, renders_argv=True) for r in s.reports)
    fleet = run(msgspec.structs.replace(s, reports=reports))
    caps = {r.host_id: r.server for r in reports}
    hosts = []
    for host in fleet.hosts:
        assert all(spec.args == () for spec in host.lanes), "a plan for such agents carries no argv"
        RENDERED.append(len(host.lanes))
        lanes = tuple(msgspec.structs.replace(spec, args=lane_args(spec, caps[host.host_id])) for spec in host.lanes)
        hosts.append(msgspec.structs.replace(host, lanes=lanes))
    return msgspec.json.decode(msgspec.json.encode(msgspec.structs.replace(fleet, hosts=tuple(hosts))))


RENDERED: list[int] = []


@pytest.mark.parametrize("agents", ["render argv", "older, argv in the plan"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_plans_equal_the_recorded_ones(scenario, agents):
    if agents == "render argv":
        now = _as_agents_render(scenario)
    else:
        now = msgspec.json.decode(msgspec.json.encode(run(scenario)))
    diffs = _differences(RECORDED[scenario.name], now)
    assert not diffs, f"{len(diffs)} difference(s), first: " + "; ".join(diffs[:5])


def test_every_recorded_argv_is_the_render_of_its_spec():
    RENDERED.clear()
    for scenario in SCENARIOS:
        now = _as_agents_render(scenario)
        recorded = [lane["args"] for h in RECORDED[scenario.name]["hosts"] for lane in h["lanes"]]
        assert [lane["args"] for h in now["hosts"] for lane in h["lanes"]] == recorded, scenario.name
    assert sum(RENDERED) == sum(len(h["lanes"]) for p in RECORDED.values() for h in p["hosts"]) == 135


def test_the_comparison_sees_a_changed_window():
    recorded = RECORDED["cpu_default"]
    changed = msgspec.json.decode(msgspec.json.encode(run(SCENARIOS[0])))
    changed["hosts"][0]["lanes"][0]["ctx_total"] += 256
    assert _differences(recorded, changed)
    changed["hosts"][0]["lanes"][0]["ctx_total"] -= 256
    changed["hosts"][0]["lanes"][0]["new_field"] = 1
    assert not _differences(recorded, changed)
