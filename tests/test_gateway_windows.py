"""Window-aware admission with the real llama-server: lanes of one model with different windows.

A generated llama model whose vocabulary is the 256 byte tokens (one token per byte), served
by two personas of the same alias: one lane with a 512-token window per slot, one with 2048.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import openai
import pytest
from fixtures_bus import agent_config, client, services
from test_real_llama import _planner_with
from tinymodels import write_llama
from waiting import eventually

import gateway.edge.app
from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from shared.messages.config import Demand, Persona


@pytest.mark.parametrize("tokenizer", ["answers", "silent"])
async def test_a_long_prompt_goes_to_the_lane_with_the_larger_window(nats_server, tmp_path, llama_server, tokenizer,
                                                                     monkeypatch):  # fmt: skip
    """Counted before routing by a lane's tokenizer, or (its tokenizer silent: busy, timed out) by
    the small lane's own refusal (exceed_context_size_error): either way it is served by the large
    lane, and a prompt no window holds gets the gateway's 400."""
    if tokenizer == "silent":

        async def no_count(*_args, **_kw):
            return None

        monkeypatch.setattr(gateway.edge.app, "count_tokens", no_count)
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "m.gguf", n_layer=2, n_ctx_train=8192)
    demand = Demand(personas=(Persona(model="m", alias="m", ctx_min=512, ctx_max=512),
                              Persona(model="m", alias="m", ctx_min=2048, ctx_max=2048, priority=1)))  # fmt: skip
    gw = Gateway(GatewaySettings(port=0))
    stop = asyncio.Event()
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, {}, demand)
        s.start_agent(agent_config(tmp_path, "win", models, llama_server))
        task = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:
            await eventually(lambda: len(gw.view.routable("m")) == 2, timeout=90, what="both lanes routable")
            windows = {f"{lane.host_id}/{lane.lane_id}": lane.window for lane in gw.view.routable("m")}
            assert sorted(windows.values()) == [512, 2048]
            large = next(name for name, w in windows.items() if w == 2048)
            ai = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
            lanes = Counter()
            for i in range(6):  # about 1000 tokens: only the larger window holds it
                raw = await ai.completions.with_raw_response.create(model="m", prompt=f"{i} " + "abcd" * 250,
                                                                    max_tokens=2)  # fmt: skip
                lanes[raw.headers["x-lanes-lane"]] += 1
            assert lanes == {large: 6}
            try:
                await ai.completions.create(model="m", prompt="abcd" * 1000, max_tokens=2)  # about 4000 tokens
                raise AssertionError("a prompt no window holds was served")
            except openai.BadRequestError as refused:
                assert refused.code == "context_length_exceeded" and "2048" in refused.message
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
