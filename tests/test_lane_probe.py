"""The gateway's /health probe of a lane (gateway/fleet/probe.py): a lane not connected to is out
at once; one that answers late or not 200 only after PROBE_FAILURES misses in a row."""

from __future__ import annotations

from gateway.fleet.probe import judge
from shared import defaults


def test_a_lane_not_connected_to_is_out_at_once():
    assert judge("unreachable", 0).out


def test_slow_answers_take_a_lane_out_only_after_the_agents_count_in_a_row():
    misses, outs = 0, []
    for _ in range(defaults.PROBE_FAILURES):
        verdict = judge("slow", misses)
        misses, outs = verdict.misses, outs + [verdict.out]
    assert outs == [False] * (defaults.PROBE_FAILURES - 1) + [True]


def test_an_answer_brings_it_back_and_starts_the_count_again():
    verdict = judge("ok", defaults.PROBE_FAILURES - 1)
    assert verdict.back and not verdict.out and verdict.misses == 0
    assert not judge("slow", verdict.misses).out


def test_a_round_probes_every_lane_up_to_its_budget_then_both_groups_in_turn():
    from gateway.fleet.probe import this_round as by_groups

    def this_round(lanes, out, start, budget):
        return by_groups([n for n in lanes if out(n)], [n for n in lanes if not out(n)], start, budget)

    lanes = list(range(10))
    assert this_round(lanes, lambda n: False, 7, budget=10) == (lanes, 0)
    out = {3, 8}
    first, start = this_round(lanes, lambda n: n in out, 0, budget=4)
    assert first == [3, 8, 0, 1] and start == 2  # both lanes out fit in half the budget
    second, start = this_round(lanes, lambda n: n in out, start, budget=4)
    assert second == [3, 8, 2, 4] and start == 4
    seen = set()
    for _ in range(4):  # every lane in rotation is reached within len/share rounds
        chosen, start = this_round(lanes, lambda n: n in out, start, budget=4)
        seen.update(chosen)
    assert seen == set(lanes)
    # Most lanes out (a fleet cut off): out lanes take turns too, none is left unprobed for ever.
    many_out = set(range(8))
    seen, start = set(), 0
    for _ in range(4):
        chosen, start = this_round(lanes, lambda n: n in many_out, start, budget=4)
        assert len(chosen) == 4
        seen.update(chosen)
    assert seen == set(lanes)
    assert this_round(lanes, lambda n: True, 0, budget=3)[0] == [0, 1, 2]  # all out: the budget still holds
