"""Hypothesis fuzzing of everything the planner and the agent consume, over a real nats-server.

One planner, one agent (host1, the fake llama-server) and one gateway run for the whole module in
an event loop on a background thread. Each fuzz test is synchronous and runs a
synchronous @given function that hands every example to that loop
(asyncio.run_coroutine_threadsafe), so all examples hit the same live services, then
checks them: still running, the lane's process untouched and alone, every bad plan
rejected on lanes.rejected.host1, every bad KV entry dropped (and logged) by the planner.

Payloads: raw bytes, random JSON, objects built from the msgspec types themselves
(msgspec.inspect: right field names with values inside, at and beyond their bounds,
wrong types, unknown tags and keys) and mutations of the real documents the services
wrote (report, status, plan, config). A payload the services would *accept* would
legitimately change the fleet (a valid config or demand relaunches the lane), so the
tests decide with the wire types what is acceptable and send only the rest.

The tests at the end pin bugs this fuzzing
found; their reasons say where.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import os
import shutil
import threading
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import psutil
import pytest
import structlog
from fixtures_bus import agent_config, fake_binary, lane_of
from waiting import eventually
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from launcher_agent.reconcile import validate_plan
from launcher_agent.service import run_agent
from launcher_agent.supervisor import model_file_exists
from planner_svc.service import run_planner
from shared import subjects
from shared.bus import connect, kv_bucket
from shared.llama.flags import lane_args
from shared.messages.activity import GatewayActivity, ModelWake, PlannerLease
from shared.messages.config import Demand, FleetConfig
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan, LaneSpec
from shared.messages.replies import ConfigSet, FleetQuery, FleetStatus, HostQuery
from shared.messages.status import HostStatus, PlanRejected
from shared.messages.wire import encode
from shared.natsserver import NatsServer

HOST = "host1"
LANE = "llama8-0"
DROPPED = "dropped malformed kv entry"  # the planner's log event for a KV entry it cannot use

# The benchmark (bench/fuzz_bench.py) runs one target at a time with many more examples:
# LANES_FUZZ_TARGET names an endpoint, a KV key or "plans"/"rejections"; LANES_FUZZ_EXAMPLES
# sets the examples. Unset (CI), every target is fuzzed with the defaults below.
TARGET = os.environ.get("LANES_FUZZ_TARGET", "")
EXAMPLES = int(os.environ.get("LANES_FUZZ_EXAMPLES", "0") or 0)


def examples(default: int) -> int:
    return EXAMPLES or default


def benchmark_target(*names: str) -> None:
    """In a benchmark run for one target, the other fuzz tests stand aside."""
    if TARGET and TARGET not in names:
        pytest.skip(f"benchmark run for {TARGET}")


FUZZ = settings(
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

# ====================================================================== strategies

_EDGE_INTS = [0, -1, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
_EDGE_STRS = ["", " ", "host1", "host2", "llama8", "llama8-0", "q8_0", "f16", "on", "off", "none", "null", "true",
              "1e999", "-1", "../../etc/passwd", "/etc/passwd", "a.b", "a b", "x" * 129, "é", "\u0000", "\ud7ff",
              "$KV.lanes.>", "lanes.>", "*", ">"]  # fmt: skip

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(_EDGE_INTS),
    st.floats(),  # NaN and +-Infinity render as bare NaN/Infinity: not JSON at all
    st.text(max_size=40),
    st.sampled_from(_EDGE_STRS),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)

ALL_TAGS = ["host_report", "fleet_config", "demand", "host_plan", "fleet_plan", "host_status", "lane_event",
            "plan_rejected", "config_set", "host_query", "error", "fleet_status"]  # fmt: skip


def _bounds(info) -> tuple[int | None, int | None]:
    lo = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else None)
    hi = info.le if info.le is not None else (info.lt - 1 if info.lt is not None else None)
    return lo, hi


def plausible(info: mi.Type, depth: int = 0) -> st.SearchStrategy:
    """Values shaped like a msgspec type: in range, on its edges and just past them."""
    if isinstance(info, mi.IntType):
        lo, hi = _bounds(info)
        edges = [v for b in (lo, hi) if b is not None for v in (b - 1, b, b + 1)]
        return st.one_of(st.integers(min_value=lo, max_value=hi), st.sampled_from(edges or _EDGE_INTS))
    if isinstance(info, mi.FloatType):
        edges = [v for v in (info.ge, info.le, info.gt, info.lt) if v is not None]
        near = [e + d for e in edges for d in (-1e-9, 0.0, 1e-9)]
        return st.one_of(st.floats(min_value=info.ge, max_value=info.le), st.sampled_from(near or [0.0]), st.floats())
    if isinstance(info, mi.StrType):
        options = [st.text(max_size=20), st.sampled_from(_EDGE_STRS)]
        if info.pattern:
            options.append(st.from_regex(info.pattern, fullmatch=True).filter(lambda s: len(s) <= 140))
        if info.max_length:
            options.append(st.just("a" * (info.max_length + 1)))
        return st.one_of(options)
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.LiteralType):
        return st.one_of(st.sampled_from(list(info.values)), st.sampled_from(_EDGE_STRS))
    if isinstance(info, mi.UnionType):
        return st.one_of([plausible(t, depth) for t in info.types])
    if isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return st.lists(plausible(info.item_type, depth + 1), max_size=3 if depth < 2 else 1)
    if isinstance(info, mi.TupleType):
        return st.tuples(*(plausible(t, depth + 1) for t in info.item_types)).map(list)
    if isinstance(info, mi.DictType):
        return st.dictionaries(plausible(info.key_type, depth + 1), plausible(info.value_type, depth + 1), max_size=3)
    if isinstance(info, mi.StructType):
        return hostile_struct(info, depth + 1) if depth < 4 else st.just({})
    return json_values


def hostile_struct(info: mi.StructType, depth: int = 0) -> st.SearchStrategy[dict]:
    """Dicts shaped like a Struct: its field names, values right or wrong, tags known or not."""
    tags = st.sampled_from([info.tag, info.tag, *ALL_TAGS]) | st.text(max_size=12)
    fields = [
        (f.encode_name, 8 if f.required else 5, st.one_of(plausible(f.type, depth), plausible(f.type, depth), json_values))
        for f in info.fields
    ]  # built once: drawing is cheap, building strategies is not
    extras = st.dictionaries(st.text(max_size=12), json_values, min_size=1, max_size=3)

    @st.composite
    def build(draw) -> dict:
        out: dict = {}
        if info.tag_field and draw(st.integers(0, 4)):
            out[info.tag_field] = draw(tags)
        for name, weight, values in fields:
            if draw(st.integers(0, 9)) < weight:
                out[name] = draw(values)
        if not draw(st.integers(0, 4)):
            out.update(draw(extras))
        return out

    return build()


@functools.lru_cache(maxsize=None)
def struct_of(t: type) -> st.SearchStrategy:
    return hostile_struct(mi.type_info(t))


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated(draw, doc) -> object:
    """A real document with one to three nodes replaced, deleted, or given unknown siblings."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            return draw(json_values)
        path = draw(st.sampled_from(paths))
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        op = draw(st.sampled_from(["replace", "replace", "delete", "sibling"]))
        if op == "delete":
            del parent[path[-1]]
        elif op == "sibling" and isinstance(parent, dict):
            parent[draw(st.text(max_size=12))] = draw(json_values)
        else:
            parent[path[-1]] = draw(json_values)
    return doc


