"""The planner's decisions for a recorded set of host reports, demands, previous plans and
feedback (tests/golden/, written by tests/record_golden_plans.py) stay exactly as recorded.

A refactor must leave every recorded field of every plan as it was: the same lanes, windows,
devices, flags, argv, predicted buffers and reasons. A field added since the recording is
allowed (older readers ignore it); a changed or missing one is not.
"""

from __future__ import annotations

import msgspec
import pytest
from record_golden_plans import OUTPUTS, load_inputs, run

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


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_plans_equal_the_recorded_ones(scenario):
    now = msgspec.json.decode(msgspec.json.encode(run(scenario)))
    diffs = _differences(RECORDED[scenario.name], now)
    assert not diffs, f"{len(diffs)} difference(s), first: " + "; ".join(diffs[:5])


def test_the_comparison_sees_a_changed_window():
    recorded = RECORDED["cpu_default"]
    changed = msgspec.json.decode(msgspec.json.encode(run(SCENARIOS[0])))
    changed["hosts"][0]["lanes"][0]["ctx_total"] += 256
    assert _differences(recorded, changed)
    changed["hosts"][0]["lanes"][0]["ctx_total"] -= 256
    changed["hosts"][0]["lanes"][0]["new_field"] = 1
    assert not _differences(recorded, changed)
