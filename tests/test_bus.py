"""The planner and agents over a real nats-server, lanes played by the rule-enforcing fake."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import time
import urllib.request

import msgspec
import pytest
from nats.js.api import StreamConfig
from nats.js.errors import BucketNotFoundError
from fixtures_bus import agent_config, client, fake_binary, fleet_status, host_status, lane_of, pid_alive, services
from waiting import eventually

from launcher_agent.cores import host_cores
from planner_svc.threads import cpu_ranges
from shared import subjects
from shared.bus import kv_bucket
from shared.messages.config import Demand, Persona
from shared.messages.hosts import HostReport
from shared.messages.plans import HostPlan
from shared.messages.replies import ConfigSet
from shared.messages.status import PlanRejected
from shared.messages.wire import encode

GIB = 2**30


def healthy(lane_id: str):
    async def check(nc, host):
        lane = lane_of(await host_status(nc, host), lane_id)
        return lane if lane and lane.state == "healthy" else None

    return check


async def test_config_change_relaunches_lane_with_quantized_kv(nats_server, tmp_path, models):
    """config set q8_0 -> new plan -> lane relaunched with -ctk/-ctv q8_0 and FA on -> larger window."""
    cfg = agent_config(tmp_path, "alpha", models, fake_binary(tmp_path / "bin"), max_ram=1 * GIB)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)
        first = await eventually(lambda: healthy("llama8-0")(nc, "alpha"), what="f16 lane healthy")
        assert "--cache-type-k" not in first.argv and "--flash-attn" not in first.argv
        assert first.kv_bytes == first.planned_kv_bytes
        # the host's cores, planned: the one lane takes them all, unpinned by default
        ids = host_cores().cpu_ids  # one CPU per core this agent may use
        cores = str(len(ids))
        assert first.argv[first.argv.index("--threads") + 1] == first.argv[first.argv.index("--threads-batch") + 1]
        assert first.argv[first.argv.index("--threads") + 1] == cores and "--cpu-range" not in first.argv

        changes = {"kv_cache_type": "q8_0", "flash_attn": "on", "cpu_pinning": True}
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes=changes)), timeout=5)
        assert "Nats-Service-Error" not in (reply.headers or {})

        async def relaunched():
            lane = await healthy("llama8-0")(nc, "alpha")
            return lane if lane and "q8_0" in lane.argv else None

        second = await eventually(relaunched, what="q8_0 lane healthy")
        argv = list(second.argv)
        assert argv[argv.index("--cache-type-k") + 1] == "q8_0"
        assert argv[argv.index("--cache-type-v") + 1] == "q8_0"
        assert argv[argv.index("--flash-attn") + 1] == "on"
        assert argv[argv.index("--cpu-range") + 1] == argv[argv.index("--cpu-range-batch") + 1] == cpu_ranges(ids)
        assert second.ctx_total > first.ctx_total
        assert second.kv_bytes == second.planned_kv_bytes

        status = await fleet_status(nc)
        (plan,) = status.plans
        assert plan.lanes[0].ctx_total == second.ctx_total
        assert status.config.kv_cache_type == "q8_0"


async def test_invalid_config_is_refused_and_changes_nothing(nats_server, tmp_path, models):
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner up")
        before = (await nc.request(subjects.CONFIG_GET, b"", timeout=5)).data
        for changes in ({"kv_cache_type": "q9_0"}, {"n_ubatch": "lots"}, {"no_such_knob": 1}):
            reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes=changes)), timeout=5)
            assert reply.headers["Nats-Service-Error-Code"] == "400"
            assert "invalid config" in reply.headers["Nats-Service-Error"]
        reply = await nc.request(subjects.CONFIG_SET, b"{not json", timeout=5)
        assert reply.headers["Nats-Service-Error-Code"] == "400"
        # A host reporting every 30 s: losing hosts after 10 s of silence would lose it between reports.
        kv = await kv_bucket(nc)
        await kv.put(subjects.report_key("h1"), encode(HostReport(host_id="h1", cpu_cores=2, ram_total=2**30,
                                                                  ram_available=2**29, report_interval=30.0)))  # fmt: skip
        await eventually(lambda: _has_report(nc, "h1"), what="planner has the report")
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"host_lost_after": 10})), timeout=5)
        assert reply.headers["Nats-Service-Error-Code"] == "400"
        assert "report interval of 30 s" in reply.headers["Nats-Service-Error"]
        assert (await nc.request(subjects.CONFIG_GET, b"", timeout=5)).data == before


async def _has_report(nc, host_id: str) -> bool:
    return any(r.host_id == host_id for r in (await fleet_status(nc)).reports)


async def test_agent_rejects_hostile_plans_and_starts_nothing(nats_server, tmp_path, models):
    """A plan written straight into KV (no planner) that breaks a rule never starts a process."""
    binary = fake_binary(tmp_path / "bin")
    cfg = agent_config(tmp_path, "beta", models, binary)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)
        await eventually(lambda: healthy("llama8-0")(nc, "beta"), what="lane healthy")
        kv = await kv_bucket(nc)
        good = msgspec.json.decode((await kv.get(subjects.plan_key("beta"))).value, type=HostPlan)
        rejected: list[PlanRejected] = []

        async def on_rejected(msg):
            rejected.append(msgspec.json.decode(msg.data, type=PlanRejected))

        await nc.subscribe(subjects.rejected_subject("beta"), cb=on_rejected)
        await s.stop("planner")  # so it does not overwrite our writes
        spec = good.lanes[0]
        r = good.plan_revision + 10
        hostile = [
            b"{definitely not json",
            b'{"kind":"host_plan","host_id":"beta","lanes":"many"}',
            b'{"kind":"surprise","host_id":"beta"}',
            encode(msgspec.structs.replace(good, plan_revision=r, host_id="gamma")),
            encode(msgspec.structs.replace(good, plan_revision=r, lanes=(msgspec.structs.replace(spec, model_path="/etc/passwd"),))),
            encode(msgspec.structs.replace(good, plan_revision=r, lanes=(msgspec.structs.replace(spec, port=9),))),
            encode(msgspec.structs.replace(good, plan_revision=r, lanes=(msgspec.structs.replace(spec, args=(*spec.args, "--rpc", "evil:1")),))),
            encode(msgspec.structs.replace(good, plan_revision=r, lanes=(msgspec.structs.replace(spec, cache_type_v="q4_0", flash_attn="off"),))),
            encode(msgspec.structs.replace(good, plan_revision=good.plan_revision - 1, lanes=())),
        ]
        lane_before = lane_of(await host_status(nc, "beta"), "llama8-0")
        for n, payload in enumerate(hostile, 1):
            # The agent reads the key's latest value when it is written: one write at a time.
            await kv.put(subjects.plan_key("beta"), payload)
            await eventually(lambda: len(rejected) >= n, what=f"hostile plan {n} rejected")
        reasons = " | ".join(x.reason for x in rejected)
        for expected in ("malformed plan", "not 'beta'", "outside the model folders", f"outside {cfg.port_base}",
                         "args disagree", "without flash attention", "older than the applied"):  # fmt: skip
            assert expected in reasons
        await asyncio.sleep(1.0)
        lane_after = lane_of(await host_status(nc, "beta"), "llama8-0")
        assert lane_after.pid == lane_before.pid and lane_after.state == "healthy"
        assert s.tasks["beta"][0].done() is False


async def test_lanes_keep_serving_through_nats_restart_and_resync(nats_server, tmp_path, models):
    """nats-server goes away and comes back with its JetStream state; KV watches are re-created."""
    cfg = agent_config(tmp_path, "gamma", models, fake_binary(tmp_path / "bin"))
    async with services(nats_server.url) as s:
        s.start_planner()
        s.start_agent(cfg)
        async with client(nats_server.url) as nc:
            lane = await eventually(lambda: healthy("llama8-0")(nc, "gamma"), what="lane healthy")
        nats_server.stop()
        await asyncio.sleep(1.5)  # NATS gone for a while (nothing is to happen: no signal to wait on)
        with urllib.request.urlopen(f"http://127.0.0.1:{lane.port}/health", timeout=2) as r:
            assert r.status == 200  # lanes serve while NATS is gone
        nats_server.start()
        async with client(nats_server.url) as nc:
            await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner back")
            await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q4_0"})), timeout=5)

            async def relaunched():
                found = await healthy("llama8-0")(nc, "gamma")
                return found if found and "q4_0" in found.argv else None

            await eventually(relaunched, timeout=40, what="config change after a NATS restart reaches the agent")


async def test_restarted_planner_recovers_plans_from_kv(nats_server, tmp_path, models):
    cfg = agent_config(tmp_path, "delta", models, fake_binary(tmp_path / "bin"))
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)
        lane = await eventually(lambda: healthy("llama8-0")(nc, "delta"), what="lane healthy")
        kv = await kv_bucket(nc)
        before = (await kv.get(subjects.plan_key("delta"))).revision
        await s.stop("planner")
        # Another process: another id (a container restarted with its planner under another pid).
        s.start_planner("planner2", planner_id="restarted-4242")

        async def replanned() -> bool:
            info = msgspec.json.decode((await nc.request(subjects.PLANNER_INFO, b"", timeout=1)).data)
            return info["active"] and info["ready"] and info["replans"] >= 1

        await eventually(replanned, what="the new planner holds the lease and replanned")
        assert (await kv.get(subjects.plan_key("delta"))).revision == before  # nothing rewritten
        after = lane_of(await host_status(nc, "delta"), "llama8-0")
        assert after.pid == lane.pid


async def test_killed_agent_adopts_running_lanes(nats_server, tmp_path, models):
    cfg = agent_config(tmp_path, "eps", models, fake_binary(tmp_path / "bin"))
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)
        lane = await eventually(lambda: healthy("llama8-0")(nc, "eps"), what="lane healthy")
        old_session = (await host_status(nc, "eps")).agent_session
        await s.kill("eps")
        assert pid_alive(lane.pid)
        s.start_agent(cfg)

        async def adopted():
            status = await host_status(nc, "eps")
            found = lane_of(status, "llama8-0")
            fresh = status.agent_session != old_session
            return found if fresh and found and found.state == "healthy" else None

        found = await eventually(adopted, what="the new agent reports the lane healthy")
        assert found.pid == lane.pid and found.restarts == 0
        await s.stop("eps")
        assert not pid_alive(lane.pid)


async def test_sigkilled_lane_restarts_with_backoff(nats_server, tmp_path, models):
    cfg = agent_config(tmp_path, "zeta", models, fake_binary(tmp_path / "bin"))
    events: list[dict] = []
    async with services(nats_server.url) as s, client(nats_server.url) as nc:

        async def on_event(msg):
            events.append(json.loads(msg.data))

        await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
        s.start_planner()
        s.start_agent(cfg)
        lane = await eventually(lambda: healthy("llama8-0")(nc, "zeta"), what="lane healthy")
        os.kill(lane.pid, signal.SIGKILL)

        async def restarted():
            found = await healthy("llama8-0")(nc, "zeta")
            return found if found and found.pid != lane.pid else None

        again = await eventually(restarted, what="lane restarted")
        assert again.restarts == 1
        assert any(e["event"] == "crashed" and e["lane_id"] == "llama8-0" for e in events)


async def test_lane_that_cannot_start_is_reported_not_restarted_forever(nats_server, tmp_path, models):
    """The fake refuses any context above 1024 (out of memory): the lane fails, the planner shrinks it."""
    binary = fake_binary(tmp_path / "bin", {"FAKE_LLAMA_OOM_ABOVE_CTX": "1024"})
    cfg = agent_config(tmp_path, "eta", models, binary, max_ram=2 * GIB)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)

        async def failed_with_feedback():
            status = await host_status(nc, "eta")
            return status if status and any(f.kind == "oom" for f in status.feedback) else None

        status = await eventually(failed_with_feedback, what="oom reported")
        fb = next(f for f in status.feedback if f.kind == "oom")
        assert "failed to allocate" in fb.detail
        # The planner halves the window each time it learns of an OOM, until the lane starts.
        lane = await eventually(lambda: healthy("llama8-0")(nc, "eta"), timeout=60, what="smaller lane healthy")
        assert lane.ctx_total <= 1024
        plan = (await fleet_status(nc)).plans[0]
        assert any("ran out of memory" in r for r in plan.lanes[0].reasons)


async def test_refused_cache_type_falls_back_to_f16_with_llama_servers_words(nats_server, tmp_path, models):
    """The binary's --help lists q4_0 but it refuses it at start: the next plan is f16, with the reason."""
    binary = fake_binary(tmp_path / "bin", {"FAKE_LLAMA_REFUSE_TYPES": "q4_0"})
    cfg = agent_config(tmp_path, "theta", models, binary)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner up")
        await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q4_0"})), timeout=5)
        s.start_agent(cfg)

        async def fell_back():
            status = await host_status(nc, "theta")
            lane = lane_of(status, "llama8-0")
            refused = [f for f in (status.feedback if status else ()) if f.kind == "unsupported"]
            return (lane, refused) if refused and lane and lane.state == "healthy" else None

        lane, refused = await eventually(fell_back, what="f16 lane after the refusal")
        assert "Unsupported cache type: q4_0" in refused[0].detail
        assert "--cache-type-k" not in lane.argv
        spec = (await fleet_status(nc)).plans[0].lanes[0]
        assert spec.cache_type_k is None and any("refused q4_0/q4_0" in r for r in spec.reasons)


