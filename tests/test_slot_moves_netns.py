"""A conversation's cache crosses hosts for real (issue 33, point 5): two hosts in their own network
namespaces, the real llama-server on each, the gateway on a third, NATS and the planner on their own.

    ns nats     nats-server -js          ns planner  lanes planner
    ns agent1   lanes agent host1 (a lane of "m", 4 slots, listening on its own address)
    ns agent2   lanes agent host2 (the same model file, copied: the same sha256)
    ns gateway  lanes gateway --api-key-file     this test: a client in the root namespace

Four conversations run through the gateway across both hosts. Then:
- a scale-down (the demand asks for one lane of "m"): the planner stops one host's lane, whose
  agent saves its slots and sends them over NATS (stream LANES_SLOTS) to its buddy on the other
  host, which restores them; the gateway hears `slots_received` and sends those conversations
  there. Every conversation's next turn is answered by the other host, >= 0.9 cached (a dense
  model and the real Gemma file);
- a rollout (`config set threads=1`, lanes restart one at a time, each taking a real model's load
  time): the lane restarting first sends its slots to the other host, and every turn while it is
  away is answered by the other host, >= 0.9 cached.
"""

from __future__ import annotations

import random
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import pytest
from fixtures_bus import fleet_status
from test_netns import LANES, start_fleet, topo  # noqa: F401  (the namespaces fixture)
from test_slot_moves_real import demand
from test_slot_save_real import CONVERSATIONS, ROUNDS, _round, _routes, _text
from tinymodels import write_llama
from waiting import eventually

from shared import subjects
from shared.bus import connect
from shared.messages.replies import ConfigSet
from shared.messages.status import LaneEvent
from shared.messages.wire import encode

KEY = "netns-slots-key"
ROLES = ("nats", "planner", "agent1", "agent2", "gateway")


