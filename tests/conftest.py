"""Shared pytest fixtures."""

from __future__ import annotations

# --- tiny models ---
# Small GGUF files written once per session with tests/tinymodels.py.
import shutil
import sys
from pathlib import Path

import pytest

# --- tiers ---
# `pytest -m "not slow"` is the work loop (pure, NATS and fake-server tests, under 2 minutes on
# 2 cores); CI runs everything. A test is slow when it runs the real llama-server (its fixture
# or the real Gemma file), network namespaces, a browser, containers, a benchmark, the bus
# fuzzers, the NATS permission suites (their own configured servers), the fault injections or
# `lanes up` as a user does, waits out a timeout by design (lease, liveness), runs services over
# NATS through seconds of a fault by design (a cut-off, a stall, a restart, a rollout, a retry),
# runs several CLI processes in a row or a full-depth projector replay, or reads a simulated fleet
# of thousands of hosts.
SLOW_FIXTURES = frozenset({"llama_server", "gemma_model", "rpc_bin", "topo"})
SLOW_MODULES = frozenset({
    "test_dashboard_browser", "test_netns", "test_slot_moves_netns", "test_compose_live", "test_bench_agent", "test_bench_scripts",
    "test_fuzz", "test_cli_online", "test_auth", "test_gateway_auth", "test_faults", "test_scaling_live",
    "test_rollout_live", "test_bus_cluster",
})  # fmt: skip
SLOW_TESTS = frozenset({
    "test_two_planners_one_plans_and_the_stand_by_takes_over",
    "test_a_dead_host_is_lost_its_lanes_move_and_it_comes_back",
    "test_lanes_up_restarts_its_nats_server_and_exits_in_one_line_when_it_cannot",
    "test_models_load_on_request_evict_the_idle_and_fail_with_the_reason",
    "test_a_planner_killed_while_requests_are_held_the_stand_by_loads_the_model",
    # seconds of a fault or a wait by design (each over 2.5 s on 2 cores)
    "test_gateways_cut_off_from_nats_converge_when_it_comes_back",
    "test_a_lane_whose_inference_loop_stalls_leaves_rotation_and_is_restarted",
    "test_rollout_halts_on_a_breaking_change_and_reverts_the_broken_lane",
    "test_an_agent_publishes_its_lanes_load_and_says_it_whole_when_asked",
    "test_a_secrets_bucket_made_late_still_carries_every_lanes_key",
    "test_lanes_keep_serving_through_nats_restart_and_resync",
    "test_agent_rejects_hostile_plans_and_starts_nothing",
    "test_two_gateways_enforce_one_budget_that_survives_a_restart",
    "test_a_wedged_lane_is_marked_unresponsive_then_restarted_like_a_crash",
    "test_idle_ttl_unloads_a_model_and_a_request_loads_it_back",
    "test_lane_that_cannot_start_is_reported_not_restarted_forever",
    "test_sigusr1_leaves_the_lanes_for_the_next_agent_and_sigterm_stops_them",
    "test_a_report_the_bucket_refused_is_sent_again_within_seconds",
    "test_agent_that_keeps_failing_ends_its_run",
    "test_nats_credentials_and_rights",
    "test_lane_using_more_than_planned_is_replanned_smaller",
    "test_config_and_plan_revisions_count_changes",
    "test_a_rejected_plan_is_fed_back_and_rewritten_newer",
    "test_sigkilled_lane_restarts_with_backoff",
    "test_agent_report_loop_restarts_after_a_failure",
    "test_compose_up_and_down_with_docker",
    "test_compose_up_adds_only_the_missing_passwords_and_gives_up_when_the_gateway_never_answers",
    "test_a_gateway_beyond_loopback_without_keys_refuses_to_start",
    "test_estimate_moe_contract",
    # several CLI processes in a row, or a planner replaying a real model's full-depth projector graph
    # (each over 3 s on 2 cores)
    "test_a_qwen_lane_takes_no_image_larger_than_its_planned_warm_up",
    "test_estimate_puts_the_draft_on_the_devices_devd_names",
    "test_estimate_takes_loras_as_llama_server_does_and_refuses_what_it_cannot_predict",
    "test_estimate_takes_llama_servers_speculative_and_swa_flags",
    "test_the_samples_decode_back_to_what_was_encoded",
    "test_config_change_relaunches_lane_with_quantized_kv",
    # thousands of simulated hosts
    "test_every_page_of_ten_thousand_hosts_is_under_256_kib_and_every_host_comes_once",
    "test_lanes_status_reads_a_thousand_hosts_in_pages",
})  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if (
            SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            or module in SLOW_MODULES
            or item.name.partition("[")[0] in SLOW_TESTS
        ):
            item.add_marker(pytest.mark.slow)


_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
# bench/measure.py (start llama-server until loaded, then stop it) serves the real-binary tests too.
_BENCH_DIR = str(Path(__file__).resolve().parent.parent / "bench")
if _BENCH_DIR not in sys.path:
    sys.path.append(_BENCH_DIR)

import tinymodels  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Paths of generated models: llama8 (8 layers, 8 KV heads x 64), llama_gqa, gemma3, mla."""
    folder = tmp_path_factory.mktemp("tiny_models")
    return {
        "llama8": tinymodels.write_llama(
            folder / "llama8.gguf",
            n_layer=8,
            n_embd=512,
            n_head=8,
            n_head_kv=8,
            head_dim=64,
            n_ctx_train=32768,
        ),
        "llama_gqa": tinymodels.write_llama(folder / "llama_gqa.gguf"),
        "gemma3": tinymodels.write_gemma3(folder / "gemma3.gguf"),
        "mla": tinymodels.write_deepseek2_mla(folder / "mla.gguf"),
    }


@pytest.fixture
def models(tmp_path, tiny_models) -> Path:
    """A model folder holding llama8.gguf."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_models["llama8"], folder / "llama8.gguf")
    return folder


# --- end tiny models ---


# --- the real model: Gemma 3 270M Q4_K_M from the PyPI chunk packages (the test extra) ---
@pytest.fixture(scope="session")
def gemma_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Gemma 3 270M Q4_K_M file (262k vocabulary), assembled and verified once per session."""
    from lanes.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("gemma"))


@pytest.fixture(scope="session")
def llama_server() -> str:
    """The real llama-server binary the end-to-end tests run."""
    from launcher_agent.probe import find_llama_server

    binary = find_llama_server()
    if binary is None:
        pytest.fail("no llama-server: run `lanes install-llama` (scripts/test does) or set LLAMA_SERVER_BIN")
    return binary


@pytest.fixture(scope="session")
def rpc_bin() -> Path:
    """The RPC build of llama.cpp (ggml-rpc-server, llama-server with --rpc), for several devices."""
    from lanes.install_rpc import rpc_bin_dir

    found = rpc_bin_dir()
    if found is None:
        pytest.fail("no RPC build of llama.cpp: run `lanes install-llama --rpc` (scripts/test builds it)")
    return found


# --- end real model ---


# --- real parts: nats-server, fake llama-server, services ---
from fixtures_bus import nats_server  # noqa: E402,F401
