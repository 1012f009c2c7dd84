"""Vision end to end: the agent pairs a generated projector with its model, the plan loads it
(--mmproj), the real llama-server reads an image the `openai` client sends through the gateway,
a text-only model answers the same request with the gateway's 400, and the projector bytes the
lane printed are the planned ones. Also the real Gemma 3 270M file with a generated gemma3
projector (its vision tower's width feeding Gemma's 640)."""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib

import openai
import pytest
from fixtures_bus import agent_config, client, fleet_status, host_status, services
from test_real_llama import _planner_with
from tinymodels import write_llama
from tinyprojectors import IDEFICS3_TOKENS, write_projector
from waiting import eventually

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from shared.messages.config import Demand, Persona

MIB = 2**20


def tiny_png(width: int = 8, height: int = 8) -> bytes:
    """An RGB PNG, written by hand (no imaging library): a red-green gradient."""
    rows = b"".join(b"\x00" + bytes(v for x in range(width) for v in (x * 32 % 256, y * 32 % 256, 128))
                    for y in range(height))  # fmt: skip

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def image_message(text: str = "What is in the picture?") -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(tiny_png()).decode()
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]


def _printed_matches_plan(planned_dev, printed_dev, proj) -> None:
    """clip prints the unpadded weights ("model size") and the compute buffer, each to 0.01 MiB; the
    plan holds the padded weights (each tensor padded to 32 bytes) and the compute buffer."""
    padding = proj.weight_bytes - proj.file_weight_bytes
    assert 0 <= padding < 32 * 64
    assert abs(planned_dev.projector_bytes - padding - printed_dev.projector_bytes) <= 0.01 * MIB, (
        planned_dev.projector_bytes, printed_dev.projector_bytes)


async def _vision_fleet(nats_server, tmp_path, llama_server, models, demand, check):
    gw = Gateway(GatewaySettings(port=0))
    stop = asyncio.Event()
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, {}, demand)
        s.start_agent(agent_config(tmp_path, "vis", models, llama_server))
        task = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:
            names = [p.model for p in demand.personas]
            await eventually(lambda: all(gw.view.routable(n) for n in names), timeout=180, what="lanes routable")
            ai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            await check(nc, ai)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


async def test_an_image_through_the_gateway_to_a_lane_with_a_projector(nats_server, tmp_path, llama_server):
    models = tmp_path / "models"
    (models / "vlm").mkdir(parents=True)
    write_llama(models / "vlm" / "vlm.gguf", n_layer=2, n_embd=256)
    write_projector(models / "vlm" / "mmproj-vlm-f16.gguf", proj_type="gemma3", text_embd=256)  # the router's folder
    write_llama(models / "smol-Q8_0.gguf", n_layer=2, n_embd=256, seed=2, special=IDEFICS3_TOKENS)
    write_projector(models / "mmproj-smol-Q8_0.gguf", proj_type="idefics3", text_embd=256)  # by base name
    write_llama(models / "chat.gguf", n_layer=2, n_embd=256, seed=1)
    demand = Demand(personas=tuple(Persona(model=m, ctx_max=2048) for m in ("vlm", "smol-Q8_0", "chat")))

    async def check(nc, ai):
        specs = {spec.model: spec for spec in (await fleet_status(nc)).plans[0].lanes}
        assert specs["vlm"].mmproj_path.endswith("/vlm/mmproj-vlm-f16.gguf")
        assert specs["smol-Q8_0"].mmproj_path.endswith("/mmproj-smol-Q8_0.gguf") and specs["chat"].mmproj_path is None
        status = {lane.lane_id: lane for lane in (await host_status(nc, "vis")).lanes}
        argv = status["vlm-0"].argv
        assert argv[argv.index("--mmproj") + 1] == specs["vlm"].mmproj_path and "--no-mmproj-offload" in argv
        report_facts = {}
        for model in ("vlm", "smol-Q8_0"):  # the bytes the lane printed are the planned ones, in host RAM
            planned = specs[model].memory.devices[0]
            printed = next(d for d in status[f"{model}-0"].devices if d.device == "CPU")
            from shared.gguf_projector import projector_facts

            report_facts[model] = proj = projector_facts(specs[model].mmproj_path)
            _printed_matches_plan(planned, printed, proj)
        listed = {m.id: m for m in (await ai.models.list()).data}
        assert "multimodal" in listed["vlm"].capabilities and listed["vlm"].input_modalities == ["text", "image"]
        assert listed["chat"].capabilities == ["completion"]
        for model in ("vlm", "smol-Q8_0"):
            answer = await ai.chat.completions.create(model=model, messages=image_message(), max_tokens=4)
            assert answer.choices[0].message is not None and answer.usage.prompt_tokens > 16  # the image's tokens
        with pytest.raises(openai.BadRequestError) as refused:
            await ai.chat.completions.create(model="chat", messages=image_message(), max_tokens=4)
        assert "takes no images" in str(refused.value) and refused.value.code == "images_not_supported"

    await _vision_fleet(nats_server, tmp_path, llama_server, models, demand, check)