def _routable(text: str) -> dict[str, float]:
    return {line.split('host="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("lanes_lane_routable{")}  # fmt: skip


@dataclass
class TwoHosts:
    nc: object
    http: aiohttp.ClientSession
    base: str  # the gateway's URL
    events: list[LaneEvent]

    async def routable(self) -> dict[str, float]:
        async with self.http.get(self.base + "/metrics", timeout=aiohttp.ClientTimeout(total=3)) as r:
            return _routable(await r.text())


@asynccontextmanager
async def two_hosts(topo, tmp_path, tiny_models, binary: str, model: Path):
    """NATS, the planner, two agents (each its own copy of `model`, lanes on its own address) and a
    gateway, each in its own namespace; one lane of "m" per host (4 slots), both routable."""
    url = start_fleet(topo, tmp_path, tiny_models, serve_network=True, llama_server=binary, model=model)
    keys = tmp_path / "gateway-keys"
    keys.write_text(KEY + "\n")
    topo.spawn("gateway", "gateway", [LANES, "gateway", "--nats", url, "--host", "0.0.0.0", "--port", "8000",
                                      "--api-key-file", str(keys)])  # fmt: skip
    nc = await connect(url, name="netns-test", retry_forever=False)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
            fleet = TwoHosts(nc, http, f"http://{topo.ip['gateway']}:8000", [])

            async def on_event(msg) -> None:
                fleet.events.append(msgspec.json.decode(msg.data, type=LaneEvent))

            await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
            reply = await eventually(lambda: nc.request(subjects.DEMAND_SET, encode(demand(None)), timeout=5),
                                     what="the planner answers")  # fmt: skip
            assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
            await eventually(lambda: _both(fleet.routable), timeout=180, what="both hosts' lanes routable")
            yield fleet
            for name, proc, _ in topo.procs:
                assert proc.poll() is None, f"{name} exited with {proc.returncode}"
    except BaseException:
        print(topo.logs())
        raise
    finally:
        await nc.close()


async def _warm(fleet: TwoHosts, rng: random.Random, chars: int) -> list[str]:
    """Four conversations, two turns each, across both hosts."""
    ROUNDS.clear()
    prompts = [f"conversation {i}\nsystem: " + _text(rng, chars) for i in range(CONVERSATIONS)]
    for _ in range(2):
        warm = await _round(fleet.http, fleet.base, prompts, rng)
    assert warm >= 0.8, f"later turns cached at {warm:.2f}{_routes()}"
    assert {lane.split("/")[0] for lane in _last_lanes()} == {"host1", "host2"}, f"not on both hosts{_routes()}"
    return prompts


@pytest.mark.parametrize("kind", ["dense", "gemma"])
@pytest.mark.parametrize("topo", [ROLES], indirect=True)
async def test_a_stopped_lanes_conversations_are_answered_cached_by_the_other_host(kind, topo, tmp_path, tiny_models,
                                                                                    llama_server, request):  # fmt: skip
    """dense: a generated llama; gemma: the real Gemma 3 270M file (sliding-window: its lanes keep
    the whole window, --swa-full, so that a slot file holds the conversation)."""
    model = tmp_path / "m.gguf"
    if kind == "dense":
        write_llama(model, n_layer=2, n_ctx_train=8192)
    else:
        model.symlink_to(request.getfixturevalue("gemma_model"))
    rng = random.Random(35)
    async with two_hosts(topo, tmp_path, tiny_models, llama_server, model) as fleet:
        nc, events = fleet.nc, fleet.events
        prompts = await _warm(fleet, rng, 600 if kind == "dense" else 2400)  # about 880 and 450 tokens
        reply = await nc.request(subjects.DEMAND_SET, encode(demand(1)), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
        stopped = await eventually(lambda: next((e for e in events if e.event == "stopped"), None), timeout=60,
                                   what="a lane stopped")  # fmt: skip
        received = await eventually(
            lambda: next((e for e in events if e.event == "slots_received"), None), timeout=60,
            what=f"the stopped lane's slots received; events: {[(e.host_id, e.event, e.detail) for e in events]}")
        assert received.host_id != stopped.host_id, "the slots stayed on their host"
        assert (received.from_host, received.from_lane) == (stopped.host_id, stopped.lane_id)
        gateway_log = tmp_path / "gateway.log"
        await eventually(lambda: "conversations follow their slots" in gateway_log.read_text(errors="replace"),
                         timeout=30, what="the gateway sends the moved conversations to their slots")  # fmt: skip
        await eventually(lambda: _only(fleet.routable, received.host_id), timeout=30, what="one host's lane left")

        after = await _round(fleet.http, fleet.base, prompts, rng)
        assert {lane.split("/")[0] for lane in _last_lanes()} == {received.host_id}, _routes()
        print(f"{kind} moved across hosts: {received.detail}; the next turn of every conversation cached {after:.3f}{_routes()}")
        assert after >= 0.9, f"the first turn after the move was cached at {after:.2f}{_routes()}"


SLOW_START = """#!/bin/sh
# llama-server, started 6 s late when it is to serve (not when asked its --version or --help):
# a restart that takes as long as a real model's load, so the rollout's window can be seen.
case " $* " in *" --model "*) sleep 6 ;; esac
exec {binary} "$@"
"""


@pytest.mark.parametrize("topo", [ROLES], indirect=True)
async def test_a_rollout_sends_a_lanes_conversations_to_the_other_host_while_it_restarts(topo, tmp_path, tiny_models,
                                                                                         llama_server):  # fmt: skip
    """The issue's case: `config set threads=1` rolls both lanes, one at a time. The lane restarting
    first sends its saved slots to its buddy on the other host, which restores them; while it
    restarts (a real model's load time), every conversation's turn is answered by the other host,
    the moved ones too, >= 0.9 cached."""
    model = write_llama(tmp_path / "m.gguf", n_layer=2, n_ctx_train=8192)
    slow = tmp_path / "slow-start" / "llama-server"
    slow.parent.mkdir()
    slow.write_text(SLOW_START.format(binary=llama_server))
    slow.chmod(0o755)
    rng = random.Random(37)
    async with two_hosts(topo, tmp_path, tiny_models, str(slow), model) as fleet:
        nc, events = fleet.nc, fleet.events
        prompts = await _warm(fleet, rng, 600)
        reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes={"threads": 1})), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
        received = await eventually(
            lambda: next((e for e in events if e.event == "slots_received"), None), timeout=60,
            what=f"the first restarting lane's slots received; events: {[(e.host_id, e.event, e.detail) for e in events]}")
        source = received.detail.split(" from ")[1].split("/")[0]
        assert source != received.host_id, "the slots stayed on their host"
        up = await fleet.routable()
        assert up.get(source) == 0.0 and up.get(received.host_id) == 1.0, f"{source} back already: {up}"

        during = await _round(fleet.http, fleet.base, prompts, rng)
        assert {lane.split("/")[0] for lane in _last_lanes()} == {received.host_id}, _routes()
        up = await fleet.routable()
        assert up.get(source) == 0.0, f"{source} came back during the round: {up}{_routes()}"
        print(f"rollout: {received.detail}; while {source} restarted every turn went to {received.host_id}, "
              f"cached {during:.3f}{_routes()}")  # fmt: skip
        assert during >= 0.9, f"the turns during the restart were cached at {during:.2f}{_routes()}"

        async def rolled() -> bool:
            lanes = [x for st in (await fleet_status(nc)).statuses for x in st.lanes]
            return len(lanes) == 2 and all(x.state == "healthy" and "--threads 1" in " ".join(x.argv) for x in lanes)

        await eventually(rolled, timeout=120, what="both lanes restarted with --threads 1")
        await eventually(lambda: _both(fleet.routable), timeout=60, what="both routable again")


async def _both(routable) -> bool:
    return await routable() == {"host1": 1.0, "host2": 1.0}


async def _only(routable, host: str) -> bool:
    return {h for h, up in (await routable()).items() if up} == {host}


def _last_lanes() -> list[str]:
    """The lane (host/lane) that answered each conversation in the last round."""
    return [item.split("@")[1].split(":")[0] for item in ROUNDS[-1].split(" ")]
