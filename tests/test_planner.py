"""Unit and property tests of the pure planner (planner_svc.planner.plan)."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from planner_svc.layouts import GPU_CONTEXT_BYTES
from planner_svc.planner import plan
from planner_svc.policy import ram_headroom, ram_pressed
from shared.lane_key import lane_key
from shared.llama.flags import lane_args
from shared.memory import QUANTIZED
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import GpuInfo, HostReport, ModelFacts, ServerCaps
from shared.messages.plans import FleetPlan, HostPlan, LaneSpec

GIB = 1024**3
MIB = 1024**2

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ALL_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def llama_8b(name: str = "llama-8b", **kw) -> ModelFacts:
    """Llama-3-8B-like: 32 layers, 8 KV heads x 128, 4 GiB of weights."""
    base = dict(
        path=f"/models/{name}.gguf",
        name=name,
        architecture="llama",
        n_layer=32,
        n_embd=4096,
        n_head=32,
        n_head_kv=(8,) * 32,
        head_dim_k=128,
        head_dim_v=128,
        n_ctx_train=131072,
        n_vocab=128256,
        n_ff=14336,
        weight_bytes=4 * GIB,
        file_bytes=4 * GIB + 8 * MIB,
    )
    base.update(kw)
    return ModelFacts(**base)


def llama_1b(name: str = "llama-1b", **kw) -> ModelFacts:
    base = dict(
        path=f"/models/{name}.gguf",
        name=name,
        architecture="llama",
        n_layer=16,
        n_embd=2048,
        n_head=32,
        n_head_kv=(8,) * 16,
        head_dim_k=64,
        head_dim_v=64,
        n_ctx_train=131072,
        n_vocab=128256,
        n_ff=8192,
        weight_bytes=1 * GIB,
        file_bytes=1 * GIB + 4 * MIB,
    )
    base.update(kw)
    return ModelFacts(**base)


def gemma_like(name: str = "gemma-4b") -> ModelFacts:
    return ModelFacts(
        path=f"/models/{name}.gguf",
        name=name,
        architecture="gemma3",
        n_layer=34,
        n_embd=2560,
        n_head=8,
        n_head_kv=(4,) * 34,
        head_dim_k=256,
        head_dim_v=256,
        n_ctx_train=131072,
        n_vocab=262144,
        n_ff=10240,
        n_swa=1024,
        swa_layers=tuple(i % 6 < 5 for i in range(34)),
        weight_bytes=3 * GIB,
        file_bytes=3 * GIB,
    )


def host(
    host_id: str = "h1",
    *,
    ram_available: int = 32 * GIB,
    ram_total: int = 64 * GIB,
    models: tuple[ModelFacts, ...] = (),
    server: ServerCaps | None = ServerCaps(),
    gpus: tuple[GpuInfo, ...] = (),
    port_base: int = 8080,
    port_count: int = 16,
) -> HostReport:
    return HostReport(
        host_id=host_id,
        cpu_cores=8,
        ram_total=ram_total,
        ram_available=ram_available,
        gpus=gpus,
        server=server,
        models=models if models else (llama_8b(),),
        port_base=port_base,
        port_count=port_count,
    )


def only_host(fleet: FleetPlan) -> HostPlan:
    assert len(fleet.hosts) == 1
    return fleet.hosts[0]


def only_lane(fleet: FleetPlan) -> LaneSpec:
    hp = only_host(fleet)
    assert len(hp.lanes) == 1, (hp.unplaced, fleet.unplaced)
    return hp.lanes[0]


def window(spec: LaneSpec) -> int:
    return spec.ctx_total // spec.parallel


def encode(fleet: FleetPlan) -> bytes:
    return msgspec.json.encode(fleet)


def device_use(lanes, report: HostReport) -> tuple[int, list[int]]:
    """RAM and each GPU's use by these lanes, as their planned per-device buffers say."""
    used_ram, used_gpu = 0, [0] * len(report.gpus)
    for lane in lanes:
        used_ram += lane.memory.overhead_bytes
        for d in lane.memory.devices:
            if d.index < 0:
                used_ram += d.total
            else:
                g = lane.gpu_devices[d.index]
                used_gpu[g] += d.total + GPU_CONTEXT_BYTES.get(report.gpus[g].backend, 0)
                used_ram += d.total if report.gpus[g].unified else 0
    return used_ram, used_gpu


KEPT_OVER_SHARE = "over a share of"  # planner_svc/prompt_cache.py: a limit kept while the host is not pressed


def kept_caches(lanes) -> int:
    """Host RAM of the prompt caches kept above their share (over-committed on purpose: a ceiling
    filled lazily, lowered once the host is pressed)."""
    return sum(d.prompt_cache_bytes for lane in lanes if any(KEPT_OVER_SHARE in r for r in lane.reasons)
               for d in lane.memory.devices if d.index < 0)  # fmt: skip


