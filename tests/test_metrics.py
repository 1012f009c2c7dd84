"""/metrics of the planner, the agent and the gateway against real NATS (fake llama-server lanes:
fast), the renaming of llama-server's series, and that every query of the Grafana board and every
alert rule (deploy/) names a series these real services export."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp
from fixtures_bus import agent_config, client, fake_binary, free_port_base, host_status, lane_of
from waiting import eventually
from prometheus_client.parser import text_string_to_metric_families

from gateway.service import Gateway, run_gateway
from gateway.settings import GatewaySettings
from launcher_agent.service import run_agent
from planner_svc.service import run_planner
from shared.llama.endpoints import rename_llama_series

# As llama-server prints it (b6xxx builds): names with a colon, counters with _total.
LLAMA_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 46
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 91
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def test_llama_series_are_renamed_and_labelled():
    families = rename_llama_series(LLAMA_METRICS, {"host": "h1", "lane": "m-0", "model": "m"})
    samples = {s.name: (s.labels, s.value) for f in families for s in f.samples}
    assert samples["lanes_llama_prompt_tokens_total"] == ({"host": "h1", "lane": "m-0", "model": "m"}, 46)
    assert samples["lanes_llama_requests_processing"][1] == 1
    assert {f.type for f in families} == {"counter", "gauge"}
    assert not any(":" in name for name in samples)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Exposition text as {(sample name, labels): value}."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


async def test_planner_and_agent_serve_metrics(nats_server, tmp_path, tiny_models):
    models = tmp_path / "models"
    models.mkdir()
    (models / "llama8.gguf").write_bytes(tiny_models["llama8"].read_bytes())
    planner_port, agent_port = free_port_base(1), free_port_base(1)
    cfg = agent_config(tmp_path, "h1", models, fake_binary(tmp_path / "bin"), metrics_port=agent_port,
                       metrics_host="127.0.0.1")  # fmt: skip
    stop = asyncio.Event()
    gw = Gateway(GatewaySettings(port=0))
    tasks = [
        asyncio.create_task(run_planner(nats_server.url, stop, metrics_port=planner_port, metrics_host="127.0.0.1")),
        asyncio.create_task(run_agent(cfg, nats_server.url, stop)),
        asyncio.create_task(run_gateway(nats_server.url, stop, gateway=gw)),
    ]
    try:
        async with client(nats_server.url) as nc:
            # No demand: one lane of every model (a window the fake llama-server has figures for).
            async def healthy():
                lane = lane_of(await host_status(nc, "h1"), "llama8-0")
                # kv_bytes: the KV line the lane printed, read back through its log writer (a process).
                ready = lane and lane.state == "healthy" and not lane.draining and lane.kv_bytes is not None
                return lane if ready else None

            lane = await eventually(healthy, timeout=40, what="lane healthy")
        planner = await _get(f"http://127.0.0.1:{planner_port}/metrics")
        labels = 'host="h1",lane="llama8-0",model="llama8"'
        on_cpu = frozenset({"host": "h1", "lane": "llama8-0", "model": "llama8", "device": "cpu"}.items())
        assert samples(planner)[("lanes_plan_lane_bytes", on_cpu)] == lane.planned_bytes
        assert f"lanes_plan_lane_slots{{{labels}}} 1.0" in planner
        assert 'lanes_host_memory_bytes{device="cpu",host="h1"}' in planner
        assert "lanes_planner_hosts 1.0" in planner and "lanes_planner_replans_total" in planner
        assert 'lanes_build_info{service="planner"' in planner

        async def agent_with_lane_series() -> str | None:
            # Each scrape reads the lane's own /metrics with a 1 s timeout; a lane slow to answer on a
            # loaded machine has none of its series in that scrape, by design (launcher_agent/metrics.py).
            # The KV figure the lane printed reaches the agent through its log writer, a process of its own.
            text = await _get(f"http://127.0.0.1:{agent_port}/metrics")
            ready = f"lanes_llama_requests_processing{{{labels}}}" in text and ("lanes_lane_kv_bytes", on_cpu) in samples(text)
            return text if ready else None

        agent = await eventually(agent_with_lane_series, timeout=30, what="the lane's own series in a scrape")
        assert f"lanes_lane_healthy{{{labels}}} 1.0" in agent
        assert f"lanes_lane_slots{{{labels}}} 1.0" in agent
        threads = lane.argv[lane.argv.index("--threads") + 1]  # the one lane takes every core
        assert f"lanes_lane_threads{{{labels}}} {float(threads)}" in agent
        assert samples(agent)[("lanes_lane_kv_planned_bytes", on_cpu)] == lane.planned_kv_bytes
        assert samples(agent)[("lanes_lane_kv_bytes", on_cpu)] == lane.kv_bytes
        assert f"lanes_llama_requests_processing{{{labels}}}" in agent  # the lane's own series, renamed
        assert "llamacpp:" not in agent
        assert 'lanes_rollouts_halted_total{host="h1"} 0.0' in agent

        # One request through the gateway, so its per-request series exist; then every metric the
        # board and the alert rules name must be among the series the three services export.
        await eventually(lambda: gw.view.routable("llama8"), timeout=30, what="lane routable at the gateway")
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/completions", json={"model": "llama8", "prompt": "hi"}) as answer:
                assert answer.status == 200
        exported = set().union(*(exported_names(text) for text in (planner, agent, await _get(gw.url + "/metrics"))))
        named = deployed_metric_names()
        assert len(named) >= 15 and named <= exported, f"not exported: {sorted(named - exported)}"
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)


DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def deployed_metric_names() -> set[str]:
    """Every lanes_* series named by a Grafana panel query or an alert rule expression."""
    board = json.loads((DEPLOY / "grafana" / "lanes-dashboard.json").read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    assert len(exprs) >= len(board["panels"]) and all(re.search(r"\blanes_", e) for e in exprs)
    rules = (DEPLOY / "prometheus" / "lanes-rules.yml").read_text()
    exprs += re.findall(r"expr: (?:>\n)?((?:.+\n)+?)\s+(?:for|labels):", rules)
    return {name for e in exprs for name in re.findall(r"\b(lanes_[a-z0-9_]+)\b", e)}


def exported_names(text: str) -> set[str]:
    """The series names a /metrics page declares (# TYPE, a family with no sample yet included) or holds."""
    names = {name for name, _ in samples(text)}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names |= {"counter": {name, f"{name}_total"}, "histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count"}}.get(kind, {name})
    return names