def _dumps(value) -> bytes:
    return json.dumps(value).encode()


@st.composite
def cut(draw, payloads: st.SearchStrategy) -> bytes:
    data = draw(payloads)
    if len(data) > 1 and not draw(st.integers(0, 5)):
        return data[: draw(st.integers(0, len(data) - 1))]
    return data


def payloads(t: type | None = None, docs: list | None = None) -> st.SearchStrategy[bytes]:
    parts = [st.binary(max_size=120), json_values.map(_dumps)]
    if t is not None:
        parts += [struct_of(t).map(_dumps)] * 2
    for doc in docs or ():
        parts += [mutated(doc).map(_dumps)] * 3
    return cut(st.one_of(parts))


# ====================================================================== what the services accept


def decodes(data: bytes, t: type):
    try:
        return msgspec.json.decode(data, type=t)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def config_set_accepted(data: bytes, current: FleetConfig) -> bool:
    """What the planner's config.set does with a request, short of writing it."""
    change = decodes(data, ConfigSet)
    if change is None:
        return False
    merged = msgspec.structs.asdict(current) | dict(change.changes)
    merged.pop("kind", None)
    try:
        msgspec.convert(merged, FleetConfig, strict=False)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return False
    return True


KEY_TYPES = {"report": HostReport, "status": HostStatus, "plan": HostPlan}


def planner_takes(key: str, value: bytes) -> bool:
    """True when the planner's state would take this KV entry (so it would replan)."""
    if key == subjects.CONFIG_KEY:
        return decodes(value, FleetConfig) is not None
    if key == subjects.DEMAND_KEY:
        return decodes(value, Demand) is not None
    kind, _, host = key.partition(".")
    msg = decodes(value, KEY_TYPES[kind])
    return msg is not None and subjects.host_token(msg.host_id) == host


# ====================================================================== the running fleet


