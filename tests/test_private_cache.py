"""A tenant's prompt cache kept private (issue 36 point 6), with the real llama-server: lanes
dedicated to a tenant serve it alone, its prompts never land in a lane another tenant uses, and
`cached_tokens` never counts another tenant's prompt. The default (shared) is the measured
contrast: two tenants on one lane see each other's prefixes as cached tokens."""

from __future__ import annotations

import asyncio

import openai
from fixtures_bus import agent_config, client, services
from test_real_llama import _planner_with
from tinymodels import write_llama
from waiting import eventually

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from shared.messages.config import Demand, Persona

ACME, BETA, GAMMA = "sk-acme-private-0001", "sk-beta-shared-00001", "sk-gamma-shared-0001"
KEYS = f"""
[[keys]]
key = "{ACME}"
tenant = "acme"
cache = "private"
lanes = {{ chat = "chat-acme" }}

[[keys]]
key = "{BETA}"
tenant = "beta"

[[keys]]
key = "{GAMMA}"
tenant = "gamma"
"""
PREFIX = "Here is a long shared preamble that both tenants happen to send. " * 12


async def test_a_private_tenant_shares_no_cached_prefix_with_another(nats_server, tmp_path, llama_server):
    models = tmp_path / "models"
    models.mkdir()
    write_llama(models / "m.gguf", n_layer=2, n_embd=256, n_vocab=4096)
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    demand = Demand(personas=(Persona(model="m", alias="chat", lanes=1, parallel=2, ctx_max=2048),
                              Persona(model="m", alias="chat-acme", lanes=1, parallel=1, ctx_max=2048)))  # fmt: skip
    gw = Gateway(GatewaySettings(port=0, keys_file=str(keys), request_timeout=60))
    stop = asyncio.Event()
    async with services(nats_server.url) as s, client(nats_server.url) as nc:
        await _planner_with(nc, s, {}, demand)
        s.start_agent(agent_config(tmp_path, "iso", models, llama_server))
        task = asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw))
        try:
            await eventually(lambda: gw.view.routable("chat") and gw.view.routable("chat-acme"), timeout=90,
                             what="the shared and the dedicated lane routable")  # fmt: skip
            acme, beta, gamma = (openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=k, max_retries=0, timeout=60)
                                 for k in (ACME, BETA, GAMMA))  # fmt: skip

            async def ask(ai, text: str, model: str = "chat") -> tuple[str, int]:
                raw = await ai.completions.with_raw_response.create(model=model, prompt=text, max_tokens=2,
                                                                    temperature=0)  # fmt: skip
                usage = raw.parse().usage
                cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
                return raw.headers["x-lanes-lane"], cached or 0

            # beta (shared) primes the shared lane with the preamble; acme asks the same "chat",
            # is served by its own lane, and nothing of beta's prompt counts as cached for it.
            shared_lane, _ = await ask(beta, PREFIX + "beta one")
            acme_lane, acme_cached = await ask(acme, PREFIX + "acme one")
            alias_of = {f"{x.host_id}/{x.lane_id}": x.alias for x in gw.view.lanes()}
            assert (alias_of[acme_lane], alias_of[shared_lane]) == ("chat-acme", "chat"), (acme_lane, shared_lane)
            assert acme_cached == 0
            # Within a tenant the cache works as ever: each sees its own preamble cached.
            again_lane, again_cached = await ask(acme, PREFIX + "acme two")
            assert again_lane == acme_lane and again_cached > 0
            beta_lane, beta_cached = await ask(beta, PREFIX + "beta two")
            assert beta_lane == shared_lane and beta_cached > 0
            # The default, shared, for contrast: gamma meets beta's preamble in the lane they share.
            gamma_lane, gamma_cached = await ask(gamma, PREFIX + "gamma one")
            assert gamma_lane == shared_lane and gamma_cached > 0
            # acme's own prompt never reaches beta's cache: a new text, first from acme, then from beta.
            secret = "Acme's quarterly numbers, never to be seen by anyone else: " * 10
            await ask(acme, secret + "q1")
            lane, cached = await ask(beta, secret + "q1")
            assert lane == shared_lane and cached == 0
            # The dedicated lanes are acme's alone; a model without dedicated lanes is refused to acme.
            try:
                await ask(beta, "hi", model="chat-acme")
                raise AssertionError("beta was served by acme's lanes")
            except openai.PermissionDeniedError as exc:
                assert exc.code == "model_not_allowed"
            # ... also when another tenant names the model itself (not an alias): acme's new prompt is
            # held by acme's lane alone, and prefix affinity would send beta's to it, cached.
            plans = "Zebra-striped plans for next year, also never to be seen by anyone else: " * 10
            await ask(acme, plans + "a")
            lane, cached = await ask(beta, plans + "b", model="m")
            # (a few leading tokens match a prompt the shared lane saw before: 4 measured; acme's
            # lane would give back some 900, its whole prompt)
            assert lane == shared_lane and cached <= 8, (lane, cached)
            try:
                await ask(acme, "hi", model="m")
                raise AssertionError("acme was served by a shared lane")
            except openai.PermissionDeniedError as exc:
                assert exc.code == "private_cache_unavailable"
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