def check_invariants(fleet: FleetPlan, reports: list[HostReport], config: FleetConfig | None = None) -> None:
    """What every plan must satisfy, whatever the inputs (`config`: the one planned with)."""
    # Every plan must survive the wire: decoding validates ports, names, ctx >= 256, ...
    assert msgspec.json.decode(msgspec.json.encode(fleet), type=FleetPlan) == fleet
    by_id = {r.host_id: r for r in reports}
    assert sorted(by_id) == [hp.host_id for hp in fleet.hosts]
    for hp in fleet.hosts:
        report = by_id[hp.host_id]
        # Every device a lane touches stays within its budget: RAM, and each GPU on its own.
        used_ram, used_gpu = device_use(hp.lanes, report)
        for lane in hp.lanes:
            assert lane.memory.total_bytes == sum(d.total for d in lane.memory.devices) + lane.memory.overhead_bytes
        # Every buffer fits, and every prompt cache but those kept over their share on a host not
        # pressed; serving lanes' windows kept on such a host may exceed the budget (they are resident).
        held = any("not short of RAM" in r for lane in hp.lanes for r in lane.reasons)
        assert held or used_ram - kept_caches(hp.lanes) <= hp.budget_ram, (hp.host_id, used_ram, hp.budget_ram)
        if config is not None and ram_pressed(report, config):
            assert kept_caches(hp.lanes) == 0 and not held
        for g, used in enumerate(used_gpu):
            assert used <= hp.budget_gpus[g], (hp.host_id, g, used, hp.budget_gpus)
        ports = [lane.port for lane in hp.lanes]
        assert len(set(ports)) == len(ports)
        assert all(report.port_base <= p <= report.port_base + report.port_count - 1 for p in ports)
        assert len({lane.lane_id for lane in hp.lanes}) == len(hp.lanes)
        caps = report.server
        for lane in hp.lanes:
            assert caps is not None
            if lane.cache_type_v in QUANTIZED:
                assert lane.flash_attn == "on", lane
            if caps.flash_attn_form == "switch":
                assert lane.flash_attn in (None, "on"), lane
            for t in (lane.cache_type_k, lane.cache_type_v):
                assert t is None or t in caps.cache_types
            assert lane.ctx_total >= 256
            assert lane.ctx_total % 256 == 0
            assert lane.args  # rendered
            assert lane.args[lane.args.index("--port") + 1] == str(lane.port)
            assert lane.args[lane.args.index("--ctx-size") + 1] == str(lane.ctx_total)
            if lane.memory.device == "gpu":
                assert lane.n_gpu_layers > 0
            else:
                assert lane.n_gpu_layers == 0
        if caps is None:
            assert hp.lanes == ()


# ------------------------------------------------------------------ strategies

cache_types = st.sampled_from((None,) + ALL_TYPES)
quant_pair = st.sampled_from(("q8_0", "q4_0"))
flash = st.sampled_from((None, "on", "off", "auto"))
ram = st.integers(min_value=2 * GIB, max_value=96 * GIB)


@st.composite
def caps_strategy(draw) -> ServerCaps:
    form = draw(st.sampled_from(("value", "switch")))
    layout = draw(st.sampled_from(("streams", "shared")))
    types = draw(
        st.lists(st.sampled_from(ALL_TYPES), min_size=1, unique=True).map(lambda ts: tuple(sorted(set(ts) | {"f16"})))
    )
    return ServerCaps(
        flash_attn_form=form,
        kv_layout=layout,
        has_kv_unified=layout == "streams",
        has_swa_full=layout == "streams",
        has_fit=form == "value",
        cache_types=types,
    )


@st.composite
def persona_strategy(draw, model: str) -> Persona:
    ctx_min = draw(st.integers(min_value=256, max_value=65536))
    ctx_max = draw(st.one_of(st.none(), st.integers(min_value=256, max_value=200000)))
    return Persona(
        model=model,
        parallel=draw(st.integers(min_value=1, max_value=8)),
        kv_unified=draw(st.booleans()),
        ctx_min=ctx_min,
        ctx_max=ctx_max,
        lanes=draw(st.one_of(st.none(), st.integers(min_value=0, max_value=4))),
        priority=draw(st.integers(min_value=-2, max_value=2)),
    )


@st.composite
def config_strategy(draw) -> FleetConfig:
    return FleetConfig(
        kv_cache_type=draw(cache_types),
        kv_cache_type_k=draw(cache_types),
        kv_cache_type_v=draw(cache_types),
        flash_attn=draw(flash),
        use_gpu=draw(st.booleans()),
    )


MODELS = (llama_8b(), llama_1b(), gemma_like())


@st.composite
def fleet_strategy(draw):
    n_hosts = draw(st.integers(min_value=1, max_value=3))
    reports = []
    for i in range(n_hosts):
        total = draw(st.integers(min_value=4 * GIB, max_value=128 * GIB))
        avail = draw(st.integers(min_value=0, max_value=total))
        gpus = draw(
            st.lists(
                st.builds(
                    lambda total_v, frac: GpuInfo(name="gpu", vram_total=total_v, vram_free=int(total_v * frac)),
                    st.integers(min_value=2 * GIB, max_value=48 * GIB),
                    st.floats(min_value=0.0, max_value=1.0),
                ),
                max_size=2,
            )
        )
        models = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique_by=lambda m: m.name))
        reports.append(
            HostReport(
                host_id=f"h{i}",
                cpu_cores=8,
                ram_total=total,
                ram_available=avail,
                gpus=tuple(gpus),
                server=draw(st.one_of(caps_strategy(), st.just(None))) if i else draw(caps_strategy()),
                models=tuple(models),
                port_base=draw(st.one_of(st.integers(min_value=1024, max_value=60000), st.integers(65530, 65535))),
                port_count=draw(st.integers(min_value=1, max_value=6)),
            )
        )
    names = [m.name for m in MODELS]
    personas = draw(st.lists(st.sampled_from(names), max_size=4).flatmap(lambda ns: st.tuples(*(persona_strategy(n) for n in ns))))
    demand = Demand(personas=tuple(personas)) if personas else None
    return reports, draw(config_strategy()), demand


# ------------------------------------------------------------------ properties


@PROPS
@given(fleet_strategy())
def test_property_invariants(scenario):
    reports, config, demand = scenario
    fleet = plan(reports, config, demand)
    check_invariants(fleet, reports)


