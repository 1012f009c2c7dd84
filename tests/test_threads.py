"""The thread split (planner_svc.threads): never over the cores, at least 1 each, deterministic,
GPU lanes few, CPU lanes by their work, stable over replans; and how the planner and argv use it."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher_agent.cores import core_ids, parse_cpu_list
from planner_svc.planner import plan
from planner_svc.threads import Cores, ThreadNeed, host_cores, split_threads
from shared.lane_key import lane_key
from shared.llama.flags import args_problem, lane_args
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import GpuInfo, HostReport, ServerCaps
from test_planner import GIB, llama_1b, llama_8b

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

needs_st = st.lists(
    st.builds(
        ThreadNeed,
        lane_id=st.integers(0, 99).map(lambda i: f"lane-{i}"),
        gpu=st.booleans(),
        work=st.integers(0, 64 * GIB),
        previous=st.none() | st.integers(1, 64),
        previous_cpus=st.just(()),
    ),
    max_size=12,
    unique_by=lambda n: n.lane_id,
)
cores_st = st.integers(1, 128).map(lambda n: Cores(n, tuple(range(n)), "physical cores"))


@PROPS
@given(needs_st, cores_st, st.booleans(), st.floats(0.0, 2.0))
def test_split_never_over_the_cores_and_at_least_one_each(needs, cores, pinning, gain):
    shares = split_threads(needs, cores, min_gain=gain, pinning=pinning)
    assert set(shares) == {n.lane_id for n in needs}
    assert all(s.threads >= 1 for s in shares.values())
    assert sum(s.threads for s in shares.values()) <= max(cores.count, len(needs))
    pinned = [c for s in shares.values() for c in s.cpus]
    assert len(pinned) == len(set(pinned))  # disjoint
    assert set(pinned) <= set(cores.cpu_ids)
    for s in shares.values():
        assert not s.cpus or len(s.cpus) == s.threads
        assert s.reasons


@PROPS
@given(needs_st, cores_st, st.booleans())
def test_split_is_deterministic_and_order_free(needs, cores, pinning):
    a = split_threads(needs, cores, pinning=pinning)
    assert a == split_threads(needs, cores, pinning=pinning)
    assert a == split_threads(list(reversed(needs)), cores, pinning=pinning)


@PROPS
@given(needs_st, cores_st)
def test_gpu_lanes_get_few_threads_and_cpu_lanes_the_rest(needs, cores):
    fresh = [ThreadNeed(n.lane_id, n.gpu, n.work) for n in needs]
    shares = split_threads(fresh, cores)
    gpu = [shares[n.lane_id].threads for n in fresh if n.gpu]
    cpu = [shares[n.lane_id].threads for n in fresh if not n.gpu]
    assert all(t <= 2 for t in gpu)
    if cpu and len(needs) < cores.count:
        assert sum(gpu) + sum(cpu) == cores.count  # no core left idle while a CPU lane could use it


@PROPS
@given(st.lists(st.integers(0, 64 * GIB), min_size=1, max_size=8), st.integers(1, 64))
def test_more_work_never_fewer_threads(works, n):
    needs = [ThreadNeed(f"l{i}", False, w) for i, w in enumerate(works)]
    shares = split_threads(needs, Cores(n, (), "physical cores"))
    for a in needs:
        for b in needs:
            if max(1, a.work) > max(1, b.work):
                assert shares[a.lane_id].threads >= shares[b.lane_id].threads


def test_cpu_lanes_share_by_weights_times_slots():
    needs = [ThreadNeed("big", False, 3 * GIB), ThreadNeed("small", False, 1 * GIB)]
    shares = split_threads(needs, Cores(8, (), "physical cores"))
    assert (shares["big"].threads, shares["small"].threads) == (6, 2)
    assert "shared by weights x slots" in shares["big"].reasons[0]


def test_two_equal_lanes_on_two_cores_get_one_thread_each():
    needs = [ThreadNeed("a", False, GIB), ThreadNeed("b", False, GIB)]
    shares = split_threads(needs, Cores(2, (0, 1), "physical cores"), pinning=True)
    assert [(s.threads, s.cpus) for s in shares.values()] == [(1, (0,)), (1, (1,))]
    assert shares["a"].reasons[-1] == "pinned to CPUs 0"


def test_gpu_lane_takes_one_or_two_and_cpu_lanes_the_rest():
    needs = [ThreadNeed("gpu", True, 0), ThreadNeed("cpu", False, GIB)]
    big = split_threads(needs, Cores(16, (), "physical cores"))
    assert (big["gpu"].threads, big["cpu"].threads) == (2, 14)
    small = split_threads(needs, Cores(4, (), "physical cores"))
    assert (small["gpu"].threads, small["cpu"].threads) == (1, 3)
    assert "computes on a GPU" in big["gpu"].reasons[0]


def test_more_lanes_than_cores_get_one_each():
    needs = [ThreadNeed(f"l{i}", False, GIB) for i in range(5)]
    shares = split_threads(needs, Cores(2, (0, 1), "physical cores"), pinning=True)
    assert {s.threads for s in shares.values()} == {1}
    assert all(not s.cpus and "cannot be disjoint" in s.reasons[-1] for s in shares.values())


def test_fixed_threads_from_config():
    shares = split_threads([ThreadNeed("a", True, 0), ThreadNeed("b", False, GIB)], Cores(8, (), "x"), fixed=3)
    assert {s.threads for s in shares.values()} == {3}
    assert shares["a"].reasons[0] == "threads 3: fixed by the fleet config"


def test_a_small_change_keeps_the_previous_threads():
    # 3 -> 4 threads (33%) is under the 50% worth a restart; 1 -> 2 (100%) is not
    a = split_threads([ThreadNeed("a", False, GIB, previous=3)], Cores(4, (), "physical cores"))
    assert a["a"].threads == 3 and a["a"].reasons[0].startswith("kept threads 3")
    b = split_threads([ThreadNeed("a", False, GIB, previous=1)], Cores(2, (), "physical cores"))
    assert b["a"].threads == 2


def test_keeping_never_pushes_the_host_over_its_cores():
    # a lane added: the old 4 + 4 no longer fit 8 cores with a third lane, so both give up threads
    needs = [ThreadNeed("a", False, GIB, previous=4), ThreadNeed("b", False, GIB, previous=4),
             ThreadNeed("c", False, GIB)]  # fmt: skip
    shares = split_threads(needs, Cores(8, (), "physical cores"), min_gain=0.9)
    assert sum(s.threads for s in shares.values()) <= 8
    assert shares["c"].threads >= 1


def test_pinning_keeps_a_lanes_cpus_when_its_count_holds():
    needs = [ThreadNeed("a", False, GIB, previous=2, previous_cpus=(2, 3)), ThreadNeed("b", False, GIB)]
    shares = split_threads(needs, Cores(4, (0, 1, 2, 3), "physical cores"), pinning=True)
    assert shares["a"].cpus == (2, 3) and shares["b"].cpus == (0, 1)


def test_host_cores_prefers_performance_cores_and_the_agents_affinity():
    base = dict(host_id="h", cpu_cores=16, ram_total=GIB, ram_available=GIB)
    assert host_cores(HostReport(**base)) is None  # an older agent: llama-server's default
    assert host_cores(HostReport(**base, cpu_physical=8)).count == 8
    hybrid = host_cores(HostReport(**base, cpu_physical=12, cpu_performance=4, cpu_ids=tuple(range(12))))
    assert (hybrid.count, hybrid.cpu_ids, hybrid.source) == (4, (0, 1, 2, 3), "performance cores")
    limited = host_cores(HostReport(**base, cpu_physical=8, cpu_ids=(4, 5)))
    assert (limited.count, limited.cpu_ids) == (2, (4, 5))


def test_core_ids_take_one_cpu_per_core_performance_first():
    siblings = {0: "0,4", 1: "1,5", 2: "2", 3: "3", 4: "0,4", 5: "1,5"}
    assert core_ids(siblings) == (0, 1, 2, 3)
    assert core_ids(siblings, performance={2, 3}) == (2, 3, 0, 1)
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


# ------------------------------------------------------------------ through the planner


def _report(host="h1", cores=2, gpus=(), caps=ServerCaps(), models=None, **kw) -> HostReport:
    return HostReport(host_id=host, cpu_cores=cores, cpu_physical=cores, cpu_ids=tuple(range(cores)),
                      ram_total=64 * GIB, ram_available=60 * GIB, gpus=gpus, server=caps,
                      models=models or (llama_1b("a"), llama_1b("b")), **kw)  # fmt: skip


def _lanes(fleet):
    return {s.lane_id: s for h in fleet.hosts for s in h.lanes}


def test_planner_gives_two_cpu_lanes_on_two_cores_one_thread_each():
    lanes = _lanes(plan([_report()], FleetConfig()))
    assert [(s.threads, s.threads_batch) for s in lanes.values()] == [(1, 1), (1, 1)]
    for s in lanes.values():
        assert s.args[s.args.index("--threads") + 1] == "1" and "--threads-batch" in s.args
        assert "--cpu-range" not in s.args and "--poll" not in s.args
        assert any(r.startswith("threads 1 of 2 physical cores") for r in s.reasons)
        assert args_problem(s, ServerCaps()) is None


def test_planner_pins_and_polls_from_config():
    lanes = _lanes(plan([_report()], FleetConfig(cpu_pinning=True, poll=0)))
    a, b = lanes["a-0"], lanes["b-0"]
    assert (a.cpus, b.cpus) == ((0,), (1,))
    assert a.args[a.args.index("--cpu-range") + 1] == "0-0" and b.args[b.args.index("--cpu-range-batch") + 1] == "1-1"
    assert a.args[a.args.index("--poll") + 1] == "0"
    assert args_problem(a, ServerCaps()) is None


def test_planner_leaves_old_binaries_unpinned_and_unpolled():
    old = ServerCaps(has_cpu_range=False, has_poll=False)
    lanes = _lanes(plan([_report(caps=old)], FleetConfig(cpu_pinning=True, poll=10)))
    for s in lanes.values():
        assert not s.cpus and s.poll is None and s.threads == 1
        assert "not pinned: this host's llama-server has no --cpu-range" in s.reasons


def test_threads_zero_in_config_means_llama_servers_default():
    for s in _lanes(plan([_report()], FleetConfig(threads=0, cpu_pinning=True))).values():
        assert s.threads is None and not s.cpus and "--threads" not in s.args and "--cpu-range" not in s.args
        assert "threads 0 in the fleet config" in s.reasons[-1]


def test_planner_leaves_old_agents_with_the_default():
    report = msgspec.structs.replace(_report(), cpu_physical=None)
    for s in _lanes(plan([report], FleetConfig(threads=2))).values():
        assert s.threads is None and "--threads" not in s.args
        assert not any("thread" in r for r in s.reasons)


def test_planner_gpu_lane_few_threads_cpu_lane_the_rest():
    gpu = GpuInfo(name="RTX", vram_total=24 * GIB, vram_free=24 * GIB, device="CUDA0")
    report = _report(cores=16, gpus=(gpu,), models=(llama_8b("big"),))
    demand = Demand(personas=(Persona(model="big", lanes=2),))
    fleet = plan([report], FleetConfig(), demand)
    # the first lane on the GPU, the second does not fit with it there: partial or CPU
    lanes = sorted(_lanes(fleet).values(), key=lambda s: s.lane_id)
    full = [s for s in lanes if s.gpu_devices and all(d.layers == 0 for d in s.memory.devices if d.device == "CPU")]
    assert full and all(s.threads == 2 for s in full)
    assert sum(s.threads for s in lanes) <= 16


def test_replan_with_a_lane_removed_keeps_or_regrows_by_the_gain():
    cfg = FleetConfig()
    first = plan([_report(cores=8, models=(llama_1b("a"), llama_1b("b"), llama_1b("c")))], cfg)
    prev = {h.host_id: h for h in first.hosts}
    before = _lanes(first)
    assert sorted(s.threads for s in before.values()) == [2, 3, 3]
    # c goes: a and b would get 4 each; 3 -> 4 is 33%, under the 50% worth a restart
    demand = Demand(personas=(Persona(model="a"), Persona(model="b")))
    again = plan([_report(cores=8, models=(llama_1b("a"), llama_1b("b"), llama_1b("c")))], cfg, demand, previous=prev)
    after = _lanes(again)
    for lane_id in ("a-0", "b-0"):
        assert after[lane_id].threads == before[lane_id].threads
        if before[lane_id].threads == 3:
            assert lane_key(after[lane_id]) == lane_key(before[lane_id])  # no restart
    # with a lower bar the lanes regrow
    regrow = _lanes(plan([_report(cores=8)], FleetConfig(threads_min_gain=0.2), demand, previous=prev))
    assert regrow["a-0"].threads == 4 and regrow["b-0"].threads == 4


def test_steady_inputs_give_the_same_plan_revision():
    cfg = FleetConfig(cpu_pinning=True)
    first = plan([_report()], cfg)
    prev = {h.host_id: h for h in first.hosts}
    again = plan([_report()], cfg, previous=prev)
    assert again.hosts[0].plan_revision == first.hosts[0].plan_revision


def test_argv_mask_for_a_scattered_cpu_set():
    lane = next(iter(_lanes(plan([_report()], FleetConfig())).values()))
    spec = msgspec.structs.replace(lane, cpus=(0, 2), threads=2, threads_batch=2)
    args = lane_args(spec, ServerCaps())
    assert args[args.index("--cpu-mask") + 1] == "0x5" and args[args.index("--cpu-mask-batch") + 1] == "0x5"


def test_a_plan_with_impossible_cpu_ids_is_refused_at_decode():
    """Found by the plan fuzzer: a negative CPU id made lane_args raise while the agent checked the plan."""
    import pytest as _pytest

    from shared.messages.plans import LaneSpec
    from shared.messages.wire import decode, encode

    spec = LaneSpec(lane_id="a", model="m", model_path="/m.gguf", alias="m", port=8080, ctx_total=4096,
                    ctx_per_slot=4096, parallel=1, threads=2, threads_batch=2, cpus=(0, 2))  # fmt: skip
    assert "--cpu-mask" in lane_args(spec, ServerCaps())  # not contiguous: a mask
    for bad in (b'"cpus":[-1]', b'"cpus":[65536]'):
        with _pytest.raises(msgspec.ValidationError):
            decode(encode(spec).replace(b'"cpus":[0,2]', bad), LaneSpec)
