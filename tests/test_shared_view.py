"""One prefix view for every gateway, with real parts: a nats-server (JetStream), the planner,
an agent serving the real Gemma 3 270M file in two lanes of two slots, and three gateways.
A conversation whose turns alternate between two gateways stays on its lane and finds its
prompt cached; a gateway started mid-run replays the stream and routes the same."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import msgspec
import nats
from test_gateway import ALIAS, SYSTEMS, _openai, fleet, gateway  # noqa: F401 (fleet: the module's fixture)
from waiting import eventually

from gateway.admission.queue import Admission
from gateway.routing.chunks import CHUNK_CHARS
from gateway.fleet.view import FleetView
from gateway.sync.shared_view import KVEventBatch, SharedView, from_wire, kv_event_batch, to_wire
from shared import subjects
from shared.messages.prefixes import PrefixEvent
from shared.natsserver import NatsServer


async def _last_sequence(js) -> int:
    return (await js.stream_info(subjects.PREFIX_STREAM)).state.last_seq


async def _synced(js, views) -> bool:
    """Every gateway (its SharedView) has applied the stream up to its last event, and published
    all it learnt."""
    views = [getattr(v, "shared", None) or v for v in views]
    if any(not v.outbox.empty() for v in views):
        return False
    last = await _last_sequence(js)
    return all(v.applied == last for v in views)


def _held(gw) -> dict:
    return {lane: set(held) for lane, held in gw.admission.index.lanes.items() if held}


async def test_turns_alternating_between_gateways_keep_their_cache_and_a_late_gateway_routes_the_same(fleet):  # noqa: F811
    async with AsyncExitStack() as stack:
        nc = await nats.connect(fleet.url)
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        one = await stack.enter_async_context(gateway(fleet, gateway_id="gw-one"))
        two = await stack.enter_async_context(gateway(fleet, gateway_id="gw-two"))
        gateways = [one, two]
        convs = [[{"role": "system", "content": s}, {"role": "user", "content": "Say hello."}] for s in SYSTEMS]
        lane_of: dict[int, str] = {}
        later, cached_ratios = 0, []
        for turn in range(3):
            for i, messages in enumerate(convs):
                await eventually(lambda: _synced(js, gateways), timeout=60, what="gateways synced")
                gw = gateways[(i + turn) % 2]  # each turn on the other gateway
                raw = await _openai(gw).chat.completions.with_raw_response.create(
                    model=ALIAS, messages=messages, max_tokens=8)  # fmt: skip
                lane, answer = raw.headers["x-lanes-lane"], raw.parse()
                if turn == 0:
                    lane_of[i] = lane
                else:
                    later += 1
                    assert lane == lane_of[i], (i, turn)
                    details = answer.usage.prompt_tokens_details
                    cached_ratios.append(details.cached_tokens / answer.usage.prompt_tokens)
                messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                             {"role": "user", "content": f"Turn {turn + 2}: tell me one more thing."}]  # fmt: skip
        assert len(set(lane_of.values())) == 2  # new conversations spread over both lanes
        assert later == 8 and min(cached_ratios) > 0.8, cached_ratios
        await eventually(lambda: _synced(js, gateways), timeout=60, what="gateways synced")
        assert _held(one) == _held(two)  # one index, whichever gateway routed what

        # A third gateway, started now: it replays the stream and holds the same index.
        started = time.monotonic()
        three = await stack.enter_async_context(gateway(fleet, gateway_id="gw-three"))
        gateways.append(three)
        await eventually(lambda: _synced(js, gateways), timeout=60, what="the late gateway synced")
        converged = time.monotonic() - started
        assert _held(three) == _held(one), f"converged in {converged:.2f} s yet differs"
        for i, messages in enumerate(convs):
            raw = await _openai(three).chat.completions.with_raw_response.create(
                model=ALIAS, messages=messages, max_tokens=8)  # fmt: skip
            assert raw.headers["x-lanes-lane"] == lane_of[i]
            usage = raw.parse().usage
            assert usage.prompt_tokens_details.cached_tokens > 0.8 * usage.prompt_tokens
        routes = {reason for (model, reason) in three.admission.counts.routes if model == ALIAS}
        assert routes == {"affinity"}, three.admission.counts.routes


def test_events_round_trip_and_read_as_vllm_kv_events():
    top = 2**64 - 1
    assert from_wire(to_wire(top)) == top and from_wire(to_wire(5)) == 5 and to_wire(top) == -1
    event = PrefixEvent(gateway="g", model="m", host_id="h", lane_id="l", stored=(to_wire(top), 7), removed=(3,))
    batch = msgspec.msgpack.decode(kv_event_batch(event, 12.5), type=KVEventBatch)
    stored, removed = batch.events
    assert batch.ts == 12.5
    assert stored.block_hashes == [-1, 7] and stored.parent_block_hash is None and stored.block_size == CHUNK_CHARS
    assert removed.block_hashes == [3]
    # On the wire as vLLM writes it: arrays, the event's tag first.
    assert msgspec.msgpack.decode(kv_event_batch(event, 1.0))[1][0][0] == "BlockStored"


async def _agree(js, views) -> bool:
    """Synced, and every one holds the same non-empty index."""
    return await _synced(js, views) and bool(_held(views[0])) and all(_held(v) == _held(views[0]) for v in views)


def _route(view: SharedView, lane, hashes) -> None:
    """What the admission does when it sends a prompt to a lane: record it, tell the others."""
    view.admission.index.record(lane, hashes)
    view.learnt(lane, "m", tuple(hashes), (), 0)


async def test_gateways_cut_off_from_nats_converge_when_it_comes_back(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    lane_x, lane_y = ("h", "x"), ("h", "y")
    async with AsyncExitStack() as stack:
        stack.callback(server.stop)
        views, tasks = [], []

        async def gateway_view(name: str) -> SharedView:
            nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
            stack.push_async_callback(nc.close)
            view = SharedView(Admission(FleetView()), name)
            task = asyncio.create_task(view.start(nc))
            stack.callback(task.cancel)
            views.append(view)
            tasks.append(task)
            return view

        one, two = await gateway_view("one"), await gateway_view("two")
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        await eventually(lambda: _synced(js, views), what="the stream made")
        _route(one, lane_x, [1, 2, 3])
        _route(two, lane_y, [7, 8])
        await eventually(lambda: _agree(js, views), what="synced")
        assert _held(one) == {lane_x: {1, 2, 3}, lane_y: {7, 8}}

        server.stop()  # both cut off: each routes alone, and one finds an entry gone
        _route(one, lane_x, [1, 2, 3, 4, 5])
        _route(two, lane_y, [7, 8, 9])
        two.admission.index.drop(lane_x, [1])
        two.learnt(lane_x, "m", (), (1,), 0)
        assert _held(one) != _held(two)
        server.start()
        await eventually(lambda: _agree(js, views), timeout=60, what="converged")
        assert _held(one) == {lane_x: {2, 3, 4, 5}, lane_y: {7, 8, 9}}
        # A gateway that starts now replays the stream: the same index at once.
        three = await gateway_view("three")
        await eventually(lambda: _synced(js, views), timeout=60, what="the late one replayed")
        assert _held(three) == _held(one)