async def test_rollout_halts_on_a_breaking_change_and_reverts_the_broken_lane(nats_server, tmp_path, tiny_models):
    """Two lanes on a host; the binary refuses q4_0 at start. The first lane to take the change
    fails and is reverted to the spec it ran healthy with; the second is never touched. A new
    config revision rolls again, one lane at a time."""
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["llama8"], models / "llama8.gguf")
    shutil.copy(tiny_models["llama_gqa"], models / "llama_gqa.gguf")
    binary = fake_binary(tmp_path / "bin", {"FAKE_LLAMA_REFUSE_TYPES": "q4_0"})
    events: list[dict] = []
    async with services(nats_server.url) as s, client(nats_server.url) as nc:

        async def on_event(msg):
            events.append(json.loads(msg.data))

        await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
        s.start_planner()
        s.start_agent(agent_config(tmp_path, "iota", models, binary))

        async def both_healthy(needle: str | None):
            status = await host_status(nc, "iota")
            lanes = [lane_of(status, x) for x in ("llama8-0", "llama_gqa-0")]
            ok = all(lane and lane.state == "healthy" and (needle is None or needle in lane.argv) for lane in lanes)
            return (status, lanes) if ok else None

        _, (first, second) = await eventually(lambda: both_healthy(None), what="two f16 lanes")
        before_change = len(events)
        await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q4_0"})), timeout=5)

        async def reverted():
            status = await host_status(nc, "iota")
            plan = (await fleet_status(nc)).plans[0]
            lane = lane_of(status, "llama8-0")
            spec = next(x for x in plan.lanes if x.lane_id == "llama8-0")
            done = status.rollout_halted and lane.state == "healthy" and any("reverted" in r for r in spec.reasons)
            return (status, lane, spec) if done else None

        status, lane, spec = await eventually(reverted, what="broken lane reverted, rollout halted")
        assert "Unsupported cache type: q4_0" in status.rollout_halted
        assert spec.cache_type_k is None and "--cache-type-k" not in lane.argv
        await asyncio.sleep(1.5)  # the halted rollout leaves this lane alone (nothing is to happen: no signal)
        untouched = lane_of(await host_status(nc, "iota"), "llama_gqa-0")
        assert untouched.pid == second.pid and "--cache-type-k" not in untouched.argv
        assert not [e for e in events[before_change:] if e["lane_id"] == "llama_gqa-0"]

        await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q8_0"})), timeout=5)
        status, _ = await eventually(lambda: both_healthy("q8_0"), what="both lanes on q8_0")
        assert status.rollout_halted == ""


