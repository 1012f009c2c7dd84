"""A file without tokenizer.chat_template is served with a built-in template, not ChatML.

The real Gemma 3 270M file carries no template: planned by the real planner, launched by the
real agent over real NATS with the real llama-server, its first chat answer (the README's
first request) must not leak ChatML's <|im_end|> / <|im_start|>, and `lanes explain`'s text
(the planner's explain endpoint) must say which template and why.
"""

from __future__ import annotations

import json
import shutil
import urllib.request

from fixtures_bus import agent_config, client, host_status, lane_auth, lane_of, services
from test_real_llama import _planner_with
from waiting import eventually

from shared import subjects
from shared.gguf_facts import read_model_facts
from shared.messages.config import Demand, Persona
from shared.messages.replies import HostQuery
from shared.messages.wire import encode


async def test_gemma_without_a_template_is_served_with_gemma_not_chatml(nats_server, tmp_path, llama_server,
                                                                        gemma_model):  # fmt: skip
    assert not read_model_facts(gemma_model).has_chat_template
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(gemma_model, models / "gemma.gguf")
    demand = Demand(personas=(Persona(model="gemma", parallel=1, ctx_min=1024, ctx_max=2048),))
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, {}, demand)
        cfg = agent_config(tmp_path, "chat", models, llama_server)
        s.start_agent(cfg)

        async def healthy():
            lane = lane_of(await host_status(nc, "chat"), "gemma-0")
            assert lane is None or lane.state not in ("failed", "mismatch"), lane
            return lane if lane and lane.state == "healthy" else None

        lane = await eventually(healthy, timeout=90, what="gemma lane healthy")
        explained = (await nc.request(subjects.PLAN_EXPLAIN, encode(HostQuery(host_id="chat")), timeout=5)).data
        body = json.dumps({"messages": [{"role": "user", "content": "say hi"}], "max_tokens": 24, "temperature": 0})
        req = urllib.request.Request(f"http://127.0.0.1:{lane.port}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json", **lane_auth(cfg, "gemma-0")})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        props_req = urllib.request.Request(f"http://127.0.0.1:{lane.port}/props", headers=lane_auth(cfg, "gemma-0"))
        with urllib.request.urlopen(props_req, timeout=5) as r:
            props = json.loads(r.read())
    assert "<|im_end|>" not in answer and "<|im_start|>" not in answer, answer
    assert props["chat_template"] == "gemma"  # the built-in one, by name
    text = explained.decode()
    assert "chat template gemma (gemma3)" in text and "ChatML" in text, text