class Fleet:
    """nats-server, planner and agent host1 in an event loop on a background thread."""

    def __init__(self, tmp: Path, models: Path, logs: list[dict]):
        self.tmp, self.models, self.logs = tmp, models, logs
        self.server = NatsServer(tmp / "nats").start()
        self.url = self.server.url
        # No periodic report: a fresh report makes the planner replan, and a replan after a
        # hostile plan entry relaunches the lane (test_rejected_plan_does_not_steer_the_next_plan),
        # which would blur what the fuzzing itself did.
        self.cfg = agent_config(tmp, HOST, models, fake_binary(tmp / "bin"), report_interval=3600.0)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-fleet", daemon=True)
        self.thread.start()
        self.rejected: list[PlanRejected] = []
        self.sent_bad_plans = self.sent_requests = 0
        self.agent_plan: HostPlan | None = None
        self.expected_drops: dict[str, int] = {}

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def start(self) -> None:
        self.stop_event = asyncio.Event()
        self.planner = asyncio.create_task(run_planner(self.url, self.stop_event))
        self.agent = asyncio.create_task(run_agent(self.cfg, self.url, self.stop_event))
        self.gateway = Gateway(GatewaySettings(port=0))  # it reads the same KV entries the planner does
        self.gateway_task = asyncio.create_task(run_gateway(self.url, self.stop_event, gateway=self.gateway))
        self.nc = await connect(self.url, name="fuzz-client", retry_forever=False)

        async def on_rejected(msg):
            self.rejected.append(msgspec.json.decode(msg.data, type=PlanRejected))

        await self.nc.subscribe(subjects.rejected_subject(HOST), cb=on_rejected)
        self.kv = await eventually(lambda: kv_bucket(self.nc), what="lanes bucket")
        self.lane = await eventually(self.healthy_lane, timeout=40, what="lane healthy")
        await eventually(lambda: self.gateway.view.routable("llama8"), timeout=20, what="the gateway routes the lane")
        self.report = json.loads((await self.kv.get(subjects.report_key(HOST))).value)
        self.status = json.loads((await self.kv.get(subjects.status_key(HOST))).value)
        self.plan_entry = await self.kv.get(subjects.plan_key(HOST))
        self.plan = json.loads(self.plan_entry.value)
        self.config = msgspec.json.decode((await self.nc.request(subjects.CONFIG_GET, b"", timeout=5)).data, type=FleetConfig)

    async def planner_active(self, active: bool) -> bool:
        status = msgspec.json.decode((await self.nc.request(subjects.FLEET_STATUS, b"", timeout=5)).data, type=FleetStatus)
        return status.planner_active == active

    async def hold_lease(self) -> None:
        await self.kv.put(subjects.LEASE_KEY, encode(PlannerLease(holder="fuzz-test", ttl=3600.0)))
        await eventually(lambda: self.planner_active(False), timeout=20, what="the planner stands by")

    async def release_lease(self) -> None:
        await self.kv.delete(subjects.LEASE_KEY)
        await eventually(lambda: self.planner_active(True), timeout=20, what="the planner is active again")

    async def agent_status(self) -> HostStatus:
        reply = await self.nc.request(f"{subjects.agent_group(HOST)}.status", b"", timeout=5)
        return msgspec.json.decode(reply.data, type=HostStatus)

    async def healthy_lane(self):
        lane = lane_of(await self.agent_status(), LANE)
        return lane if lane and lane.state == "healthy" else None

    async def shutdown(self) -> None:
        self.stop_event.set()
        await asyncio.wait_for(asyncio.gather(self.planner, self.agent, self.gateway_task, return_exceptions=True), 30)
        await self.nc.close()

    def close(self) -> None:
        try:
            if hasattr(self, "stop_event"):
                self.run(self.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.server.stop()
            for proc in self.lane_processes():  # never leave a lane behind, whatever failed
                proc.kill()

    def lane_processes(self) -> list[psutil.Process]:
        """Every process (a fake llama-server) whose command line names this module's model folder."""
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if any(str(self.models) in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        return found

    def dropped(self, key: str | None = None) -> int:
        return sum(1 for e in list(self.logs) if e.get("event") == DROPPED and (key is None or e.get("key") == key))

    def assert_untouched(self) -> None:
        """The services run, the lane is the same process, no other lane process exists, and the
        gateway still routes to the lane."""
        assert not self.planner.done(), self.planner
        assert not self.agent.done(), self.agent
        assert not self.gateway_task.done(), self.gateway_task
        assert self.gateway.view.routable("llama8"), "the gateway lost the lane"
        lane = self.run(self.healthy_lane())
        assert lane is not None, "the lane is no longer healthy"
        assert lane.pid == self.lane.pid and lane.argv == self.lane.argv
        assert [p.pid for p in self.lane_processes()] == [self.lane.pid]
        status = msgspec.json.decode(self.run(self.nc.request(subjects.FLEET_STATUS, b"", timeout=5)).data, type=FleetStatus)
        assert [s.host_id for s in status.reports] == [HOST]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_models):
    tmp = tmp_path_factory.mktemp("fuzz")
    models = tmp / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "llama8.gguf")
    with structlog.testing.capture_logs() as logs:
        f = Fleet(tmp, models, logs)
        try:
            f.run(f.start())
            yield f
        finally:
            f.close()


# ====================================================================== the planner's endpoints


def _error(reply) -> tuple[str, str] | None:
    headers = reply.headers or {}
    if "Nats-Service-Error-Code" in headers:
        return headers["Nats-Service-Error-Code"], headers.get("Nats-Service-Error", "")
    return None


def _code(reply) -> str | None:
    """The micro error code of a reply (None: a success; "500": the handler raised)."""
    error = _error(reply)
    return error[0] if error else None


_HOST_IDS = st.one_of(st.sampled_from(["host1", "host2", "", "host1.x", "x" * 200, "HOST1", " host1 "]), st.text(max_size=20))
_CONFIG_FIELDS = {f.encode_name: f.type for f in mi.type_info(FleetConfig).fields}
config_changes = st.dictionaries(
    st.one_of(st.sampled_from(sorted(_CONFIG_FIELDS)), st.text(max_size=12)),
    st.one_of(json_scalars, *(plausible(t) for t in _CONFIG_FIELDS.values())),
    max_size=4,
)
config_set_requests = st.one_of(
    payloads(ConfigSet),
    st.fixed_dictionaries({"kind": st.sampled_from(["config_set", "config_set", "fleet_config", "zz"]), "changes": config_changes}).map(_dumps),
    st.fixed_dictionaries({"changes": config_changes}).map(_dumps),
)
demand_requests = payloads(Demand, [{"kind": "demand", "personas": [{"model": "llama8", "parallel": 2, "lanes": 1}]}])
query_requests = st.one_of(payloads(HostQuery, [{"kind": "host_query", "host_id": "host1"}]),
                           st.builds(lambda h: _dumps({"kind": "host_query", "host_id": h}), _HOST_IDS))  # fmt: skip