async def test_old_build_gets_bare_flash_attn_switch_and_shared_kv_layout(nats_server, tmp_path, models):
    """A bare -fa build (early 2025): no -fit, the switch form, one KV cache shared by all slots."""
    binary = fake_binary(tmp_path / "bin", {"FAKE_LLAMA_HELP_OLD": "1"})
    cfg = agent_config(tmp_path, "kappa", models, binary)
    assert cfg.caps.flash_attn_form == "switch" and cfg.caps.kv_layout == "shared" and not cfg.caps.has_fit
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        await eventually(lambda: nc.request(subjects.CONFIG_GET, b"", timeout=1), what="planner up")
        await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"kv_cache_type": "q8_0"})), timeout=5)
        await nc.request(
            subjects.DEMAND_SET, encode(Demand(personas=(Persona(model="llama8", parallel=3, ctx_max=4096),))), timeout=5
        )
        s.start_agent(cfg)
        lane = await eventually(lambda: healthy("llama8-0")(nc, "kappa"), what="lane healthy on the old build")
        argv = list(lane.argv)
        assert "--flash-attn" in argv and argv[argv.index("--flash-attn") + 1].startswith("-")  # bare switch
        assert "-fit" not in argv
        spec = (await fleet_status(nc)).plans[0].lanes[0]
        assert spec.memory.kv_streams == 1 and spec.memory.kv_cells == 3 * 4096
        assert lane.kv_bytes == spec.memory.kv_bytes


