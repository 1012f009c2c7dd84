"""One lane across hosts (planner_svc.spans and the planner's span step): pure, host reports in,
plans out. A span is planned only for a model that fits no single host at its floor; its
split comes from exact per-device costs; every worker's memory is reserved in its own plan."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from test_planner import GIB, host, llama_1b, window

from planner_svc import spans
from planner_svc.layouts import CPU_RESOURCE, Layout
from planner_svc.planner import plan
from shared.lane_key import lane_key
from shared.memory import place
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import HostReport, RpcWorkerOffer, ServerCaps
from shared.messages.plans import FleetPlan, HostPlan, LaneSpec
from shared.messages.status import LaneFeedback
from shared.span_check import SPAN_FAILED

MIB = 2**20


def worker(host_id: str, ram: float, address: str | None = None, ports: int = 4, models=None, **kw) -> HostReport:
    """A host offering itself as a worker (--rpc-worker); by default it holds no model and no llama-server."""
    report = host(host_id, ram_available=int(ram * GIB), ram_total=int(ram * GIB), **kw)
    return msgspec.structs.replace(
        report,
        models=models or (),
        server=kw.get("server"),
        rpc_worker=RpcWorkerOffer(address=address or f"10.0.0.{host_id[-1]}", port_base=50052, port_count=ports),
    )


def serving(ram: float = 3.0, **kw) -> HostReport:
    return host("serve", ram_available=int(ram * GIB), ram_total=int(ram * GIB), **kw)


def by_host(fleet: FleetPlan) -> dict[str, HostPlan]:
    return {h.host_id: h for h in fleet.hosts}


def span_lane(fleet: FleetPlan) -> LaneSpec:
    found = [s for h in fleet.hosts for s in h.lanes if s.workers]
    assert len(found) == 1, [(h.host_id, h.unplaced) for h in fleet.hosts]
    return found[0]


def arg(lane: LaneSpec, flag: str) -> str | None:
    return lane.args[lane.args.index(flag) + 1] if flag in lane.args else None


def check_span_invariants(fleet: FleetPlan, reports: list[HostReport]) -> None:
    """Every device a span touches stays within its host's budget; the spec agrees with itself."""
    assert msgspec.json.decode(msgspec.json.encode(fleet), type=FleetPlan) == fleet
    plans = by_host(fleet)
    reports_by = {r.host_id: r for r in reports}
    lent: dict[str, int] = {}
    for hp in fleet.hosts:
        for w in hp.rpc_workers:
            lent[hp.host_id] = lent.get(hp.host_id, 0) + w.reserved_bytes
            assert w.bind == reports_by[hp.host_id].rpc_worker.address  # only the operator's address
    for hp in fleet.hosts:
        used = lent.get(hp.host_id, 0)
        for lane in hp.lanes:
            used += lane.memory.overhead_bytes + sum(d.total for d in lane.memory.devices if d.index < 0)
        assert used <= hp.budget_ram, (hp.host_id, used, hp.budget_ram)
        for lane in hp.lanes:
            if not lane.workers:
                continue
            assert lane.rpc_servers == tuple(w.endpoint for w in lane.workers)
            assert arg(lane, "--rpc") == ",".join(lane.rpc_servers)
            assert arg(lane, "--device") == ",".join(f"RPC{k}" for k in range(len(lane.workers)))
            devices = {d.index: d for d in lane.memory.devices}
            for k, w in enumerate(lane.workers):
                assert w.index == k
                d = devices[k]
                assert d.backend == "rpc" and d.layers > 0  # a worker that holds nothing is one too many
                assert (w.model_bytes, w.kv_bytes, w.compute_bytes) == (d.model_bytes, d.kv_bytes, d.compute_bytes)
                # its buffers, the largest tensor it receives while loading, and the process
                assert w.reserved_bytes > d.total + spans.RPC_SERVER_OVERHEAD
                served = [x for x in plans[w.host_id].rpc_workers if x.lane_id == lane.lane_id]
                assert len(served) == 1 and served[0].serving_host == hp.host_id
                assert served[0].reserved_bytes == w.reserved_bytes
                assert w.endpoint == f"{served[0].bind}:{served[0].port}"
            if len(lane.workers) > 1:
                # the split is the planner's layer counts, never llama-server's default
                counts = [int(c) for c in arg(lane, "--tensor-split").split(",")]
                assert counts == [devices[k].layers for k in range(len(lane.workers))]
            cpu_layers = sum(d.layers for d in lane.memory.devices if d.index < 0)
            assert cpu_layers + sum(devices[k].layers for k in range(len(lane.workers))) == llama_layers(lane) + 1


