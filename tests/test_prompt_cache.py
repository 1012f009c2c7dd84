"""The prompt cache planned: --cache-ram from the RAM the lanes' buffers leave, counted in the budget; embeddings lanes."""

from __future__ import annotations

import msgspec

from planner_svc.planner import plan
from planner_svc.policy import ram_pressed
from planner_svc.prompt_cache import CACHE_STEP_MIB, DEFAULT_CACHE_RAM_MIB, MIB, plan_cache_ram
from shared.gguf_facts import read_model_facts
from shared.llama.flags import args_problem, lane_args, parse_caps
from shared.memory import LaneShape, lane_memory
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import ServerCaps
from test_planner import GIB, device_use, host, llama_1b, only_host, only_lane


def test_the_share_is_the_default_capped_by_what_is_left_in_steps():
    assert plan_cache_ram(["a", "b"], 100 * GIB, {}, 0.1) == {
        lane: (DEFAULT_CACHE_RAM_MIB, "prompt cache --cache-ram 8192 MiB: llama-server's default, counted in the host's RAM")
        for lane in "ab"
    }  # fmt: skip
    got = plan_cache_ram(["a", "b"], 3 * GIB + 5 * MIB, {}, 0.1)
    assert {mib for mib, _ in got.values()} == {1536}  # 1.5 GiB each, in 256 MiB steps
    assert plan_cache_ram(["a"], 200 * MIB, {}, 0.1)["a"][0] == 0
    assert "off" in plan_cache_ram(["a"], -5, {}, 0.1)["a"][1]
    assert plan_cache_ram(["a"], 4 * GIB, {}, 0.1, factor=2.0)["a"][0] == 2048  # a corrected lane grows more
    assert plan_cache_ram([], GIB, {}, 0.1) == {}


def test_a_lane_keeps_its_limit_while_it_fits_and_the_gain_is_small():
    # The budget drifts up a little: the running lane keeps 1024 (no restart for 256 MiB more).
    assert plan_cache_ram(["a"], 1300 * MIB, {"a": 1024}, 0.1)["a"][0] == 1024
    assert "kept" in plan_cache_ram(["a"], 1300 * MIB, {"a": 1024}, 0.1)["a"][1]
    # A large gain is taken; a limit that no longer fits is cut.
    assert plan_cache_ram(["a"], 4 * GIB, {"a": 1024}, 0.1)["a"][0] == 4096
    assert plan_cache_ram(["a"], 900 * MIB, {"a": 1024}, 0.1)["a"][0] == 768
    assert plan_cache_ram(["a"], 900 * MIB, {"a": None}, 0.1)["a"][0] == 768  # an older planner's lane
    for left in range(0, 20 * 1024, 97):  # whatever is left, the limits fit in it
        got = plan_cache_ram(["a", "b", "c"], left * MIB, {"a": 512, "b": 8192}, 0.1)
        assert sum(mib for mib, _ in got.values()) * MIB <= max(0, left * MIB)
        assert all(mib % CACHE_STEP_MIB == 0 or mib in (512, 8192) for mib, _ in got.values())


def test_the_plan_passes_and_counts_the_cache():
    roomy = only_lane(plan([host(ram_available=32 * GIB, models=(llama_1b(),))], FleetConfig(),
                           Demand(personas=(Persona(model="llama-1b", ctx_max=4096),))))  # fmt: skip
    assert roomy.cache_ram_mib == DEFAULT_CACHE_RAM_MIB
    assert roomy.args[roomy.args.index("--cache-ram") + 1] == "8192"
    assert roomy.memory.prompt_cache_bytes == 8192 * MIB and roomy.memory.devices[0].prompt_cache_bytes == 8192 * MIB
    assert roomy.memory.total_bytes >= roomy.memory.kv_bytes + roomy.memory.weights_bytes + 8192 * MIB
    assert any(r.startswith("prompt cache --cache-ram 8192 MiB") for r in roomy.reasons)
    # Elastic windows take the whole budget: nothing is left, the cache is off, and still passed.
    tight = [host(ram_available=3 * GIB, ram_total=8 * GIB, models=(llama_1b(),))]
    fleet = plan(tight, FleetConfig(), Demand(personas=(Persona(model="llama-1b"),)))
    lane = only_lane(fleet)
    assert lane.cache_ram_mib is not None and lane.cache_ram_mib < DEFAULT_CACHE_RAM_MIB
    used, _ = device_use(only_host(fleet).lanes, tight[0])
    assert used <= only_host(fleet).budget_ram
    # A llama-server without the flag gets none (and none is counted).
    old = parse_caps("-fa, --flash-attn [on|off|auto]\n--kv-unified\n", "version: 6000 (abc)")
    assert not old.has_cache_ram and parse_caps(
        "-fa, --flash-attn [on|off|auto]\n-cram, --cache-ram N  set the maximum cache size in MiB\n").has_cache_ram
    legacy = only_lane(plan([host(server=msgspec.structs.replace(ServerCaps(), has_cache_ram=False),
                                  models=(llama_1b(),))], FleetConfig(), Demand(personas=(Persona(model="llama-1b", ctx_max=4096),))))  # fmt: skip
    assert legacy.cache_ram_mib is None and "--cache-ram" not in legacy.args and legacy.memory.prompt_cache_bytes == 0