async def test_lane_using_more_than_planned_is_replanned_smaller(nats_server, tmp_path, models):
    """llama-server reports 1.5x the planned KV: the agent feeds it back, the next plan sizes for it."""
    binary = fake_binary(tmp_path / "bin", {"FAKE_LLAMA_KV_SCALE": "1.5"})
    cfg = agent_config(tmp_path, "lambda", models, binary, max_ram=1 * GIB)
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        s.start_agent(cfg)

        async def corrected():
            status = await host_status(nc, "lambda")
            over = [f for f in (status.feedback if status else ()) if f.kind == "over_plan"]
            lane = lane_of(status, "llama8-0")
            if not over or not lane or lane.state != "healthy" or lane.ctx_total >= over[0].ctx_total:
                return None
            return over[0], lane

        over, lane = await eventually(corrected, what="a smaller lane after the over-plan report")
        assert over.actual_bytes > over.planned_bytes * 1.4
        spec = (await fleet_status(nc)).plans[0].lanes[0]
        assert any("larger" in r and "measured more than planned" in r for r in spec.reasons)
        assert lane.kv_bytes > lane.planned_kv_bytes  # still reported, still visible beside the plan


def test_a_nats_server_a_dead_parent_left_on_a_folder_is_stopped_by_the_next_start(tmp_path):
    """Where the server could not go with its parent, the next start on the folder finds it by its
    pid file and stops it: it comes up on the same port and store."""
    from shared.natsserver import NatsServer

    left = NatsServer(tmp_path / "nats").start()
    try:
        again = NatsServer(tmp_path / "nats", port=left.port).start()
        try:
            assert left.proc.wait(10) is not None
            assert again.proc.poll() is None and again.port == left.port
        finally:
            again.stop()
    finally:
        left.stop()


