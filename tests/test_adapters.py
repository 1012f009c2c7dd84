"""LoRA adapters and rerankers, without a bus: the scan pairs an adapter with the models it fits,
the memory model puts its bytes where llama.cpp does (exact against the recorded lines of the real
binary), the planner loads a persona's adapters with --lora-scaled at 0 and turns --reranking on
for a rank-pooling GGUF, and the gateway routes "base:adapter" with that lane's adapter id."""

from __future__ import annotations

import json

import msgspec
import pytest
from record_lora_figures import CASES, FIGURES, measure, write_case
from tinymodels import write_llama, write_lora

import gateway.edge.adapters as gw_adapters
from gateway.fleet.view import LaneRoute
from planner_svc.adapters import lane_adapters, reranks
from planner_svc.planner import plan
from shared.adapters import read_adapter, scan_adapters
from shared.gguf_facts import read_model_facts, scan_models
from shared.llama.flags import lane_args, parse_caps
from shared.memory import LaneShape, lane_memory
from shared.memory.buffers import adapter_bytes
from shared.memory.placement import place
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import OUTPUT_LAYER, HostReport, ServerCaps
from shared.messages.plans import LaneSpec

MIB = 1 << 20


def test_an_adapter_is_reported_with_the_models_it_fits_and_its_size(tmp_path):
    (tmp_path / "loras").mkdir()
    write_llama(tmp_path / "base.gguf")
    write_llama(tmp_path / "loras" / "base-copy.gguf", seed=3)  # the same shapes elsewhere: it fits too
    write_llama(tmp_path / "wide.gguf", n_embd=512)
    write_lora(tmp_path / "style.gguf", token_embd=True, output=True)
    write_lora(tmp_path / "loras" / "terse.gguf", rank=4, dtype="f32")
    write_lora(tmp_path / "loras" / "other-arch.gguf", arch="qwen3")
    models, problems = scan_models([tmp_path])
    assert sorted(m.name for m in models) == ["base", "base-copy", "wide"] and problems == []  # adapters are not models
    found, problems = scan_adapters([tmp_path], models)
    by_name = {a.name: a for a in found}
    assert by_name["style"].bases == ("base", "base-copy")  # the one beside it first
    assert by_name["terse"].bases == ("base-copy", "base")
    assert by_name["other-arch"].bases == () and problems == [
        f"{tmp_path}/loras/other-arch.gguf: a LoRA adapter for qwen3 that fits no model here"
    ]
    style = by_name["style"]
    assert (style.rank, style.alpha, style.architecture) == (8, 16.0, "llama")
    assert style.file_bytes == (tmp_path / "style.gguf").stat().st_size
    assert [lw.layer for lw in style.layer_weights] == [-1, 0, 1, OUTPUT_LAYER]
    # token_embd's pair: A [8, 259] and B [8, 256] f16, each padded to 32 bytes on the CPU
    assert style.layer_weights[0].bytes == -(-8 * 259 * 2 // 32) * 32 + 8 * 256 * 2


def test_adapter_bytes_land_on_the_device_of_the_tensor_they_modify(tmp_path):
    facts = read_adapter(write_lora(tmp_path / "a.gguf", n_layer=4, token_embd=True, output=True))
    groups = {lw.layer: lw for lw in facts.layer_weights}
    # -ngl 3 of 4 blocks (output first): the output and blocks 2, 3 on the GPU; token_embd, blocks 0, 1 in RAM
    cuda = place(4, 3, (1.0,), backends=("cuda",))
    cpu, gpu = adapter_bytes((facts,), cuda)
    assert cpu == groups[-1].bytes + groups[0].bytes + groups[1].bytes
    assert gpu == groups[2].cuda_bytes + groups[3].cuda_bytes + groups[OUTPUT_LAYER].cuda_bytes
    assert adapter_bytes((facts, facts), place(4, 0, ())) == [2 * sum(lw.bytes for lw in facts.layer_weights)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_planned_adapter_bytes_match_the_recorded_lines(tmp_path, case):
    """tests/lora_figures.json: the real binary's `LoRA buffer size` lines (record_lora_figures.py),
    and its compute buffer, which adapters loaded at scale 0 leave as it is."""
    printed = json.loads(FIGURES.read_text())[case]
    base, files = write_case(tmp_path, case)
    shape = LaneShape(ctx=1024, adapters=tuple(read_adapter(f) for f in files))
    memory = lane_memory(read_model_facts(base), shape)
    assert round(memory.devices[0].adapter_bytes / MIB, 2) == pytest.approx(printed["CPU"], abs=0.011)
    assert printed["compute"] == printed["compute_without"]
    without = lane_memory(read_model_facts(base), LaneShape(ctx=1024))
    assert memory.total_bytes - without.total_bytes == memory.adapter_bytes


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_bytes_as_the_binary_prints_them(tmp_path, llama_server, case):
    base, files = write_case(tmp_path, case)
    printed = measure(llama_server, base, files)
    planned = lane_memory(read_model_facts(base), LaneShape(ctx=1024, adapters=tuple(read_adapter(f) for f in files)))
    assert planned.devices[0].adapter_bytes / MIB == pytest.approx(printed["CPU"], abs=0.011)
    assert set(printed) == {"CPU", "compute"}


def _report(tmp_path, caps: ServerCaps = ServerCaps()) -> HostReport:
    write_llama(tmp_path / "base.gguf")
    write_lora(tmp_path / "style.gguf", rank=32)
    write_lora(tmp_path / "wide.gguf", n_embd=512)
    write_llama(tmp_path / "rr.gguf", arch="qwen3", pooling=4, cls_labels=("yes", "no"))
    models, _ = scan_models([tmp_path])
    found, _ = scan_adapters([tmp_path], models)
    return HostReport(host_id="h", cpu_cores=4, ram_total=8 << 30, ram_available=8 << 30, server=caps,
                      models=tuple(models), adapters=tuple(found))  # fmt: skip


def test_a_persona_s_adapters_are_loaded_at_scale_0_and_planned(tmp_path):
    report = _report(tmp_path)
    demand = Demand(personas=(Persona(model="base", alias="chat", adapters=("style", "wide", "absent"), ctx_max=1024),
                              Persona(model="rr", ctx_max=1024)))  # fmt: skip
    lanes = {s.model: s for s in plan([report], FleetConfig(), demand).hosts[0].lanes}
    chat, rr = lanes["base"], lanes["rr"]
    assert chat.adapters == ("style",) and chat.adapter_paths == (str(tmp_path / "style.gguf"),)
    assert "adapter wide: does not fit base" in chat.reasons
    assert "adapter absent: no such adapter file on this host" in chat.reasons
    style = next(a for a in report.adapters if a.name == "style")
    assert chat.memory.adapter_bytes == sum(lw.bytes for lw in style.layer_weights) > 0
    args = lane_args(chat, report.server)
    assert args[args.index("--lora-scaled") + 1] == f"{tmp_path / 'style.gguf'}:0"
    assert "--reranking" in lane_args(rr, report.server) and rr.reranking and not rr.embeddings
    assert "--reranking" not in args and "--embeddings" not in args


def test_a_build_without_lora_scaled_loads_no_adapter(tmp_path):
    report = _report(tmp_path, ServerCaps(has_lora=False))
    adapters, reasons = lane_adapters(Persona(model="base", adapters=("style",)), report, report.models[0])
    assert adapters == () and "no --lora-scaled" in reasons[0]
    help_text = "--flash-attn [on|off|auto]\n--lora FNAME\n--lora-scaled FNAME:SCALE,...\n--rerank, --reranking"
    caps = parse_caps(help_text)
    assert caps.has_lora and caps.has_reranking
    assert not parse_caps("--flash-attn [on|off|auto]\n--lora FNAME").has_lora


def test_reranking_follows_the_gguf_unless_the_persona_says(tmp_path):
    ranked = read_model_facts(write_llama(tmp_path / "rr.gguf", arch="qwen3", pooling=4, cls_labels=("yes", "no")))
    plain = read_model_facts(write_llama(tmp_path / "m.gguf"))
    assert ranked.pooling == "rank"
    assert reranks(Persona(model="rr"), ranked) and not reranks(Persona(model="rr", reranking=False), ranked)
    assert not reranks(Persona(model="m"), plain) and reranks(Persona(model="m", reranking=True), plain)


def _lane(adapters=("style", "terse")) -> LaneRoute:
    return LaneRoute(host_id="h", lane_id="base-0", model="base", alias="chat", url="http://x", parallel=1,
                     state="healthy", adapters=adapters)  # fmt: skip


def test_a_lane_serves_an_adapter_only_when_it_loads_it():
    lane = _lane()
    assert lane.serves("chat") and lane.serves("base") and lane.serves("chat:style") and lane.serves("base:terse")
    assert not lane.serves("chat:absent") and not lane.serves("other:style")
    assert not _lane(()).serves("chat:style")


def test_the_gateway_writes_the_lane_s_id_for_the_named_adapter():
    assert gw_adapters.requested("chat", {"lora": "terse"}) == "chat:terse"
    assert gw_adapters.requested("chat", {"lora": [{"name": "terse", "scale": 0.5}]}) == "chat:terse"
    assert gw_adapters.requested("chat", {"lora": [{"id": 0, "scale": 1.0}]}) == "chat"  # llama-server's own form
    assert gw_adapters.requested("chat:style", {"lora": "terse"}) == "chat:style"
    body = msgspec.json.encode({"model": "chat", "lora": [{"name": "terse", "scale": 0.5}], "prompt": "x"})
    out = msgspec.json.decode(gw_adapters.body_for(body, "chat:terse", _lane()))
    assert out["lora"] == [{"id": 1, "scale": 0.5}] and out["prompt"] == "x"
    out = msgspec.json.decode(gw_adapters.body_for(msgspec.json.encode({"model": "chat:style"}), "chat:style",
                                                   _lane(("terse", "style"))))  # fmt: skip
    assert out["lora"] == [{"id": 1, "scale": 1.0}]
    plain = msgspec.json.encode({"model": "chat"})
    assert gw_adapters.body_for(plain, "chat", _lane()) == plain


def test_a_spec_with_adapters_round_trips():
    spec = LaneSpec(lane_id="b-0", model="b", model_path="/m/b.gguf", alias="b", port=8080, ctx_total=1024,
                    ctx_per_slot=1024, parallel=1, adapters=("s",), adapter_paths=("/m/s.gguf",), reranking=True)  # fmt: skip
    assert msgspec.json.decode(msgspec.json.encode(spec), type=LaneSpec) == spec


# Pooled lanes (--embeddings, --reranking) reserve the logits of every ubatch token: the real
# binary's CPU compute buffer (b11434) for a 32k-vocabulary model, by (pooling, slots, ctx, ubatch, fa).
POOLED = {
    ("rank", 1, 1024, 512, True): 66.02,
    ("rank", 4, 1024, 512, True): 65.27,
    ("mean", 1, 1024, 512, True): 66.02,
    ("rank", 2, 4096, 256, True): 33.51,
    ("mean", 1, 2048, 512, False): 69.52,
}


def _pooled_model(tmp_path, pooling: str):
    if pooling == "rank":
        return write_llama(tmp_path / "rr.gguf", arch="qwen3", pooling=4, cls_labels=("yes", "no"), n_vocab=32000)
    return write_llama(tmp_path / "e.gguf", pooling=1, n_vocab=32000)


def _pooled_compute_mib(facts, case) -> float:
    _, slots, ctx, ubatch, fa = case
    shape = LaneShape(ctx=ctx, parallel=slots, n_ubatch=ubatch, flash_attn=fa, pooled=True)
    return lane_memory(facts, shape).devices[0].compute_bytes / MIB


@pytest.mark.parametrize("case", sorted(POOLED))
def test_a_pooled_lane_s_compute_buffer_holds_every_token_s_logits(tmp_path, case):
    facts = read_model_facts(_pooled_model(tmp_path, case[0]))
    assert _pooled_compute_mib(facts, case) == pytest.approx(POOLED[case], abs=0.6)
    _, slots, ctx, ubatch, fa = case
    chat = lane_memory(facts, LaneShape(ctx=ctx, parallel=slots, n_ubatch=ubatch, flash_attn=fa))
    assert chat.devices[0].compute_bytes / MIB < POOLED[case] / 2  # what it was planned at before


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(POOLED))
def test_a_pooled_lane_s_compute_buffer_as_the_binary_prints_it(tmp_path, llama_server, case):
    from record_lora_figures import _lines

    from shared.llama.logs import parse_buffers

    pooling, slots, ctx, ubatch, fa = case
    model = _pooled_model(tmp_path, pooling)
    flags = ["--reranking"] if pooling == "rank" else ["--embeddings"]
    lines = _lines(llama_server, model, [*flags, "--parallel", str(slots), "--ctx-size", str(ctx), "--ubatch-size",
                                         str(ubatch), "--flash-attn", "on" if fa else "off"])  # fmt: skip
    printed = parse_buffers(lines).get("CPU", "compute")
    assert printed == POOLED[case]
    assert _pooled_compute_mib(read_model_facts(model), case) == pytest.approx(printed, abs=0.6)


def test_a_lane_goes_to_the_host_that_holds_the_persona_s_adapters(tmp_path):
    (tmp_path / "h1").mkdir()
    (tmp_path / "h2").mkdir()
    reports = []
    for host in ("h1", "h2"):
        write_llama(tmp_path / host / "base.gguf")
        if host == "h2":
            write_lora(tmp_path / host / "style.gguf")
        models, _ = scan_models([tmp_path / host])
        found, _ = scan_adapters([tmp_path / host], models)
        reports.append(HostReport(host_id=host, cpu_cores=4, ram_total=8 << 30, ram_available=8 << 30,
                                  server=ServerCaps(), models=tuple(models), adapters=tuple(found)))  # fmt: skip
    demand = Demand(personas=(Persona(model="base", lanes=1, adapters=("style",), ctx_max=1024),))
    fleet = plan(reports, FleetConfig(), demand)
    placed = {h.host_id: [s.adapters for s in h.lanes] for h in fleet.hosts}
    assert placed.get("h2") == [("style",)] and not placed.get("h1")
    plain = plan(reports, FleetConfig(), Demand(personas=(Persona(model="base", lanes=1, ctx_max=1024),)))
    assert [h.host_id for h in plain.hosts if h.lanes] == ["h1"]  # without adapters the first host, as before
