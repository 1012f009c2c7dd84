"""The planner's side of core NATS: its micro endpoints and its subscriptions.

Endpoints (request/reply): config get and set, demand set, a host's plan and its explanation,
fleet status and info. An active and a stand-by planner answer alike, from the state the watch
folds; a change is written to the bucket (compare-and-set on the config key, which
`ensure_config` creates at start), never to the state: the watch brings it back. The pure
answers are in planner_svc/answers.py. Subscriptions: plan rejections, wakes and gateway
activity are decoded here and handed to planner_svc.service, which applies them. The service
is seen through `ServingPlanner`, what these handlers read of it, so this module does not import
the service that calls it.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import msgspec
import nats
import structlog
from nats.aio.client import Client
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.request import Request, ServiceError

from planner_svc.answers import config_problem, explain_lines, merged_config
from planner_svc.fleet_pages import Fleet, page, summary
from planner_svc.lease import Lease
from planner_svc.state import PlannerState
from shared import subjects
from shared.bus import logged_endpoint, quietly
from shared.messages.activity import GatewayActivity, ModelWake
from shared.messages.config import Demand, FleetConfig
from shared.messages.plans import HostPlan
from shared.messages.replies import ConfigSet, FleetQuery, FleetStatus, FleetSummary, HostQuery
from shared.messages.status import PlanRejected
from shared.messages.wire import encode
from shared.version import VERSION

log = structlog.get_logger("lanes.planner")


class ServingPlanner(Protocol):
    """What the endpoints and subscriptions read of the planner service (planner_svc.service)."""

    nc: Client
    kv: KeyValue
    leader_kv: KeyValue
    state: PlannerState
    lease: Lease
    ready: asyncio.Event
    id: str
    replans: int

    async def on_rejected(self, rejection: PlanRejected) -> None: ...

    async def read_latest(self, key: str) -> None: ...

    async def on_wake(self, wake: ModelWake) -> None: ...

    async def on_activity(self, activity: GatewayActivity) -> None: ...


async def ensure_config(svc: ServingPlanner, patience: float = 60.0) -> None:
    """Create the config key if missing. A bucket another planner is creating right now (its
    replicas still forming) has no responders yet: wait for it rather than exit."""
    deadline = time.monotonic() + patience
    while True:
        try:
            await svc.leader_kv.get(subjects.CONFIG_KEY)
            return
        except NotFoundError:
            try:
                await svc.kv.create(subjects.CONFIG_KEY, encode(FleetConfig()))
            except Exception:
                pass  # another planner created it first
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise
            log.info("bucket not answering yet; waiting", error=type(exc).__name__)
            await asyncio.sleep(0.5)


async def _config_get(svc: ServingPlanner, req: Request) -> None:
    await req.respond(encode(svc.state.config))


CONFIG_SET_TRIES = 3


async def _config_set(svc: ServingPlanner, req: Request) -> None:
    """A change is merged onto the config as the bucket holds it. A lost compare-and-set (the
    watch has not yet shown this planner the latest entry: just started, or another planner
    wrote it) reads that entry and merges again; 409 only when writers keep racing."""
    try:
        change = msgspec.json.decode(req.data, type=ConfigSet)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ServiceError("400", f"invalid config: {exc}") from None
    for _ in range(CONFIG_SET_TRIES):
        try:
            new = merged_config(svc.state.config, change, svc.state.config_revision + 1)
        except msgspec.ValidationError as exc:
            raise ServiceError("400", f"invalid config: {exc}") from None
        if new is not None and (problem := config_problem(new, svc.state.reports)) is not None:
            raise ServiceError("400", f"invalid config: {problem}")
        if new is None:
            await req.respond(encode(svc.state.config))  # nothing changes: no new revision
            return
        try:
            await svc.kv.update(subjects.CONFIG_KEY, encode(new), last=svc.state.config_kv_rev or None)
        except KeyWrongLastSequenceError:
            await svc.read_latest(subjects.CONFIG_KEY)
            continue
        log.info("config set", changes=change.changes)
        await req.respond(encode(new))
        return
    raise ServiceError("409", "config changed meanwhile; retry")


async def _demand_set(svc: ServingPlanner, req: Request) -> None:
    try:
        demand = msgspec.json.decode(req.data, type=Demand)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ServiceError("400", f"invalid demand: {exc}") from None
    await svc.kv.put(subjects.DEMAND_KEY, encode(demand))
    await req.respond(encode(demand))


def _host_plan(svc: ServingPlanner, req: Request) -> HostPlan:
    try:
        query = msgspec.json.decode(req.data, type=HostQuery)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ServiceError("400", f"invalid query: {exc}") from None
    found = svc.state.plans.get(subjects.host_token(query.host_id))
    if found is None:
        raise ServiceError("404", f"no plan for host {query.host_id!r}")
    return found


async def _plan_get(svc: ServingPlanner, req: Request) -> None:
    await req.respond(encode(_host_plan(svc, req)))


async def _plan_explain(svc: ServingPlanner, req: Request) -> None:
    found = _host_plan(svc, req)
    lines = explain_lines(found, svc.state.statuses.get(found.host_id))
    await req.respond("\n".join(lines).encode())


SNAPSHOT_SECONDS = 30.0  # the longest a listing's later pages are cut from its first page's view


@dataclass
class Snapshots:
    """The fleet as a listing's pages see it, and its summary: taken fresh for a first page, and
    kept for the pages after it (as a Kubernetes list's continue token keeps its resource
    version): the pages of one listing agree, and paging a fleet of 10,000 hosts, hundreds of
    requests, does not rebuild an O(hosts) view on the event loop for each."""

    taken_at: float = -1e9
    fleet: Fleet | None = None
    totals: FleetSummary | None = None

    def view(self, s: PlannerState, first: bool) -> tuple[Fleet, FleetSummary]:
        now = time.monotonic()
        if first or self.fleet is None or self.totals is None or now - self.taken_at >= SNAPSHOT_SECONDS:
            self.fleet = Fleet(
                reports={r.host_id: r for r in s.reports.values()},
                plans={p.host_id: p for p in s.plans.values()},
                statuses={x.host_id: x for x in s.statuses.values()},
                liveness=tuple(sorted(s.liveness(), key=lambda h: h.host_id)),
                models=s.model_states()[0].models,
            )
            self.totals, self.taken_at = summary(self.fleet), now
        return self.fleet, self.totals


async def _fleet_status(svc: ServingPlanner, snapshots: Snapshots, req: Request) -> None:
    """One page of the fleet (planner_svc/fleet_pages.py); an empty request asks for the first."""
    try:
        query = msgspec.json.decode(req.data, type=FleetQuery) if req.data.strip() else FleetQuery()
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ServiceError("400", f"invalid query: {exc}") from None
    s = svc.state
    fleet, totals = snapshots.view(s, first=not query.after)
    head = FleetStatus(config_revision=s.config_revision, config=s.config, planner_id=svc.id,
                       planner_active=svc.lease.holds())  # fmt: skip
    await req.respond(encode(page(fleet, query, head, totals)))


async def _info(svc: ServingPlanner, req: Request) -> None:
    s = svc.state
    info = {
        "version": VERSION,
        "config_revision": s.config_revision,
        "hosts": sorted(s.reports),
        "plans": {host: p.plan_revision for host, p in sorted(s.plans.items())},
        "ready": svc.ready.is_set(),
        "planner_id": svc.id,
        "active": svc.lease.holds(),
        "replans": svc.replans,  # tests and operators can wait for a replan instead of sleeping
        "lost": sorted(s.lost),
    }
    await req.respond(msgspec.json.encode(info))


async def add_endpoints(svc: ServingPlanner, stack: AsyncExitStack) -> None:
    """Serve the endpoints until `stack` closes."""
    micro = await add_service(
        svc.nc,
        name=subjects.PLANNER_SERVICE,
        version=VERSION,
        description="lanes planner: lane plans for every host",
        metadata={"bucket": subjects.BUCKET},
    )
    stack.push_async_callback(quietly(micro.stop))
    group = micro.add_group(name=subjects.PLANNER_GROUP)
    snapshots = Snapshots()
    for name, subject, handler in (
        ("config_get", subjects.CONFIG_GET, partial(_config_get, svc)),
        ("config_set", subjects.CONFIG_SET, partial(_config_set, svc)),
        ("demand_set", subjects.DEMAND_SET, partial(_demand_set, svc)),
        ("plan_get", subjects.PLAN_GET, partial(_plan_get, svc)),
        ("plan_explain", subjects.PLAN_EXPLAIN, partial(_plan_explain, svc)),
        ("fleet_status", subjects.FLEET_STATUS, partial(_fleet_status, svc, snapshots)),
        ("status", subjects.PLANNER_STATUS, partial(_fleet_status, svc, snapshots)),
        ("info", subjects.PLANNER_INFO, partial(_info, svc)),
    ):
        tail = subjects.endpoint_tail(subject, subjects.PLANNER_GROUP)
        await group.add_endpoint(name=name, subject=tail, handler=logged_endpoint(handler, name))


def _on_its_subject(msg, kind: type, field: str, subject_of, what: str):
    """The message decoded, or None (logged and dropped): malformed, or sent on another
    sender's subject than the one its `field` names (a client may publish only on its own)."""
    try:
        decoded = msgspec.json.decode(msg.data, type=kind)
        named = getattr(decoded, field)
        if subject_of(named) != msg.subject:
            raise msgspec.ValidationError(f"{field} {named!r} does not match {msg.subject!r}")
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.warning(f"dropped malformed {what}", subject=msg.subject, reason=str(exc))
        return None
    return decoded


async def subscribe(svc: ServingPlanner, stack: AsyncExitStack) -> None:
    """Hand the service what agents and gateways publish, decoded: plan rejections, wakes and
    activity (a malformed message, or one on another sender's subject, is dropped here)."""
    for subject, kind, field, subject_of, what, handler in (
        (subjects.ALL_REJECTED, PlanRejected, "host_id", subjects.rejected_subject, "rejection", svc.on_rejected),
        (subjects.ALL_WAKES, ModelWake, "name", subjects.wake_subject, "wake", svc.on_wake),
        (subjects.ALL_ACTIVITY, GatewayActivity, "gateway", subjects.activity_subject, "activity", svc.on_activity),
    ):
        sub = await svc.nc.subscribe(subject, cb=_decoded(handler, kind, field, subject_of, what))
        stack.push_async_callback(quietly(sub.unsubscribe))


def _decoded(handler, kind: type, field: str, subject_of, what: str):
    async def on_msg(msg) -> None:
        if (decoded := _on_its_subject(msg, kind, field, subject_of, what)) is not None:
            await handler(decoded)

    return on_msg