@PROPS
@given(fleet_strategy(), st.randoms(use_true_random=False))
def test_property_deterministic(scenario, rnd):
    reports, config, demand = scenario
    first = encode(plan(reports, config, demand))
    again = encode(plan(list(reports), config, demand))
    shuffled = list(reports)
    rnd.shuffle(shuffled)
    assert encode(plan(shuffled, config, demand)) == first
    assert again == first


@PROPS
@given(fleet_strategy())
def test_property_replan_same_inputs_is_stable(scenario):
    reports, config, demand = scenario
    first = plan(reports, config, demand)
    previous = {hp.host_id: hp for hp in first.hosts}
    second = plan(reports, config, demand, previous=previous)
    assert encode(second) == encode(first)
    assert all(hp.plan_revision == 1 for hp in second.hosts)


def _running(report: HostReport, hp: HostPlan, fill: float, taken: int) -> HostReport:
    """The host's report once the plan's lanes run: their host-RAM buffers, and `fill` of their
    prompt caches, held by lanes (lanes_rss); `taken` more held by other programs."""
    held = 0
    for spec in hp.lanes:
        held += spec.memory.overhead_bytes  # the process's own: resident like its buffers
        for d in spec.memory.devices:
            if d.index == -1:
                held += d.total - d.prompt_cache_bytes + int(fill * d.prompt_cache_bytes)
    held = min(held, report.ram_available)
    return msgspec.structs.replace(report, ram_available=max(0, report.ram_available - held - taken), lanes_rss=held,
                                   serving_lanes=tuple(sorted(lane_key(s) for s in hp.lanes)))  # fmt: skip


@PROPS
@given(fleet_strategy(), st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.0, max_value=1.0))
def test_property_a_restarted_planner_plans_what_runs_and_others_taking_ram_shrink_no_cache(scenario, fill, share):
    """Planning again from the reports of the lanes it planned (their RAM counted as in use by
    lanes, caches filled anywhere up to their limit) yields the same plan; and while other
    programs take RAM but the host's free RAM stays above its headroom, no serving lane placed
    alike (device, layers, cache types) is restarted: its window, --cache-ram and every other
    launch field stay (its lane key)."""
    reports, config, demand = scenario
    first = plan(reports, config, demand)
    previous = {hp.host_id: hp for hp in first.hosts}
    running = [_running(r, previous[r.host_id], fill, 0) for r in reports]
    again = plan(running, config, demand, previous=previous)
    assert [hp.lanes for hp in again.hosts] == [hp.lanes for hp in first.hosts]
    # Others take `share` of what is free above the headroom: the host is never pressed.
    busy = [_running(r, previous[r.host_id], fill, int(share * max(0, x.ram_available - ram_headroom(x, config))))
            for r, x in zip(reports, running)]  # fmt: skip
    assert not any(ram_pressed(x, config) for x, r in zip(busy, running) if not ram_pressed(r, config))
    moved = plan(busy, config, demand, previous=previous)
    for before, after, report in zip(first.hosts, moved.hosts, busy):
        if ram_pressed(report, config) or before.unplaced:  # an unplaced lane may take room when it fits
            continue
        old = {s.lane_id: s for s in before.lanes}
        for spec in after.lanes:
            was = old.get(spec.lane_id)
            if was is not None and _placed_alike(was, spec):  # a lane placed otherwise restarts anyway
                assert lane_key(spec) == lane_key(was), (
                    (was.ctx_total, was.cache_ram_mib, was.swa_full), (spec.ctx_total, spec.cache_ram_mib, spec.swa_full),
                    spec.reasons)


def test_a_serving_lanes_window_is_kept_while_others_take_ram_and_shrinks_when_the_host_is_pressed():
    """The issue's workstation: a lane whose window fills the budget, its process resident at
    80% of the plan (mapped weights and compute buffers are touched lazily); another program
    takes half of the free RAM. The host keeps its headroom, so the serving lane keeps its
    window (the same lane key: no restart). Not yet serving, or with the host pressed, it shrinks."""
    config = FleetConfig()
    demand = Demand(personas=(Persona(model="llama-8b", parallel=1),))
    workstation = host(ram_total=24 * GIB, ram_available=20 * GIB)
    first = plan([workstation], config, demand)
    lane = only_lane(first)
    assert any("fits the budget" in r for r in lane.reasons)  # the window is the budget's, not a ceiling
    previous = {workstation.host_id: only_host(first)}
    serving = _running(workstation, previous["h1"], 0.5, 0)
    lazy = serving.lanes_rss // 5
    serving = msgspec.structs.replace(serving, lanes_rss=serving.lanes_rss - lazy,
                                      ram_available=serving.ram_available + lazy)  # fmt: skip
    half = serving.ram_available // 2
    busy = msgspec.structs.replace(serving, ram_available=serving.ram_available - half)
    assert not ram_pressed(busy, config)
    again = plan([busy], config, demand, previous=previous)
    check_invariants(again, [busy], config)
    kept = only_lane(again)
    assert lane_key(kept) == lane_key(lane), (kept.ctx_total, lane.ctx_total, kept.reasons)
    assert any(r.startswith(f"kept window {lane.ctx_total}: the replan's") and "not short of RAM" in r for r in kept.reasons), kept.reasons
    # Not serving yet (its buffers not resident): the replan's window.
    starting = only_lane(plan([msgspec.structs.replace(busy, serving_lanes=())], config, demand, previous=previous))
    assert starting.ctx_total < lane.ctx_total
    # Pressed: free RAM under the headroom, the window shrinks (the rollout restarts it).
    pressed = msgspec.structs.replace(serving, ram_available=ram_headroom(serving, config) - 1)
    assert only_lane(plan([pressed], config, demand, previous=previous)).ctx_total < lane.ctx_total