def llama_layers(lane: LaneSpec) -> int:
    return {"llama-8b": 32, "llama-1b": 16}[lane.model]


# ------------------------------------------------------------------ the pure pieces


def test_worker_candidates_most_memory_first_and_never_the_serving_host():
    reports = [serving(), worker("w1", 2.0), worker("w2", 4.0), worker("w3", 4.0), host("plain")]
    remaining = {r.host_id: {CPU_RESOURCE: int(r.ram_available * 0.9)} for r in reports}
    got = spans.worker_candidates("serve", reports, remaining, {})
    assert [w.host_id for w in got] == ["w2", "w3", "w1"]  # host id breaks the tie
    assert all(w.budget == remaining[w.host_id][CPU_RESOURCE] - spans.RPC_SERVER_OVERHEAD for w in got)
    # a worker serving as the lane's own host is no worker of it; one without memory left neither
    assert "w2" not in [w.host_id for w in spans.worker_candidates("w2", reports, remaining, {})]
    remaining["w1"][CPU_RESOURCE] = spans.RPC_SERVER_OVERHEAD
    assert "w1" not in [w.host_id for w in spans.worker_candidates("serve", reports, remaining, {})]


def test_worker_ports_previous_first_then_lowest_free_and_none_when_all_taken():
    w = worker("w1", 4.0, ports=3)
    assert spans.free_port(w, set()) == 50052
    assert spans.free_port(w, {50052}) == 50053
    assert spans.free_port(w, set(), previous=50054) == 50054
    assert spans.free_port(w, {50054}, previous=50054) == 50052
    assert spans.free_port(w, set(), previous=60000) == 50052  # outside the range: not kept
    assert spans.free_port(w, {50052, 50053, 50054}) is None
    top = msgspec.structs.replace(w, rpc_worker=RpcWorkerOffer(address="a", port_base=65535, port_count=5))
    assert spans.free_port(top, set()) == 65535 and spans.free_port(top, {65535}) is None
    remaining = {"w1": {CPU_RESOURCE: 4 * GIB}}
    assert spans.worker_candidates("s", [w], remaining, {"w1": {50052, 50053, 50054}}) == []


def test_span_report_adds_one_rpc_device_per_worker_in_rpc_order():
    report = serving()
    ws = [spans.Worker("w1", "10.0.0.1", 50052, "CPU", GIB), spans.Worker("w2", "fd00::2", 50053, "CPU", 2 * GIB)]
    view = spans.span_report(report, ws)
    assert [(g.backend, g.device, g.endpoint, g.vram_free) for g in view.gpus] == [
        ("rpc", "RPC0", "10.0.0.1:50052", GIB), ("rpc", "RPC1", "[fd00::2]:50053", 2 * GIB)
    ]  # fmt: skip
    assert spans.span_remaining(report, {CPU_RESOURCE: 5, ("gpu", 0): 9}, ws) == {
        CPU_RESOURCE: 5, ("gpu", 0): GIB, ("gpu", 1): 2 * GIB
    }  # fmt: skip


@pytest.mark.parametrize("counts", [(5,), (33,), (3, 4), (10, 23), (1, 1, 1), (8, 8, 17)])
def test_layer_counts_as_tensor_split_place_exactly_those_layers(counts):
    gpus = tuple(range(len(counts)))
    layout = spans.counts_layout(gpus, counts, 32)
    shares = layout.shares or (1.0,)
    placed = place(32, layout.n_gpu_layers, shares)
    assert [len(placed.layers_on(d)) for d in gpus] == list(counts)
    assert layout.kind == ("partial" if sum(counts) < 33 else "split" if len(counts) > 1 else "gpu")


