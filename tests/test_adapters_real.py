"""LoRA adapters and rerankers end to end: generated adapter and reranker files, the real
llama-server, the planner, an agent and the gateway, asked with the `openai` client and plain HTTP.

An adapter is served as a model of its own ("base:adapter", or `lora` naming it), only on lanes
that load it, with only that adapter applied; its bytes are what the binary prints; a request for
it wakes its unloaded base. A reranker GGUF (rank pooling) gets --reranking and /v1/rerank.
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import openai
from fixtures_bus import agent_config, client, fleet_status, host_status, lane_of, services
from test_real_llama import _planner_with
from tinymodels import write_llama, write_lora
from waiting import eventually

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from shared import subjects
from shared.messages.config import Demand, Persona
from shared.messages.wire import encode

MIB = 1 << 20
ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Greedy and computed whole each time (no prompt cache): the same lane gives the same text for the same adapter.
PROMPT = {"prompt": "hello lanes", "max_tokens": 6, "temperature": 0, "seed": 1, "cache_prompt": False}


def _models(tmp_path):
    models = tmp_path / "models"
    (models / "loras").mkdir(parents=True)
    write_llama(models / "base.gguf", n_layer=2, n_embd=256, n_vocab=4096)
    # beside its base: every matrix, token_embd and output (2.1 MiB at rank 64)
    write_lora(models / "style.gguf", n_vocab=4096, rank=64, targets=ALL, token_embd=True, output=True, strength=1.0)
    # in a folder of adapters: f32, a few matrices of one block
    write_lora(models / "loras" / "terse.gguf", n_vocab=4096, rank=16, dtype="f32", blocks=(1,), seed=5, strength=1.0)
    write_lora(models / "loras" / "wide.gguf", n_embd=512)  # fits no model here: reported as a problem
    write_llama(models / "rr.gguf", arch="qwen3", pooling=4, cls_labels=("yes", "no"), seed=2)
    return models


async def _completion(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with http.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_adapters_and_a_reranker_through_the_gateway(nats_server, tmp_path, llama_server):
    models = _models(tmp_path)
    demand = Demand(personas=(
        Persona(model="base", alias="chat", adapters=("style", "terse", "absent"), ctx_max=1024),
        Persona(model="rr", ctx_max=1024),
    ))  # fmt: skip
    gw = Gateway(GatewaySettings(port=0, activity_interval=0.5, wake_repeat=0.5, request_timeout=60, load_timeout=90))
    stop = asyncio.Event()
    async with services(nats_server.url) as s, client(nats_server.url) as nc, aiohttp.ClientSession() as http:
        await _planner_with(nc, s, {}, demand)
        s.start_agent(agent_config(tmp_path, "ad", models, llama_server))
        task = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:
            await eventually(lambda: gw.view.routable("chat:style") and gw.view.routable("rr"), timeout=90,
                             what="the adapters' lane and the reranker routable")  # fmt: skip
            fleet = await fleet_status(nc)
            report = fleet.reports[0]
            found = {a.name: a for a in report.adapters}
            assert found["style"].bases == ("base",) and found["terse"].bases == ("base",) and found["wide"].bases == ()
            assert found["style"].rank == 64 and found["style"].file_bytes > 2 * MIB
            specs = {spec.model: spec for spec in fleet.plans[0].lanes}
            chat, rr = specs["base"], specs["rr"]
            assert chat.adapters == ("style", "terse") and chat.adapter_paths[0].endswith("/style.gguf")
            assert any("adapter absent: no such adapter file" in r for r in chat.reasons)
            assert rr.reranking and not rr.embeddings and not chat.reranking
            async def loaded():
                status = await host_status(nc, "ad")
                lanes = [lane_of(status, x) for x in ("base-0", "rr-0")]
                return status if all(x and x.state == "healthy" and x.devices for x in lanes) else None

            status = await eventually(loaded, what="both lanes' printed buffers")
            lane = lane_of(status, "base-0")
            i = lane.argv.index("--lora-scaled")
            assert lane.argv[i + 1] == f"{chat.adapter_paths[0]}:0,{chat.adapter_paths[1]}:0"
            assert "--reranking" in lane_of(status, "rr-0").argv
            # The adapters' bytes: planned per device as the binary prints them (two decimals).
            planned = {d.device: d.adapter_bytes for d in chat.memory.devices}
            printed = {d.device: d.adapter_bytes for d in lane.devices}
            assert planned["CPU"] > 2 * MIB and abs(planned["CPU"] - printed["CPU"]) <= 0.011 * MIB, (planned, printed)
            assert chat.memory.adapter_bytes == sum(planned.values())

            ai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            listed = {m.id: m for m in (await ai.models.list()).data}
            assert {"chat", "chat:style", "chat:terse", "rr"} <= set(listed) and "chat:absent" not in listed
            assert listed["chat:style"].adapter == {"base": "chat", "name": "style"}
            assert listed["chat"].adapters == ["style", "terse"] and listed["rr"].reranking is True

            async def text(model: str, **extra) -> str:
                got = await ai.completions.create(model=model, extra_body={"cache_prompt": False, **extra},
                                                  **{k: v for k, v in PROMPT.items() if k != "cache_prompt"})  # fmt: skip
                return got.choices[0].text

            base, style, terse = await text("chat"), await text("chat:style"), await text("chat:terse")
            assert await text("chat", lora="style") == style  # the `lora` field names it as well
            assert await text("chat", lora=[{"name": "style", "scale": 1.0}]) == style
            # Only the named adapter is applied, at its scale; the base model without the field.
            lane = next(x for x in gw.view.lanes_for("chat"))  # straight to it, with its key
            direct = {}
            for key, lora in (("none", [{"id": 0, "scale": 0.0}]), ("style", [{"id": 0, "scale": 1.0}]),
                              ("terse", [{"id": 1, "scale": 1.0}])):  # fmt: skip
                code, answer = await _completion(http, lane.url + "/v1/completions", {**PROMPT, "lora": lora}, lane.auth)
                assert code == 200, answer
                direct[key] = answer["choices"][0]["text"]
            assert (base, style, terse) == (direct["none"], direct["style"], direct["terse"])
            assert len({base, style, terse}) == 3, (base, style, terse)
            code, answer = await _completion(http, gw.url + "/v1/completions", {**PROMPT, "model": "chat:absent"})
            assert code == 404, answer

            # Rerankers: /v1/rerank and /rerank through the gateway, like embeddings.
            ask = {"model": "rr", "query": "a lane", "documents": ["a slot", "a lane here", "nothing"]}
            for path in ("/v1/rerank", "/rerank"):
                code, answer = await _completion(http, gw.url + path, ask)
                assert code == 200, answer
                assert sorted(r["index"] for r in answer["results"]) == [0, 1, 2]

            # Past its idle_ttl the base unloads; a request for an adapter wakes a lane that has it.
            short = Demand(personas=(msgspec.structs.replace(demand.personas[0], idle_ttl=2.0), demand.personas[1]))
            reply = await nc.request(subjects.DEMAND_SET, encode(short), timeout=5)
            assert not (reply.headers or {}).get("Nats-Service-Error"), reply.headers
            await eventually(lambda: not gw.view.lanes_for("chat"), timeout=60, what="chat unloaded after its idle_ttl")
            assert {m["id"]: m["state"] for m in (await ai.models.list()).model_dump()["data"]}["chat:style"] == "unloaded"
            assert await text("chat:style") == style
            assert [x.adapters for x in gw.view.lanes_for("chat:style")] == [("style", "terse")]
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
