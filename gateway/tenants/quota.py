"""Tenants' token limits per minute and per day, counted over every gateway. Pure (time passed in).

Windows are calendar minutes and days (UTC, from wall-clock time): every gateway cuts them the
same way, so their counts add up without comparing clocks beyond NTP's. Each gateway counts its
own tokens and shares them (gateway/sync/usage.py, one KV key per tenant and gateway); a
tenant's use is the sum over gateways of the current window. Two gateways can overshoot a limit
by at most what they counted between two shares (defaults.USAGE_SYNC_INTERVAL each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from gateway.refusals import Refused
from gateway.tenants.keys import Tenant
from shared.messages.activity import TenantUsage


def minute_of(wall: float) -> int:
    return int(wall // 60)


def day_of(wall: float) -> int:
    return int(wall // 86400)


def _current(u: TenantUsage, wall: float) -> tuple[float, float]:
    return (u.minute_tokens if u.minute == minute_of(wall) else 0.0, u.day_tokens if u.day == day_of(wall) else 0.0)


@dataclass
class UsageBook:
    gateway: str
    mine: dict[str, TenantUsage] = field(default_factory=dict)  # tenant -> this gateway's count
    others: dict[tuple[str, str], TenantUsage] = field(default_factory=dict)  # (tenant, gateway) -> theirs
    dirty: set[str] = field(default_factory=set)  # tenants whose count changed since the last share
    synced: bool = False  # every gateway's count as NATS held it at start has been read

    def add(self, tenant: str, tokens: float, wall: float) -> None:
        self.mine[tenant] = self._plus(self.mine.get(tenant), tenant, tokens, wall)
        self.dirty.add(tenant)

    def _plus(self, u: TenantUsage | None, tenant: str, tokens: float, wall: float) -> TenantUsage:
        minute, day = (0.0, 0.0) if u is None else _current(u, wall)
        return TenantUsage(tenant=tenant, gateway=self.gateway, minute=minute_of(wall), day=day_of(wall),
                           minute_tokens=minute + tokens, day_tokens=day + tokens)  # fmt: skip

    def restore(self, u: TenantUsage, wall: float) -> None:
        """This gateway's own count as it last shared it (before a restart): added to what it has counted since."""
        minute, day = _current(u, wall)
        mine = self.mine.get(u.tenant)
        now_minute, now_day = (0.0, 0.0) if mine is None else _current(mine, wall)
        self.mine[u.tenant] = TenantUsage(tenant=u.tenant, gateway=self.gateway, minute=minute_of(wall),
                                          day=day_of(wall), minute_tokens=minute + now_minute,
                                          day_tokens=day + now_day)  # fmt: skip
        self.dirty.add(u.tenant)

    def merge(self, u: TenantUsage) -> float:
        """Another gateway's count; returns the tokens it grew by since its last one (for fairness)."""
        before = self.others.get((u.tenant, u.gateway))
        self.others[(u.tenant, u.gateway)] = u
        had = before.day_tokens if before is not None and before.day == u.day else 0.0
        return max(0.0, u.day_tokens - had)

    def used(self, tenant: str, wall: float) -> tuple[float, float]:
        """(tokens this minute, tokens today) of a tenant over every gateway."""
        rows = [u for (t, _), u in self.others.items() if t == tenant]
        if tenant in self.mine:
            rows.append(self.mine[tenant])
        pairs = [_current(u, wall) for u in rows]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)

    def check(self, tenant: Tenant, wall: float) -> Refused | None:
        """The 429 for a tenant over a token limit, naming it, with the seconds until its window ends."""
        if tenant.tokens_per_minute is None and tenant.tokens_per_day is None:
            return None
        minute, day = self.used(tenant.name, wall)
        if tenant.tokens_per_day is not None and day >= tenant.tokens_per_day:
            left = int(86400 - wall % 86400) + 1
            return Refused(f"tenant {tenant.name!r} used {day:.0f} tokens today, its tokens_per_day is "
                           f"{tenant.tokens_per_day}", "tokens_per_day", left)  # fmt: skip
        if tenant.tokens_per_minute is not None and minute >= tenant.tokens_per_minute:
            left = int(60 - wall % 60) + 1
            return Refused(f"tenant {tenant.name!r} used {minute:.0f} tokens this minute, its tokens_per_minute is "
                           f"{tenant.tokens_per_minute}", "tokens_per_minute", left)  # fmt: skip
        return None

    def take_dirty(self) -> list[TenantUsage]:
        out = [msgspec.structs.replace(self.mine[t], gateway=self.gateway) for t in sorted(self.dirty) if t in self.mine]
        self.dirty.clear()
        return out