fleet_queries = payloads(FleetQuery, [{"kind": "fleet_query", "host": "host*", "state": "live", "limit": 2},
                                      {"kind": "fleet_query", "after": "host1", "model": "llama8"}])  # fmt: skip

ENDPOINTS = ["config.set", "demand.set", "plan.get", "plan.explain", "config.get", "fleet.status", "agent", "srv"]


@settings(FUZZ, max_examples=examples(1000))
@given(endpoint=st.sampled_from([TARGET] if TARGET in ENDPOINTS else ENDPOINTS), data=st.data())
def _fuzz_request_endpoints(fleet, endpoint, data):
    event(endpoint)
    fleet.sent_requests += 1
    if endpoint == "config.set":
        body = data.draw(config_set_requests)
        if config_set_accepted(body, fleet.config):
            event("config.set: valid, not sent")
            fleet.sent_requests -= 1
            return
        reply = fleet.run(fleet.nc.request(subjects.CONFIG_SET, body, timeout=5))
        assert _code(reply) == "400", (body, reply.headers)
    elif endpoint == "demand.set":
        body = data.draw(demand_requests)
        if decodes(body, Demand) is not None:
            event("demand.set: valid, not sent")
            fleet.sent_requests -= 1
            return
        reply = fleet.run(fleet.nc.request(subjects.DEMAND_SET, body, timeout=5))
        assert _code(reply) == "400", (body, reply.headers)
    elif endpoint in ("plan.get", "plan.explain"):
        body = data.draw(query_requests)
        subject = subjects.PLAN_GET if endpoint == "plan.get" else subjects.PLAN_EXPLAIN
        reply = fleet.run(fleet.nc.request(subject, body, timeout=5))
        query = decodes(body, HostQuery)
        if query is None:
            assert _code(reply) == "400", (body, reply.headers)
        elif subjects.host_token(query.host_id) == HOST:
            assert _code(reply) is None, (body, reply.headers)
            if endpoint == "plan.get":
                assert msgspec.json.decode(reply.data, type=HostPlan).host_id == HOST
        else:
            assert _code(reply) == "404", (body, reply.headers)
    elif endpoint == "config.get":
        reply = fleet.run(fleet.nc.request(subjects.CONFIG_GET, data.draw(payloads()), timeout=5))
        assert msgspec.json.decode(reply.data, type=FleetConfig) == fleet.config
    elif endpoint == "fleet.status":  # a page of the fleet: an empty body asks for the first, a FleetQuery for one
        body = data.draw(fleet_queries)
        reply = fleet.run(fleet.nc.request(subjects.FLEET_STATUS, body, timeout=5))
        if body.strip() and decodes(body, FleetQuery) is None:
            assert _code(reply) == "400", (body, reply.headers)
        else:
            assert _code(reply) is None, (body, reply.headers)
            assert msgspec.json.decode(reply.data, type=FleetStatus).config == fleet.config
    elif endpoint == "agent":
        name = data.draw(st.sampled_from(["status", "info"]))
        reply = fleet.run(fleet.nc.request(f"{subjects.agent_group(HOST)}.{name}", data.draw(payloads()), timeout=5))
        assert msgspec.json.decode(reply.data, type=HostStatus if name == "status" else HostReport).host_id == HOST
    else:
        verb = data.draw(st.sampled_from(["PING", "INFO", "STATS"]))
        name = data.draw(st.sampled_from(["", f".{subjects.PLANNER_SERVICE}", f".{subjects.AGENT_SERVICE}"]))
        reply = fleet.run(fleet.nc.request(f"$SRV.{verb}{name}", data.draw(payloads()), timeout=5))
        assert reply.data


def test_fuzz_request_endpoints(fleet):
    """Every request gets an answer (no hang), never a 500 (an unhandled exception), 400 when invalid;
    afterwards both services run, the lane is untouched and the config unchanged."""
    benchmark_target(*ENDPOINTS)
    fleet.sent_requests = 0
    _fuzz_request_endpoints(fleet)
    print(f"request fuzz: {fleet.sent_requests} requests sent")
    assert fleet.sent_requests > 0.7 * examples(1000)
    fleet.assert_untouched()
    config = msgspec.json.decode(fleet.run(fleet.nc.request(subjects.CONFIG_GET, b"", timeout=5)).data, type=FleetConfig)
    assert config == fleet.config


# ====================================================================== KV entries the planner reads


_TOKENS = st.from_regex(r"\A[A-Za-z0-9_-]{1,16}\Z").filter(lambda t: t != HOST)
_OTHER_HOSTS = ["host2", "hOsT_3", "h-" + "x" * 14, "9"]  # few, so each key's strategy is built once
PLANNER_KEYS = [subjects.CONFIG_KEY, subjects.DEMAND_KEY, subjects.report_key(HOST), subjects.status_key(HOST)] + [
    f"{kind}.{host}" for kind in ("report", "status", "plan") for host in _OTHER_HOSTS
]
planner_keys = st.sampled_from([TARGET] if TARGET in PLANNER_KEYS else PLANNER_KEYS)
other_keys = st.builds(lambda a, b: f"{a}.{b}", _TOKENS.filter(lambda t: t not in ("report", "status", "plan")), _TOKENS)


def _kv_payloads(fleet, key: str) -> st.SearchStrategy[bytes]:
    """Built once per key (building strategies is what costs, not drawing from them)."""
    cache = fleet.__dict__.setdefault("kv_strategies", {})
    if key not in cache:
        cache[key] = _build_kv_payloads(fleet, key)
    return cache[key]