def test_ram_another_program_takes_lowers_no_limit_until_the_host_is_pressed():
    """The issue's workstation: 2 lanes with llama-server's 8192 MiB each, 22 GiB free of 32. A
    program takes 4 GiB: no limit comes down (each would restart its lane and lose its cached
    conversations for memory nobody used). Most of the RAM taken: the host is pressed, they do."""
    config = FleetConfig()
    demand = Demand(personas=(Persona(model="llama-1b", lanes=2, ctx_max=4096),))
    quiet = host(ram_available=22 * GIB, ram_total=32 * GIB, models=(llama_1b(),))
    first = only_host(plan([quiet], config, demand))
    assert [s.cache_ram_mib for s in first.lanes] == [DEFAULT_CACHE_RAM_MIB] * 2
    held = sum(d.total - d.prompt_cache_bytes for s in first.lanes for d in s.memory.devices if d.index == -1)

    def running(taken: int):
        report = msgspec.structs.replace(quiet, ram_available=quiet.ram_available - held - taken, lanes_rss=held)
        return report, only_host(plan([report], config, demand, previous={"h1": first}))

    report, busy = running(4 * GIB)
    assert not ram_pressed(report, config)
    assert [s.cache_ram_mib for s in busy.lanes] == [DEFAULT_CACHE_RAM_MIB] * 2
    assert [s.ctx_total for s in busy.lanes] == [s.ctx_total for s in first.lanes]
    assert all("above its headroom" in " ".join(s.reasons) for s in busy.lanes)
    report, pressed = running(quiet.ram_available - held - GIB)  # 1 GiB free: under 5% of 32 GiB + 512 MiB
    assert ram_pressed(report, config)
    assert all(s.cache_ram_mib < DEFAULT_CACHE_RAM_MIB for s in pressed.lanes)


def test_lane_memory_counts_the_cache_in_host_ram_only(tiny_models):
    facts = read_model_facts(tiny_models["llama8"])
    bare = lane_memory(facts, LaneShape(ctx=4096))
    cached = lane_memory(facts, LaneShape(ctx=4096, cache_ram=512 * MIB))
    assert cached.total_bytes - bare.total_bytes == 512 * MIB
    assert cached.devices[0].prompt_cache_bytes == 512 * MIB and cached.kv_bytes == bare.kv_bytes


def test_embeddings_by_persona_or_by_the_models_pooling():
    def lane_for(facts, **persona):
        return only_lane(plan([host(models=(facts,))], FleetConfig(),
                              Demand(personas=(Persona(model=facts.name, ctx_max=4096, **persona),))))  # fmt: skip

    chat = lane_for(llama_1b())
    assert not chat.embeddings and "--embeddings" not in chat.args and "--pooling" not in chat.args
    asked = lane_for(llama_1b(), embeddings=True)
    assert asked.embeddings and "--embeddings" in asked.args
    assert asked.args[asked.args.index("--pooling") + 1] == "mean"  # the model declares none
    embedder = msgspec.structs.replace(llama_1b(), pooling="cls")
    by_model = lane_for(embedder)
    assert by_model.embeddings and "--pooling" not in by_model.args
    assert any("declares cls pooling" in r for r in by_model.reasons)
    assert not lane_for(embedder, embeddings=False).embeddings
    for spec in (asked, by_model, chat):
        assert args_problem(spec, ServerCaps()) is None
        assert tuple(spec.args) == lane_args(spec, ServerCaps())
    wrong = msgspec.structs.replace(asked, embeddings=False)
    assert args_problem(wrong, ServerCaps()) is not None  # an agent checks the flag by meaning
