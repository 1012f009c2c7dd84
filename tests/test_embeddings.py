"""Embeddings: a model whose GGUF declares a pooling type gets --embeddings lanes, and /v1/embeddings
works through the gateway with the `openai` client (the real llama-server on generated models)."""

from __future__ import annotations

import asyncio

import openai
from fixtures_bus import agent_config, client, fleet_status, host_status, services
from tinymodels import write_llama
from waiting import eventually
from test_real_llama import _planner_with

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from shared.gguf_facts import read_model_facts
from shared.messages.config import Demand, Persona


def test_the_pooling_type_is_read_from_the_gguf(tmp_path):
    assert read_model_facts(write_llama(tmp_path / "e.gguf", pooling=1)).pooling == "mean"
    assert read_model_facts(write_llama(tmp_path / "c.gguf", pooling=2)).pooling == "cls"
    assert read_model_facts(write_llama(tmp_path / "n.gguf", pooling=0)).pooling == ""
    assert read_model_facts(write_llama(tmp_path / "m.gguf")).pooling == ""


async def test_embeddings_through_the_gateway(nats_server, tmp_path, llama_server):
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "embedder.gguf", n_layer=2, n_embd=256, pooling=1)  # declares mean pooling
    write_llama(models / "chat.gguf", n_layer=2, n_embd=256, seed=1)
    demand = Demand(personas=(Persona(model="embedder", ctx_max=1024), Persona(model="chat", ctx_max=1024)))
    gw = Gateway(GatewaySettings(port=0))
    stop = asyncio.Event()
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, {}, demand)
        s.start_agent(agent_config(tmp_path, "emb", models, llama_server))
        task = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:
            await eventually(lambda: gw.view.routable("embedder") and gw.view.routable("chat"), timeout=90,
                             what="both lanes routable")  # fmt: skip
            specs = {spec.model: spec for spec in (await fleet_status(nc)).plans[0].lanes}
            assert specs["embedder"].embeddings and not specs["chat"].embeddings
            running = {lane.lane_id: lane.argv for lane in (await host_status(nc, "emb")).lanes}  # as the agent renders
            assert "--embeddings" in running["embedder-0"] and "--embeddings" not in running["chat-0"]
            ai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
            listed = {m.id: m for m in (await ai.models.list()).data}
            assert listed["embedder"].embeddings is True and listed["chat"].embeddings is False
            got = await ai.embeddings.create(model="embedder", input=["a lane", "a slot"])
            assert len(got.data) == 2 and all(len(d.embedding) == 256 for d in got.data)
            assert got.data[0].embedding != got.data[1].embedding
            answer = await ai.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2)  # fmt: skip
            assert answer.choices[0].message is not None
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