def _build_kv_payloads(fleet, key: str) -> st.SearchStrategy[bytes]:
    if key == subjects.CONFIG_KEY:
        return payloads(FleetConfig, [msgspec.to_builtins(fleet.config)])
    if key == subjects.DEMAND_KEY:
        return payloads(Demand, [{"kind": "demand", "personas": [{"model": "llama8"}]}])
    kind, _, host = key.partition(".")
    doc = {"report": fleet.report, "status": fleet.status, "plan": fleet.plan}[kind]
    # The real document as written for this key's host: only its body is hostile.
    return payloads(KEY_TYPES[kind], [dict(doc, host_id=host)])


@settings(FUZZ, max_examples=examples(1000))
@given(data=st.data())
def _fuzz_planner_kv_entries(fleet, data):
    if not TARGET and data.draw(st.integers(0, 9)) == 0:
        key, value = data.draw(other_keys), data.draw(payloads())
        event("unrelated key")
    else:
        key = data.draw(planner_keys)
        value = data.draw(_kv_payloads(fleet, key))
        if planner_takes(key, value):
            event("valid entry, not sent")
            return
        fleet.expected_drops[key] = fleet.expected_drops.get(key, 0) + 1
        event(f"bad {key.partition('.')[0]}")
    fleet.run(fleet.kv.put(key, value))


def test_fuzz_planner_kv_entries(fleet):
    """Entries the planner cannot use are dropped, each with a log line; other keys are ignored;
    a bad plan entry is overwritten with the planner's own plan; the lane is untouched."""
    benchmark_target(*PLANNER_KEYS)
    fleet.expected_drops = {}
    before_total = fleet.dropped()
    gateway_before = fleet.gateway.view.bad_entries
    before: dict[str, int] = {}
    for e in list(fleet.logs):
        if e.get("event") == DROPPED:
            before[e.get("key")] = before.get(e.get("key"), 0) + 1
    _fuzz_planner_kv_entries(fleet)
    expected = dict(fleet.expected_drops)
    print(f"kv fuzz: malformed entries sent per key: {expected}")
    assert sum(expected.values()) > (0.05 if TARGET else 0.2) * examples(1000), f"too few malformed entries: {expected}"

    def all_dropped():
        return all(fleet.dropped(k) - before.get(k, 0) >= n for k, n in expected.items())

    fleet.run(eventually(all_dropped, timeout=20, what="the planner dropped every malformed entry"))
    assert fleet.dropped() - before_total >= sum(expected.values())
    # The gateway drops the same entries (all but the demand, which it does not read) and keeps its view.
    for_gateway = sum(n for k, n in expected.items() if k != subjects.DEMAND_KEY)
    fleet.run(eventually(lambda: fleet.gateway.view.bad_entries - gateway_before >= for_gateway, timeout=20,
                         what=f"the gateway dropped {for_gateway} malformed entries"))  # fmt: skip
    fleet.assert_untouched()
    # Malformed plan entries were overwritten: the key holds the planner's own plan again,
    # asking for exactly the lane it asked for before the fuzz.
    before_plan = decodes(fleet.plan_entry.value, HostPlan)

    async def restored():
        now = decodes((await fleet.kv.get(subjects.plan_key(HOST))).value, HostPlan)
        return now if now is not None and now.lanes == before_plan.lanes else None

    after_plan = fleet.run(eventually(restored, timeout=10, what="the planner's plan back on the key"))
    assert after_plan.plan_revision >= before_plan.plan_revision


# ====================================================================== plans the agent reads


def _spec_variants(fleet) -> list[dict]:
    """The real plan with one field of its lane set to something the agent must refuse."""
    good = fleet.plan
    spec = good["lanes"][0]
    models = str(fleet.models)
    variants = []
    for field, value in [("model_path", "/etc/passwd"), ("model_path", f"{models}/../llama8.gguf"),
                         ("model_path", f"{models}/missing.gguf"), ("model_path", f"{models}/"),
                         ("port", 9), ("port", spec["port"] + 1), ("ctx_total", spec["ctx_total"] * 2),
                         ("cache_type_v", "q4_0"), ("cache_type_k", "q4_1"), ("flash_attn", "off"),
                         ("args", [*spec["args"], "--rpc", "evil:1"]), ("args", []), ("args", spec["args"][:-2]),
                         ("lane_id", "../x"), ("alias", "other"),
                         # --rpc and --device: shape, count, ports, duplicates (decode or validate_plan)
                         ("rpc_servers", ["evil:0"]), ("rpc_servers", ["evil:70000"]), ("rpc_servers", ["a:1", "a:1"]),
                         ("rpc_servers", ["a b:1"]), ("rpc_servers", ["a:1,b:2"]), ("rpc_servers", [f"h{i}:1" for i in range(65)]),
                         ("device_names", ["CUDA0,CUDA1"]), ("device_names", ["CUDA0"]), ("device_names", ["x" * 200]),
                         ("device_names", ["--help"])]:  # fmt: skip
        variants.append(dict(good, plan_revision=good["plan_revision"] + 1, lanes=[dict(spec, **{field: value})]))
    variants.append(dict(good, host_id="host2", plan_revision=good["plan_revision"] + 1))
    variants.append(dict(good, plan_revision=good["plan_revision"] + 1, lanes=[spec, dict(spec, lane_id="llama8-1")]))
    variants.append(dict(good, plan_revision=-1, lanes=[]))
    return variants