async def test_the_real_gemma_file_with_a_generated_projector(nats_server, tmp_path, llama_server, gemma_model):
    models = tmp_path / "models"
    models.mkdir()
    (models / "gemma-3-270m-it-Q4_K_M.gguf").symlink_to(gemma_model)
    write_projector(models / "mmproj-gemma-3-270m-it-f16.gguf", proj_type="gemma3", text_embd=640)
    name = "gemma-3-270m-it-Q4_K_M"
    demand = Demand(personas=(Persona(model=name, ctx_max=4096),))

    async def check(nc, ai):
        spec = (await fleet_status(nc)).plans[0].lanes[0]
        lane = (await host_status(nc, "vis")).lanes[0]
        from shared.gguf_projector import projector_facts

        proj = projector_facts(spec.mmproj_path)
        assert proj.n_mmproj_embd == 640
        _printed_matches_plan(spec.memory.devices[0], next(d for d in lane.devices if d.device == "CPU"), proj)
        answer = await ai.chat.completions.create(model=name, messages=image_message(), max_tokens=4)
        assert answer.choices[0].message is not None and answer.usage.prompt_tokens > 16

    await _vision_fleet(nats_server, tmp_path, llama_server, models, demand, check)


async def test_an_image_wakes_an_unloaded_model_with_its_projector(nats_server, tmp_path, llama_server):
    """On demand: the model unloaded after its idle_ttl still says it takes images; an image request
    wakes a lane that loads the projector; a text-only model unloaded is refused at once, not woken."""
    models = tmp_path / "models"
    (models / "vlm").mkdir(parents=True)
    write_llama(models / "vlm" / "vlm.gguf", n_layer=2, n_embd=256)
    write_projector(models / "vlm" / "mmproj-f16.gguf", proj_type="gemma3", text_embd=256)
    write_llama(models / "chat.gguf", n_layer=2, n_embd=256, seed=1)
    demand = Demand(personas=(Persona(model="vlm", ctx_max=2048, idle_ttl=2.0), Persona(model="chat", ctx_max=2048, idle_ttl=2.0)))
    gw = Gateway(GatewaySettings(port=0, load_timeout=300))
    stop = asyncio.Event()
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, {}, demand)
        s.start_agent(agent_config(tmp_path, "vis", models, llama_server))
        task = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:
            await eventually(lambda: gw.view.routable("vlm") and gw.view.routable("chat"), timeout=180, what="loaded")
            await eventually(lambda: not gw.view.lanes_for("vlm") and not gw.view.lanes_for("chat"), timeout=60,
                             what="both unloaded after their idle_ttl")  # fmt: skip
            ai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            listed = {m.id: m for m in (await ai.models.list()).data}
            assert listed["vlm"].state == "unloaded" and "multimodal" in listed["vlm"].capabilities
            with pytest.raises(openai.BadRequestError):
                await ai.chat.completions.create(model="chat", messages=image_message(), max_tokens=4)
            answer = await ai.chat.completions.create(model="vlm", messages=image_message(), max_tokens=4)
            assert answer.usage.prompt_tokens > 16
            lanes = {lane.lane_id: lane for lane in (await host_status(nc, "vis")).lanes if lane.state == "healthy"}
            assert "--mmproj" in lanes["vlm-0"].argv and "chat-0" not in lanes
            states = {m.name: m.state for m in (await fleet_status(nc)).models}
            assert states["chat"] == "unloaded"  # the refusal woke nothing (vlm loaded meanwhile)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


async def test_an_image_longer_than_its_lanes_plan_holds_is_refused_at_the_door(nats_server, tmp_path, llama_server):
    """MiniCPM-V (a generated resampler projector): the plan holds the largest slice of images up to
    20:1 and says so (LaneSpec.image_max_aspect); through the gateway a 105 x 1,911 image (18:1) is
    sliced and answered by the real llama-server, a 49 x 4,095 one (84:1, whose slice llama.cpp would
    give more patches than the plan holds) is refused with a 400 before any lane sees it."""
    from tinyprojectors import MINICPMV_TOKENS

    models = tmp_path / "models"
    (models / "minicpm").mkdir(parents=True)
    write_llama(models / "minicpm" / "minicpm.gguf", n_layer=2, n_embd=256, special=MINICPMV_TOKENS)
    write_projector(models / "minicpm" / "mmproj-minicpm-f16.gguf", proj_type="resampler", text_embd=256,
                    image_size=448, scale_factor=64)  # fmt: skip
    demand = Demand(personas=(Persona(model="minicpm", ctx_max=4096),))

    def picture(width: int, height: int) -> list[dict]:
        url = "data:image/png;base64," + base64.b64encode(tiny_png(width, height)).decode()
        return [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}]

    async def check(nc, ai):
        spec = (await fleet_status(nc)).plans[0].lanes[0]
        assert spec.image_max_aspect == 20 and "images up to 20:1" in " ".join(spec.reasons)
        answer = await ai.chat.completions.create(model="minicpm", messages=picture(105, 1911), max_tokens=2)
        assert answer.usage.prompt_tokens > 3 * 64  # an overview and two slices of 64 queries each
        with pytest.raises(openai.BadRequestError) as refused:
            await ai.chat.completions.create(model="minicpm", messages=picture(49, 4095), max_tokens=2)
        assert refused.value.code == "image_too_long" and "49 x 4095 pixels is longer than 20:1" in str(refused.value)

    await _vision_fleet(nats_server, tmp_path, llama_server, models, demand, check)
