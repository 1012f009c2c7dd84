"""The gateway's own /health probe of each lane: what one answer (or its absence) means. Pure.

A lane that cannot be connected to (refused, no route) is out of rotation at once: a
dead process or host. One that answers late, not 200, or drops the connection is out only
after PROBE_FAILURES misses in a row, as its agent judges it: a host busy prefilling answers
/health late but serves (llama-server answers it from an HTTP thread, and with every HTTP
thread held by a stream it waits for one). Taken out on one slow answer, a lane left rotation
in the middle of a rolling change (test_rollout_live, CI: one lane of three serving)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from shared import defaults

T = TypeVar("T")
Outcome = Literal["ok", "unreachable", "slow"]  # answered 200; not connected; late, not 200, or dropped


@dataclass(frozen=True)
class Verdict:
    misses: int  # slow answers in a row, this one included
    out: bool  # take the lane out of rotation (else: back in, or leave it as it is)
    back: bool  # it answered: back in rotation


def judge(outcome: Outcome, misses: int, failures: int = defaults.PROBE_FAILURES) -> Verdict:
    if outcome == "ok":
        return Verdict(0, out=False, back=True)
    if outcome == "unreachable":
        return Verdict(misses + 1, out=True, back=False)
    return Verdict(misses + 1, out=misses + 1 >= failures, back=False)


def this_round(down: Sequence[T], up: Sequence[T], start: int, budget: int) -> tuple[list[T], int]:
    """The lanes to probe this round, from those out of rotation (`down`) and the others (`up`), and
    where the next round starts (pure).

    Every lane while there are at most `budget`; beyond that, half the budget (or more, where the
    others need less) for the lanes out of rotation (a probe is what brings them back), the rest
    for the others, each group in turn from `start`: at 10,000 hosts x 4 lanes a probe of every
    lane every second was 40,000 requests a second from each gateway. A lane not probed this round
    is still taken out at once by a request that cannot reach it. A round costs its budget, not the
    fleet: the groups are the view's, kept between changes (FleetView.probe_groups).
    """
    if len(down) + len(up) <= budget:
        return [*down, *up], 0
    take_down = min(len(down), max(budget // 2, budget - len(up)))
    take_up = min(len(up), budget - take_down)
    # The cursor moves by the larger share: the group not probed whole this round is the one that took it.
    return _turn(down, start, take_down) + _turn(up, start, take_up), start + max(take_down, take_up, 1)


def _turn(items: Sequence[T], start: int, n: int) -> list[T]:
    if not items or n <= 0:
        return []
    start %= len(items)
    head = list(items[start:start + n])
    return head + list(items[:n - len(head)])
