"""The agent's state file: feedback kept across restarts until it expires, pids recorded
the moment a lane starts, and adoption that refuses a reused pid. Real processes."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import psutil
import pytest
from fixtures_bus import agent_config, fake_binary, free_port_base
from waiting import eventually_blocking

from launcher_agent.feedback import Feedback
from launcher_agent.lane import Lane
from launcher_agent.persistence import Saved
from launcher_agent.process import LaneProcess
from launcher_agent.report import host_report
from launcher_agent.supervisor import Supervisor
from planner_svc.planner import plan
from shared.llama.flags import lane_args
from shared.messages.config import FleetConfig


@pytest.fixture
def cfg(tmp_path, models):
    return agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin"), port_base=free_port_base())


def _plan(cfg):
    (host,) = plan([host_report(cfg)], FleetConfig()).hosts
    return host


def _saved(cfg) -> Saved:
    return msgspec.json.decode((cfg.data_dir / "agent-state.json").read_bytes(), type=Saved)


async def test_a_pid_is_on_disk_as_soon_as_its_lane_starts(cfg):
    sup = Supervisor(cfg)
    assert sup.accept_plan(_plan(cfg)) is None
    spec = sup.plan.lanes[0]
    await sup.procs.start(spec, sup.plan.plan_revision)  # no reconcile pass around it
    try:
        lane = sup.lanes[spec.lane_id]
        saved = _saved(cfg)
        assert saved.pids == {spec.lane_id: lane.process.pid}
        assert saved.started[spec.lane_id] == pytest.approx(psutil.Process(lane.process.pid).create_time())
        key_file = cfg.data_dir / "lanes" / f"{spec.lane_id}.key"
        assert saved.argv == {spec.lane_id: list(lane_args(spec, cfg.caps, key_file=str(key_file)))}
        # Its key: new, in a file only this user reads, named on the command line by its path only.
        assert lane.api_key and lane.api_key.startswith("lane-") and lane.api_key not in " ".join(lane.process.argv)
        assert key_file.read_text() == lane.api_key + "\n" and key_file.stat().st_mode & 0o777 == 0o600
    finally:
        await sup.stop_all()
    assert _saved(cfg).pids == {}
    assert not key_file.exists()  # a stopped lane's key opens nothing again


async def test_a_record_an_older_agent_wrote_is_adopted_and_restarts_nothing(cfg):
    """Older agents kept the launched argv in the saved plan's args and no argv map."""
    sup = Supervisor(cfg)
    assert sup.accept_plan(_plan(cfg)) is None
    spec = sup.plan.lanes[0]
    await sup.procs.start(spec, sup.plan.plan_revision)
    pid = sup.lanes[spec.lane_id].process.pid
    later = Supervisor(cfg)
    try:
        old = msgspec.to_builtins(_saved(cfg))
        del old["argv"]
        ran = list(lane_args(spec, cfg.caps, key_file=str(cfg.data_dir / "lanes" / f"{spec.lane_id}.key")))
        old["plan"]["lanes"][0]["args"] = ran
        (cfg.data_dir / "agent-state.json").write_bytes(msgspec.json.encode(old))
        later.load_saved()
        assert later.lanes[spec.lane_id].process.pid == pid  # adopted
        assert later.accept_plan(_plan(cfg)) is None  # the planner's plan: typed, no args
        await later.reconcile(now=0.0)
        assert later.lanes[spec.lane_id].process.pid == pid  # nothing restarted
        assert _saved(cfg).argv == {spec.lane_id: ran}  # rewritten in the new form
        assert later.lanes[spec.lane_id].api_key == sup.lanes[spec.lane_id].api_key  # its key read back
    finally:
        await later.stop_all()
        await sup.stop_all()


def test_adoption_refuses_a_reused_pid(tmp_path, cfg):
    spec = _plan(cfg).lanes[0]
    args = lane_args(spec, cfg.caps)  # as the agent launched it (the state file records them)
    # A process whose command line ends with the lane's flags, as a lane's would.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    try:
        # Until the child has exec'd, its command line is still pytest's (seen under load).
        eventually_blocking(lambda: psutil.Process(proc.pid).cmdline()[-1:] == [args[-1]], timeout=10,
                            what="the child's exec")  # fmt: skip
        started = psutil.Process(proc.pid).create_time()
        log = tmp_path / "lane.log"
        assert LaneProcess.adopt(spec, args, cfg.binary, log, proc.pid, started) is not None
        assert LaneProcess.adopt(spec, args, cfg.binary, log, proc.pid, started - 30.0) is None  # same pid, other process
        assert LaneProcess.adopt(spec, (*args[:-1], "3"), cfg.binary, log, proc.pid, started) is None  # other flags
        assert LaneProcess.adopt(spec, (), cfg.binary, log, proc.pid, started) is None  # nothing recorded
    finally:
        proc.kill()
        proc.wait()


def test_feedback_is_kept_across_restarts_and_expires(cfg):
    now = [1_000_000.0]
    sup = Supervisor(cfg, feedback=Feedback(clock=lambda: now[0]))
    assert sup.accept_plan(_plan(cfg)) is None
    lane = Lane(spec=sup.plan.lanes[0])
    sup.feedback.failure(lane, "oom", "failed to allocate buffer")
    sup.feedback.port_busy(lane, "port taken")
    sup._save()
    kinds = sorted(fb.kind for fb in _saved(cfg).feedback)
    assert kinds == ["oom", "port_busy"]

    later = Supervisor(cfg, feedback=Feedback(clock=lambda: now[0]))  # a restarted agent
    later.load_saved()
    assert sorted(fb.kind for fb in later.status().feedback) == ["oom", "port_busy"]
    assert all(fb.noted_at == 1_000_000.0 for fb in later.status().feedback)
    now[0] += cfg.feedback_ttl - 1
    assert not later.feedback.expire(cfg.feedback_ttl)
    now[0] += 2
    assert later.feedback.expire(cfg.feedback_ttl)
    assert later.status().feedback == ()
    later._save()
    assert _saved(cfg).feedback == []
