"""Token-fair queueing: which waiting request gets the next free slot. Pure (time is passed in).

As llm-d's flow control: a tenant's cost is the tokens it consumed (prompt + output weighted
above prompt), decayed with a half-life so old use is forgiven; the next slot goes to the
highest priority present, and within it to the tenant with the least decayed cost per unit
of weight; within a tenant, first come first served. A tenant alone is never held back
(nothing to compare with), and one that stops asking recovers its share as its cost decays.

Costs are charged when an answer ends (its usage is known then). Requests still running are
charged an estimate in the meantime (`started`): without it a tenant with many requests in
flight would look as cheap as an idle one until they finish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from shared import defaults


class Waiting(Protocol):
    tenant: str
    priority: int
    seq: int  # arrival order


@dataclass
class Ledger:
    half_life: float = defaults.FAIR_HALF_LIFE
    output_weight: float = defaults.OUTPUT_WEIGHT
    running_estimate: float = 256.0  # tokens a request in flight is counted at until its answer ends
    _cost: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (cost, at time)
    _running: dict[str, int] = field(default_factory=dict)

    def tokens(self, prompt: int, output: int) -> float:
        return prompt + self.output_weight * output

    def _decayed(self, tenant: str, now: float) -> float:
        cost, at = self._cost.get(tenant, (0.0, now))
        if self.half_life <= 0:
            return cost
        return cost * math.pow(0.5, max(0.0, now - at) / self.half_life)

    def charge(self, tenant: str, tokens: float, now: float) -> None:
        self._cost[tenant] = (self._decayed(tenant, now) + max(0.0, tokens), now)

    def started(self, tenant: str) -> None:
        self._running[tenant] = self._running.get(tenant, 0) + 1

    def finished(self, tenant: str) -> None:
        left = self._running.get(tenant, 0) - 1
        if left > 0:
            self._running[tenant] = left
        else:
            self._running.pop(tenant, None)

    def cost(self, tenant: str, now: float) -> float:
        return self._decayed(tenant, now) + self._running.get(tenant, 0) * self.running_estimate


def order(waiters: list, ledger: Ledger, weights: dict[str, float], now: float) -> list:
    """The waiters in the order free slots should go to them."""
    costs: dict[str, float] = {}
    for w in waiters:
        if w.tenant not in costs:
            costs[w.tenant] = ledger.cost(w.tenant, now) / max(weights.get(w.tenant, 1.0), 1e-9)
    return sorted(waiters, key=lambda w: (-w.priority, costs[w.tenant], w.seq))


def pick(waiters: list, ledger: Ledger, weights: dict[str, float], now: float):
    """The one waiter the next free slot goes to (None when none waits)."""
    ranked = order(waiters, ledger, weights, now)
    return ranked[0] if ranked else None