def _placed_alike(a: LaneSpec, b: LaneSpec) -> bool:
    return (a.model_path, a.parallel, a.n_gpu_layers, a.gpu_devices, a.cache_type_k, a.cache_type_v, a.flash_attn) == (
        b.model_path, b.parallel, b.n_gpu_layers, b.gpu_devices, b.cache_type_k, b.cache_type_v, b.flash_attn)


@PROPS
@given(
    small=ram,
    extra=st.integers(min_value=0, max_value=64 * GIB),
    ctx_min=st.integers(min_value=256, max_value=32768),
    ctx_max=st.one_of(st.none(), st.integers(min_value=256, max_value=131072)),
    parallel=st.integers(min_value=1, max_value=8),
    unified=st.booleans(),
    k=cache_types,
    v=cache_types,
    fa=flash,
    layout=st.sampled_from(("streams", "shared")),
    model=st.sampled_from(MODELS),
)
def test_property_more_ram_never_smaller_window(small, extra, ctx_min, ctx_max, parallel, unified, k, v, fa, layout, model):
    config = FleetConfig(kv_cache_type_k=k, kv_cache_type_v=v, flash_attn=fa)
    caps = ServerCaps(kv_layout=layout)
    demand = Demand(personas=(Persona(model=model.name, parallel=parallel, kv_unified=unified, ctx_min=ctx_min, ctx_max=ctx_max),))
    total = 200 * GIB
    less = plan([host(ram_available=small, ram_total=total, models=(model,), server=caps)], config, demand)
    more = plan([host(ram_available=small + extra, ram_total=total, models=(model,), server=caps)], config, demand)
    assert only_host(more).budget_ram >= only_host(less).budget_ram
    if only_host(less).lanes:
        # placed with less memory: placed with more too, never with a smaller window
        a, b = only_lane(less), only_lane(more)
        assert window(b) >= window(a)
        assert b.ctx_total >= a.ctx_total


@PROPS
@given(
    rams=st.lists(ram, min_size=2, max_size=2),
    personas=st.lists(
        st.tuples(
            st.sampled_from([m.name for m in MODELS]),
            st.integers(min_value=256, max_value=16384),
            st.integers(min_value=1, max_value=4),
        ),
        min_size=1,
        max_size=3,
    ),
    k=st.sampled_from((None, "q8_0", "q4_0")),
)
def test_property_more_ram_same_lanes_never_smaller_windows(rams, personas, k):
    """Several lanes on one host: as long as the same lanes are placed, none gets a smaller window."""
    lo, hi = sorted(rams)
    demand = Demand(
        personas=tuple(Persona(model=m, ctx_min=c, parallel=p, alias=f"{m}-{i}") for i, (m, c, p) in enumerate(personas))
    )
    config = FleetConfig(kv_cache_type=k)
    a = only_host(plan([host(ram_available=lo, ram_total=128 * GIB, models=MODELS)], config, demand))
    b = only_host(plan([host(ram_available=hi, ram_total=128 * GIB, models=MODELS)], config, demand))
    ids_a = {lane.lane_id for lane in a.lanes}
    ids_b = {lane.lane_id for lane in b.lanes}
    assume(ids_a == ids_b)
    wins_b = {lane.lane_id: window(lane) for lane in b.lanes}
    for lane in a.lanes:
        assert wins_b[lane.lane_id] >= window(lane), lane.lane_id


@PROPS
@given(
    avail=ram,
    ctx_min=st.integers(min_value=256, max_value=32768),
    parallel=st.integers(min_value=1, max_value=8),
    unified=st.booleans(),
    quant=quant_pair,
    mode=st.sampled_from(("both", "k_only", "v_only")),
    fa=flash,
    form=st.sampled_from(("value", "switch")),
    layout=st.sampled_from(("streams", "shared")),
    model=st.sampled_from(MODELS),
)
def test_property_quantized_kv_never_smaller_window(avail, ctx_min, parallel, unified, quant, mode, fa, form, layout, model):
    caps = ServerCaps(flash_attn_form=form, kv_layout=layout)
    persona = Persona(model=model.name, parallel=parallel, kv_unified=unified, ctx_min=ctx_min)
    demand = Demand(personas=(persona,))
    report = host(ram_available=avail, models=(model,), server=caps)
    f16 = plan([report], FleetConfig(flash_attn=fa), demand)
    if mode == "both":
        qconfig = FleetConfig(kv_cache_type=quant, flash_attn=fa)
    elif mode == "k_only":
        qconfig = FleetConfig(kv_cache_type_k=quant, flash_attn=fa)
    else:
        qconfig = FleetConfig(kv_cache_type_v=quant, flash_attn=fa)
    q = plan([report], qconfig, demand)
    if only_host(f16).lanes:
        a, b = only_lane(f16), only_lane(q)
        assert window(b) >= window(a)
        assert b.memory.device == a.memory.device


@PROPS
@given(config=config_strategy(), caps=caps_strategy(), model=st.sampled_from(MODELS), avail=ram)
def test_property_quantized_v_always_has_flash_attn_on(config, caps, model, avail):
    fleet = plan([host(ram_available=avail, models=(model,), server=caps)], config)
    for lane in only_host(fleet).lanes:
        if lane.cache_type_v in QUANTIZED:
            assert lane.flash_attn == "on"
            i = lane.args.index("--flash-attn")
            if caps.flash_attn_form == "value":
                assert lane.args[i + 1] == "on"
            else:
                assert i == len(lane.args) - 1 or lane.args[i + 1].startswith("-")


@PROPS
@given(fa=flash, k=cache_types, v=cache_types, avail=ram)
def test_property_switch_form_never_auto_or_off(fa, k, v, avail):
    caps = ServerCaps(flash_attn_form="switch", kv_layout="shared", has_fit=False, has_kv_unified=False)
    fleet = plan([host(ram_available=avail, server=caps)], FleetConfig(kv_cache_type_k=k, kv_cache_type_v=v, flash_attn=fa))
    for lane in only_host(fleet).lanes:
        assert lane.flash_attn in (None, "on")
        assert "off" not in lane.args and "auto" not in lane.args
        assert "-fit" not in lane.args