_LANE_FIELDS = {f.encode_name: plausible(f.type) for f in mi.type_info(LaneSpec).fields}


@st.composite
def tweaked_plans(draw, plan: dict, caps) -> dict:
    """The real plan with lane fields set to values of the right type (so it still decodes),
    its args left alone or re-rendered from the tweaked spec (so only the deeper checks stand)."""
    plan = copy.deepcopy(plan)
    spec = plan["lanes"][0]
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(_LANE_FIELDS)))
        spec[name] = draw(_LANE_FIELDS[name])
    plan["plan_revision"] += draw(st.integers(0, 3))
    if draw(st.booleans()):
        decoded = decodes(_dumps(spec), LaneSpec)
        if decoded is not None:
            spec["args"] = list(lane_args(decoded, caps))
    return plan


def agent_must_reject(fleet, value: bytes) -> bool | None:
    """True: the agent must reject it. False: it would apply it. None: validate_plan itself raises."""
    plan = decodes(value, HostPlan)
    if plan is None:
        return True
    if fleet.agent_plan is not None and plan == fleet.agent_plan:
        return False
    cfg = fleet.cfg
    try:
        reason = validate_plan(
            plan,
            host_id=cfg.host_id,
            model_dirs=cfg.model_dirs,
            port_range=range(cfg.port_base, cfg.port_base + cfg.port_count),
            caps=cfg.caps,
            applied_revision=0,  # the most lenient: rejected here means rejected at any applied revision
            model_exists=model_file_exists,
        )
    except Exception:
        return None
    return reason is not None


@settings(FUZZ, max_examples=examples(700))
@given(data=st.data())
def _fuzz_plans(fleet, data):
    value = data.draw(fleet.plan_payloads)
    verdict = agent_must_reject(fleet, value)
    if verdict is None:
        # validate_plan raises on it (e.g. a NUL byte or an over-long name in model_path):
        # see test_plan_that_crashes_validation_is_rejected. Sending it would leave the agent
        # re-reading it in a loop, so it is not sent here.
        event("crashes validate_plan, not sent")
        return
    if not verdict:
        event("acceptable plan, not sent")
        return
    if value == getattr(fleet, "last_bad_plan", None):
        event("same entry again, not sent")  # the agent acts on a changed entry only
        return
    fleet.last_bad_plan = value
    event("decodes" if decodes(value, HostPlan) else "malformed")
    fleet.sent_bad_plans += 1
    expected = len(fleet.rejected) + 1
    fleet.run(fleet.kv.put(subjects.plan_key(HOST), value))
    # The agent reads its key's latest value when it is written: the next write waits for its answer.
    fleet.run(eventually(lambda: len(fleet.rejected) >= expected, timeout=10, interval=0.005, what="rejection"))


def test_fuzz_plans(fleet):
    """Every bad plan produced a PlanRejected; no lane process started; the planner dropped the malformed."""
    benchmark_target("plans")
    fleet.agent_plan = decodes(fleet.plan_entry.value, HostPlan)
    fleet.sent_bad_plans = 0
    variants = st.sampled_from(_spec_variants(fleet))
    fleet.plan_payloads = st.one_of(
        payloads(HostPlan, [fleet.plan]),
        variants.map(_dumps),
        variants.flatmap(mutated).map(_dumps),
        tweaked_plans(fleet.plan, fleet.cfg.caps).map(_dumps),
        tweaked_plans(fleet.plan, fleet.cfg.caps).map(_dumps),
    )
    rejected_before = len(fleet.rejected)
    dropped_before = fleet.dropped(subjects.plan_key(HOST))
    # The planner rewrites any plan it did not write; the agent reads its key's latest value,
    # so a rewrite could overtake a bad plan. The test holds the planner's lease meanwhile
    # (the planner stands by: it follows the bucket and writes nothing).
    fleet.run(fleet.hold_lease())
    try:
        _fuzz_plans(fleet)
    finally:
        fleet.run(fleet.release_lease())
    assert fleet.sent_bad_plans > 0.25 * examples(700)
    fleet.run(eventually(lambda: len(fleet.rejected) - rejected_before >= fleet.sent_bad_plans, timeout=20,
                         what=f"{fleet.sent_bad_plans} rejections"))  # fmt: skip
    fleet.run(asyncio.sleep(1.0))
    new = fleet.rejected[rejected_before:]
    reasons: dict[str, int] = {}
    for r in new:
        head = r.reason.split(":")[0] if r.reason.startswith("malformed") else r.reason.split(": ")[-1][:40]
        reasons[head] = reasons.get(head, 0) + 1
    print(f"plan fuzz: {fleet.sent_bad_plans} bad plans sent; rejections by reason: {reasons}")
    assert len(new) == fleet.sent_bad_plans  # one each: none lost, none repeated
    assert all(r.host_id == HOST and r.reason for r in new)
    assert any(r.reason.startswith("malformed plan") for r in new)
    assert any("args disagree" in r.reason for r in new)
    assert any("rpc_servers" in r.reason or "rpc server" in r.reason for r in new)
    assert any("device_names" in r.reason or "device" in r.reason for r in new)
    assert fleet.dropped(subjects.plan_key(HOST)) > dropped_before
    fleet.assert_untouched()


# ====================================================================== rejections the planner reads


_REJECTION = {"kind": "plan_rejected", "host_id": HOST, "plan_revision": 1, "reason": "x", "applied_revision": 0}


