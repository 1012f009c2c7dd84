"""`lanes agent` as a service manager drives it (deploy/systemd/lanes-agent.service): SIGUSR1 (a
restart) makes it exit and leave its lanes serving, and the next agent adopts them; SIGTERM (a
stop) stops its lanes with it. A real agent process, real NATS, the fake llama-server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from fixtures_bus import client, fake_binary, free_port_base, host_status, lane_of, pid_alive, services
from waiting import eventually


def _agent(url: str, tmp_path, models) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lanes.cli", "agent", "--nats", url, "--models", str(models), "--host-id", "sig",
         "--llama-server", fake_binary(tmp_path / "bin"), "--data", str(tmp_path / "agent"),
         "--port-base", str(free_port_base(4)), "--port-count", "4", "--max-ram", "1GiB"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


async def _exit_code(proc: subprocess.Popen) -> int:
    return await asyncio.to_thread(proc.wait, 60)


async def test_sigusr1_leaves_the_lanes_for_the_next_agent_and_sigterm_stops_them(nats_server, tmp_path, models):
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        s.start_planner()
        first = _agent(nats_server.url, tmp_path, models)
        second, lane = None, None
        try:
            async def healthy_lane(not_session: str | None = None):
                status = await host_status(nc, "sig")
                lane = lane_of(status, "llama8-0")
                fresh = status is not None and status.agent_session != not_session
                return (status, lane) if fresh and lane and lane.state == "healthy" else None

            status, lane = await eventually(healthy_lane, timeout=60, what="lane healthy")
            first.send_signal(signal.SIGUSR1)
            assert await _exit_code(first) == 0
            assert "lanes keep serving" in first.stderr.read()
            assert pid_alive(lane.pid)

            second = _agent(nats_server.url, tmp_path, models)
            _, adopted = await eventually(lambda: healthy_lane(status.agent_session), timeout=60,
                                          what="the next agent reports the lane")  # fmt: skip
            assert adopted.pid == lane.pid and adopted.restarts == 0
            second.send_signal(signal.SIGTERM)
            assert await _exit_code(second) == 0
            assert not pid_alive(lane.pid)
        finally:
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.kill()
            if lane is not None and pid_alive(lane.pid):  # a failed run leaves no lane behind
                os.kill(lane.pid, signal.SIGKILL)