@PROPS
@given(
    port_base=st.integers(min_value=1024, max_value=65000),
    port_count=st.integers(min_value=1, max_value=8),
    lanes=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=3),
)
def test_property_ports_unique_and_in_range(port_base, port_count, lanes):
    models = (llama_1b("a"), llama_1b("b"), llama_1b("c"))
    demand = Demand(personas=tuple(Persona(model=m.name, lanes=n, ctx_min=256, ctx_max=1024) for m, n in zip(models, lanes)))
    report = host(ram_available=256 * GIB, ram_total=256 * GIB, models=models, port_base=port_base, port_count=port_count)
    hp = only_host(plan([report], FleetConfig(), demand))
    ports = [lane.port for lane in hp.lanes]
    assert len(set(ports)) == len(ports)
    assert all(port_base <= p < port_base + port_count for p in ports)
    wanted = sum(lanes)
    assert len(hp.lanes) == min(wanted, port_count)
    no_port = [u for u in hp.unplaced if "no free port" in u.reason]
    assert len(no_port) == max(0, wanted - port_count)


# ------------------------------------------------------------------ unit tests


def test_default_no_flags():
    fleet = plan([host()], FleetConfig())
    lane = only_lane(fleet)
    assert lane.cache_type_k is None and lane.cache_type_v is None
    assert lane.flash_attn is None
    assert not any(a.startswith("--cache-type") for a in lane.args)
    assert "--flash-attn" not in lane.args and "-fa" not in lane.args
    assert lane.model == "llama-8b" and lane.alias == "llama-8b"
    assert lane.model_path == "/models/llama-8b.gguf"
    assert lane.parallel == 1
    assert lane.fit_off is True and lane.args[-4:] == ("-fit", "off", "--verbosity", "4")


def test_default_demand_one_lane_per_model_per_host():
    reports = [host("a", models=(llama_8b(), llama_1b())), host("b", models=(llama_1b(),))]
    fleet = plan(reports, FleetConfig())
    assert [[lane.model for lane in hp.lanes] for hp in fleet.hosts] == [["llama-1b", "llama-8b"], ["llama-1b"]]


def test_quantized_config_sets_types_and_flash_attn():
    lane = only_lane(plan([host()], FleetConfig(kv_cache_type="q8_0")))
    assert (lane.cache_type_k, lane.cache_type_v, lane.flash_attn) == ("q8_0", "q8_0", "on")
    assert any("quantized V" in r for r in lane.reasons)
    i = lane.args.index("--cache-type-k")
    assert lane.args[i : i + 4] == ("--cache-type-k", "q8_0", "--cache-type-v", "q8_0")


def test_quantized_v_overrides_flash_attn_off():
    lane = only_lane(plan([host()], FleetConfig(kv_cache_type_v="q4_0", flash_attn="off")))
    assert lane.cache_type_v == "q4_0"
    assert lane.flash_attn == "on"


def test_quantized_k_alone_keeps_flash_attn_off():
    lane = only_lane(plan([host()], FleetConfig(kv_cache_type_k="q8_0", flash_attn="off")))
    assert (lane.cache_type_k, lane.cache_type_v, lane.flash_attn) == ("q8_0", None, "off")


def test_unsupported_cache_type_falls_back():
    caps = ServerCaps(cache_types=("f32", "f16", "q8_0"))
    lane = only_lane(plan([host(server=caps)], FleetConfig(kv_cache_type="q4_0")))
    assert lane.cache_type_k is None and lane.cache_type_v is None
    assert lane.flash_attn is None  # nothing forced it on
    assert any("does not list" in r and "q4_0" in r for r in lane.reasons)
    assert not any(a.startswith("--cache-type") for a in lane.args)


def test_unsupported_v_only_falls_back_for_v():
    caps = ServerCaps(cache_types=("f32", "f16", "q8_0"))
    lane = only_lane(plan([host(server=caps)], FleetConfig(kv_cache_type_k="q8_0", kv_cache_type_v="q4_0")))
    assert (lane.cache_type_k, lane.cache_type_v) == ("q8_0", None)
    assert any("V cache" in r and "does not list" in r for r in lane.reasons)


def test_head_dim_not_multiple_of_32_keeps_f16():
    model = llama_8b(head_dim_k=80, head_dim_v=80)
    lane = only_lane(plan([host(models=(model,))], FleetConfig(kv_cache_type="q8_0")))
    assert lane.cache_type_k is None and lane.cache_type_v is None


def test_mla_v_follows_k():
    model = llama_8b(
        name="deepseek", architecture="deepseek2", is_mla=True, n_head_kv=(1,) * 32, head_dim_k=576, head_dim_v=512
    )
    lane = only_lane(plan([host(models=(model,))], FleetConfig(kv_cache_type_k="q8_0", kv_cache_type_v="q4_0")))
    assert lane.cache_type_k == lane.cache_type_v == "q8_0"


def test_switch_form_with_auto_passes_nothing():
    caps = ServerCaps(flash_attn_form="switch", kv_layout="shared", has_fit=False, has_kv_unified=False)
    lane = only_lane(plan([host(server=caps)], FleetConfig(flash_attn="auto")))
    assert lane.flash_attn is None
    assert "--flash-attn" not in lane.args
    assert any("bare switch" in r for r in lane.reasons)