def test_a_nats_server_started_from_a_thread_that_ends_keeps_serving(tmp_path):
    """The parent-death signal follows the thread that starts the child: a server started from a
    worker thread (a cluster started side by side, `lanes up`'s restart) must outlive that thread."""
    import threading

    from shared.natsserver import NatsServer

    server = NatsServer(tmp_path / "nats")
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    try:
        # Told to go, it would stop within milliseconds of the thread's end: ask it for half a second.
        for _ in range(10):
            with urllib.request.urlopen(server.monitor + "/healthz", timeout=5) as reply:
                assert reply.status == 200
            time.sleep(0.05)
        assert server.proc.poll() is None, "the server went with the thread that started it"
    finally:
        server.stop()


async def test_a_report_the_bucket_refused_is_sent_again_within_seconds(nats_server, tmp_path, models):
    """A host is planned only once its report is in the bucket: a report put that failed (here the
    bucket refuses values that big; under load, a put that timed out) is tried again within
    seconds, not a 30 s report interval later (4 of 1,000 agents went unplanned in
    bench/convergence_bench.py)."""
    from nats.js.api import KeyValueConfig

    async with client(nats_server.url) as nc:
        js = nc.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket=subjects.BUCKET, history=1, max_value_size=64))
        cfg = agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin"), report_interval=30.0)
        async with services(nats_server.url) as s:
            s.start_agent(cfg)
            await asyncio.sleep(3.0)  # the agent's first report (and its first retries) refused
            with pytest.raises(Exception):
                await kv.get(subjects.report_key("h1"))
            info = await js.stream_info(f"KV_{subjects.BUCKET}")
            await js.update_stream(dataclasses.replace(info.config, max_msg_size=-1))  # values of any size
            began = time.monotonic()

            async def reported():
                try:
                    return (await kv.get(subjects.report_key("h1"))).value
                except Exception:
                    return None

            value = await eventually(reported, timeout=20, what="the report in the bucket")
            assert msgspec.json.decode(value, type=HostReport).host_id == "h1"
            assert time.monotonic() - began < 20  # well within the 30 s report interval


