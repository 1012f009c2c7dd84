"""Tenants through a served gateway, in front of the fake llama-server (tests/fake_llama_server.py):
token-fair queueing, priority classes that shed the right requests, tenants' limits named in
429s, per-tenant metrics; then two gateways on one nats-server sharing a tenant's usage.

A slot is held by the test itself (a lease taken from the gateway's admission), so who waits,
and in which order the queue is served once it is let go, depends on no timing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from fixtures_bus import FAKE, client, free_port_base
from test_gateway_core import healthy, put_plan, put_status, spec
from test_metrics import samples
import time
from waiting import eventually

from gateway.edge.app_keys import USAGE
from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from gateway.tenants.keys import digest
from lanes.online import tenant_lines
from shared import subjects
from shared.messages.activity import GatewayActivity
from shared.messages.wire import decode
from shared.natsserver import NatsServer

MODEL = "gemma"


def keys_text(**tenants: str) -> str:
    """One [[keys]] per tenant, its key "key-<tenant>", its extra fields as TOML lines."""
    return "".join(f'[[keys]]\nsha256 = "{digest("key-" + t)}"\ntenant = "{t}"\n{extra}\n' for t, extra in tenants.items())


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer key-{tenant}"}


@pytest.fixture
def lane(tiny_models):
    """A fake llama-server lane (answers at once: prompt 1 token, output 1)."""
    port = free_port_base(1)
    env = {**os.environ, "FAKE_LLAMA_LOAD_SECONDS": "0", "FAKE_LLAMA_REPLY_SECONDS": "0"}
    proc = subprocess.Popen([sys.executable, str(FAKE), "-m", str(tiny_models["llama8"]), "--port", str(port),
                             "-np", "1", "-c", "2048"], env=env, stderr=subprocess.DEVNULL)  # fmt: skip
    yield port
    proc.kill()
    proc.wait(10)


def one_slot(gw: Gateway, port: int) -> None:
    put_plan(gw.view, "h1", spec("gemma-0", port=port, parallel=1))
    put_status(gw.view, "h1", healthy("gemma-0", port))
    gw.view.mark_synced()  # the fleet, as if read from NATS: requests do not wait for it


@asynccontextmanager
async def served(tmp_path, port: int, keys: str, **settings):
    path = tmp_path / "keys.toml"
    path.write_text(keys)
    gw = Gateway(GatewaySettings(port=0, keys_file=str(path), **settings))
    one_slot(gw, port)
    server = TestServer(gw.app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            url = str(server.make_url("")).rstrip("/")
            await eventually(lambda: _health(http, port), what="the fake lane answers")
            yield gw, url, http
    finally:
        await server.close()


async def _health(http, port):
    async with http.get(f"http://127.0.0.1:{port}/health") as resp:
        return resp.status == 200


async def chat(http, url, tenant, model=MODEL):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with http.post(url + "/v1/chat/completions", json=body, headers=auth(tenant)) as resp:
        return resp.status, await resp.json(), resp.headers.get("Retry-After")


def metric(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def queued(gw: Gateway) -> int:
    return gw.admission.counts.queued.get(MODEL, 0)


async def _served_order(tmp_path, lane, fair: bool) -> list[str]:
    keys = keys_text(heavy="", light="")
    async with served(tmp_path, lane, keys, fair=fair) as (gw, url, http):
        for _ in range(2):  # the heavy tenant has used the fleet before
            assert (await chat(http, url, "heavy"))[0] == 200
        held = await gw.admission.acquire(MODEL)  # the one slot, held by the test
        done: list[str] = []

        async def ask(tenant):
            status, _, _ = await chat(http, url, tenant)
            assert status == 200
            done.append(tenant)

        heavy = [asyncio.create_task(ask("heavy")) for _ in range(5)]
        await eventually(lambda: queued(gw) == 5, what="5 heavy requests waiting")
        light = asyncio.create_task(ask("light"))
        await eventually(lambda: queued(gw) == 6, what="the light request waiting too")
        held.release()
        await asyncio.gather(*heavy, light)
        return done


async def test_the_next_slot_goes_to_the_tenant_that_used_least(tmp_path, lane):
    fair = await _served_order(tmp_path, lane, fair=True)
    fifo = await _served_order(tmp_path, lane, fair=False)
    assert fair.index("light") == 0, fair  # behind no heavy request
    assert fifo.index("light") == 5, fifo  # the baseline: behind all five


async def test_priority_classes_shed_sheddable_first_and_critical_is_never_refused(tmp_path, lane):
    keys = keys_text(batch='priority = "sheddable"', team='priority = "standard"', ops='priority = "critical"\nrole = "ops"')  # ops reads /metrics
    async with served(tmp_path, lane, keys, queue_depth=4) as (gw, url, http):
        held = await gw.admission.acquire(MODEL)
        batch = [asyncio.create_task(chat(http, url, "batch")) for _ in range(2)]
        await eventually(lambda: queued(gw) == 2, what="sheddable requests up to their ceiling (half of 4)")
        status, body, retry = await chat(http, url, "batch")  # a third: past its class's ceiling
        assert status == 429 and body["error"]["code"] == "shed" and "sheddable" in body["error"]["message"]
        assert retry and int(retry) >= 1
        team = [asyncio.create_task(chat(http, url, "team")) for _ in range(2)]
        await eventually(lambda: queued(gw) == 4, what="the queue full")
        ops = [asyncio.create_task(chat(http, url, "ops")) for _ in range(3)]
        # Each critical arrival takes the place of the lowest-class waiter: both batch, then one team.
        shed = [await t for t in batch]
        assert all(s == 429 and b["error"]["code"] == "shed" and r for s, b, r in shed), shed
        await eventually(lambda: sum(t.done() for t in team) == 1, what="a standard request shed")
        held.release()
        answers = [await t for t in team + ops]
        assert sorted(s for s, _, _ in answers) == [200, 200, 200, 200, 429]
        assert all(s == 200 for s, _, _ in answers[2:]), "no critical request refused"
        text = await (await http.get(url + "/metrics", headers=auth("ops"))).text()
        assert metric(text, "lanes_gateway_refusals_total", tenant="batch", reason="shed", **{"class": "sheddable"}) == 3
        assert metric(text, "lanes_gateway_refusals_total", tenant="team", reason="shed", **{"class": "standard"}) == 1
        assert metric(text, "lanes_gateway_tenant_requests_total", tenant="ops", status="200", **{"class": "critical"}) == 3
        assert metric(text, "lanes_gateway_tenant_queue_wait_seconds_count", tenant="ops", **{"class": "critical"}) == 3


async def test_a_tenant_over_its_limits_gets_429_naming_the_limit_before_a_slot(tmp_path, lane):
    keys = keys_text(small="tokens_per_day = 5", one='max_concurrent = 1\nrole = "ops"', narrow='models = ["qwen*"]')
    async with served(tmp_path, lane, keys) as (gw, url, http):
        for _ in range(2):  # 1 prompt + 2 x 1 output token each: 6 >= 5
            assert (await chat(http, url, "small"))[0] == 200
        status, body, retry = await chat(http, url, "small")
        assert status == 429 and body["error"]["code"] == "tokens_per_day" and "tokens_per_day is 5" in body[
            "error"]["message"] and int(retry) >= 1  # fmt: skip
        held = await gw.admission.acquire(MODEL)
        first = asyncio.create_task(chat(http, url, "one"))
        await eventually(lambda: queued(gw) == 1, what="the tenant's one request waiting")
        status, body, _ = await chat(http, url, "one")
        assert status == 429 and body["error"]["code"] == "max_concurrent"
        held.release()
        assert (await first)[0] == 200
        status, body, _ = await chat(http, url, "narrow")
        assert status == 403 and body["error"]["code"] == "model_not_allowed"
        assert (await chat(http, url, "nobody"))[0] == 401
        text = await (await http.get(url + "/metrics", headers=auth("one"))).text()
        std = {"class": "standard"}
        assert metric(text, "lanes_gateway_tenant_tokens_total", tenant="small", kind="output", **std) == 2
        for tenant, reason in (("small", "tokens_per_day"), ("one", "max_concurrent"), ("narrow", "model_not_allowed")):
            assert metric(text, "lanes_gateway_refusals_total", tenant=tenant, reason=reason, **std) == 1


# ------------------------------------------------------------------ two gateways, one budget


@asynccontextmanager
async def running(nats_url: str, port: int, keys_file, gateway_id: str):
    gw = Gateway(GatewaySettings(port=0, keys_file=str(keys_file), gateway_id=gateway_id, activity_interval=0.2))
    one_slot(gw, port)
    stop = asyncio.Event()
    task = asyncio.create_task(run_gateway(nats_url, stop, gateway=gw))
    try:
        await asyncio.wait_for(gw.started.wait(), 10)
        yield gw
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_two_gateways_enforce_one_budget_that_survives_a_restart(tmp_path, lane):
    server = NatsServer(tmp_path / "nats").start()
    path = tmp_path / "keys.toml"
    path.write_text(keys_text(team="tokens_per_day = 12"))
    try:
        async with aiohttp.ClientSession() as http, client(server.url) as nc:
            activity: list[GatewayActivity] = []

            async def on_activity(msg):
                activity.append(decode(msg.data, GatewayActivity))

            await nc.subscribe(subjects.ALL_ACTIVITY, cb=on_activity)
            async with running(server.url, lane, path, "gw1") as one, running(server.url, lane, path, "gw2") as two:
                await eventually(lambda: _health(http, lane), what="the fake lane answers")
                await eventually(lambda: one.app[USAGE].synced and two.app[USAGE].synced, what="usage read from NATS")
                for _ in range(2):  # 6 tokens through gw1
                    assert (await chat(http, one.url, "team"))[0] == 200
                await eventually(lambda: two.app[USAGE].used("team", time.time())[1] == 6,
                                 what="gw2 sees gw1's tokens")  # fmt: skip
                # ... and counts them in the tenant's fair share too (it served the tenant nothing itself).
                assert two.admission.ledger.cost("team", asyncio.get_running_loop().time()) > 0
                for _ in range(2):  # 6 more through gw2: 12, the budget
                    assert (await chat(http, two.url, "team"))[0] == 200
                await eventually(lambda: one.app[USAGE].used("team", time.time())[1] == 12,
                                 what="gw1 sees gw2's tokens")  # fmt: skip
                status, body, _ = await chat(http, one.url, "team")
                assert status == 429 and body["error"]["code"] == "tokens_per_day"
                # The keys file changes: a new key works without a restart; a broken file keeps the last good.
                path.write_text(keys_text(team="tokens_per_day = 12", other=""))
                await eventually(lambda: _status_of(http, one.url, "other"), what="the new key accepted")
                path.write_text("[[keys]\nbroken")
                await eventually(lambda: _keys_error(one), what="the bad file noted")
                assert (await chat(http, one.url, "other"))[0] == 200
                # The tenant travels with the activity the gateway reports.
                held = await one.admission.acquire(MODEL)
                waiting = asyncio.create_task(chat(http, one.url, "other"))
                await eventually(lambda: any(t.tenant == "other" and t.queued == 1 for a in activity if a.gateway == "gw1"
                                             for m in a.models for t in m.tenants), what="tenant in activity")  # fmt: skip
                held.release()
                assert (await waiting)[0] == 200
            lines = await tenant_lines(nc)
            assert any(line.startswith("tenant team: ") and "12 today (2 gateway(s))" in line for line in lines), lines
            path.write_text(keys_text(team="tokens_per_day = 12", other=""))
            async with running(server.url, lane, path, "gw1") as again:  # a restart: its counts read back
                await eventually(lambda: again.app[USAGE].used("team", time.time())[1] == 12,
                                 what="the restarted gateway's usage")  # fmt: skip
                status, body, _ = await chat(http, again.url, "team")
                assert status == 429 and body["error"]["code"] == "tokens_per_day"
    finally:
        server.stop()


async def _status_of(http, url, tenant):
    return (await chat(http, url, tenant))[0] == 200


def _keys_error(gw: Gateway) -> bool:
    from gateway.edge.app_keys import KEYS

    return bool(gw.app[KEYS].error)