def _additive_cost(sizes: list[int], overhead: int = 0):
    """A cost where each layer weighs sizes[il] wherever it lands (the CPU also pays `overhead`)."""

    def cost(layout: Layout):
        p = place(len(sizes) - 1, layout.n_gpu_layers, layout.shares or (1.0,) * max(1, len(layout.gpus)))
        out = {CPU_RESOURCE: overhead}
        for il, d in enumerate(p.layer_device):
            key = CPU_RESOURCE if d < 0 else ("gpu", layout.gpus[d])
            out[key] = out.get(key, 0) + sizes[il]
        return out

    return cost


@pytest.mark.parametrize("budgets", list(itertools.product([0, 3, 7, 12], [2, 5, 9], [4, 10, 40])))
def test_split_layers_fills_each_device_to_its_exact_budget_from_the_last(budgets):
    sizes = [1, 2, 1, 3, 1, 2, 1, 1, 2]  # 8 blocks and the output layer
    cpu, *devs = budgets
    gpus = (0, 1)
    remaining = {CPU_RESOURCE: cpu, ("gpu", 0): devs[0], ("gpu", 1): devs[1]}
    cost = _additive_cost(sizes)
    layout = spans.split_layers(8, gpus, cost, remaining)
    # the exhaustive answer: the last device takes the most trailing layers that fit, then the one before
    best = None
    c1 = max((c for c in range(0, 10) if sum(sizes[9 - c :]) <= devs[1]), default=0)
    c0 = max((c for c in range(0, 10 - c1) if sum(sizes[9 - c1 - c : 9 - c1]) <= devs[0]), default=0)
    if c0 and c1 and sum(sizes[: 9 - c0 - c1]) <= cpu:
        best = (c0, c1)
    if best is None:
        assert layout is None
    else:
        assert layout is not None and layout.shares == best and layout.gpus == gpus
        got = cost(layout)
        assert all(got[r] <= remaining[r] for r in got)