def test_switch_form_quantized_v_gets_bare_switch():
    caps = ServerCaps(flash_attn_form="switch", kv_layout="shared", has_fit=False, has_kv_unified=False)
    lane = only_lane(plan([host(server=caps)], FleetConfig(kv_cache_type="q8_0")))
    assert lane.flash_attn == "on"
    i = lane.args.index("--flash-attn")
    assert i + 1 == len(lane.args) or lane.args[i + 1].startswith("-")
    assert "-fit" not in lane.args


def test_model_not_fitting_at_floor_is_unplaced():
    report = host(ram_available=5 * GIB, ram_total=8 * GIB)  # budget 5 - 0.5 - 0.4 GiB < 4 GiB of weights + KV
    fleet = plan([report], FleetConfig(), Demand(personas=(Persona(model="llama-8b", ctx_min=8192),)))
    hp = only_host(fleet)
    assert hp.lanes == ()
    assert len(hp.unplaced) == 1
    assert hp.unplaced[0].model == "llama-8b"
    assert "does not fit" in hp.unplaced[0].reason
    assert "8192" in hp.unplaced[0].reason


def test_floor_is_respected_not_squeezed():
    # Enough room for the floor: the window is at least the floor.
    demand = Demand(personas=(Persona(model="llama-8b", ctx_min=16384, parallel=2),))
    lane = only_lane(plan([host(ram_available=24 * GIB)], FleetConfig(), demand))
    assert window(lane) >= 16384
    assert lane.ctx_total == window(lane) * 2


def test_window_capped_at_ctx_max_and_trained():
    demand = Demand(personas=(Persona(model="llama-8b", ctx_min=1024, ctx_max=5000),))
    lane = only_lane(plan([host(ram_available=96 * GIB, ram_total=128 * GIB)], FleetConfig(), demand))
    assert window(lane) == 4864  # 5000 rounded down to 256
    small = llama_8b(n_ctx_train=8192)
    lane = only_lane(plan([host(ram_available=96 * GIB, ram_total=128 * GIB, models=(small,))], FleetConfig()))
    assert window(lane) == 8192


def test_unknown_model_is_fleet_unplaced():
    fleet = plan([host()], FleetConfig(), Demand(personas=(Persona(model="nowhere"),)))
    assert [u.model for u in fleet.unplaced] == ["nowhere"]
    assert only_host(fleet).lanes == ()


def test_host_without_server_gets_no_lanes():
    fleet = plan([host(server=None)], FleetConfig())
    hp = only_host(fleet)
    assert hp.lanes == ()
    assert any("llama-server" in r for r in hp.reasons)


def test_gpu_lane_when_it_fits():
    gpu = GpuInfo(name="rtx", vram_total=24 * GIB, vram_free=23 * GIB)
    lane = only_lane(plan([host(gpus=(gpu,))], FleetConfig()))
    assert lane.memory.device == "gpu"
    assert lane.n_gpu_layers == 33
    cpu_lane = only_lane(plan([host(gpus=(gpu,))], FleetConfig(use_gpu=False)))
    assert cpu_lane.memory.device == "cpu" and cpu_lane.n_gpu_layers == 0


def test_budget_respected_with_many_lanes():
    # budget 16 - 0.5 - 0.05 * 64 = 12.3 GiB; one lane at 4096 costs ~4.7 GiB (4 GiB weights + 0.5 GiB KV
    # + compute; compute counts logits for one output per slot, as llama-server reserves them)
    demand = Demand(personas=(Persona(model="llama-8b", lanes=3, ctx_min=4096),))
    report = host(ram_available=16 * GIB)
    fleet = plan([report], FleetConfig(), demand)
    check_invariants(fleet, [report])
    hp = only_host(fleet)
    assert len(hp.lanes) == 2
    assert all(window(lane) >= 4096 for lane in hp.lanes)
    assert [u.model for u in hp.unplaced + fleet.unplaced] == ["llama-8b"]


def test_ports_never_beyond_65535():
    models = (llama_1b("a"),)
    report = host(models=models, port_base=65534, port_count=16)
    demand = Demand(personas=(Persona(model="a", lanes=4, ctx_max=1024),))
    fleet = plan([report], FleetConfig(), demand)
    check_invariants(fleet, [report])
    hp = only_host(fleet)
    assert [lane.port for lane in hp.lanes] == [65534, 65535]
    assert sum("no free port" in u.reason for u in hp.unplaced) == 2


def test_long_model_name_gives_valid_lane_id():
    name = "m" * 128
    report = host(models=(llama_1b(name),))
    fleet = plan([report], FleetConfig())
    msgspec.json.decode(msgspec.json.encode(fleet), type=FleetPlan)


def test_feedback_unsupported_falls_back_to_f16():
    from shared.messages.status import LaneFeedback

    fb = LaneFeedback(lane_id="llama-8b-0", model="llama-8b", kind="unsupported", cache_type_k="q8_0", cache_type_v="q8_0")
    lane = only_lane(plan([host()], FleetConfig(kv_cache_type="q8_0"), feedback={"h1": [fb]}))
    assert lane.cache_type_k is None and lane.cache_type_v is None
    assert any("refused" in r for r in lane.reasons)


def test_feedback_oom_caps_window():
    from shared.messages.status import LaneFeedback

    report = host(ram_available=96 * GIB, ram_total=128 * GIB)
    demand = Demand(personas=(Persona(model="llama-8b", ctx_min=2048),))
    before = only_lane(plan([report], FleetConfig(), demand))
    fb = LaneFeedback(lane_id="llama-8b-0", model="llama-8b", kind="oom", ctx_total=before.ctx_total)
    after = only_lane(plan([report], FleetConfig(), demand, feedback={"h1": [fb]}))
    assert after.ctx_total <= before.ctx_total // 2
    assert any("ran out of memory" in r for r in after.reasons)


