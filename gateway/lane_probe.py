"""The gateway's own /health probe of each lane: what one answer (or its absence) means. Pure.

A lane that cannot be connected to (refused, no route) is out of rotation at once: a
dead process or host. One that answers late, not 200, or drops the connection is out only after PROBE_FAILURES
misses in a row, as its agent judges it: a host busy prefilling answers /health late but
serves (llama-server answers it from an HTTP thread, and with every HTTP thread held by a
stream it waits for one), and taking it out on one slow answer sent its conversations cold
to another lane (test_slot_save_real, 0.48 cached in CI where it measures 0.94)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared import defaults

Outcome = Literal["ok", "unreachable", "slow"]  # answered 200; not connected; late, or not 200


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