async def test_a_secrets_bucket_made_late_still_carries_every_lanes_key(nats_server, tmp_path, models):
    """JetStream refusing the planner's first tries (a cluster still electing its leader: the CI
    failure of test_compose_live, where no lane's key ever reached the gateway): the planner keeps
    trying until lanes-secrets is there, and an agent that found it missing puts its lanes' keys
    once it is."""
    cfg = agent_config(tmp_path, "late", models, fake_binary(tmp_path / "bin"))
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        js = nc.jetstream()
        await kv_bucket(nc, create=True)  # the lanes bucket is there; the secrets' subjects are taken:
        await js.add_stream(StreamConfig(name="TAKEN", subjects=[f"$KV.{subjects.SECRETS_BUCKET}.>"]))
        s.start_agent(cfg)  # ... so the agent finds no secrets bucket and cannot make one
        s.start_planner()  # ... nor can the planner, for now
        await asyncio.sleep(2.0)
        with pytest.raises(BucketNotFoundError):
            await js.key_value(subjects.SECRETS_BUCKET)
        assert not s.tasks["planner"][0].done()  # still trying, not gone on without it
        await js.delete_stream("TAKEN")
        secrets = await eventually(lambda: js.key_value(subjects.SECRETS_BUCKET), timeout=15, what="lanes-secrets made")
        await eventually(lambda: healthy("llama8-0")(nc, "late"), what="lane healthy")
        entry = await eventually(lambda: secrets.get(subjects.lane_secret_key("late", "llama8-0")), timeout=20,
                                 what="the lane's key put")  # fmt: skip
        assert msgspec.json.decode(entry.value)["key"] == (cfg.data_dir / "lanes" / "llama8-0.key").read_text().strip()
