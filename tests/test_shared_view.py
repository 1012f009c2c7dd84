"""One prefix view for every gateway, with real parts: a nats-server (JetStream), the planner,
an agent serving the real Gemma 3 270M file in two lanes of two slots, and three gateways.
A conversation whose turns alternate between two gateways stays on its lane and finds its
prompt cached; a gateway started mid-run replays the stream and routes the same."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import msgspec
import nats
from test_gateway import ALIAS, SYSTEMS, _openai, fleet, gateway  # noqa: F401 (fleet: the module's fixture)
from waiting import eventually

from gateway.affinity import CHUNK_CHARS
from gateway.shared_view import KVEventBatch, from_wire, kv_event_batch, to_wire
from shared import subjects
from shared.messages import PrefixEvent


async def _last_sequence(js) -> int:
    return (await js.stream_info(subjects.PREFIX_STREAM)).state.last_seq


async def _synced(js, gateways) -> bool:
    """Every gateway has applied the stream up to its last event (and published all it learnt)."""
    if any(not gw.shared.outbox.empty() for gw in gateways):
        return False
    last = await _last_sequence(js)
    return all(gw.shared.applied == last for gw in gateways)


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
