"""Hot prompts survive a rolling restart, with the real llama-server, planner, agent and gateway.

Two lanes of a generated llama model (one token per byte, no sliding window), two slots each,
four conversations through the gateway. `config set threads=...` restarts both lanes, one at a
time, with the same KV layout: each lane saves its slots before it goes and restores them before
it serves, so the next turn of every conversation is served mostly from cache (without saved
slots it is not cached at all: the host-RAM prompt cache dies with the process). Then a change
of cache types restarts them again: the saved slots cannot be restored, the lanes say so in
their events, the files are removed, and the next turn is prefilled in full. Last, with no disk for saved
slots (slot_cache_bytes=0, as before this feature), a restart leaves nothing cached.
"""

from __future__ import annotations

import asyncio
import random
import re
import shutil
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest
from fixtures_bus import agent_config, client, fleet_status, services
from test_on_demand import gateway
from test_real_llama import _planner_with
from tinymodels import write_llama
from waiting import eventually

from launcher_agent.config import AgentConfig
from shared import subjects
from shared.messages.config import Demand, Persona
from shared.messages.replies import ConfigSet
from shared.messages.status import LaneEvent
from shared.messages.wire import encode

CONVERSATIONS = 4
WORDS = "lane slot cache prompt token model fleet agent planner gateway restart budget".split()


def _text(rng: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + " "
    return out[:chars]


async def _turn(http: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, int, str]:
    """One turn through the gateway: (prompt tokens prefilled, tokens taken from the cache, the lane)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        lane = resp.headers.get("X-Lanes-Lane", "?")
    return answer["timings"]["prompt_n"], answer["timings"]["cache_n"], lane


ROUNDS: list[str] = []  # each round's routing, conversation by conversation: said when a ratio is off


async def _round(http, url: str, prompts: list[str], rng: random.Random) -> float:
    """Each conversation's next turn (its prompt grows by a short message): the cached ratio."""
    for i in range(len(prompts)):
        prompts[i] += "\nuser: " + _text(rng, 40)
    results = await asyncio.gather(*(_turn(http, url, p) for p in prompts))
    ROUNDS.append(" ".join(f"{i}@{lane}:{c}/{p + c}" for i, (p, c, lane) in enumerate(results)))
    return sum(c for _, c, _ in results) / sum(p + c for p, c, _ in results)


def _routes() -> str:
    return "; rounds (conversation@lane:cached/prompt): " + " | ".join(ROUNDS)


async def _config(nc, changes: dict) -> None:
    reply = await nc.request(subjects.CONFIG_SET, encode(ConfigSet(changes=changes)), timeout=5)
    assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers


def _restarted_with(nc, flag: str):
    async def check() -> bool:
        lanes = [lane for s in (await fleet_status(nc)).statuses for lane in s.lanes]
        return len(lanes) == 2 and all(x.state == "healthy" and flag in " ".join(x.argv) for x in lanes)

    return check


@dataclass
class SlotFleet:
    nc: object
    gw: object
    http: aiohttp.ClientSession
    events: list[LaneEvent]
    cfg: AgentConfig


@asynccontextmanager
async def slot_fleet(url: str, tmp_path, models, binary: str, demand: Demand, host: str):
    """Planner, an agent of `host` and a gateway for model "m", its lanes' events collected; once
    both of its lanes are routable."""
    events: list[LaneEvent] = []
    async with services(url) as s, client(url) as nc:

        async def on_event(msg) -> None:
            events.append(msgspec.json.decode(msg.data, type=LaneEvent))

        sub = await nc.subscribe(subjects.ALL_EVENTS, cb=on_event)
        await _planner_with(nc, s, {}, demand)
        cfg = agent_config(tmp_path, host, models, binary)
        s.start_agent(cfg)
        try:
            async with gateway(url) as gw, aiohttp.ClientSession() as http:
                await eventually(lambda: len(gw.view.routable("m")) == 2, timeout=120, what="both lanes routable")
                yield SlotFleet(nc, gw, http, events, cfg)
        finally:
            await sub.unsubscribe()


async def warm_then_roll(nc, gw, http, prompts: list[str], rng: random.Random, events: list[LaneEvent],
                         label: str = "") -> tuple[list, int]:  # fmt: skip
    """Three turns of each conversation (the later ones cached); then `config set threads=...`
    restarts both lanes of model "m", one at a time, each saving its slots and restoring them, and
    each conversation's next turn is cached too. Returns the lanes before and the threads set."""
    for _ in range(3):
        warm = await _round(http, gw.url, prompts, rng)
    assert warm >= 0.8, f"later turns before any restart cached at {warm:.2f}{_routes()}"
    lanes = [lane for st in (await fleet_status(nc)).statuses for lane in st.lanes]
    now = {m.group(1) for x in lanes if (m := re.search(r"--threads (\d+)", " ".join(x.argv)))}
    threads = 2 if now == {"1"} else 1
    await _config(nc, {"threads": threads})
    await eventually(_restarted_with(nc, f"--threads {threads}"), timeout=180, what="both lanes restarted")
    await eventually(lambda: len(gw.view.routable("m")) == 2, timeout=60, what="both lanes routable again")
    # The gateway sees both new lanes idle (its /slots reads of them, not of the processes before):
    # the round measures where a quiet fleet sends each conversation's next turn.
    await eventually(lambda: all(gw.admission.counts.busy(x.key) == 0 for x in gw.view.routable("m")),
                     timeout=30, what="both lanes idle in the gateway's view")  # fmt: skip
    after = await _round(http, gw.url, prompts, rng)
    saved = [e for e in events if e.event == "slots_saved"]
    restored = [e for e in events if e.event == "slots_restored"]
    print(f"{label}cached ratio: before the restart {warm:.3f}, first turn after it {after:.3f}; "
          f"saved: {[e.detail for e in saved]}; restored: {[e.detail for e in restored]}{_routes()}")  # fmt: skip
    assert {e.lane_id for e in saved} == {e.lane_id for e in restored} == {x.lane_id for x in lanes}
    assert after >= 0.8, f"the first turn after the rolling restart was cached at {after:.2f}{_routes()}"
    return lanes, threads


async def test_a_rolling_restart_keeps_each_conversations_cache_and_a_cache_type_change_discards_it(
    nats_server, tmp_path, llama_server
):
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "m.gguf", n_layer=2, n_ctx_train=8192)
    demand = Demand(personas=(Persona(model="m", alias="m", lanes=2, parallel=2, ctx_min=2048, ctx_max=2048),))
    rng = random.Random(27)
    async with slot_fleet(nats_server.url, tmp_path, models, llama_server, demand, "slots") as f:
        nc, gw, http, events, cfg = f.nc, f.gw, f.http, f.events, f.cfg
        prompts = [f"conversation {i}\nsystem: " + _text(rng, 600) for i in range(CONVERSATIONS)]
        lanes, threads = await warm_then_roll(nc, gw, http, prompts, rng, events)
        restored = [e for e in events if e.event == "slots_restored"]
        assert list((cfg.data_dir / "slots").glob("*.slot")) == []  # restored files are consumed

        await _round(http, gw.url, prompts, rng)  # the slots hold the conversations again
        await _config(nc, {"kv_cache_type": "q8_0", "flash_attn": "on"})
        await eventually(_restarted_with(nc, "--cache-type-k q8_0"), timeout=180, what="lanes on q8_0")
        await eventually(lambda: len(gw.view.routable("m")) == 2, timeout=60, what="routable on q8_0")
        discarded = [e for e in events if e.event == "slots_discarded"]
        assert {e.lane_id for e in discarded} == {x.lane_id for x in lanes}, [e.detail for e in events]
        assert all("f16/f16 -> q8_0/q8_0" in e.detail for e in discarded), [e.detail for e in discarded]
        assert len([e for e in events if e.event == "slots_restored"]) == len(restored)  # nothing new restored
        assert list((cfg.data_dir / "slots").glob("*.slot")) == []
        cold = await _round(http, gw.url, prompts, rng)
        assert cold == 0.0, f"a turn after the cache type change was cached at {cold:.2f}"

        # As before this change: no disk for saved slots, and a restart loses every cache.
        await _round(http, gw.url, prompts, rng)
        await _config(nc, {"slot_cache_bytes": 0, "threads": 3 - threads})
        await eventually(_restarted_with(nc, f"--threads {3 - threads}"), timeout=180, what="restarted again")
        await eventually(lambda: len(gw.view.routable("m")) == 2, timeout=60, what="routable again")
        unsaved = await _round(http, gw.url, prompts, rng)
        print(f"first turn after a restart without saved slots: cached ratio {unsaved:.3f}")
        assert unsaved == 0.0