@settings(FUZZ, max_examples=examples(500))
@given(data=st.data())
def _fuzz_rejections(fleet, data):
    host = data.draw(st.sampled_from([HOST, "host2", "x"]))
    value = data.draw(payloads(PlanRejected, [dict(_REJECTION, host_id=host)]))
    rejection = decodes(value, PlanRejected)
    valid = rejection is not None and subjects.rejected_subject(rejection.host_id) == subjects.rejected_subject(host)
    if valid and rejection.applied_revision > 0:
        event("valid rejection asking for a rewrite, not sent")  # it would move the plan on
        return
    fleet.sent_rejections += 1
    if not valid:
        fleet.bad_rejections += 1
    fleet.run(fleet.nc.publish(subjects.rejected_subject(host), value))


def test_fuzz_rejections(fleet):
    """The planner reads lanes.rejected.*: a malformed one is dropped with a log line, a valid
    one is recorded; neither crashes it nor touches the lane."""
    benchmark_target("rejections")
    fleet.sent_rejections = fleet.bad_rejections = 0
    before = sum(1 for e in list(fleet.logs) if e.get("event") == "dropped malformed rejection")
    _fuzz_rejections(fleet)
    print(f"rejection fuzz: {fleet.sent_rejections} sent, {fleet.bad_rejections} malformed")
    assert fleet.bad_rejections > 0.2 * examples(500)

    def all_dropped():
        return sum(1 for e in list(fleet.logs) if e.get("event") == "dropped malformed rejection") - before >= (
            fleet.bad_rejections
        )

    fleet.run(eventually(all_dropped, timeout=20, what="every malformed rejection dropped"))
    fleet.assert_untouched()


# ====================================================================== wakes and activity the planner reads


_WAKE = {"kind": "model_wake", "name": "llama8", "gateway": "g1"}
_ACTIVITY = {"kind": "gateway_activity", "gateway": "g1", "interval": 2.0,
             "models": [{"name": "llama8", "in_flight": 1, "queued": 0, "idle_s": 1.5}]}  # fmt: skip


@settings(FUZZ, max_examples=examples(500))
@given(data=st.data())
def _fuzz_demand_messages(fleet, data):
    if data.draw(st.booleans()):
        name = data.draw(st.sampled_from(["llama8", "ghost", "x.y"]))
        value = data.draw(payloads(ModelWake, [dict(_WAKE, name=name)]))
        msg = decodes(value, ModelWake)
        valid = msg is not None and subjects.wake_subject(msg.name) == subjects.wake_subject(name)
        subject = subjects.wake_subject(name)
    else:
        gateway = data.draw(st.sampled_from(["g1", "g2"]))
        # Past its bounds: an interval that would hold a model busy for long, counts, names.
        doc = data.draw(st.sampled_from([_ACTIVITY, dict(_ACTIVITY, interval=3600.0), dict(_ACTIVITY, interval=1e300),
                                         dict(_ACTIVITY, models=[dict(_ACTIVITY["models"][0], in_flight=10**7)])]))
        value = data.draw(payloads(GatewayActivity, [dict(doc, gateway=gateway)]))
        msg = decodes(value, GatewayActivity)
        sender = data.draw(st.sampled_from([gateway, gateway, "g3"]))  # g3: reporting under another's name
        valid = msg is not None and subjects.activity_subject(msg.gateway) == subjects.activity_subject(sender)
        subject = subjects.activity_subject(sender)
    fleet.sent_demand += 1
    fleet.bad_demand += not valid
    fleet.run(fleet.nc.publish(subject, value))


def test_fuzz_wakes_and_activity(fleet):
    """The planner reads lanes.wake.* and lanes.activity.*: a malformed message is dropped with a
    log line; none crashes it, and a wake for the model that runs (or for none) touches no lane."""
    benchmark_target("demand")
    fleet.sent_demand = fleet.bad_demand = 0
    events = ("dropped malformed wake", "dropped malformed activity")
    before = sum(1 for e in list(fleet.logs) if e.get("event") in events)
    _fuzz_demand_messages(fleet)
    print(f"demand fuzz: {fleet.sent_demand} sent, {fleet.bad_demand} malformed")
    assert fleet.bad_demand > 0.2 * examples(500)

    def all_dropped():
        return sum(1 for e in list(fleet.logs) if e.get("event") in events) - before >= fleet.bad_demand

    fleet.run(eventually(all_dropped, timeout=20, what="every malformed wake and activity dropped"))
    fleet.assert_untouched()


def test_activity_out_of_range_or_under_another_name_is_dropped_with_its_reason(fleet):
    """One report must not pin a model busy (a long interval, a huge count) nor speak for another gateway."""
    model = _ACTIVITY["models"][0]
    bad = [
        (subjects.activity_subject("g1"), dict(_ACTIVITY, interval=3600.0), "$.interval"),
        (subjects.activity_subject("g1"), dict(_ACTIVITY, models=[dict(model, queued=10**7)]), "$.models[0].queued"),
        (subjects.activity_subject("g1"), dict(_ACTIVITY, models=[dict(model, wait_s=1e6)]), "$.models[0].wait_s"),
        (subjects.activity_subject("g2"), _ACTIVITY, "does not match"),  # g1's report on g2's subject
    ]
    before = len(list(fleet.logs))

    def drops():
        return [e for e in list(fleet.logs)[before:] if e.get("event") == "dropped malformed activity"]

    for subject, doc, _ in bad:
        fleet.run(fleet.nc.publish(subject, _dumps(doc)))
    fleet.run(eventually(lambda: len(drops()) >= len(bad), timeout=10, what="every bad activity report dropped"))
    assert [why in drop["reason"] for (_, _, why), drop in zip(bad, drops())] == [True] * len(bad), drops()
    fleet.assert_untouched()


