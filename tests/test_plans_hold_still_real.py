"""Plans that hold still (issue 33, points 1 and 2), with the real llama-server on the real Gemma file.

Gemma lanes (a sliding-window model: llama-server prints two KV caches) with fixed windows,
enough of them that the host's free RAM, shared among their prompt caches, gives each less
than llama-server's default. Another program then takes 4 GiB for three
report intervals: the planner sees the smaller free RAM and keeps every --cache-ram (the host is
not pressed), so no lane restarts. Then the agent is killed (its lanes keep running) and the
planner stopped, and both started again under the same load: the new agent adopts both lanes,
reads each one's KV once (it read it twice from a young lane's log: "lane uses more than
planned", exactly twice the plan, and a new plan restarting every lane), and nothing restarts.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
import sys

import msgspec
import psutil
import structlog
from fixtures_bus import agent_config, client, fleet_status, host_status, services
from test_real_llama import _planner_with
from waiting import eventually

from planner_svc.prompt_cache import DEFAULT_CACHE_RAM_MIB
from shared import subjects
from shared.bus import kv_bucket
from shared.messages.config import Demand, Persona
from shared.messages.hosts import HostReport

GIB = 2**30
TAKEN = 4 * GIB
HOG = "import sys, time\nb = bytearray({n})\nb[::4096] = b'x' * len(b[::4096])\nprint('held', flush=True)\ntime.sleep(600)"


async def _lanes(nc) -> dict[str, tuple[int, int | None, int]]:
    """Each healthy lane: (pid, --cache-ram MiB, restarts)."""
    status = await host_status(nc, "still")
    plans = {s.lane_id: s for p in (await fleet_status(nc)).plans for s in p.lanes}
    return {x.lane_id: (x.pid, plans[x.lane_id].cache_ram_mib if x.lane_id in plans else None, x.restarts)
            for x in (status.lanes if status else ()) if x.state == "healthy"}  # fmt: skip


async def _available(nc) -> int:
    kv = await kv_bucket(nc)
    return msgspec.json.decode((await kv.get(subjects.report_key("still"))).value, type=HostReport).ram_available


async def test_ram_taken_and_a_restarted_control_plane_restart_no_lane(nats_server, tmp_path, llama_server,
                                                                         gemma_model):  # fmt: skip
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(gemma_model, models / "gemma.gguf")
    # Enough lanes that their caches get a share of the free RAM, below llama-server's 8 GiB default:
    # RAM taken then lowers the share (4 lanes on this 24 GiB machine).
    free = psutil.virtual_memory().available
    count = min(6, max(2, math.ceil(free / (DEFAULT_CACHE_RAM_MIB * 2**20)) + 1))
    demand = Demand(personas=(Persona(model="gemma", lanes=count, parallel=1, ctx_min=2048, ctx_max=2048),))
    cfg = agent_config(tmp_path, "still", models, llama_server, report_interval=1.0)
    hog: subprocess.Popen | None = None
    with structlog.testing.capture_logs() as logs:
        try:
            async with services(nats_server.url) as s, client(nats_server.url) as nc:
                await _planner_with(nc, s, {}, demand)
                s.start_agent(cfg)
                first = await eventually(_ready(nc, count), timeout=120, what="the lanes up")
                assert all(mib and 0 < mib < DEFAULT_CACHE_RAM_MIB for _, mib, _ in first.values()), first  # a share
                free_before = await _available(nc)

                hog = subprocess.Popen([sys.executable, "-c", HOG.format(n=TAKEN)], stdout=subprocess.PIPE, text=True)
                assert (await asyncio.to_thread(hog.stdout.readline)).strip() == "held"
                await eventually(lambda: _dropped(nc, free_before), timeout=30, what="the report shows the RAM taken")
                await asyncio.sleep(3 * cfg.report_interval + 1)  # reports, plans, any rollout would start
                assert await _lanes(nc) == first, "a lane restarted while another program held RAM"

                old_session = (await host_status(nc, "still")).agent_session
                await s.kill("still")  # as SIGKILL: the lanes keep running
                await s.stop("planner")
                s.start_planner()
                s.start_agent(cfg)
                await eventually(lambda: _new_session(nc, old_session), timeout=60, what="the new agent reports")
                await eventually(_ready(nc, count), timeout=60, what="the lanes adopted")
                await asyncio.sleep(3 * cfg.report_interval + 1)
                status = await host_status(nc, "still")
                assert not [f for f in status.feedback if f.kind == "over_plan"], status.feedback
                assert await _lanes(nc) == first, "a lane restarted after the control plane restarted"
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    over = [e for e in logs if e.get("event") == "lane uses more than planned"]
    assert not over, over
    restarted = [e for e in logs if e.get("event") == "lane stopped" and e.get("reason") != "agent shutting down"]
    assert not restarted, restarted


def _ready(nc, count: int):
    async def check():
        lanes = await _lanes(nc)
        return lanes if len(lanes) == count else None

    return check


async def _dropped(nc, before: int) -> bool:
    return await _available(nc) <= before - TAKEN * 3 // 4


async def _new_session(nc, old: str):
    status = await host_status(nc, "still")
    return status if status is not None and status.agent_session != old else None