@pytest.mark.parametrize("kind", ["dense", "gemma"])
async def test_a_lane_scaled_down_gets_its_conversations_back_when_it_returns(kind, nats_server, tmp_path, llama_server,
                                                                               request):  # fmt: skip
    """A stop the plan asks for (scale-down, or eviction: both stop a lane) saves its slots; the
    lane started again for the model restores them before it serves. dense: a generated llama;
    gemma: the real Gemma 3 270M file (sliding-window), prompts longer than its 512-token window."""
    models = tmp_path / "models"
    models.mkdir()
    if kind == "dense":
        write_llama(models / "m.gguf", n_layer=2, n_ctx_train=8192)
    else:
        shutil.copy(request.getfixturevalue("gemma_model"), models / "m.gguf")
    rng = random.Random(28)

    def demand(lanes: int) -> Demand:
        return Demand(personas=(Persona(model="m", alias="m", lanes=lanes, parallel=2, ctx_min=2048, ctx_max=2048),))

    async with slot_fleet(nats_server.url, tmp_path, models, llama_server, demand(2), "slots") as f:
        nc, gw, http, events, cfg = f.nc, f.gw, f.http, f.events, f.cfg
        chars = 600 if kind == "dense" else 6000  # about 900 and 1,100 tokens
        prompts = [f"conversation {i}\nsystem: " + _text(rng, chars) for i in range(CONVERSATIONS)]
        await _round(http, gw.url, prompts, rng)
        await _round(http, gw.url, prompts, rng)
        reply = await nc.request(subjects.DEMAND_SET, encode(demand(1)), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
        await eventually(lambda: [x.lane_id for x in gw.view.routable("m")] == ["m-0"], timeout=60, what="m-1 gone")
        await eventually(lambda: any(e.event == "stopped" and e.lane_id == "m-1" for e in events), what="m-1 stopped")
        saved = [e for e in events if e.event == "slots_saved" and e.lane_id == "m-1"]
        files = list((cfg.data_dir / "slots").glob("*.slot"))
        reply = await nc.request(subjects.DEMAND_SET, encode(demand(2)), timeout=5)
        assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
        await eventually(lambda: len(gw.view.routable("m")) == 2, timeout=120, what="m-1 back")
        restored = [e for e in events if e.event == "slots_restored" and e.lane_id == "m-1"]
        after = await _round(http, gw.url, prompts, rng)
        print(f"{kind} scale-down saved {[e.detail for e in saved]} ({len(files)} files); "
              f"restored {[e.detail for e in restored]}; next turn cached {after:.3f}")  # fmt: skip
        assert saved and restored and files
        assert list((cfg.data_dir / "slots").glob("*.slot")) == []
        assert after >= 0.8, f"the turn after the lane came back was cached at {after:.2f}{_routes()}"