# ====================================================================== after all the fuzzing


def test_fleet_answers_after_fuzz(fleet):
    fleet.assert_untouched()
    reply = fleet.run(fleet.nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q9_9"})), timeout=5))
    assert _code(reply) == "400"
    for subject in (subjects.CONFIG_GET, subjects.FLEET_STATUS):
        assert _error(fleet.run(fleet.nc.request(subject, b"", timeout=5))) is None
    reply = fleet.run(fleet.nc.request(subjects.PLAN_EXPLAIN, encode(HostQuery(host_id=HOST)), timeout=5))
    assert _error(reply) is None and reply.data.startswith(b"host ")


# ====================================================================== bugs found, fixed, pinned
# Each on a fleet of its own: a bug leaves the fleet in a state the next test should not inherit.


@pytest.fixture
def fresh(tmp_path, tiny_models):
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "llama8.gguf")
    with structlog.testing.capture_logs() as logs:
        f = Fleet(tmp_path, models, logs)
        try:
            f.run(f.start())
            yield f
        finally:
            f.close()


def test_config_set_works_after_a_malformed_config_entry(fresh):
    """A bad `config` value in KV (as the fuzzing writes) must not lock the fleet config."""
    fresh.run(fresh.kv.put(subjects.CONFIG_KEY, b"{not a config"))
    fresh.run(eventually(lambda: fresh.dropped(subjects.CONFIG_KEY), what="drop logged"))
    reply = fresh.run(fresh.nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"n_ubatch": 256})), timeout=5))
    assert _error(reply) is None, reply.headers


def test_config_change_reaches_agent_after_a_malformed_plan_entry(fresh):
    """A bad `plan.host1` value in KV must not cut host1 off from every later plan."""
    fresh.run(fresh.kv.put(subjects.plan_key(HOST), b"{not a plan"))
    fresh.run(eventually(lambda: fresh.dropped(subjects.plan_key(HOST)), what="drop logged"))
    reply = fresh.run(fresh.nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q8_0"})), timeout=5))
    assert _error(reply) is None, reply.headers

    async def relaunched():
        lane = await fresh.healthy_lane()
        return lane if lane and "q8_0" in lane.argv else None

    try:
        fresh.run(eventually(relaunched, timeout=6, what="q8_0 lane healthy"))
    finally:
        lost = sum(1 for e in list(fresh.logs) if e.get("event", "").startswith("plan write lost compare-and-set"))
        print(f"planner lost {lost} compare-and-sets on plan.{HOST}")


def test_plan_that_crashes_validation_is_rejected(fresh):
    spec = fresh.plan["lanes"][0]
    # Held lease: the planner stands by, so its rewrite of the foreign plan cannot reach the
    # agent first (the agent reads its key's latest value; seen once in a fresh-clone CI run).
    fresh.run(fresh.hold_lease())
    try:
        for n, name in enumerate(["llama8\u0000.gguf", "a" * 300 + ".gguf"], start=1):  # a NUL byte; a name too long
            plan = dict(fresh.plan, plan_revision=fresh.plan["plan_revision"] + n,
                        lanes=[dict(spec, model_path=f"{fresh.models}/{name}")])  # fmt: skip
            fresh.run(fresh.kv.put(subjects.plan_key(HOST), _dumps(plan)))
            try:
                fresh.run(eventually(lambda: len(fresh.rejected) >= n, timeout=3, what=f"plan {n} rejected"))
            finally:
                crashes = [e.get("error") for e in list(fresh.logs) if e.get("event") == "kv watch failed; retrying"]
                print(f"agent's plan watch failed: {crashes}")
    finally:
        fresh.run(fresh.release_lease())
    assert not fresh.agent.done()


def test_rejected_plan_does_not_steer_the_next_plan(fresh):
    current = decodes(fresh.plan_entry.value, HostPlan)
    spec = current.lanes[0]
    port = fresh.cfg.port_base + (spec.port - fresh.cfg.port_base + 5) % fresh.cfg.port_count
    # As an older planner would write it, with argv rendered, but its args still say the old port.
    moved = msgspec.structs.replace(spec, port=port, args=lane_args(spec, fresh.cfg.caps))
    hostile = msgspec.structs.replace(current, plan_revision=current.plan_revision + 50, lanes=(moved,))
    # Held lease: the planner stands by, so its rewrite cannot overtake the hostile plan
    # before the agent has read it (the agent reads its key's latest value).
    fresh.run(fresh.hold_lease())
    try:
        fresh.run(fresh.kv.put(subjects.plan_key(HOST), encode(hostile)))
        fresh.run(eventually(lambda: fresh.rejected, what="hostile plan rejected"))
    finally:
        fresh.run(fresh.release_lease())
    report = fresh.run(fresh.kv.get(subjects.report_key(HOST)))
    fresh.run(fresh.kv.put(subjects.report_key(HOST), report.value))  # any new report makes the planner replan
    # The replan keeps the plan, and an unchanged plan is not written: no signal to wait on.
    fresh.run(asyncio.sleep(2.0))
    after = fresh.run(fresh.healthy_lane())
    assert after is not None and (after.port, after.pid) == (fresh.lane.port, fresh.lane.pid), (fresh.lane, after)
