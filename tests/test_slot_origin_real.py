"""Saved slots bound to what made them, and kept where they are, with the real llama-server (issue 33, points 4 and 6).

A slot file records the cache's shape, not the model: llama-server reads one saved by another
quantization of a model, or by another model of the same shape, and answers from the wrong
state. The agent's store keeps each file's origin (the model file's sha256, the build, the
cache types, flash attention, --kv-unified, --swa-full and the slot's context) and hands
llama-server only files whose origin matches the lane's. Here the store is driven against real
lanes of generated models: a q8_0-cache lane's file, files of the same path after the model was
replaced by another quantization and by another model, are refused with their reasons (and the
binary is shown to accept the dangerous two); the matching file restores and is served from.
"""

from __future__ import annotations

import asyncio
import shutil
from contextlib import asynccontextmanager

import aiohttp
from tinymodels import write_llama

from launcher_agent import lane_http
from launcher_agent.lane import Lane
from launcher_agent.probe import probe
from launcher_agent.slot_store import SlotStore
from shared.llama import endpoints
from shared.llama.flags import lane_args
from shared.messages.plans import LaneSpec
from waiting import eventually
from fixtures_bus import free_port_base

PROMPT = " ".join(f"turn {i} of a conversation about lanes, slots and caches" for i in range(8))
SHAPE = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=4, head_dim=64, n_ctx_train=4096)


class Events(list):
    async def __call__(self, lane, event: str, detail: str = "") -> None:
        self.append((event, detail))


@asynccontextmanager
async def serving(binary: str, spec: LaneSpec, slot_dir: str, log):
    args = lane_args(spec, probe(binary), slot_dir)
    proc = await asyncio.create_subprocess_exec(binary, *args, stdout=log, stderr=log)
    try:
        async def up():
            return (await lane_http.readiness(spec, None))[0] == "healthy"

        await eventually(up, timeout=60, what=f"{spec.lane_id} serving")
        yield Lane(spec=spec, state="healthy")
    finally:
        proc.terminate()
        await proc.wait()


async def complete(spec: LaneSpec, prompt: str, slot: list | None = None) -> tuple[int, int]:
    """(prompt tokens prefilled, tokens taken from the cache); `slot` gets the slot that served it."""
    url = endpoints.url(spec.bind, spec.port, "/completion")
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0, "cache_prompt": True}
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    if slot is not None:
        slot.append(answer["id_slot"])
    return answer["timings"]["prompt_n"], answer["timings"]["cache_n"]


