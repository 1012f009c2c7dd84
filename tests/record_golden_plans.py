"""Record the planner's plans for a fixed set of inputs (tests/golden/): the golden-plan test
holds every later planner to them, so a refactor shows it changed no decision.

Run only when a change of plans is intended, and say so in the commit:
    .venv/bin/python tests/record_golden_plans.py

The inputs are written once (plan_inputs.json) from real GGUF facts (generated models and, when
installed, the real Gemma 3 270M file) and synthetic hosts; the outputs (plan_outputs.json) are
what `planner_svc.planner.plan` returned for them. Pass --inputs to rebuild the inputs too.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_svc.planner import plan  # noqa: E402
from shared.messages.config import Demand, FleetConfig, Persona  # noqa: E402
from shared.messages.hosts import GpuInfo, HostReport, ModelFacts, ServerCaps  # noqa: E402
from shared.messages.plans import FleetPlan, HostPlan, LaneSpec  # noqa: E402
from shared.messages.status import LaneFeedback  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
INPUTS = GOLDEN / "plan_inputs.json"
OUTPUTS = GOLDEN / "plan_outputs.json"
GIB = 1024**3
MIB = 1024**2


class Scenario(msgspec.Struct, kw_only=True):
    name: str
    reports: tuple[HostReport, ...]
    config: FleetConfig = FleetConfig()
    demand: Demand | None = None
    previous: dict[str, HostPlan] = {}
    feedback: dict[str, tuple[LaneFeedback, ...]] = {}
    config_revision: int = 0


def run(s: Scenario) -> FleetPlan:
    return plan(
        s.reports, s.config, s.demand, previous=s.previous, feedback=s.feedback, config_revision=s.config_revision
    )


def load_inputs() -> list[Scenario]:
    return msgspec.json.decode(INPUTS.read_bytes(), type=list[Scenario])


# ------------------------------------------------------------------ building the inputs


def _real_facts() -> list[ModelFacts]:
    import tinymodels

    from shared.gguf_facts import read_model_facts

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = [
            tinymodels.write_llama(folder / "llama8.gguf", n_layer=8, n_embd=512, n_head=8, n_head_kv=8, head_dim=64,
                                   n_ctx_train=32768),
            tinymodels.write_llama(folder / "llama_gqa.gguf"),
            tinymodels.write_gemma3(folder / "gemma3.gguf"),
            tinymodels.write_deepseek2_mla(folder / "mla.gguf"),
            tinymodels.write_llama(folder / "bigvocab.gguf", n_layer=4, n_vocab=131072, tied=True),
        ]  # fmt: skip
        for p in paths:
            facts = read_model_facts(p)
            out.append(msgspec.structs.replace(facts, path=f"/models/{p.name}", file_mtime_ns=0))
    try:
        from lanes.demo_model import ensure_demo_model

        with tempfile.TemporaryDirectory() as tmp:
            gemma = ensure_demo_model(Path(tmp))
            facts = read_model_facts(gemma)
            out.append(msgspec.structs.replace(facts, path=f"/models/{gemma.name}", file_mtime_ns=0))
    except Exception as exc:  # the demo packages are a test extra
        print(f"no real Gemma facts: {exc}", file=sys.stderr)
    return out


def _synthetic(name: str, n_layer: int, n_embd: int, n_kv: int, head: int, weights: int, n_ff: int) -> ModelFacts:
    return ModelFacts(
        path=f"/models/{name}.gguf", name=name, architecture="llama", n_layer=n_layer, n_embd=n_embd,
        n_head=n_embd // head, n_head_kv=(n_kv,) * n_layer, head_dim_k=head, head_dim_v=head, n_ctx_train=131072,
        n_vocab=128256, n_ff=n_ff, weight_bytes=weights, file_bytes=weights + 8 * MIB,
    )  # fmt: skip


def _host(host_id: str, models, *, ram=64 * GIB, free=32 * GIB, gpus=(), server=ServerCaps(), **kw) -> HostReport:
    return HostReport(
        host_id=host_id, cpu_cores=8, ram_total=ram, ram_available=free, gpus=tuple(gpus), server=server,
        models=tuple(models), **kw,
    )  # fmt: skip


def _gpu(i: int, total: float, free: float, **kw) -> GpuInfo:
    kw.setdefault("device", f"CUDA{i}")
    return GpuInfo(name=f"gpu{i}", vram_total=int(total * GIB), vram_free=int(free * GIB), **kw)


def build_inputs() -> list[Scenario]:
    real = _real_facts()
    llama8b = _synthetic("llama-8b", 32, 4096, 8, 128, 4 * GIB, 14336)
    llama1b = _synthetic("llama-1b", 16, 2048, 8, 64, 1 * GIB, 8192)
    models = [*real, llama8b, llama1b]
    by_name = {m.name: m for m in models}
    old = ServerCaps(
        build=4000, flash_attn_form="switch", cache_types=("f32", "f16", "q8_0", "q4_0"), has_fit=False,
        has_kv_unified=False, has_swa_full=False, kv_layout="shared", ngl_rule="blocks_first", has_device=False,
    )  # fmt: skip
    rpc_gpus = [
        GpuInfo(name=f"rpc{i}", vram_total=2 * GIB, vram_free=2 * GIB, backend="rpc", device=f"RPC{i}[127.0.0.1:5005{i}]",
                endpoint=f"127.0.0.1:5005{i}")
        for i in range(2)
    ]  # fmt: skip
    metal = GpuInfo(name="Apple M2", vram_total=int(16 * GIB * 2 / 3), vram_free=int(16 * GIB * 2 / 3), backend="metal",
                    device="MTL0", unified=True)  # fmt: skip
    multi = Demand(
        personas=(
            Persona(model="llama-8b", alias="chat", lanes=3, parallel=4, ctx_min=4096, priority=2),
            Persona(model="llama-1b", lanes=2, parallel=2, kv_unified=True, ctx_max=16384),
            Persona(model="gemma3", parallel=3),
            Persona(model="missing-model"),
        )
    )
    out = [
        Scenario(name="cpu_default", reports=(_host("h1", models),)),
        Scenario(name="cpu_small_ram", reports=(_host("h1", models, free=3 * GIB),)),
        Scenario(name="cpu_q8_fa_on", reports=(_host("h1", models),),
                 config=FleetConfig(kv_cache_type="q8_0", flash_attn="on"), config_revision=3),
        Scenario(name="cpu_q4_v_needs_fa", reports=(_host("h1", models),), config=FleetConfig(kv_cache_type_v="q4_0")),
        Scenario(name="cpu_mixed_kv_fa_off", reports=(_host("h1", models),),
                 config=FleetConfig(kv_cache_type_k="q8_0", flash_attn="off", n_ubatch=1024)),
        Scenario(name="cpu_fa_auto_ubatch_4096", reports=(_host("h1", models),),
                 config=FleetConfig(flash_attn="auto", n_ubatch=4096, headroom_fraction=0.2)),
        Scenario(name="old_binary", reports=(_host("h1", models, server=old, gpus=[_gpu(0, 4, 3.5, device="")]),),
                 config=FleetConfig(kv_cache_type="q8_0", flash_attn="off")),
        Scenario(name="no_binary", reports=(_host("h1", models, server=None),)),
        Scenario(name="gpu_one_whole", reports=(_host("h1", models, gpus=[_gpu(0, 8, 7), _gpu(1, 24, 23)]),)),
        Scenario(name="gpu_split", reports=(_host("h1", [llama8b], gpus=[_gpu(0, 5, 4.2), _gpu(1, 5, 3.8)]),)),
        Scenario(name="gpu_partial", reports=(_host("h1", [llama8b, by_name.get("gemma-3-270m-q4_k_m", llama1b)],
                                                    gpus=[_gpu(0, 3, 2.5)]),)),
        Scenario(name="gpu_unnamed_split", reports=(_host("h1", [llama8b], gpus=[_gpu(0, 5, 4.2, device=""),
                                                                                 _gpu(1, 5, 3.8, device="")]),)),
        Scenario(name="gpu_off", reports=(_host("h1", models, gpus=[_gpu(0, 24, 23)]),),
                 config=FleetConfig(use_gpu=False)),
        Scenario(name="gpu_stale_rocm", reports=(_host("h1", models, gpus=[_gpu(0, 16, 15, stale=True, backend="rocm",
                                                                               device="ROCm0")]),)),
        Scenario(name="rpc_two_devices", reports=(_host("h1", real, gpus=rpc_gpus),),
                 config=FleetConfig(kv_cache_type="q8_0")),
        Scenario(name="metal_unified", reports=(_host("mac", models, ram=16 * GIB, free=14 * GIB, gpus=[metal]),)),
        Scenario(name="metal_tight", reports=(_host("mac", [llama8b], ram=16 * GIB, free=int(5.5 * GIB),
                                                    gpus=[metal]),)),
        Scenario(name="multi_host_personas", demand=multi,
                 reports=(_host("a", models), _host("b", [llama8b, llama1b], free=12 * GIB, port_base=9000, port_count=3),
                          _host("c", [llama8b], free=2 * GIB, gpus=[_gpu(0, 12, 11)]))),
    ]  # fmt: skip
    out += _feedback_scenarios(models, llama8b)
    out += _replan_scenarios(models, llama8b, multi)
    return out


def _feedback_scenarios(models, llama8b) -> list[Scenario]:
    config = FleetConfig(kv_cache_type="q8_0", flash_attn="on")
    first = run(Scenario(name="", reports=(_host("h1", models),), config=config)).hosts[0]
    spec = next(s for s in first.lanes if s.model == "llama-8b")
    good = msgspec.structs.replace(spec, cache_type_k=None, cache_type_v=None, flash_attn=None)
    fb = (
        LaneFeedback(lane_id=spec.lane_id, model="llama-8b", kind="oom", cache_type_k="q8_0", cache_type_v="q8_0",
                     ctx_total=spec.ctx_total, detail="failed to allocate"),
        LaneFeedback(lane_id="llama-1b-0", model="llama-1b", kind="over_plan", planned_bytes=1000 * MIB,
                     actual_bytes=1150 * MIB),
        LaneFeedback(lane_id="gemma3-0", model="gemma3", kind="unsupported", cache_type_k="q8_0", cache_type_v="q8_0",
                     detail="Unsupported cache type"),
        LaneFeedback(lane_id="mla-0", model="mla", kind="crash_loop", cache_type_k="q8_0", cache_type_v="q8_0",
                     detail="exited 5 times"),
        LaneFeedback(lane_id="x-0", model="x", kind="port_busy", port=8081, detail="Address already in use"),
    )  # fmt: skip
    revert = (
        LaneFeedback(lane_id=spec.lane_id, model="llama-8b", kind="other", cache_type_k="q8_0", cache_type_v="q8_0",
                     detail="crashed after the change", last_good=good),
    )  # fmt: skip
    return [
        Scenario(name="feedback_mixed", reports=(_host("h1", models),), config=config, feedback={"h1": fb},
                 previous={"h1": first}),
        Scenario(name="feedback_revert_to_last_good", reports=(_host("h1", models),), config=config,
                 feedback={"h1": revert}, previous={"h1": first}),
    ]  # fmt: skip


def _replan_scenarios(models, llama8b, multi) -> list[Scenario]:
    """Replans with the previous plan: a small change keeps windows, a large one moves them."""
    base = Scenario(name="", reports=(_host("h1", models), _host("g", [llama8b], gpus=[_gpu(0, 6, 5), _gpu(1, 4, 3)])),
                    demand=multi)  # fmt: skip
    first = run(base)
    previous = {h.host_id: h for h in first.hosts}
    out = []
    for name, free in (("replan_small_change", 30 * GIB), ("replan_large_change", 16 * GIB)):
        reports = tuple(msgspec.structs.replace(r, ram_available=free) if r.host_id == "h1" else r for r in base.reports)
        out.append(Scenario(name=name, reports=reports, demand=multi, previous=previous, config_revision=1))
    out.append(Scenario(name="replan_same_inputs", reports=base.reports, demand=multi, previous=previous))
    out.append(Scenario(name="replan_config_change", reports=base.reports, demand=multi, previous=previous,
                        config=FleetConfig(kv_cache_type="q4_0", flash_attn="on"), config_revision=2))  # fmt: skip
    return out


def record(rebuild_inputs: bool) -> None:
    GOLDEN.mkdir(exist_ok=True)
    if rebuild_inputs or not INPUTS.exists():
        INPUTS.write_bytes(msgspec.json.format(msgspec.json.encode(build_inputs()), indent=1) + b"\n")
    scenarios = load_inputs()
    outputs = {s.name: run(s) for s in scenarios}
    OUTPUTS.write_bytes(msgspec.json.format(msgspec.json.encode(outputs), indent=1) + b"\n")
    lanes = sum(len(h.lanes) for p in outputs.values() for h in p.hosts)
    print(f"{len(scenarios)} scenarios, {lanes} lanes -> {OUTPUTS}")


if __name__ == "__main__":
    record("--inputs" in sys.argv)


__all__ = ["LaneSpec", "Scenario", "load_inputs", "run", "OUTPUTS"]
