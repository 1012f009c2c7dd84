"""The planner's requests and replies: a config change, a host query, an error, every host's
liveness and the whole fleet's status."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared.messages.activity import ModelState
from shared.messages.config import FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.status import HostStatus
from shared.messages.wire import MANY, Bytes, Int32, Label, Message, Name, Revision, Seconds, Text

HostState = Literal["live", "lost"]


class ConfigSet(Message, tag="config_set", kw_only=True):
    """Partial update: only the named fields change."""

    changes: Annotated[
        dict[
            Annotated[str, msgspec.Meta(max_length=64)],
            Label | Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
            | Annotated[float, msgspec.Meta(ge=-1e18, le=1e18)] | bool | None,
        ],
        msgspec.Meta(max_length=64),
    ]


class HostQuery(Message, tag="host_query", kw_only=True):
    host_id: Name


class FleetQuery(Message, tag="fleet_query", kw_only=True):
    """One page of the fleet's status: the hosts after `after` (by host id) that match every filter
    given, at most `limit` of them and never a reply over PAGE_BYTES (planner_svc/fleet_pages.py)."""

    host: Label = ""  # a host id, or a prefix ending in "*"
    model: Label = ""  # hosts with a lane of this model planned or running
    state: Label = ""  # hosts "live" or "lost", or with a lane in this state ("failed", "healthy" ...)
    after: Label = ""  # the last host id of the page before ("": from the first)
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100


class ModelLanes(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One model's lanes in one state, fleet-wide."""

    model: Name
    state: Label  # a lane state as agents report it, or "planned" (in a plan, not reported yet)
    lanes: Int32 = 0


class FleetSummary(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """The whole fleet in a few numbers: its size does not grow with the hosts."""

    hosts: Int32 = 0
    hosts_lost: Int32 = 0
    hosts_rejecting: Int32 = 0  # whose agent refused its latest plan
    lanes: Annotated[tuple[ModelLanes, ...], MANY] = ()
    planned_bytes: Bytes = 0  # every planned lane's memory
    used_bytes: Bytes = 0  # what the running lanes hold (their RSS)
    lane_errors: Int32 = 0  # lanes failed, crashed, mismatched or unresponsive
    feedback: Int32 = 0  # what agents say the plans got wrong
    unplaced: Int32 = 0  # models the plans could not place


class ErrorReply(Message, tag="error", kw_only=True):
    error: Text


class HostLiveness(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A host as the planner sees it: `lost` after a silence; its plan is kept meanwhile."""

    host_id: Name
    state: HostState = "live"
    seen_ago_s: Seconds = 0.0
    rejected: Text = ""  # the agent's reason for refusing its latest plan, if it did


class FleetHosts(Message, tag="fleet_hosts", kw_only=True):
    """KV key `hosts`: the hosts that are not simply live (lost, or refusing their plan), put by the
    active planner when a state changes (seen_ago_s is 0 there: the key changes with states, not
    with time). A host it does not list is live: the key does not grow with a healthy fleet."""

    hosts: Annotated[tuple[HostLiveness, ...], MANY] = ()
    total: Int32 = 0  # hosts the planner knows, listed or not (0: a planner from before, listing every host)


class FleetStatus(Message, tag="fleet_status", kw_only=True):
    config_revision: Revision = 0  # counts config changes, as FleetConfig.revision
    config: FleetConfig = FleetConfig()
    reports: Annotated[tuple[HostReport, ...], MANY] = ()
    plans: Annotated[tuple[HostPlan, ...], MANY] = ()
    statuses: Annotated[tuple[HostStatus, ...], MANY] = ()
    hosts: Annotated[tuple[HostLiveness, ...], MANY] = ()
    planner_id: Label = ""  # the planner that answered
    planner_active: bool = True  # False: a stand-by answered (it plans nothing)
    models: Annotated[tuple[ModelState, ...], MANY] = ()  # every servable model and whether it is loaded
    # Paged (a FleetQuery asked): the hosts above are one page, the models name only them.
    summary: FleetSummary | None = None  # the whole fleet, whatever the page
    matched: Int32 = 0  # hosts matching the query's filters
    next_after: Label = ""  # ask again with this as `after` for the next page; "": none left
