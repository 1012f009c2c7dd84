"""A host's plan revision in the bucket never goes down: planner restarts, NATS nodes that
restart and serve stale reads, lease changes (and a former holder that writes once more).

The property test models the bucket (a log of entries, a compare-and-set on each key's latest
revision, as the stream's leader checks it) and replicas that fall behind; the planners are
the real PlannerState with the service's write bookkeeping (planner_svc.plan_writes). The
live test does the same against nats-server: a planner with a stale view writes nothing over
a newer plan.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import msgspec
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st
from fixtures_bus import client
from test_planner_state import report

from planner_svc import endpoints, plan_writes
from planner_svc.service import PlannerService
from planner_svc.state import PlannerState
from shared import subjects
from shared.bus import kv_bucket
from shared.messages.config import FleetConfig
from shared.messages.plans import HostPlan
from shared.messages.replies import ConfigSet
from shared.messages.wire import encode

HOSTS = ("h1", "h2")
CONFIGS = (FleetConfig(), FleetConfig(kv_cache_type="q8_0"), FleetConfig(n_ubatch=256), FleetConfig(kv_cache_type="q4_0"))


class Bucket:
    """The stream as its leader holds it; replicas hold a prefix of it (`upto`)."""

    def __init__(self, replicas: int = 3) -> None:
        self.log: list[tuple[str, bytes]] = []  # revision i+1 is log[i]
        self.upto = [0] * replicas
        self.plan_revisions: dict[str, list[int]] = {}  # every plan_revision written on each plan key

    def last(self, key: str, upto: int | None = None) -> tuple[int, bytes | None]:
        for i in range((len(self.log) if upto is None else upto) - 1, -1, -1):
            if self.log[i][0] == key:
                return i + 1, self.log[i][1]
        return 0, None

    def put(self, key: str, value: bytes) -> int:
        self.log.append((key, value))
        if key.startswith("plan."):
            self.plan_revisions.setdefault(key, []).append(msgspec.json.decode(value, type=HostPlan).plan_revision)
        return len(self.log)

    def compare_and_set(self, key: str, value: bytes, expected: int) -> int | None:
        return self.put(key, value) if self.last(key)[0] == expected else None

    def catch_up(self, replica: int) -> None:
        self.upto[replica] = len(self.log)


class Planner:
    """One planner process: its state fed by a watch served by one replica."""

    def __init__(self, name: str, replica: int) -> None:
        self.state = PlannerState(clock=lambda: 0.0)
        self.state.following = True
        self.state.planner_id = name
        self.replica = replica
        self.cursor = 0  # the last revision its watch delivered
        self.snapshot_done = False
        self.lost = 0  # compare-and-sets it lost

    def deliver(self, bucket: Bucket) -> None:
        upto = bucket.upto[self.replica]
        if not self.snapshot_done:  # a new watch: the latest entry of each key the replica holds
            keys = dict.fromkeys(k for k, _ in bucket.log[:upto])
            for rev, key in sorted((bucket.last(k, upto)[0], k) for k in keys):
                self.state.apply(key, bucket.log[rev - 1][1], rev)
            self.state.caught_up, self.state.replan_all, self.snapshot_done = True, True, True
        else:
            for i in range(self.cursor, upto):
                self.state.apply(bucket.log[i][0], bucket.log[i][1], i + 1)
        self.cursor = max(self.cursor, upto)

    def replan(self, bucket: Bucket) -> None:
        """What PlannerService.write_plans does, over the modeled bucket."""
        if not self.state.caught_up or self.state.following:
            return
        plans = self.state.planning_job()().plans
        for host, new in plans.items():
            if self.state.plans.get(host) == new and self.state.plan_stored.get(host):
                continue
            key = subjects.plan_key(host)
            new, before, expected = plan_writes.begin(self.state, host, new)
            revision = bucket.compare_and_set(key, encode(new), expected)
            if revision is None:
                self.lost += 1
                plan_writes.lost(self.state, host, before)
                latest, value = bucket.last(key)  # read from the leader
                self.state.apply(key, value, latest)
            else:
                plan_writes.won(self.state, host, new, revision)


def seeded_bucket() -> Bucket:
    bucket = Bucket()
    bucket.put(subjects.CONFIG_KEY, encode(CONFIGS[0]))
    for host in HOSTS:
        bucket.put(subjects.report_key(host), report(host))
    for r in range(len(bucket.upto)):
        bucket.catch_up(r)
    return bucket


EVENTS = (
    *[("config", c) for c in range(len(CONFIGS))],
    ("report", "h1", 6),
    *[("restart_planner", i, r) for i in (0, 1) for r in (0, 1, 2, 2)],  # its new watch on replica r
    *[("node_stops", r) for r in (0, 1, 2)],  # its replica stops following the leader
    *[("node_catches_up", r) for r in (0, 1, 2)],
    *[("lease", i, zombie) for i in (0, 1) for zombie in (False, True)],  # a zombie holder writes once more
    *[(kind, i) for kind in ("tick", "deliver", "replan") for i in (0, 1)],
)
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(st.lists(st.sampled_from(EVENTS), min_size=1, max_size=30))
def test_a_hosts_plan_revision_in_the_bucket_never_goes_down(events):
    bucket = seeded_bucket()
    following = {0, 1}  # replicas whose copy follows the leader: nats-3 was restarted and lags
    planners = [Planner("p0", 0), Planner("p1", 1)]
    holder = 0
    planners[0].state.following = False
    planners[1].state.leader = "p0"
    for event in events:
        kind, *args = event
        if kind == "config":
            bucket.put(subjects.CONFIG_KEY, encode(msgspec.structs.replace(CONFIGS[args[0]], revision=len(bucket.log))))
        elif kind == "report":
            host, free = args
            bucket.put(subjects.report_key(host), report(host, free=free))
        elif kind == "restart_planner":
            i, replica = args
            planners[i] = Planner(f"p{i}-{len(bucket.log)}", replica)
            planners[i].state.following = i != holder
            planners[i].state.leader = planners[holder].state.planner_id
            planners[1 - i].state.leader = planners[holder].state.planner_id
        elif kind == "node_stops":
            following.discard(args[0])
        elif kind == "node_catches_up":
            following.add(args[0])
        elif kind == "lease":
            new, zombie = args
            old, holder = holder, new
            planners[new].state.following, planners[new].state.replan_all = False, True
            planners[1 - new].state.leader = planners[new].state.planner_id
            if zombie and old != new:
                planners[old].deliver(bucket)
                planners[old].replan(bucket)  # it still believed it held the lease
            if old != new:
                planners[old].state.following = True
        elif kind == "deliver":
            planners[args[0]].deliver(bucket)
        elif kind == "replan":
            planners[args[0]].replan(bucket)
        elif kind == "tick":
            planners[args[0]].deliver(bucket)
            planners[args[0]].replan(bucket)
        for r in following:
            bucket.catch_up(r)
    # Steer the search to runs with stale views that lose compare-and-sets and plans well past 1.
    target(float(sum(p.lost for p in planners)), label="lost writes")
    target(float(max((max(r) for r in bucket.plan_revisions.values()), default=0)), label="plan revision")
    for key, revisions in bucket.plan_revisions.items():
        assert revisions == sorted(revisions), f"{key}: plan revisions written {revisions}"


def test_a_planner_whose_snapshot_lacked_a_plan_carries_on_from_it_once_seen():
    """The case that wrote revision 1 over a newer plan: a restarted planner whose watch (on a
    replica still catching up) held no plan for a host sees it only after its snapshot."""
    bucket = seeded_bucket()
    first = Planner("p0", 0)
    first.state.following = False
    first.deliver(bucket)
    first.replan(bucket)
    bucket.put(subjects.CONFIG_KEY, encode(msgspec.structs.replace(CONFIGS[1], revision=1)))
    bucket.catch_up(0)
    first.deliver(bucket)
    first.replan(bucket)
    assert bucket.plan_revisions[subjects.plan_key("h1")] == [1, 2]
    stale = Planner("p1", 1)
    stale.state.following = False
    stale.state.apply(subjects.CONFIG_KEY, encode(msgspec.structs.replace(CONFIGS[1], revision=1)), 1)
    for host in HOSTS:
        stale.state.apply(subjects.report_key(host), report(host), 2)
    stale.snapshot_done, stale.state.caught_up = True, True
    stale.cursor = len(bucket.log)  # its replica brings the plans only now, after the snapshot
    for i, (key, value) in enumerate(bucket.log):
        if key.startswith("plan."):
            stale.state.apply(key, value, i + 1)
    stale.replan(bucket)
    for host in HOSTS:
        assert stale.state.plans[host].plan_revision == 2  # the same plan, now written by p1
        assert bucket.plan_revisions[subjects.plan_key(host)] == [1, 2, 2], "replanned from nothing"


# ------------------------------------------------------------------ against nats-server


async def _planner(nc, kv, name: str, entries) -> PlannerService:
    """A planner holding the lease whose view of the bucket is `entries` (key, value, revision)."""
    planner = PlannerService(nc, kv, name=name)
    planner.state.planner_id = name
    await kv.delete(subjects.LEASE_KEY)  # the previous holder is gone
    await planner.lease.step()
    assert planner.lease.holds()
    for key, value, revision in entries:
        await planner._on_entry(key, value, revision)
    await planner._on_caught_up()
    return planner


async def _entry(kv, key: str, revision: int | None = None):
    found = await kv.get(key, revision=revision)
    return key, found.value, found.revision


async def test_a_planner_with_a_stale_view_writes_nothing_over_a_newer_plan(nats_server):
    key = subjects.plan_key("h1")
    async with client(nats_server.url) as nc:
        kv = await kv_bucket(nc, create=True)
        await kv.put(subjects.CONFIG_KEY, encode(CONFIGS[0]))
        await kv.put(subjects.report_key("h1"), report("h1"))
        first = await _planner(nc, kv, "first", [await _entry(kv, subjects.CONFIG_KEY), await _entry(kv, subjects.report_key("h1"))])
        await first.write_plans()
        old_plan = await _entry(kv, key)  # revision 1, soon stale
        for n, config in enumerate(CONFIGS[1:3], start=1):
            await kv.put(subjects.CONFIG_KEY, encode(msgspec.structs.replace(config, revision=n)))
            await first._on_entry(*await _entry(kv, subjects.CONFIG_KEY))
            await first.write_plans()
        newest = msgspec.json.decode((await kv.get(key)).value, type=HostPlan)
        assert newest.plan_revision == 3
        inputs = [await _entry(kv, subjects.CONFIG_KEY), await _entry(kv, subjects.report_key("h1"))]

        # A restarted planner whose watch gave it the plan as it was two revisions ago.
        stale = await _planner(nc, kv, "stale", [*inputs, old_plan])
        assert stale.state.plans["h1"].plan_revision == 1
        await stale.write_plans()
        assert msgspec.json.decode((await kv.get(key)).value, type=HostPlan) == newest, "a stale plan overwrote r3"
        await stale.write_plans()  # the lost compare-and-set read the latest entry from the leader

        # A restarted planner whose snapshot had no plan for h1 and sees r3 only afterwards.
        late = await _planner(nc, kv, "late", inputs)
        await late._on_entry(*await _entry(kv, key))
        await late.write_plans()

        revisions = [msgspec.json.decode(e.value, type=HostPlan).plan_revision for e in await kv.history(key)]
        assert revisions == sorted(revisions) and revisions[-1] >= 3, revisions


async def test_a_config_set_before_the_watch_shows_the_config_merges_onto_the_bucket(nats_server):
    """The CI failure of stop 42: a planner answers `config set` as soon as its endpoints are up;
    its watch had not yet shown it the entry `ensure_config` found, and the compare-and-set on
    revision 0 answered 409. It must merge onto the config the bucket holds."""
    async with client(nats_server.url) as nc, AsyncExitStack() as stack:
        kv = await kv_bucket(nc, create=True)
        await kv.put(subjects.CONFIG_KEY, encode(msgspec.structs.replace(CONFIGS[1], revision=4)))  # another planner's
        planner = PlannerService(nc, kv, name="fresh")  # no watch: its state is still the empty default
        await endpoints.ensure_config(planner)
        await endpoints.add_endpoints(planner, stack)
        assert planner.state.config_kv_rev == 0

        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"n_ubatch": 256})), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
        stored = msgspec.json.decode((await kv.get(subjects.CONFIG_KEY)).value, type=FleetConfig)
        assert (stored.kv_cache_type, stored.n_ubatch, stored.revision) == ("q8_0", 256, 5)
        assert msgspec.json.decode(reply.data, type=FleetConfig) == stored
