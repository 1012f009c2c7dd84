"""Real pressure (issue 33, point 1): another program takes about 80% of a host's RAM; the lanes shrink,
restart one at a time, nothing is killed and no request through the gateway fails.

The host is a memory cgroup with a limit (as a container's `mem_limit` makes one): the agent runs
in it as its own process (`lanes agent`), with its two real llama-server lanes (its children), and
so does the other program, which holds its memory until the test ends. The kernel's OOM killer
acts at the group's limit, so the test risks nothing outside it, and the agent reports the group's
limit and use (launcher_agent/cgroup_memory.py). The planner and gateway run in this process.

Before: each lane's window is at the persona's ceiling (its KV resident from the start) and its
--cache-ram a large share. The program takes what leaves the group below its headroom; the
planner, pressed, plans smaller windows and caches, and the agent restarts the lanes one at a time
(the rollout's pacing) while a client keeps asking through the gateway.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgspec
import psutil
import pytest
from fixtures_bus import client, fleet_status, services
from test_cgroup_memory import limited_group
from test_on_demand import gateway
from test_real_llama import _planner_with
from tinymodels import write_llama
from waiting import eventually

from launcher_agent.cgroup_memory import group_memory
from shared import subjects
from shared.messages.config import Demand, Persona
from shared.messages.status import LaneEvent

GIB, MIB = 2**30, 2**20
LIMIT = 15 * GIB // 2  # the host: 7.5 GiB, of which the other program takes about 80%
LANES = str(Path(sys.executable).parent / "lanes")
HOG = """
import sys, time
held = bytearray(int(sys.argv[1])); held[::4096] = b"x" * len(range(0, len(held), 4096))
print("holding", flush=True)
time.sleep(3600)
"""


def _join(procs: Path):
    return lambda: procs.write_text(str(os.getpid()))  # in the child, before it runs anything


def _flag(argv, name: str) -> int:
    argv = list(argv)
    return int(argv[argv.index(name) + 1])


async def test_another_program_taking_80_percent_shrinks_lanes_one_at_a_time(nats_server, tmp_path, llama_server):
    group, v1 = limited_group(f"lanes-host-{os.getpid()}", LIMIT)
    procs = group / "cgroup.procs"

    def used() -> int:
        """What the group holds, as the agent inside it counts it (launcher_agent/cgroup_memory.py)."""
        found = group_memory("4:memory:/\n" if v1 else "0::/\n", lambda rel: _text(group / rel.rpartition("/")[2]))
        return found.used if found else 0

    models = tmp_path / "models"
    models.mkdir()
    # 16 KiB of f16 K+V per token: a 16,384-token window of 2 slots holds 512 MiB.
    write_llama(models / "m.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=8, head_dim=64, n_ctx_train=32768)
    demand = Demand(personas=(Persona(model="m", alias="m", lanes=2, parallel=2, ctx_min=2048, ctx_max=16384),))
    events: list[LaneEvent] = []
    started: list[subprocess.Popen] = []
    log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115  (closed below)
    try:
        async with services(nats_server.url) as s, client(nats_server.url) as nc:
            async def on_event(msg) -> None:
                events.append(msgspec.json.decode(msg.data, type=LaneEvent))

            await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
            await _planner_with(nc, s, {}, demand)
            started.append(subprocess.Popen(
                [LANES, "agent", "--nats", nats_server.url, "--host-id", "box", "--models", str(models),
                 "--llama-server", llama_server, "--data", str(tmp_path / "data"), "--report-interval", "1"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, preexec_fn=_join(procs)))  # fmt: skip
            agent = started[0]

            async def lanes_now():
                status = (await fleet_status(nc)).statuses
                lanes = [x for st in status for x in st.lanes]
                assert agent.poll() is None, f"the agent exited {agent.returncode}"
                return lanes if len(lanes) == 2 and all(x.state == "healthy" for x in lanes) else None

            before = await eventually(lanes_now, timeout=120, what="both lanes healthy")
            assert all(_flag(x.argv, "--ctx-size") == 2 * 16384 for x in before), [x.argv for x in before]
            cache_before = {x.lane_id: _flag(x.argv, "--cache-ram") for x in before}

            async with gateway(nats_server.url) as gw, aiohttp.ClientSession() as http:
                await eventually(lambda: len(gw.view.routable("m")) == 2, timeout=60, what="both lanes routable")
                failures, answered, fewest = [], [0], [2]
                stop = asyncio.Event()

                async def keep_asking():
                    body = {"model": "m", "prompt": "lane slot cache " * 8, "max_tokens": 2}
                    while not stop.is_set():
                        fewest[0] = min(fewest[0], len(gw.view.routable("m")))
                        try:
                            async with http.post(gw.url + "/v1/completions", json=body,
                                                 timeout=aiohttp.ClientTimeout(total=60)) as resp:  # fmt: skip
                                if resp.status != 200:
                                    failures.append((resp.status, (await resp.text())[:200]))
                                else:
                                    answered[0] += 1
                        except Exception as exc:  # noqa: BLE001  (every failure is counted)
                            failures.append(repr(exc))
                        await asyncio.sleep(0.2)

                asking = asyncio.create_task(keep_asking())
                await asyncio.sleep(2)
                headroom = 512 * MIB + LIMIT // 20  # the default headroom at this host's total
                take = LIMIT - used() - (headroom - 300 * MIB)
                print(f"the other program takes {take / GIB:.2f} GiB, {take / LIMIT:.0%} of the host")
                assert take >= 0.7 * LIMIT, f"the lanes hold more than planned: {used() / GIB:.2f} GiB in the group"
                asked = time.monotonic()
                hog = subprocess.Popen([sys.executable, "-c", HOG, str(take)], stdout=subprocess.PIPE,
                                       preexec_fn=_join(procs))  # fmt: skip
                started.append(hog)
                # (in a thread: this loop runs the planner and the gateway meanwhile)
                holding = await asyncio.wait_for(asyncio.to_thread(hog.stdout.readline), 120)
                assert holding.strip() == b"holding", "the other program did not get its memory"
                print(f"... held after {time.monotonic() - asked:.1f} s")

                def shrunk(lanes):
                    return lanes and all(x.lane_id in cache_before and x.pid not in {b.pid for b in before}
                                         for x in lanes)  # fmt: skip

                after = await eventually(lambda: _and(lanes_now(), shrunk), timeout=240,
                                         what=f"both lanes restarted smaller; events {_said(events)}")  # fmt: skip
                await asyncio.sleep(3)  # a few more requests on the new lanes
                stop.set()
                await asyncio.wait_for(asking, 70)

            print(f"{answered[0]} answered; lanes after: "
                  f"{[(x.lane_id, _flag(x.argv, '--ctx-size'), _flag(x.argv, '--cache-ram')) for x in after]}")
            for x in after:  # smaller: the window, or the prompt cache, or both
                assert (_flag(x.argv, "--ctx-size"), _flag(x.argv, "--cache-ram")) < (2 * 16384, cache_before[x.lane_id]) \
                    or _flag(x.argv, "--cache-ram") < cache_before[x.lane_id], x.argv
            assert not failures, f"requests failed through the gateway: {failures[:5]}"
            assert answered[0] > 10
            assert fewest[0] >= 1, "both lanes were out of rotation at once"
            assert [e for e in events if e.event in ("crashed", "failed")] == [], _said(events)
            order = [(e.event, e.lane_id) for e in events if e.event in ("stopped", "healthy")]
            assert _one_at_a_time(order), order
            assert hog.poll() is None and agent.poll() is None, "the OOM killer took a process"
            if v1:
                assert "oom_kill 0" in (group / "memory.oom_control").read_text()
            else:
                assert "oom_kill 0" in (group / "memory.events").read_text()
    finally:
        for proc in reversed(started):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()
        for pid in _text(procs).split() if procs.exists() else []:  # lanes the agent left behind
            try:
                psutil.Process(int(pid)).kill()
            except psutil.Error:
                pass
        await _rmdir(group)


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


async def _and(lanes, check):
    found = await lanes
    return found if check(found) else None


def _said(events) -> list:
    return [(e.event, e.lane_id, e.detail[:80]) for e in events]


def _one_at_a_time(order: list[tuple[str, str]]) -> bool:
    """Between one lane's stop and its healthy again, no other lane stopped."""
    down: set[str] = set()
    for event, lane in order:
        if event == "stopped":
            down.add(lane)
            if len(down) > 1:
                return False
        else:
            down.discard(lane)
    return bool(order)


async def _rmdir(group: Path) -> None:
    for _ in range(50):  # the group can go once its last process is reaped
        try:
            group.rmdir()
            return
        except OSError:
            await asyncio.sleep(0.1)
    pytest.fail(f"cgroup {group} left behind")
