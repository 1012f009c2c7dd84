"""Each benchmark script runs on a small size (no timing is asserted: that is what bench/ is for)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def test_planner_bench_small(tmp_path):
    out = tmp_path / "planner.md"
    result = run("planner_bench.py", "--small", "--out", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "| 100 | 300 |" in text and "One host's report changing in a fleet of 100" in text


def test_plan_churn_bench_holds_serving_windows(tmp_path):
    out = tmp_path / "churn.json"
    result = run("plan_churn.py", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {(r["scenario"], r["swing"], r["resident"], r["serving_reported"]): r for r in json.loads(out.read_text())}
    for (scenario, swing, resident, serving), r in rows.items():
        if resident < 1 and serving:  # the host keeps its headroom: nothing restarts
            assert r["restarts_per_hour"] == 0 and r["pressed_intervals"] == 0, r
    assert rows[("one 8B lane whose window fills the budget", 0.25, 0.8, False)]["restarts_per_hour"] > 0  # the old rule


def test_slot_move_bench_small(tmp_path, llama_server):
    """A slot saved on one real lane, sent through NATS and restored on another serves the next turn."""
    out = tmp_path / "move.json"
    result = run("slot_move_bench.py", "--tokens", "256", "--runs", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    m = json.loads(out.read_text())["median"]
    assert m["n_restored"] == m["n_saved"] >= 200 and m["moved_cached"] > 0.9 and m["cold_cached"] == 0, m


def test_slots_read_cost_small(tmp_path, llama_server):
    """Simulated gateways read a generating lane's /slots and /health (poll), or its agent reads /slots once
    for them (agent); every figure is there."""
    out = tmp_path / "slots.json"
    result = run("slots_read_cost.py", "--gateways", "0", "3", "--seconds", "2", "--rounds", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {(r["design"], r["gateways"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("poll", 0)]["tokens_per_second"] > 0 and rows[("poll", 0)]["ratio"] == 1.0
    assert rows[("poll", 3)]["reads_per_second"] == 6 and rows[("poll", 3)]["read_ms_p50"] > 0
    assert rows[("agent", 3)]["reads_per_second"] == 2 and rows[("agent", 3)]["read_ms_p50"] > 0
    assert rows[("agent", 3)]["tokens_per_second"] > 0


def test_convergence_bench_small(tmp_path):
    out = tmp_path / "convergence.md"
    result = run("convergence_bench.py", "--agents", "5", "--trials", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "| 5 |" in out.read_text()
    row = json.loads(out.with_suffix(".json").read_text())["rows"][0]
    # Each step seen for every agent, in order; a serving lane's change waits out its drain's grace.
    assert 0 < row["planned"]["max"] <= row["taken"]["max"] < row["applied"]["max"]
    assert row["applied"]["p50"] >= 0.5 and row["bus"]["max"] > 0


def test_kv_bench_quick(tmp_path):
    out = tmp_path / "kv.md"
    result = run("kv_bench.py", "--quick", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "KV size predicted exactly" in text and "Fixed-divisor windows" in text


def test_scan_bench_runs(tiny_models):
    result = run("scan_bench.py", "--model", str(tiny_models["gemma3"]), "--repeats", "1")
    assert result.returncode == 0, result.stderr
    assert "header scan" in result.stdout and "cached (agent restart)" in result.stdout


def test_threads_bench_small(tmp_path, llama_server):
    out = tmp_path / "threads.json"
    result = run("threads_bench.py", "--lanes", "1", "--seconds", "2", "--repeats", "1", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    (row,) = json.loads(out.read_text())["summary"]
    assert set(row["median_tokens_per_s"]) == {"bare", "planned", "default"}


def test_demand_bench_small(tmp_path):
    out = tmp_path / "demand.json"
    result = run("demand_bench.py", "--requests", "12", "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    for policy in ("lanes", "evict_oldest"):
        assert data[policy]["served"] == 12 and data[policy]["aborted"] == 0
    assert data["trace"]["lanes_need_gib"] >= 2 * data["trace"]["fleet_budget_gib"] - 0.1


def test_affinity_bench_small(tmp_path, llama_server):
    out = tmp_path / "affinity.md"
    result = run("affinity_bench.py", "--convs", "3", "--turns", "2", "--system-words", "200", "--out", str(out),
                 timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["affinity"]["requests"] == data["most_free_slots"]["requests"] == data["two_gateways"]["requests"] == 6
    assert "cached-token ratio, turns 2+" in out.read_text()


def test_loop_lag_bench_agent_small(tmp_path):
    out = tmp_path / "lag.json"
    result = run("loop_lag_bench.py", "agent", "--models", "20", "--rescans", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["models"] == 20 and data["loop_lag"]["samples"] > 0


def test_gateway_loop_lag_small(tmp_path):
    out = tmp_path / "lag.json"
    result = run("gateway_loop_lag.py", "--streams", "4", "--seconds", "3", "--tokens", "10", "--out", str(out))
    assert result.returncode == 0, result.stderr
    found = json.loads(out.read_text())
    assert found["streams"] == 4 and found["failed"] == 0 and found["streams_done"] >= 4
    assert found["loaded"]["samples"] > 0 and found["loaded"]["p99_ms"] >= found["loaded"]["p50_ms"]


def test_chaos_bench_short(tmp_path):
    """Five kills (one of each kind) in a short run: the report's figures are there and hold."""
    out, data = tmp_path / "chaos.md", tmp_path / "chaos.json"
    result = run("chaos_bench.py", "--seconds", "18", "--every", "3", "--down", "1", "--out", str(out),
                 "--json", str(data), "--work", str(tmp_path), timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(data.read_text())
    assert sorted({k["kind"] for k in r["kills"]}) == ["agent", "gateway", "lane", "nats", "planner"], r["kills"]
    assert r["requests"] > 0 and r["failed_otherwise"] == [], r
    assert r["orphans"] == {"llama-server": 0, "ggml-rpc-server": 0, "nats-server": 0}
    assert r["services_that_exited_on_their_own"] == {}, r
    assert r["plan_revisions_down"] == [] and r["plan_entries_watched"] > 3 and r["plans_follow_the_last_config"], r
    assert "RSS at start" in out.read_text()


def test_fairness_bench_small(tmp_path, llama_server):
    out = tmp_path / "fairness.md"
    result = run("fairness_bench.py", "--seconds", "3", "--heavy", "2", "--max-tokens", "4", "--out", str(out),
                 timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert set(data) >= {"capacity", "alone", "fifo", "fair", "shed", "checks"}
    assert data["shed"]["light"]["refused"] == 0 and data["fair"]["light"]["requests"] >= 1
    assert "| fair | light |" in out.read_text()
def test_spec_bench_small(tmp_path, llama_server):
    out = tmp_path / "spec.json"
    result = run("spec_bench.py", "--skip-gemma", "--rounds", "1", "--tokens", "8", "--out", str(out))
    assert result.returncode == 0, result.stderr
    pair = json.loads(out.read_text())["pair"]
    assert [r["spec"] for r in pair] == ["none", "draft-simple"]
    drafted = pair[1]
    assert drafted["tasks"]["free"]["drafted"] > 0  # the draft model drafted
    for kind in ("model", "KV", "output"):  # planned as printed, the draft's lines included
        assert abs(drafted["planned"][kind] - drafted["printed"][kind]) <= 0.011


def test_spec_bench_by_busy_slots_small(tmp_path, gemma_model, llama_server):
    """The busy-slot mode: a gain per speculator and slot count, against none at the same count."""
    out = tmp_path / "slots.json"
    result = run("spec_bench.py", "--slots", "1,2", "--specs", "ngram-simple", "--rounds", "1", "--tokens", "8",
                 "--out", str(out), timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(out.read_text())
    assert {(r["spec"], r["slots"]) for r in got["rows"]} == {(s, n) for s in ("none", "ngram-simple") for n in (1, 2)}
    assert set(got["gains"]["ngram-simple"]) == {"1", "2"}
    assert all(copy > 0 and free > 0 for copy, free in got["gains"]["ngram-simple"].values())


def test_ttfb_profile_small():
    """The gateway's added first byte against a stub lane (it hung once: its requests waited for a fleet
    the bench never marked read)."""
    result = run("ttfb_profile.py", "--rounds", "20", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "added (median of paired differences)" in result.stdout


def test_route_cost_bench_small():
    result = run("route_cost_bench.py", "--requests", "200", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "routing per request p50" in result.stdout


def test_hostile_clients_small(tmp_path, llama_server):
    """Every hostile case answered as it should be (4xx with a reason, a closed connection for a
    client too slow), the lane healthy and the gateway running at the end (the script exits 1 otherwise)."""
    out = tmp_path / "hostile.md"
    result = run("hostile_clients.py", "--small", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert len(cases) >= 20 and all(c["ok"] for c in cases), cases
    by_name = {c["case"].split(" (")[0]: c for c in cases}
    assert by_name["slow headers"]["closed"] and by_name["slow body"]["status"] == 408
    assert by_name["n_probs 1,000,000"]["code"] == "out_of_range"


def test_router_bench_small(tmp_path, llama_server):
    """lanes (as shipped and with the router's 4 slots) and llama-server's router mode answer every
    request of each trace, and every figure of the table is there."""
    out = tmp_path / "router.json"
    result = run("router_bench.py", "--small", "--json", str(out), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["side"], r["trace"]) for r in rows} == {
        (side, trace) for side in ("lanes", "lanes-4slots", "router") for trace in ("steady", "mix", "conversations")
    }
    for r in rows:
        assert r["failed"] == 0 and r["answered"] > 0, r
        assert r["ttft_p50_s"] > 0 and r["output_tok_s"] > 0 and r["peak_llama_rss_mib"] > 0, r
        if r["trace"] == "mix":
            assert r["cold_ttft_s"] > 0, r
        if r["trace"] == "conversations":
            assert r["cached_ratio"] > 0, r  # the shared system prompt is reused
    assert all(r["models_max"] == 2 for r in rows if r["side"] == "router")


def test_door_bench_small(tmp_path, llama_server):
    """Every path of the door's bench answers on a real lane, and every figure is there."""
    out = tmp_path / "door.json"
    result = run("door_bench.py", "--small", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(out.read_text())
    one = got["one_stream"]
    for path in ("direct", "floor", "gateway", "gateway_pooled"):
        assert one[f"{path}_p50_ms"] > 0, one
    assert one["gateway_own_p50_ms"] is not None and 0 < one["gateway_own_p50_ms"] < one["gateway_p50_ms"], one
    for streams in ("streams_8", "streams_64"):
        assert got[streams]["ratio"] > 0 and got[streams]["gateway_cpu_ms_per_request"] > 0, got[streams]
    assert got["gateway_idle_cpu_percent"] >= 0


def test_gateway_scale_bench_small(tmp_path):
    out = tmp_path / "scale.json"
    result = run("gateway_scale.py", "--hosts", "20", "100", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {r["hosts"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[100]["lanes"] == 300 and rows[100]["routing_decisions_per_s"] > 0 and rows[100]["view_mib"] > 0
    assert rows[100]["lanes_probed_per_round"] <= 64


def test_gateway_idle_bench_small(tmp_path):
    """A real gateway process reads a simulated 50-host bucket; every figure is there."""
    out = tmp_path / "idle.json"
    result = run("gateway_idle.py", "--hosts", "50", "--seconds", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["hosts"] == 50 and row["rss_mib"] > 0 and row["read_s"] > 0 and row["agent_messages_per_s"] > 0


def test_dashboard_scale_bench_small(tmp_path):
    """The dashboard of a simulated fleet in headless Chromium: painted, searched, every figure there."""
    out = tmp_path / "dashboard.json"
    result = run("dashboard_scale.py", "--hosts", "120", "--runs", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    row = json.loads(out.read_text())["row"]
    assert row["hosts"] == 120 and row["first_paint_s_median"] > 0 and row["filtered_s_median"] > 0
    assert 0 < row["state_kib"] < 256 and row["heap_mib_median"] > 0


def test_fleet_scale_bench_small(tmp_path):
    """On a 3-node cluster with a real planner, gateway and CLI: every figure there, every host
    planned, replanned by a config change, read by the gateway and found by the dashboard."""
    out = tmp_path / "fleet.json"
    result = run("fleet_scale.py", "--hosts", "40", "--idle-seconds", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["hosts"] == 40 and row["lanes"] == 120 and row["planned_s"] > 0 and row["config_to_every_plan_s"] > 0
    assert 0 < row["largest_value_bytes"] <= 256 * 1024 and 0 < row["status_json_bytes"] <= 256 * 1024
    assert row["gateway_rss_mib"] > 0 and row["dashboard_page_bytes"] > 0 and row["dashboard_search_ms"] > 0
