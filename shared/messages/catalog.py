"""The messages as a whole: the types that travel on their own (one JSON Schema each in
docs/schemas/, shared/schemas.py) and every struct the package defines."""

from __future__ import annotations

import msgspec

from shared.messages import activity, config, hosts, plans, prefixes, replies, slots, status, wire

WIRE_TYPES: tuple[type, ...] = (
    hosts.HostReport,
    config.FleetConfig,
    config.Demand,
    plans.HostPlan,
    plans.FleetPlan,
    status.HostStatus,
    status.LaneEvent,
    status.HostLoad,
    status.PlanRejected,
    status.LaneSecret,
    status.SessionSecret,
    replies.ConfigSet,
    replies.HostQuery,
    replies.ErrorReply,
    replies.FleetStatus,
    activity.PlannerLease,
    replies.FleetHosts,
    activity.ModelWake,
    activity.GatewayActivity,
    activity.ModelStates,
    activity.TenantUsage,
    prefixes.PrefixEvent,
    slots.SlotsOffer,
    slots.SlotsAsk,
)

# Every module of the package that defines messages, in the order of the flow: the wire's
# vocabulary, what a host has, what is wanted, the plan, what runs, the planner's answers,
# models on demand, the prefix view, saved slots that move (docs/reference/messages.md follows it).
MODULES = (wire, hosts, config, plans, status, replies, activity, prefixes, slots)


def structs() -> list[type[msgspec.Struct]]:
    """Every Struct the package defines, module by module, each in its source order, once."""
    found: dict[type[msgspec.Struct], None] = {}
    for module in MODULES:
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__module__ == module.__name__:
                found.setdefault(value)
    return list(found)