async def test_only_a_file_of_the_same_model_build_and_cache_shape_is_restored(tmp_path, llama_server):
    models = tmp_path / "models"
    models.mkdir()
    base = write_llama(models / "base-f16.gguf", seed=0, **SHAPE)
    requant = write_llama(models / "base-q8.gguf", seed=0, matrix_type="q8_0", **SHAPE)  # the same model, requantized
    other = write_llama(models / "other.gguf", seed=1, **SHAPE)  # another model of the same shape
    served = tmp_path / "served" / "m.gguf"  # the path the lane runs: the operator swaps files under it
    served.parent.mkdir()
    shutil.copy(base, served)
    slots = tmp_path / "slots"
    events = Events()
    store = SlotStore(slots, events, budget=1 << 30, build=probe(llama_server).version)
    port = free_port_base()
    spec = LaneSpec(lane_id="m-0", model="m", model_path=str(served), alias="m", port=port, ctx_total=1024,
                    ctx_per_slot=1024, parallel=1, threads=1, threads_batch=1)  # fmt: skip
    q8_cache = msgspec_replace(spec, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")
    log = open(tmp_path / "lanes.log", "ab")

    async def save_one(lane_spec: LaneSpec) -> str:
        async with serving(llama_server, lane_spec, str(slots), log) as lane:
            prefilled, _ = await complete(lane_spec, PROMPT)
            assert prefilled > 200
            await store.save(lane)
        return store.entries[-1].file

    async def restore_into(lane_spec: LaneSpec, expect_refusal: str | None) -> tuple[int, int] | None:
        events.clear()
        async with serving(llama_server, lane_spec, str(slots), log) as lane:
            await store.restore(lane)
            if expect_refusal is not None:
                assert [e for e, _ in events] == ["slots_discarded"], events
                assert expect_refusal in events[0][1], events
                assert store.entries == [] and not list(slots.glob("*.slot"))
                return None
            assert [e for e, _ in events] == ["slots_restored"], events
            return await complete(lane_spec, PROMPT + " and one more turn")

    # 1. A file saved by a lane with a q8_0 cache, offered to the f16 lane of the same model.
    await save_one(q8_cache)
    assert store.entries[0].origin.cache_types == "q8_0/q8_0"
    await restore_into(spec, "saved with cache types q8_0/q8_0, this lane runs f16/f16")

    # 2. and 3. The model file replaced in place by another quantization of the same model, then
    # by another model: each file of the old weights is refused, never handed to llama-server.
    for replacement in (requant, other):
        shutil.copy(base, served)
        saved = await save_one(spec)
        kept = slots / saved
        shutil.copy(kept, tmp_path / "copy.slot")
        shutil.copy(replacement, served)
        await restore_into(spec, "saved from another model file")
        # What the origin guards against: llama-server itself takes the file and says it restored.
        shutil.copy(tmp_path / "copy.slot", kept)
        async with serving(llama_server, spec, str(slots), log):
            status, body = await lane_http.slot_file(spec, None, 0, "restore", saved, 30)
            assert status == 200 and body["n_restored"] > 200, body
        kept.unlink()

    # 4. The same weights again (a copy: another mtime, the same sha256) and the same cache: restored.
    shutil.copy(base, served)
    await save_one(spec)
    shutil.copy(base, served)
    prefilled, cached = await restore_into(spec, None)
    assert cached > 200 and prefilled < 40, (prefilled, cached)

    # 5. A slot of another size that holds the file's tokens takes it too.
    await save_one(spec)
    larger = msgspec_replace(spec, ctx_total=2048, ctx_per_slot=2048)
    prefilled, cached = await restore_into(larger, None)
    assert cached > 200 and prefilled < 40, (prefilled, cached)


async def test_a_restored_slot_of_a_unified_cache_is_kept_by_the_planned_flags(tmp_path, llama_server):
    """Issue 33, point 6. With --kv-unified, llama-server's default (--cache-idle-slots) empties
    every idle slot into the RAM prompt cache when another task starts: a just-restored slot too,
    lost where the cache is smaller than the slot (here a 1 MiB --cache-ram and a 2.3 MiB slot).
    The planner gives such lanes --no-cache-idle-slots (tests/test_planner.py): the restored slot
    stays in the pool and the conversation's next turn is served from it."""
    caps = probe(llama_server)
    assert caps.has_cache_idle_slots
    served = write_llama(tmp_path / "m.gguf", seed=0, **SHAPE)
    slots = tmp_path / "slots"
    events = Events()
    store = SlotStore(slots, events, budget=1 << 30, build=caps.version)
    log = open(tmp_path / "lanes.log", "ab")
    other = " ".join(f"step {i} of another talk about planners, gateways and budgets" for i in range(8))
    results = {}
    for idle in (None, False):  # the binary's default, then the planned flag
        spec = LaneSpec(lane_id="m-0", model="m", model_path=str(served), alias="m", port=free_port_base(),
                        ctx_total=2048, ctx_per_slot=2048, parallel=2, kv_unified=True, cache_ram_mib=1,
                        cache_idle_slots=idle, threads=1, threads_batch=1)  # fmt: skip
        async with serving(llama_server, spec, str(slots), log) as lane:
            await complete(spec, PROMPT)
            await store.save(lane)
        async with serving(llama_server, spec, str(slots), log) as lane:
            events.clear()
            await store.restore(lane)
            assert [e for e, _ in events] == ["slots_restored"], events
            took: list[int] = []
            await complete(spec, other, took)  # another conversation starts in the other slot
            assert took != [0], "the other conversation was given the restored slot"
            results[idle] = await complete(spec, PROMPT + " and one more turn")
    (_, lost), (prefilled, kept) = results[None], results[False]
    assert lost == 0, f"the binary's default kept the restored slot ({results}): is the trap gone in this build?"
    assert kept > 500 and prefilled < 40, results


def msgspec_replace(spec: LaneSpec, **changes) -> LaneSpec:
    import msgspec

    return msgspec.structs.replace(spec, **changes)
