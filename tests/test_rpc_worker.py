"""The worker side of a span and the serving side's check, on one machine.

Pure parts: which ggml-rpc-servers to start and stop, the argv, what a worker refuses, and the
span check over buffer lines. Real parts (the RPC build, slow): a planned span of the real Gemma
file over two ggml-rpc-servers on loopback, run by RpcWorkers exactly as the plan asks; the
serving llama-server started with the plan's argv prints per RPC device what the plan says.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import msgspec
import psutil
import pytest
from waiting import eventually_blocking

from launcher_agent.rpc_worker import RESTART_AFTER, Running, RpcWorkers, WorkerSettings, decide, spec_problem, worker_argv
from shared.memory.overhead import PROCESS_OVERHEAD, overhead_bytes
from shared.messages.plans import RpcWorkerSpec
from shared.span_check import SPAN_FAILED, span_problem

SETTINGS = WorkerSettings("/opt/ggml-rpc-server", "10.0.0.2", 50052, 4, Path("/tmp/unused"), threads=2)


def spec(port: int = 50052, lane: str = "m-0", **kw) -> RpcWorkerSpec:
    return RpcWorkerSpec(lane_id=lane, serving_host="serve", bind=kw.pop("bind", "10.0.0.2"), port=port, **kw)


def test_argv_binds_the_named_address_with_the_local_cache():
    assert worker_argv(spec(), SETTINGS) == ["/opt/ggml-rpc-server", "-H", "10.0.0.2", "-p", "50052", "-t", "2", "-c"]
    assert worker_argv(spec(device="CUDA0"), SETTINGS)[-2:] == ["-d", "CUDA0"]


def test_a_worker_refuses_another_address_or_a_port_outside_its_range():
    assert spec_problem(spec(), SETTINGS) is None
    assert "binds only its --advertise address" in spec_problem(spec(bind="0.0.0.0"), SETTINGS)
    assert "outside this worker's range" in spec_problem(spec(port=50056), SETTINGS)
    assert spec_problem(spec(port=50055), SETTINGS) is None


def test_decide_starts_what_the_plan_adds_and_stops_what_it_drops():
    a, b = spec(50052, "a-0"), spec(50053, "b-0")
    assert decide([a, b], {}, now=0) == ([a, b], [])
    running = {50052: Running(a, True), 50054: Running(spec(50054, "c-0"), True)}
    assert decide([a, b], running, now=0) == ([b], [50054])
    # a changed spec on the same port: stopped, then started as asked
    changed = msgspec.structs.replace(a, lane_id="a-1")
    assert decide([changed], {50052: Running(a, True)}, now=0) == ([changed], [50052])
    assert decide([], {50052: Running(a, True)}, now=0) == ([], [50052])


def test_an_exited_server_is_restarted_after_a_pause():
    a = spec()
    assert decide([a], {50052: Running(a, False, exited_at=10.0)}, now=10.5) == ([], [])
    assert decide([a], {50052: Running(a, False, exited_at=10.0)}, now=10.0 + RESTART_AFTER) == ([a], [50052])


def _lines(*rpc: tuple[int, str, float, float, float]) -> list[str]:
    """Buffer lines as llama-server b11434 prints them with two RPC devices (from a real run)."""
    out = [f"llama_prepare_model_devices: using device RPC{i} ({ep}) - 24105 MiB free" for i, ep, *_ in rpc]
    out += ["load_tensors:   CPU_Mapped model buffer size =   170.00 MiB"]
    for i, ep, model, kv, compute in rpc:
        out += [f"load_tensors: RPC{i}[{ep}] model buffer size =   {model:.2f} MiB",
                f"llama_kv_cache: RPC{i}[{ep}] KV buffer size =   {kv:.2f} MiB",
                f"sched_reserve: RPC{i}[{ep}] compute buffer size =   {compute:.2f} MiB"]  # fmt: skip
    return out


def _span_spec():
    from shared.messages.plans import DeviceMemory, LaneSpec, MemoryBreakdown, SpanWorker

    mib = 2**20
    devices = (
        DeviceMemory(device="CPU", model_bytes=170 * mib),
        DeviceMemory(device="GPU0", index=0, backend="rpc", model_bytes=40 * mib, kv_bytes=6 * mib, compute_bytes=18 * mib),
        DeviceMemory(device="GPU1", index=1, backend="rpc", model_bytes=190 * mib, kv_bytes=5 * mib, compute_bytes=18 * mib),
    )  # fmt: skip
    workers = (SpanWorker(host_id="w1", endpoint="10.0.0.2:50052", index=0),
               SpanWorker(host_id="w2", endpoint="10.0.0.3:50052", index=1))  # fmt: skip
    return LaneSpec(lane_id="m-0", model="m", model_path="/m.gguf", alias="m", port=8080, ctx_total=2048,
                    ctx_per_slot=2048, parallel=1, memory=MemoryBreakdown(devices=devices), workers=workers)  # fmt: skip


def test_span_check_passes_when_every_worker_printed_its_planned_buffers():
    lines = _lines((0, "10.0.0.2:50052", 40, 6, 18), (1, "10.0.0.3:50052", 190, 5, 18.5))
    assert span_problem(_span_spec(), lines) is None


def test_span_check_fails_a_lane_that_ran_without_a_worker():
    # llama-server served locally only: no RPC line at all
    problem = span_problem(_span_spec(), ["load_tensors:   CPU_Mapped model buffer size =   400.00 MiB"])
    assert problem.startswith(SPAN_FAILED) and "w1 (10.0.0.2:50052) is missing" in problem
    # only one of the two servers took layers
    problem = span_problem(_span_spec(), _lines((0, "10.0.0.2:50052", 40, 6, 18)))
    assert "w2 (10.0.0.3:50052) is missing" in problem


def test_span_check_fails_a_worker_holding_other_sizes_than_planned():
    lines = _lines((0, "10.0.0.2:50052", 40, 6, 18), (1, "10.0.0.3:50052", 150, 5, 18))
    problem = span_problem(_span_spec(), lines)
    assert "w2 (10.0.0.3:50052) printed model 150.00 MiB, planned 190.00 MiB" in problem


def test_a_lane_without_workers_is_not_checked():
    assert span_problem(msgspec.structs.replace(_span_spec(), workers=()), []) is None


# ------------------------------------------------------------------ real processes (the RPC build)


def _free_port_block(n: int) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535 and all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free block of ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _listening(port: int) -> bool:
    return not _port_free(port)


def test_workers_run_and_stop_real_servers_and_a_restarted_agent_adopts_them(rpc_bin, tmp_path):
    base = _free_port_block(2)
    settings = WorkerSettings(str(rpc_bin / "ggml-rpc-server"), "127.0.0.1", base, 2, tmp_path / "rpc-cache")
    workers = RpcWorkers(settings, tmp_path / "rpc-workers.json")
    a = spec(base, bind="127.0.0.1")
    asyncio.run(workers.apply([a, spec(base + 5, "x-0", bind="127.0.0.1")], now=0))  # the second is outside the range
    assert list(workers.procs) == [base]
    eventually_blocking(lambda: _listening(base), timeout=10, interval=0.05, what="ggml-rpc-server to listen")
    pid = workers.procs[base].pid
    assert psutil.Process(pid).cmdline() == worker_argv(a, settings)
    assert workers.rss() > 0
    # an agent restarted: the new one adopts the server instead of starting a second
    again = RpcWorkers(settings, tmp_path / "rpc-workers.json")
    again.adopt()
    assert again.procs[base].pid == pid
    asyncio.run(again.apply([a], now=1))
    assert again.procs[base].pid == pid
    # killed: started again after the pause
    psutil.Process(pid).kill()
    eventually_blocking(lambda: not again.procs[base].alive(), timeout=5, interval=0.05, what="the server to die")
    asyncio.run(again.apply([a], now=2))
    asyncio.run(again.apply([a], now=2 + RESTART_AFTER))
    assert again.procs[base].pid != pid
    eventually_blocking(lambda: _listening(base), timeout=10, interval=0.05, what="the restarted server")
    (shown,) = again.status()
    assert (shown.lane_id, shown.port, shown.running, shown.restarts) == ("m-0", base, True, 1)
    new_pid = again.procs[base].pid
    # no span needs it: stopped
    asyncio.run(again.apply([], now=10))
    assert again.procs == {}
    eventually_blocking(lambda: not psutil.pid_exists(new_pid) or psutil.Process(new_pid).status() == "zombie",
                        timeout=5, interval=0.05, what="the server to stop")  # fmt: skip
    psutil.Process(pid).wait(0) if psutil.pid_exists(pid) else None


def test_a_planned_span_over_two_loopback_workers_prints_what_the_plan_says(rpc_bin, gemma_model, tmp_path):
    from launcher_agent import hardware
    from measure import load_and_stop
    from launcher_agent.probe import probe
    from planner_svc.planner import plan
    from shared.gguf_facts import read_model_facts
    from shared.llama.logs import parse_buffers
    from shared.llama.printed import compare
    from shared.messages.config import FleetConfig
    from shared.messages.hosts import HostReport, RpcWorkerOffer

    mib = 2**20
    caps = probe(str(rpc_bin / "llama-server"))
    facts = read_model_facts(gemma_model)
    config = FleetConfig(headroom_bytes=0, headroom_fraction=0.0)
    vocab = overhead_bytes(facts) - PROCESS_OVERHEAD  # the tokenizer's tables, on the serving host
    alone = 330 * mib + vocab  # about what the model needs at its floor on one host: no host has it

    def report(host_id: str, ram: int, **kw) -> HostReport:
        return HostReport(host_id=host_id, cpu_cores=2, ram_total=ram, ram_available=ram, server=caps,
                          cpu_repack=hardware.cpu_repack(), **kw)  # fmt: skip

    bases = [_free_port_block(2), None]
    bases[1] = _free_port_block(2) if bases[0] else None
    reports = [
        report("serve", 235 * mib + vocab, models=(facts,)),
        report("w1", 184 * mib, rpc_worker=RpcWorkerOffer(address="127.0.0.1", port_base=bases[0], port_count=1)),
        report("w2", 400 * mib, rpc_worker=RpcWorkerOffer(address="127.0.0.1", port_base=bases[1], port_count=1)),
    ]
    # the serving host and w1 are too small for the model; w2 takes the output layer (a copy of
    # the 170 MiB token embeddings, held twice while it loads): it needs more than the model alone
    assert all(r.ram_available < alone for r in reports[:2])
    fleet = plan(reports, config)
    plans = {h.host_id: h for h in fleet.hosts}
    lane = plans["serve"].lanes[0]
    assert [w.host_id for w in lane.workers] == ["w1", "w2"], (lane.reasons, plans["serve"].unplaced)
    running = []
    try:
        for h in ("w1", "w2"):
            w = RpcWorkers(WorkerSettings(str(rpc_bin / "ggml-rpc-server"), "127.0.0.1", plans[h].rpc_workers[0].port,
                                          1, tmp_path / h / "rpc-cache"), tmp_path / h / "state.json")  # fmt: skip
            asyncio.run(w.apply(plans[h].rpc_workers, now=0))
            running.append(w)
            port = plans[h].rpc_workers[0].port
            eventually_blocking(lambda: _listening(port), timeout=10, interval=0.05, what=f"{h}'s server")
        loaded = load_and_stop(str(rpc_bin / "llama-server"), list(lane.args))
        assert loaded.ok, loaded.lines[-10:]
        printed = parse_buffers(loaded.lines)
        checks = compare(lane.memory.devices, printed)
        assert {c.device for c in checks} == {"CPU", "GPU0", "GPU1"}
        for check in checks:  # model, KV and output exact; compute never above the plan
            if check.kind == "compute":
                print("compute MiB predicted/printed", check.device, check.predicted_mib, check.printed_mib)
                assert check.ok or check.printed_mib < check.predicted_mib, check
            else:
                assert check.ok, check
        assert span_problem(lane, loaded.lines) is None
        for w in lane.workers:  # each worker's printed buffers are its planned ones, its peak within its reservation
            pid = next(iter(next(x for x, h in zip(running, ("w1", "w2")) if h == w.host_id).procs.values())).pid
            with open(f"/proc/{pid}/status") as status:
                peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
            assert peak <= w.reserved_bytes, (w.host_id, peak, w.reserved_bytes)
            dev = printed.mib[f"GPU{w.index}"]
            assert round(dev["model"] * mib) == pytest.approx(w.model_bytes, abs=0.011 * mib)
            assert round(dev.get("KV", 0.0) * mib) == pytest.approx(w.kv_bytes, abs=0.011 * mib)
        # the same spec run without its workers (a local-only run) fails the check
        local = [a for a in lane.args]
        for flag in ("--rpc", "--device", "--n-gpu-layers", "--tensor-split"):
            if flag in local:
                i = local.index(flag)
                del local[i : i + 2]
        alone_run = load_and_stop(str(rpc_bin / "llama-server"), local)
        assert alone_run.ok
        assert span_problem(lane, alone_run.lines).startswith(SPAN_FAILED)
    finally:
        for w in running:
            asyncio.run(w.stop_all())
