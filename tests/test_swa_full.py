"""--swa-full for sliding-window models (planner_svc/swa_full.py): when a lane gets it, what it costs,
and what `lanes explain` says of its conversations across a restart."""

from __future__ import annotations

import msgspec

from launcher_agent.slot_cache import not_reusable
from planner_svc.planner import plan
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import ServerCaps
from test_planner import GIB, check_invariants, gemma_like, host, llama_1b, only_host, only_lane

GEMMA = gemma_like()


def _lane(persona: Persona, config: FleetConfig = FleetConfig(), **host_kw):
    reports = [host(models=(GEMMA, llama_1b()), **host_kw)]
    fleet = plan(reports, config, Demand(personas=(persona,)))
    check_invariants(fleet, reports, config)
    return only_lane(fleet)


def test_a_window_at_its_ceiling_gets_swa_full_and_its_slots_are_saved():
    capped = _lane(Persona(model="gemma-4b", parallel=2, ctx_max=8192))
    assert capped.swa_full and "--swa-full" in capped.args
    assert capped.memory.swa_cells == capped.memory.kv_cells  # every layer caches the whole window
    plain = _lane(Persona(model="gemma-4b", parallel=2, ctx_max=8192, swa_full=False))
    assert not plain.swa_full and "--swa-full" not in plain.args
    assert plain.memory.swa_cells < plain.memory.kv_cells
    assert capped.ctx_total == plain.ctx_total  # the same window: the KV came off the prompt cache
    assert capped.memory.kv_bytes > 3 * plain.memory.kv_bytes  # 5 of every 6 layers grow from 1024+512 cells
    assert capped.cache_ram_mib <= plain.cache_ram_mib
    assert any(r.startswith("--swa-full: ") and "keep their cache across a restart" in r for r in capped.reasons)
    assert any("start cold after a restart" in r and "swa_full=false" in r for r in plain.reasons)
    assert not_reusable(capped) is None and "sliding-window" in not_reusable(plain)


def test_no_swa_full_where_it_would_narrow_the_window_or_slots_are_not_saved():
    # An open window grows into all the RAM there is: --swa-full would cost it window.
    grown = _lane(Persona(model="gemma-4b", parallel=2), ram_available=12 * GIB, ram_total=16 * GIB)
    assert not grown.swa_full
    assert any("--swa-full would need" in r for r in grown.reasons), grown.reasons
    unsaved = _lane(Persona(model="gemma-4b", ctx_max=4096), FleetConfig(slot_cache_bytes=0))
    assert not unsaved.swa_full and any("slot_cache_bytes=0" in r for r in unsaved.reasons)
    asked = _lane(Persona(model="gemma-4b", ctx_max=4096, swa_full=True), FleetConfig(slot_cache_bytes=0))
    assert asked.swa_full  # asked for: wherever it fits
    old = _lane(Persona(model="gemma-4b", ctx_max=4096), server=msgspec.structs.replace(ServerCaps(), has_swa_full=False))
    assert not old.swa_full and any("no --swa-full" in r for r in old.reasons)


def test_a_model_without_a_sliding_window_is_left_as_it_was():
    dense = _lane(Persona(model="llama-1b", ctx_max=4096))
    assert not dense.swa_full and not any("swa" in r.lower() for r in dense.reasons)
    assert not_reusable(dense) is None


def test_replanned_with_the_same_inputs_the_choice_holds():
    reports = [host(models=(GEMMA,))]
    demand = Demand(personas=(Persona(model="gemma-4b", lanes=2, parallel=2, ctx_max=8192),))
    first = plan(reports, FleetConfig(), demand)
    again = plan(reports, FleetConfig(), demand, previous={"h1": only_host(first)})
    assert msgspec.json.encode(again) == msgspec.json.encode(first)
    assert all(s.swa_full for s in only_host(first).lanes)