def test_feedback_crash_loop_unplaces_that_spec_only():
    from shared.messages.status import LaneFeedback

    fb = LaneFeedback(lane_id="llama-8b-0", model="llama-8b", kind="crash_loop", detail="error loading model")
    fleet = plan([host()], FleetConfig(), feedback={"h1": [fb]})
    hp = only_host(fleet)
    assert hp.lanes == ()
    assert any("keeps failing" in u.reason and "error loading model" in u.reason for u in hp.unplaced)
    # A different cache type is a different spec: it gets its chance.
    assert only_lane(plan([host()], FleetConfig(kv_cache_type="q8_0"), feedback={"h1": [fb]})).cache_type_k == "q8_0"


def test_feedback_over_plan_sizes_larger_within_budget():
    from shared.messages.status import LaneFeedback

    report = host(ram_available=16 * GIB)
    before = only_lane(plan([report], FleetConfig()))
    fb = LaneFeedback(
        lane_id="llama-8b-0", model="llama-8b", kind="over_plan",
        planned_bytes=before.memory.total_bytes, actual_bytes=before.memory.total_bytes * 5 // 4,
    )  # fmt: skip
    fleet = plan([report], FleetConfig(), feedback={"h1": [fb]})
    check_invariants(fleet, [report])
    after = only_lane(fleet)
    assert window(after) < window(before)
    assert after.memory.total_bytes * 1.25 <= only_host(fleet).budget_ram + 1
    assert any("1.25x" in r for r in after.reasons)


# ------------------------------------------------------------------ stability and revisions


def _single(avail: int, previous: FleetPlan | None = None) -> FleetPlan:
    prev = {hp.host_id: hp for hp in previous.hosts} if previous else None
    return plan([host(ram_available=avail)], FleetConfig(), previous=prev)


def test_stability_small_change_keeps_window():
    base = 16 * GIB
    first = _single(base)
    w1 = window(only_lane(first))
    assert w1 < 131072  # budget-bound, not at the ceiling
    bumped = base + 300 * MIB
    fresh = window(only_lane(_single(bumped)))
    change = (fresh - w1) / w1
    assert 0 < change < 0.10, (w1, fresh)  # precondition of this test
    replan = _single(bumped, previous=first)
    lane = only_lane(replan)
    assert window(lane) == w1
    assert lane.ctx_total == only_lane(first).ctx_total
    assert any("kept window" in r for r in lane.reasons)


def test_stability_large_change_moves_window():
    base = 16 * GIB
    first = _single(base)
    w1 = window(only_lane(first))
    bumped = base + 3 * GIB
    fresh = window(only_lane(_single(bumped)))
    assert (fresh - w1) / w1 > 0.10, (w1, fresh)
    lane = only_lane(_single(bumped, previous=first))
    assert window(lane) == fresh
    assert not any("kept window" in r for r in lane.reasons)


def test_stability_never_keeps_a_window_over_budget():
    base = 16 * GIB
    first = _single(base)
    w1 = window(only_lane(first))
    shrunk = base - 300 * MIB
    fresh = window(only_lane(_single(shrunk)))
    assert 0 < (w1 - fresh) / w1 < 0.10
    replan = _single(shrunk, previous=first)
    check_invariants(replan, [host(ram_available=shrunk)])
    assert window(only_lane(replan)) == fresh


def test_stability_kv_unified_persona_on_build_without_kvu():
    # The spec says kv_unified False there (no -kvu flag to pass); that must still count as the same lane.
    caps = ServerCaps(flash_attn_form="switch", kv_layout="shared", has_fit=False, has_kv_unified=False)
    demand = Demand(personas=(Persona(model="llama-8b", parallel=2, kv_unified=True),))

    def run(avail: int, previous: FleetPlan | None = None) -> FleetPlan:
        prev = {hp.host_id: hp for hp in previous.hosts} if previous else None
        return plan([host(ram_available=avail, server=caps)], FleetConfig(), demand, previous=prev)

    first = run(16 * GIB)
    assert only_lane(first).kv_unified is False
    fresh = only_lane(run(16 * GIB + 300 * MIB))
    assert 0 < (fresh.ctx_total - only_lane(first).ctx_total) / only_lane(first).ctx_total < 0.10
    lane = only_lane(run(16 * GIB + 300 * MIB, previous=first))
    assert lane.ctx_total == only_lane(first).ctx_total
    assert any("kept window" in r for r in lane.reasons)


def test_a_unified_cache_whose_slots_are_saved_keeps_its_idle_slots_in_place():
    """With --kv-unified, llama-server's default empties every idle slot (a restored one too) into
    the RAM prompt cache at each new task (tests/test_slot_origin_real.py shows a restored slot lost
    so): --no-cache-idle-slots where slots are saved, the unified cache asked for, the binary has
    the flag and the RAM cache is on; otherwise the binary's default."""
    caps = ServerCaps(has_cache_idle_slots=True)

    def lane_for(persona: Persona, config: FleetConfig = FleetConfig(), server: ServerCaps = caps) -> LaneSpec:
        return only_lane(plan([host(ram_available=16 * GIB, server=server)], config, Demand(personas=(persona,))))

    unified = Persona(model="llama-8b", parallel=2, kv_unified=True, ctx_max=8192)
    kept = lane_for(unified)
    assert kept.cache_idle_slots is False and "--no-cache-idle-slots" in lane_args(kept, caps)
    assert any(r.startswith("--no-cache-idle-slots: with --kv-unified") for r in kept.reasons)
    assert kept.cache_ram_mib > 0
    for spec in (lane_for(Persona(model="llama-8b", parallel=2, ctx_max=8192)),  # a stream per slot: nothing emptied
                 lane_for(unified, FleetConfig(slot_cache_bytes=0)),  # nothing restored, the default stands
                 lane_for(unified, server=ServerCaps()),  # a binary without the flag
                 lane_for(msgspec.structs.replace(unified, ctx_max=None))):  # no RAM left: no RAM cache to empty into
        assert spec.cache_idle_slots is None and "--no-cache-idle-slots" not in lane_args(spec, caps), spec.reasons