def test_find_span_takes_the_fewest_workers_then_the_largest_window():
    sizes = [2] * 9

    def cost_at(view, layout, window):  # KV grows with the window on every device holding layers
        base = _additive_cost(sizes)(layout)
        return {r: b + (window // 256) * (1 if r != CPU_RESOURCE else 0) for r, b in base.items()}

    report = serving()
    big, small = spans.Worker("w1", "a", 1, "CPU", 30), spans.Worker("w2", "b", 1, "CPU", 6)
    one = spans.find_span(report, {CPU_RESOURCE: 4}, [big, small], 8, cost_at, 256, 256 * 64, 256)
    assert one is not None and [w.host_id for w in one.workers] == ["w1"]
    assert one.layout.n_gpu_layers == 7 and one.window == 256 * (30 - 14)  # 7 layers of 2, one KV unit per 256
    # too little on the big one alone: both, the largest last (it takes the output layer)
    two = spans.find_span(report, {CPU_RESOURCE: 4}, [spans.Worker("w1", "a", 1, "CPU", 12), small], 8, cost_at, 256,
                          256 * 64, 256)  # fmt: skip
    assert two is not None and [w.host_id for w in two.workers] == ["w2", "w1"]
    assert two.layout.shares == (2, 5)  # the last filled first: 5 layers of 2 and its KV in 12
    assert spans.find_span(report, {CPU_RESOURCE: 4}, [small, small], 8, cost_at, 256, 512, 256) is None


def test_find_span_keeps_the_previous_workers_and_window_under_min_gain():
    sizes = [2] * 9

    def cost_at(view, layout, window):
        base = _additive_cost(sizes)(layout)
        return {r: b + (window // 256) * (1 if r != CPU_RESOURCE else 0) for r, b in base.items()}

    ws = [spans.Worker("w1", "a", 1, "CPU", 41), spans.Worker("w2", "b", 1, "CPU", 40)]
    fresh = spans.find_span(serving(), {CPU_RESOURCE: 4}, ws, 8, cost_at, 256, 256 * 64, 256)
    assert [w.host_id for w in fresh.workers] == ["w1"]
    kept = spans.find_span(serving(), {CPU_RESOURCE: 4}, ws, 8, cost_at, 256, 256 * 64, 256,
                           previous=(("w2",), fresh.window - 256), min_gain=0.1)  # fmt: skip
    assert [w.host_id for w in kept.workers] == ["w2"] and kept.window == fresh.window - 256
    moved = spans.find_span(serving(), {CPU_RESOURCE: 4}, ws, 8, cost_at, 256, 256 * 64, 256,
                            previous=(("w2",), 256), min_gain=0.1)  # fmt: skip
    assert moved.window > 256  # far from the best: the gain is worth a restart
    gone = spans.find_span(serving(), {CPU_RESOURCE: 4}, ws[:1], 8, cost_at, 256, 256 * 64, 256,
                           previous=(("w2",), 512), min_gain=0.1)  # fmt: skip
    assert [w.host_id for w in gone.workers] == ["w1"]  # the old worker is gone (lost): replanned


# ------------------------------------------------------------------ the planner with spans


def fleet_of(serve_ram=3.0, workers=(("w1", 3.0), ("w2", 3.0)), **kw):
    return [serving(serve_ram), *(worker(h, r) for h, r in workers)]


def test_no_span_for_a_model_that_fits_one_host():
    reports = [serving(16.0), worker("w1", 16.0)]
    fleet = plan(reports, FleetConfig())
    lane = by_host(fleet)["serve"].lanes[0]
    assert lane.workers == () and "--rpc" not in lane.args
    assert by_host(fleet)["w1"].rpc_workers == () and by_host(fleet)["w1"].lanes == ()


def test_no_span_without_workers_says_why_unplaced():
    fleet = plan([serving(3.0)], FleetConfig())
    hp = by_host(fleet)["serve"]
    assert hp.lanes == () and "does not fit" in hp.unplaced[0].reason


def test_a_model_no_host_holds_alone_spans_the_fewest_workers():
    reports = fleet_of(3.0, (("w1", 2.3), ("w2", 2.3), ("w3", 2.3)))
    fleet = plan(reports, FleetConfig())
    check_span_invariants(fleet, reports)
    lane = span_lane(fleet)
    assert [w.host_id for w in lane.workers] == ["w2", "w1"]  # two are needed (the largest last), the third is left alone
    assert by_host(fleet)["w3"].rpc_workers == ()
    assert any(r.startswith("span: fits no single host") for r in lane.reasons)
    # its plan as `lanes plan --json` shows it: each worker with its device and buffers
    shown = msgspec.to_builtins(lane)["workers"]
    assert all({"host_id", "device", "model_bytes", "kv_bytes", "compute_bytes"} <= set(w) for w in shown)
    assert sum(w["model_bytes"] for w in shown) > 2 * GIB


def test_one_big_worker_is_enough():
    reports = fleet_of(3.0, (("w1", 3.0), ("w2", 8.0)))
    lane = span_lane(plan(reports, FleetConfig()))
    assert [w.host_id for w in lane.workers] == ["w2"] and "--tensor-split" not in lane.args
    assert 0 < lane.n_gpu_layers < 33


def test_workers_memory_is_reserved_in_their_own_plans():
    # w1 also serves a small model of its own: the span's reservation comes off first
    w1 = msgspec.structs.replace(worker("w1", 6.0), models=(llama_1b(),), server=ServerCaps())
    reports = [serving(3.0), w1, worker("w2", 3.0)]
    demand = Demand(personas=(Persona(model="llama-8b", priority=1), Persona(model="llama-1b", ctx_max=131072)))
    fleet = plan(reports, FleetConfig(), demand)
    check_span_invariants(fleet, reports)
    plans = by_host(fleet)
    own = [s for s in plans["w1"].lanes if s.model == "llama-1b"]
    assert own, plans["w1"].unplaced
    alone = plan([msgspec.structs.replace(w1, rpc_worker=None)], FleetConfig(), Demand(personas=demand.personas[1:]))
    assert window(own[0]) < window(by_host(alone)["w1"].lanes[0])  # it grew into less memory


def test_a_lost_worker_is_never_in_a_span_and_the_span_is_replanned():
    reports = fleet_of(3.0, (("w1", 2.3), ("w2", 2.3), ("w3", 2.3)))
    first = plan(reports, FleetConfig())
    previous = {h.host_id: h for h in first.hosts}
    live = [r for r in reports if r.host_id != "w1"]  # the planner plans live hosts only
    second = plan(live, FleetConfig(), previous=previous)
    check_span_invariants(second, live)
    lane = span_lane(second)
    assert [w.host_id for w in lane.workers] == ["w3", "w2"]
    assert by_host(second)["serve"].plan_revision == 2  # the serving host's plan changed


def test_steady_inputs_keep_the_span_and_its_plans():
    reports = fleet_of()
    first = plan(reports, FleetConfig())
    previous = {h.host_id: h for h in first.hosts}
    again = plan(reports, FleetConfig(), previous=previous)
    assert msgspec.json.encode(again) == msgspec.json.encode(first)
    # a little drift in free memory restarts nothing
    drift = [msgspec.structs.replace(r, ram_available=r.ram_available - 8 * MIB) for r in reports]
    drifted = plan(drift, FleetConfig(), previous=previous)
    assert lane_key(span_lane(drifted)) == lane_key(span_lane(first))


def test_two_spans_over_one_worker_get_their_own_ports():
    reports = [
        serving(3.0),
        msgspec.structs.replace(serving(3.0), host_id="serve2"),
        worker("w1", 12.0),
    ]
    fleet = plan(reports, FleetConfig(), Demand(personas=(Persona(model="llama-8b", lanes=2),)))
    check_span_invariants(fleet, reports)
    ports = sorted(w.port for w in by_host(fleet)["w1"].rpc_workers)
    assert ports == [50052, 50053]


def test_a_failed_span_check_is_fed_back_and_blocks_the_span():
    reports = fleet_of()
    lane = span_lane(plan(reports, FleetConfig()))
    fb = LaneFeedback(lane_id=lane.lane_id, model=lane.model, kind="other",
                      detail=f"{SPAN_FAILED}: worker w1 (10.0.0.1:50052) is missing from llama-server's buffer lines")  # fmt: skip
    fleet = plan(reports, FleetConfig(), feedback={"serve": (fb,)})
    hp = by_host(fleet)["serve"]
    assert hp.lanes == () and SPAN_FAILED in hp.unplaced[0].reason
    assert all(not h.rpc_workers for h in fleet.hosts)


def test_a_crash_looping_span_is_not_planned_again_on_that_host():
    reports = fleet_of()
    lane = span_lane(plan(reports, FleetConfig()))
    fb = LaneFeedback(lane_id=lane.lane_id, model=lane.model, kind="crash_loop",
                      detail="failed to connect to 10.0.0.2:50052")  # fmt: skip
    hp = by_host(plan(reports, FleetConfig(), feedback={"serve": (fb,)}))["serve"]
    assert hp.lanes == () and "keeps failing with it: failed to connect" in hp.unplaced[0].reason
    # another host's feedback does not block it
    assert span_lane(plan(reports, FleetConfig(), feedback={"w1": (fb,)})).workers == lane.workers


def test_no_span_from_a_llama_server_built_without_rpc():
    reports = fleet_of()
    reports[0] = msgspec.structs.replace(reports[0], server=ServerCaps(has_rpc=False))
    hp = by_host(plan(reports, FleetConfig()))["serve"]
    assert hp.lanes == () and "built without the RPC backend" in hp.unplaced[0].reason


def test_one_span_per_model_when_every_holder_would_want_one():
    reports = [serving(3.0), msgspec.structs.replace(serving(3.0), host_id="serve2"), worker("w1", 12.0)]
    fleet = plan(reports, FleetConfig())
    spanning = [s for h in fleet.hosts for s in h.lanes if s.workers]
    assert len(spanning) == 1 and by_host(fleet)["w1"].rpc_workers[0].serving_host == "serve"


# ------------------------------------------------------------------ the command line


@pytest.mark.slow  # six `lanes` processes
def test_cli_report_rpc_worker_and_plan_json_show_the_span(tmp_path):
    """`lanes report --rpc-worker` describes a worker (no model folder needed); `lanes plan --hosts
    --json` shows the span lane with its workers."""
    import json

    from fixtures_bus import fake_binary
    from test_cli_offline import assert_one_line_error, lanes

    binary = fake_binary(tmp_path / "bin")
    rpc_server = tmp_path / "bin" / "ggml-rpc-server"
    rpc_server.write_text("#!/bin/sh\n")
    run = lanes("report", "--llama-server", binary, "--host-id", "w1", "--max-ram", "3GiB", "--rpc-worker",
                "--advertise", "10.0.0.7", "--rpc-worker-ports", "50100:3")  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = msgspec.json.decode(run.stdout, type=HostReport)
    assert report.rpc_worker == RpcWorkerOffer(address="10.0.0.7", port_base=50100, port_count=3)
    assert report.models == () and report.ram_total == 3 * GIB
    assert_one_line_error(lanes("report", "--llama-server", binary, "--rpc-worker"), "--rpc-worker needs --advertise")
    assert_one_line_error(lanes("report", "--llama-server", binary, "--rpc-worker", "--advertise", "0.0.0.0"),
                          "not a wildcard")  # fmt: skip
    assert_one_line_error(lanes("report", "--llama-server", binary), "--models")

    hosts = tmp_path / "hosts.json"
    reports = [serving(3.0), worker("w1", 2.3), worker("w2", 2.3)]
    hosts.write_bytes(msgspec.json.encode(reports))
    run = lanes("plan", "--hosts", hosts, "--json")
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)
    lane = next(s for h in shown["hosts"] for s in h["lanes"] if s["workers"])
    assert [w["host_id"] for w in lane["workers"]] == ["w2", "w1"]
    for w in lane["workers"]:
        assert {"host_id", "device", "model_bytes", "kv_bytes", "compute_bytes"} <= set(w) and w["model_bytes"] > 0
    text = lanes("plan", "--hosts", hosts)
    assert "span: fits no single host" in text.stdout and "--rpc 10.0.0.2:50052,10.0.0.1:50052" in text.stdout
    assert "worker w2 at 10.0.0.2:50052 (CPU): model" in text.stdout
    assert "ggml-rpc-server on 10.0.0.1:50052 for serve's llama-8b-0" in text.stdout


def test_a_fleet_with_workers_is_replanned_whole_when_one_host_changes():
    """A span ties hosts' plans together: with a worker in the fleet, one host's new report replans all."""
    from planner_svc.state import PlannerState
    from shared import subjects

    state = PlannerState()
    reports = fleet_of(3.0, (("w1", 2.3), ("w2", 2.3)))
    for i, r in enumerate(reports):
        assert state.apply(subjects.report_key(r.host_id), msgspec.json.encode(r), i + 1)
    state.caught_up = True
    first = state.planning_job()().plans
    assert sorted(first) == ["serve", "w1", "w2"] and first["w1"].rpc_workers and first["w2"].rpc_workers
    for host, p in first.items():
        state.apply(subjects.plan_key(host), msgspec.json.encode(p), 10)
    state.planning_job()()  # whatever reading the plans back asked for
    # the worker w2 has less memory now: the serving host's plan (its span) is replanned with it
    less = msgspec.structs.replace(reports[2], ram_available=reports[2].ram_available - 256 * MIB)
    state.apply(subjects.report_key("w2"), msgspec.json.encode(less), 20)
    again = state.planning_job()().plans
    assert sorted(again) == ["serve", "w1", "w2"]


def test_lanes_status_shows_each_workers_ggml_rpc_server():
    from lanes.online import render_status
    from shared.messages.replies import FleetStatus
    from shared.messages.status import HostStatus, RpcWorkerStatus

    reports = fleet_of()
    fleet = plan(reports, FleetConfig())
    w1 = by_host(fleet)["w1"].rpc_workers[0]
    statuses = (HostStatus(host_id="w1", rpc_workers=(RpcWorkerStatus(lane_id=w1.lane_id, serving_host="serve",
                                                                      port=w1.port, pid=7, running=True, restarts=2),)),)  # fmt: skip
    text = render_status(FleetStatus(reports=tuple(reports), plans=fleet.hosts, statuses=statuses))
    assert f"ggml-rpc-server on w1 {w1.bind}:{w1.port} for serve's {w1.lane_id}:" in text
    assert "reserved, running, 2 restarts" in text
    assert "reserved, pending" in text  # w2's: its agent has not said yet
