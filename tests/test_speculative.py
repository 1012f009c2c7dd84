"""Speculative decoding, planned (pure): the persona key, draft matching and refusal, the flags
rendered from --help, and the draft's and speculator's bytes counted in the window search."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from tinymodels import write_llama

from planner_svc import speculative
from planner_svc.answers import explain_lines
from planner_svc.layouts import CPU_RESOURCE
from planner_svc.planner import plan
from planner_svc.wake_placement import room_on
from shared.gguf_facts import read_model_facts
from shared.llama.flags import lane_args, parse_caps
from shared.memory import LaneShape, lane_memory
from shared.memory.speculative import (
    N_MAX, draft_shape, n_outputs, on_devices, speculator_host_bytes, target_shape, with_speculation,
)
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import AdapterFacts, GpuInfo, HostReport, ServerCaps

GIB = 1024**3
MIB = 1024**2
# b11434's --help, the lines about speculative decoding (the removed --draft-max listed as removed)
HELP = """
-fa,   --flash-attn [on|off|auto]           set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
--kv-unified, -kvu
--spec-draft-type-k, -ctkd, --cache-type-k-draft TYPE
--spec-draft-type-v, -ctvd, --cache-type-v-draft TYPE
--spec-draft-n-max N                    number of tokens to draft for speculative decoding (default: 3)
--spec-draft-ngl, -ngld, --gpu-layers-draft, --n-gpu-layers-draft N
--spec-draft-model, -md, --model-draft FNAME
--spec-type none,draft-simple,draft-eagle3,draft-mtp,draft-dflash,draft-dspark,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache
                                        comma-separated list of types of speculative decoding to use (default:
--draft, --draft-n, --draft-max N       the argument has been removed. use --spec-draft-n-max or
"""
CAPS = parse_caps(HELP)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return {
        "target": write_llama(d / "target.gguf", n_layer=4, n_embd=256, n_vocab=32000, seed=1, n_ctx_train=131072),
        "draft": write_llama(d / "draft.gguf", n_layer=2, n_embd=256, n_vocab=32000, seed=2),
        "other": write_llama(d / "other.gguf", n_layer=2, n_embd=256, n_vocab=4000, seed=3),
    }


@pytest.fixture(scope="module")
def facts(files):
    return {name: read_model_facts(path) for name, path in files.items()}


def _report(facts, ram=8 * GIB, caps=CAPS, names=("target", "draft", "other")):
    return HostReport(host_id="h", cpu_cores=4, ram_total=ram, ram_available=ram, server=caps,
                      models=tuple(facts[n] for n in names), renders_argv=True)  # fmt: skip


def _lane(facts, persona, config=FleetConfig(speculative="off"), **kw):
    fleet = plan([_report(facts, **kw)], config, Demand(personas=(persona,)))
    assert not fleet.unplaced and not fleet.hosts[0].unplaced, fleet
    return fleet.hosts[0].lanes[0]


def test_the_binary_help_gives_the_types_and_current_flags_never_a_removed_one():
    assert "ngram-mod" in CAPS.spec_types and "draft-simple" in CAPS.spec_types and "none" not in CAPS.spec_types
    assert "--spec-draft-model" in CAPS.spec_flags and "--spec-draft-ngl" in CAPS.spec_flags
    assert parse_caps(HELP.replace("--spec-type", "--spec-typo")).spec_types == ()


def test_the_vocabulary_identity_is_read_from_the_file(facts):
    assert facts["target"].vocab_id and facts["target"].vocab_id == facts["draft"].vocab_id
    assert facts["other"].vocab_id != facts["target"].vocab_id


def test_a_persona_key_turns_an_ngram_speculator_on(facts):
    spec = _lane(facts, Persona(model="target", speculative="ngram-mod", ctx_max=4096))
    assert spec.spec_type == "ngram-mod" and spec.draft_path == ""
    argv = lane_args(spec, CAPS)
    assert argv[argv.index("--spec-type") + 1] == "ngram-mod"
    assert not any("draft-max" in a or a == "--draft" for a in argv)
    # its 16 MiB table and the outputs of 65 drafted tokens per slot, counted in host memory
    assert spec.memory.speculator_bytes == 16 * MIB + 64 * 32000 * 4 + 12 * MIB  # + the RSS measured past them
    assert any("--spec-type ngram-mod" in r for r in spec.reasons)


def test_off_by_the_fleet_and_by_the_persona(facts):
    assert _lane(facts, Persona(model="target")).spec_type is None
    on = FleetConfig(speculative="ngram-simple")
    assert _lane(facts, Persona(model="target"), on).spec_type == "ngram-simple"
    assert _lane(facts, Persona(model="target", speculative="off"), on).spec_type is None


def test_a_named_draft_is_planned_and_rendered(facts):
    spec = _lane(facts, Persona(model="target", speculative="draft-simple", draft="draft", ctx_max=4096))
    assert spec.spec_type == "draft-simple" and spec.draft_model == "draft" and spec.draft_path == facts["draft"].path
    argv = lane_args(spec, CAPS)
    assert argv[argv.index("--spec-draft-model") + 1] == facts["draft"].path
    assert argv[argv.index("--spec-draft-ngl") + 1] == "0"  # a CPU lane: the draft on the CPU too
    alone = _lane(facts, Persona(model="target", ctx_max=4096))
    assert spec.memory.draft_bytes > facts["draft"].weight_bytes  # weights, KV and compute
    assert spec.memory.total_bytes > alone.memory.total_bytes + spec.memory.draft_bytes - MIB


def test_a_draft_is_found_by_shared_vocabulary(facts):
    spec = _lane(facts, Persona(model="target", speculative="draft-simple", ctx_max=4096))
    assert spec.draft_model == "draft"  # `other` has another vocabulary
    assert any("smallest model here with target's vocabulary" in r for r in spec.reasons)


def test_a_draft_with_another_vocabulary_is_refused_with_the_reason(facts):
    spec = _lane(facts, Persona(model="target", speculative="draft-simple", draft="other", ctx_max=4096))
    assert spec.spec_type is None and spec.draft_path == ""
    assert any("draft other refused: its vocabulary has 4000 tokens, target's 32000" in r for r in spec.reasons)
    assert any("needs a draft model" in r for r in spec.reasons)


def test_lanes_explain_says_why(facts):
    fleet = plan([_report(facts)], FleetConfig(speculative="off"), Demand(personas=(
        Persona(model="target", speculative="draft-simple", draft="other"),
        Persona(model="draft", speculative="ngram-mod"),
    )))  # fmt: skip
    text = "\n".join(explain_lines(fleet.hosts[0], None))
    assert "draft other refused: its vocabulary has 4000 tokens, target's 32000" in text
    assert "speculative decoding: --spec-type ngram-mod" in text and "speculator 35.81 planned" in text


def test_a_binary_without_spec_type_gets_no_speculation(facts):
    spec = _lane(facts, Persona(model="target", speculative="ngram-mod"), caps=ServerCaps())
    assert spec.spec_type is None and any("has no --spec-type" in r for r in spec.reasons)


def test_the_draft_is_counted_in_the_window_search(facts):
    """On a host where memory bounds the window, the draft's KV and compute leave a smaller one."""
    ram = 800 * MIB  # 250 MiB after the planner's headroom: ~100k tokens of the target's KV
    without = _lane(facts, Persona(model="target", ctx_min=256), ram=ram)
    with_draft = _lane(facts, Persona(model="target", speculative="draft-simple", ctx_min=256), ram=ram)
    assert without.ctx_per_slot < 131072  # bounded by memory, not by the ceiling
    assert with_draft.draft_path and with_draft.ctx_per_slot < without.ctx_per_slot
    # the planned total with its draft fits where the window search put it
    assert with_draft.memory.total_bytes <= without.memory.total_bytes + MIB  # one 256-token step of both caches


def test_auto_follows_the_measured_figures(facts, monkeypatch):
    persona = Persona(model="target", speculative="auto")
    monkeypatch.setattr(speculative, "MEASURED_BY_SLOTS", {})  # one slot: MEASURED's figures alone
    monkeypatch.setattr(speculative, "MEASURED", {("cpu", "ngram-mod"): (1.05, 1.0), ("gpu", "ngram-mod"): (2.0, 1.0)})
    off = _lane(facts, persona)
    assert off.spec_type is None and any("measured no speculator on cpu lanes" in r for r in off.reasons)
    monkeypatch.setattr(speculative, "MEASURED", {("cpu", "ngram-mod"): (1.5, 0.99), ("cpu", "ngram-simple"): (1.3, 1.0)})
    on = _lane(facts, persona)
    assert on.spec_type == "ngram-mod" and any("measured x1.50 decode on copy-heavy" in r for r in on.reasons)
    monkeypatch.setattr(speculative, "MEASURED", {("cpu", "ngram-mod"): (1.5, 0.80)})  # loses on free generation
    assert _lane(facts, persona).spec_type is None


def test_auto_holds_only_where_the_lanes_slots_all_busy_lose_nothing(facts, monkeypatch):
    """A speculator that gains with one slot busy is turned on for a lane of several slots only
    where the figures with that many busy still gain on copy-heavy work, and no count up to
    them loses on free generation; the figures stand in for the next measured count up."""
    monkeypatch.setattr(speculative, "MEASURED", {("cpu", "ngram-simple"): (2.6, 1.5), ("cpu", "ngram-mod"): (1.5, 2.4)})
    monkeypatch.setattr(speculative, "MEASURED_BY_SLOTS", {
        ("cpu", "ngram-simple"): {1: (2.6, 1.5), 2: (2.0, 1.2), 4: (1.3, 1.0), 8: (0.9, 0.7)},
        ("cpu", "ngram-mod"): {1: (1.5, 2.4), 2: (1.4, 1.5), 4: (1.2, 0.9), 8: (1.1, 1.0)},
    })  # fmt: skip

    def auto(parallel: int):
        return _lane(facts, Persona(model="target", speculative="auto", parallel=parallel, ctx_max=4096))

    one = auto(1)
    assert one.spec_type == "ngram-simple" and not any("slots busy" in r for r in one.reasons)
    three = auto(3)  # taken at 4 busy: ngram-simple still gains x1.3 and loses nothing
    assert three.spec_type == "ngram-simple" and any("with 4 slots busy x1.30 and x1.00" in r for r in three.reasons)
    eight = auto(8)  # ngram-simple loses at 8; ngram-mod lost free generation at 4 on the way
    assert eight.spec_type is None
    assert any("off for a lane of 8 slots" in r and "ngram-simple x0.70 on free generation with 8 slots busy" in r
               and "ngram-mod x0.90 on free generation with 4 slots busy" in r for r in eight.reasons), eight.reasons
    assert auto(32).spec_type is None  # past the largest count: taken at 8
    monkeypatch.setattr(speculative, "MEASURED_BY_SLOTS", {})
    unmeasured = auto(2)
    assert unmeasured.spec_type is None
    assert any("ngram-simple was not measured with several slots busy" in r for r in unmeasured.reasons)


def test_outputs_and_unprinted_bytes():
    assert n_outputs(None, 4, 512) == 4
    assert n_outputs("draft-simple", 4, 512) == 4 * (1 + N_MAX["draft-simple"])
    assert n_outputs("ngram-mod", 64, 512) == 2048  # capped at the batch
    assert speculator_host_bytes(None, 1000, 1, 512) == 0
    assert speculator_host_bytes("ngram-simple", 1000, 2, 512) == 2 * 48 * 1000 * 4 + 2 * 12 * MIB
    assert speculator_host_bytes("draft-simple", 1000, 2, 512) == 2 * 3 * 1000 * 4


def test_the_draft_adds_to_the_devices_it_lands_on(facts):
    base = LaneShape(ctx=4096, parallel=2, flash_attn=True)
    target = lane_memory(facts["target"], target_shape(base, "draft-simple"))
    draft = lane_memory(facts["draft"], base)
    both = with_speculation(target, draft, 0)
    cpu, t, d = both.devices[0], target.devices[0], draft.devices[0]
    assert cpu.kv_bytes == t.kv_bytes + d.kv_bytes and cpu.model_bytes == t.model_bytes + d.model_bytes
    assert cpu.draft_bytes == d.total and both.total_bytes == target.total_bytes + d.total
    assert both.kv_bytes == target.kv_bytes + draft.kv_bytes  # the KV lines the agent sums include the draft's


def test_the_draft_is_loaded_bare_and_moved_to_its_own_devices(facts):
    """The draft carries none of the target's adapters or projector (llama_model_load_from_file
    alone); -devd's devices: the draft planned over its list, then placed at those indices."""
    adapter = AdapterFacts(path="a.gguf", name="a", architecture="llama")
    shape = draft_shape(LaneShape(ctx=4096, parallel=2, mmproj=True, adapters=(adapter,), flash_attn=True), "q8_0")
    assert not shape.mmproj and shape.adapters == () and shape.type_k == "q8_0" and shape.cache_ram == 0
    alone = lane_memory(facts["draft"], dataclasses.replace(shape, devices=("cuda",), tensor_split=(1.0,),
                                                            n_gpu_layers="all"))  # fmt: skip
    moved = on_devices(alone, (2,))
    assert [(d.index, d.device) for d in moved.devices] == [(-1, "CPU"), (2, "GPU2")]
    assert [d.total for d in moved.devices] == [d.total for d in alone.devices]


def test_auto_with_todays_figures(facts):
    """The recorded figures (bench/spec_slots.json): on a CPU host auto picks ngram-simple for a lane
    of up to 4 slots (x1.52 copy-heavy with one busy, x1.15 with four), and ngram-mod for 8, where
    ngram-simple lost (x0.98 copy-heavy, x0.96 free with 8 busy)."""
    one = _lane(facts, Persona(model="target", speculative="auto"))
    assert one.spec_type == "ngram-simple" and any("x1.52" in r for r in one.reasons)
    four = _lane(facts, Persona(model="target", speculative="auto", parallel=4, ctx_max=4096))
    assert four.spec_type == "ngram-simple" and any("with 4 slots busy x1.15" in r for r in four.reasons)
    eight = _lane(facts, Persona(model="target", speculative="auto", parallel=8, ctx_max=4096))
    passed_over = "passed over: ngram-simple x0.96 on free generation with 8 slots busy"
    assert eight.spec_type == "ngram-mod"
    assert any("with 8 slots busy x1.25 and x1.14" in r and passed_over in r for r in eight.reasons)


def test_messages_stay_compatible():
    """New fields at their defaults: a spec without them decodes, and round-trips."""
    assert msgspec.json.decode(b'{"model": "m"}', type=Persona).speculative is None
    assert FleetConfig().speculative == "off"  # the default bench/RESULTS.md argues for


def test_waking_and_eviction_count_the_draft(facts):
    """Loads on demand: what a woken lane needs (and what a lane frees when evicted) includes its
    draft's buffers and the speculator's bytes."""
    report = _report(facts)
    config = FleetConfig(speculative="off")
    plain = Persona(model="target", ctx_min=2048)
    drafted = Persona(model="target", ctx_min=2048, speculative="draft-simple", draft="draft")
    alone, _ = room_on(report, config, plain, None, [plain], ())
    with_draft, _ = room_on(report, config, drafted, None, [drafted], ())
    spec = plan([report], config, Demand(personas=(msgspec.structs.replace(drafted, ctx_max=2048),))).hosts[0].lanes[0]
    assert spec.memory.draft_bytes > 0
    assert with_draft.needs[CPU_RESOURCE] - alone.needs[CPU_RESOURCE] >= spec.memory.draft_bytes + spec.memory.speculator_bytes - MIB


def test_on_a_gpu_lane_the_draft_goes_to_its_gpu(facts):
    """Every target layer on the GPU: the draft's too (--spec-draft-ngl all of it), its bytes on that device."""
    report = msgspec.structs.replace(_report(facts), gpus=(GpuInfo(name="g", vram_total=8 * GIB, vram_free=8 * GIB),))
    persona = Persona(model="target", speculative="draft-simple", draft="draft", ctx_max=4096)
    spec = plan([report], FleetConfig(), Demand(personas=(persona,))).hosts[0].lanes[0]
    assert spec.gpu_devices == (0,) and spec.draft_n_gpu_layers == facts["draft"].n_layer + 1
    gpu = next(d for d in spec.memory.devices if d.index == 0)
    cpu = next(d for d in spec.memory.devices if d.index < 0)
    assert gpu.draft_bytes > facts["draft"].weight_bytes // 2 and gpu.draft_bytes > cpu.draft_bytes
    argv = lane_args(spec, CAPS)
    assert argv[argv.index("--spec-draft-ngl") + 1] == str(facts["draft"].n_layer + 1)