@PROPS
@given(scenario=fleet_strategy(), factor=st.floats(min_value=0.5, max_value=1.5))
def test_property_replan_with_previous_keeps_invariants(scenario, factor):
    reports, config, demand = scenario
    first = plan(reports, config, demand)
    changed = [msgspec.structs.replace(r, ram_available=min(r.ram_total, int(r.ram_available * factor))) for r in reports]
    previous = {hp.host_id: hp for hp in first.hosts}
    second = plan(changed, config, demand, previous=previous)
    check_invariants(second, changed, config)
    old = {(hp.host_id, lane.lane_id): lane for hp in first.hosts for lane in hp.lanes}
    for hp in second.hosts:
        prev = previous[hp.host_id]
        assert hp.plan_revision in (prev.plan_revision, prev.plan_revision + 1)
        for lane in hp.lanes:
            if any("kept window" in r for r in lane.reasons):
                before = old[(hp.host_id, lane.lane_id)]
                assert lane.ctx_total == before.ctx_total
                assert lane.port == before.port


def test_plan_revision_increments_only_on_change():
    first = _single(16 * GIB)
    assert only_host(first).plan_revision == 1
    same = _single(16 * GIB, previous=first)
    assert only_host(same).plan_revision == 1
    assert encode(same) == encode(first)
    changed = _single(20 * GIB, previous=same)
    assert only_host(changed).plan_revision == 2
    assert window(only_lane(changed)) > window(only_lane(first))
    again = _single(20 * GIB, previous=changed)
    assert only_host(again).plan_revision == 2
    assert encode(again) == encode(changed)


def test_ports_kept_across_replans():
    models = (llama_1b("a"), llama_1b("b"))
    demand_ab = Demand(personas=(Persona(model="a"), Persona(model="b")))
    demand_b = Demand(personas=(Persona(model="b"),))
    r = host(models=models)
    first = only_host(plan([r], FleetConfig(), demand_ab))
    ports = {lane.lane_id: lane.port for lane in first.lanes}
    assert sorted(ports.values()) == [8080, 8081]
    second = only_host(plan([r], FleetConfig(), demand_b, previous={"h1": first}))
    assert [(lane.lane_id, lane.port) for lane in second.lanes] == [("b-0", ports["b-0"])]


def test_determinism_with_shuffled_reports():
    reports = [
        host("c", models=(llama_8b(), llama_1b())),
        host("a", models=(llama_1b(),), ram_available=8 * GIB),
        host("b", models=(gemma_like(),), gpus=(GpuInfo(name="g", vram_total=16 * GIB, vram_free=15 * GIB),)),
    ]
    config = FleetConfig(kv_cache_type="q8_0")
    expected = encode(plan(reports, config))
    rnd = random.Random(7)
    for _ in range(5):
        shuffled = list(reports)
        rnd.shuffle(shuffled)
        assert encode(plan(shuffled, config)) == expected
    assert [hp.host_id for hp in plan(reports, config).hosts] == ["a", "b", "c"]


@pytest.mark.parametrize("layout", ["streams", "shared"])
def test_plan_memory_matches_lane_shape(layout):
    # The memory in a plan is what the lane's own shape costs (kv cells match ctx / slots).
    demand = Demand(personas=(Persona(model="llama-8b", parallel=4, ctx_min=2048),))
    lane = only_lane(plan([host(server=ServerCaps(kv_layout=layout))], FleetConfig(), demand))
    if layout == "streams":
        assert lane.memory.kv_streams == 4 and lane.memory.kv_cells == window(lane)
    else:
        assert lane.memory.kv_streams == 1 and lane.memory.kv_cells == lane.ctx_total
    # 32 layers x 8 KV heads x 128 f16, K + V: 131072 bytes per cell
    assert lane.memory.kv_bytes == lane.memory.kv_cells * lane.memory.kv_streams * 131072


def test_a_shared_cache_gives_each_slot_at_most_the_trained_context():
    """--kv-unified: a slot may fill the whole cache, but llama-server caps it at the trained
    context (server-context.cpp), so that is the window the plan promises and checks /props by."""
    trained = 8192
    model = llama_8b(n_ctx_train=trained)

    def lane_for(persona: Persona, caps: ServerCaps = ServerCaps()) -> LaneSpec:
        report = host(ram_available=64 * GIB, ram_total=96 * GIB, models=(model,), server=caps)
        return only_lane(plan([report], FleetConfig(), Demand(personas=(persona,))))

    wide = lane_for(Persona(model=model.name, parallel=4, kv_unified=True))
    assert wide.ctx_total == 4 * trained and wide.ctx_per_slot == trained
    narrow = lane_for(Persona(model=model.name, parallel=4, kv_unified=True, ctx_max=1024))
    assert (narrow.ctx_total, narrow.ctx_per_slot) == (4096, 4096)  # the whole pool, under the trained context
    split = lane_for(Persona(model=model.name, parallel=4, ctx_max=1024))
    assert (split.ctx_total, split.ctx_per_slot) == (4096, 1024)
    no_flag = lane_for(Persona(model=model.name, parallel=4, kv_unified=True, ctx_max=1024),
                       ServerCaps(has_kv_unified=False))  # fmt: skip
    assert (no_flag.kv_unified, no_flag.ctx_per_slot) == (False, 1024)  # a stream per slot: the binary splits it
