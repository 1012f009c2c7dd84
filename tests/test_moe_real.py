"""Mixture-of-Experts models against the real llama-server, on the CPU and on RPC devices.

Generated qwen3moe (F16 and Q4_0 experts: Q4_0 stacks are repacked on AVX2 CPUs), qwen2moe
(a gated shared expert beside the routed ones), a 152k-vocabulary qwen3moe and gpt-oss
(sliding-window and full layers alternating: two KV caches per device); each case
compares every printed buffer with shared.memory for -ngl all and partial, --n-cpu-moe N,
-ot patterns and splits over two devices: model, KV and output exact, compute within 3% or
4 MiB (the dense models' tolerances, shared.llama.printed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rpc_harness import rpc_servers
from tinymodels import write_gpt_oss, write_moe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from device_bench import Case, run_case  # noqa: E402

from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.memory import placement_for  # noqa: E402


@pytest.fixture(scope="module")
def endpoints(rpc_bin):
    with rpc_servers(rpc_bin, 2) as eps:
        yield eps


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("moe")
    return {
        "qwen3moe": write_moe(folder / "qwen3moe.gguf"),
        "qwen3moe_q4_0": write_moe(folder / "qwen3moe_q4.gguf", expert_type="q4_0"),
        "qwen2moe_shexp": write_moe(folder / "qwen2moe.gguf", arch="qwen2moe"),
        "qwen3moe_v152k": write_moe(folder / "qwen3moe_v152k.gguf", n_layer=6, n_expert=16, n_expert_used=4,
                                    n_vocab=151936),
        "gpt_oss_swa": write_gpt_oss(folder / "gpt_oss.gguf"),
    }  # fmt: skip


CASES = [
    Case(4096, 1, "on", "f16", 0, 0),
    Case(4096, 1, "off", "f16", 0, 0),
    Case(8192, 1, "off", "f16", "all", 1),
    Case(8192, 4, "on", "q8_0", "all", 1),
    Case(8192, 1, "on", "f16", "all", 1, n_cpu_moe=1),
    Case(8192, 1, "off", "f16", "all", 1, n_cpu_moe=2),
    Case(8192, 2, "on", "q8_0", "all", 1, n_cpu_moe=4),
    Case(4096, 1, "on", "f16", 3, 1),
    Case(4096, 1, "off", "f16", 3, 1, n_cpu_moe=1),
    Case(8192, 1, "on", "f16", "all", 2, (1.0, 1.0)),
    Case(8192, 1, "off", "f16", "all", 2, (1.0, 1.0), n_cpu_moe=2),
    Case(8192, 2, "on", "q4_0", "all", 2, (3.0, 1.0), overrides=(r"blk\.[23]\.ffn_.*_exps\.=CPU",)),
    Case(8192, 1, "on", "f16", "all", 1, overrides=("exps=CPU",)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", ["qwen3moe", "qwen3moe_q4_0", "qwen2moe_shexp", "qwen3moe_v152k", "gpt_oss_swa"])
def test_moe_buffers_per_device_equal_the_binary(rpc_bin, endpoints, moe_models, name, case):
    model = moe_models[name]
    facts = read_model_facts(model)
    assert facts.n_expert and len(facts.expert_weights) == facts.n_layer
    result = run_case(rpc_bin, model, facts, case, endpoints)
    assert result["started"], result["error"]
    bad = [c for c in result["checks"] if not c["ok"]]
    assert not bad, bad
    kinds = {(c["device"], c["kind"]) for c in result["checks"]}
    assert ("CPU", "model") in kinds
    placement = placement_for(facts, case.shape())
    assert result["offloaded"] == (placement.offloaded, facts.n_layer + 1)
    if name == "gpt_oss_swa":  # even blocks slide: half the layers in the small cache
        assert facts.swa_layers == (True, False) * (facts.n_layer // 2) and facts.n_swa == 128
    moved = placement.cpu_experts
    if case.n_cpu_moe and case.ngl == "all":
        assert moved == frozenset(range(min(case.n_cpu_moe, facts.n_layer)))
    if moved:  # the experts really left the device: its weights are less than the block's
        cpu = next(c for c in result["checks"] if c["device"] == "CPU" and c["kind"] == "model")
        assert cpu["printed_mib"] * 2**20 >= sum(ew.bytes for ew in facts.expert_weights if ew.layer in moved) - 2**14


@pytest.mark.parametrize("budget_mib", [60, 40])
def test_expert_offload_against_llama_fit_params(rpc_bin, tmp_path, budget_mib):
    """On the same RPC budget: lanes' window at least llama-fit-params', no more expert blocks in
    RAM, both started, neither over the budget (bench/moe_fit_bench.py runs the whole table)."""
    import subprocess

    from moe_fit_bench import fit_choice, run_fit
    from fit_bench import lanes_choice, over, run_lane

    from launcher_agent.hardware import listed_devices
    from shared.llama.logs import MIB

    model = write_moe(tmp_path / "moe8x32.gguf", n_layer=8, n_expert=32, n_expert_used=4, n_ff_exp=256,
                      n_ctx_train=16384)  # fmt: skip
    facts = read_model_facts(model)
    server = str(rpc_bin / "llama-server")
    with rpc_servers(rpc_bin, 1) as eps:
        listed = subprocess.run([server, "--rpc", eps[0], "--list-devices"], capture_output=True, text=True).stdout
        dev = next(d for d in listed_devices(listed) if d[0].startswith("RPC"))
        extra = ["-fa", "on", "-np", "1"]
        fit = fit_choice(rpc_bin, model, eps, [dev[2] // MIB - budget_mib], extra)
        assert "ctx" in fit, fit
        fit.update(run_fit(server, model, eps, fit, extra))
        ours = lanes_choice(server, model, facts, eps, [dev[0]], (budget_mib,), "on", "f16")
        assert "ctx" in ours, ours
        args = ours.pop("args")
        assert "--n-cpu-moe" in args and ours["ngl"] == facts.n_layer + 1  # every layer on the device
        n = int(args[args.index("--n-cpu-moe") + 1])
        ours.update(run_lane(server, args, ours["ctx"], ours["devices"]))
    assert fit["started"] and ours["started"]
    assert not over(ours["used_mib"], [budget_mib]) and not over(fit["used_mib"], [budget_mib])
    assert ours["ctx"] >= fit["ctx"]
    assert n <= len(fit["expert_blocks_in_ram"]), (n, fit["expert_blocks_in_ram"])


def test_estimate_cli_with_experts_in_ram_equals_the_binary(rpc_bin, endpoints, moe_models):
    """`lanes estimate --n-cpu-moe 2 -ot ...` on the RPC build's llama-server: its JSON is what llama-server prints."""
    import json
    import subprocess

    from measure import load_and_stop
    from shared.llama.logs import parse_buffers

    model = moe_models["qwen3moe_q4_0"]
    ot = r"blk\.3\.ffn_.*_exps\.=CPU"
    run = subprocess.run(
        [sys.executable, "-m", "lanes.cli", "estimate", str(model), "--ctx", "8192", "--parallel", "2",
         "--n-gpu-layers", "all", "--gpus", "20GiB,10GiB", "--n-cpu-moe", "2", "-ot", ot, "--ubatch-size", "256",
         "--llama-server", str(rpc_bin / "llama-server"), "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    est = json.loads(run.stdout)
    assert est["flash_attn"] is True  # auto on RPC devices: the CPU's kernels
    loaded = load_and_stop(
        str(rpc_bin / "llama-server"),
        ["-m", str(model), "-c", "8192", "-np", "2", "-ngl", "all", "-ts", "20,10", "--n-cpu-moe", "2", "-ot", ot,
         "-ub", "256", "--rpc", ",".join(endpoints), "-fit", "off"],
    )  # fmt: skip
    assert loaded.ok, loaded.lines[-5:]
    printed = parse_buffers(loaded.lines)
    assert {d["device"] for d in est["devices"]} == {"CPU", "GPU0", "GPU1"}
    for d in est["devices"]:
        for field, kind in (("model_bytes", "model"), ("kv_bytes", "KV"), ("output_bytes", "output")):
            assert round(d[field] / 2**20, 2) == pytest.approx(printed.get(d["device"], kind), abs=0.011), (d, kind)
        shown = printed.get(d["device"], "compute")
        assert abs(d["compute_bytes"] / 2**20 - shown) <= max(4.0, 0.03 * shown), (d, shown)


WIDE_EXPERT_CASES = [
    Case(8192, 1, "on", "f16", "all", 1, n_cpu_moe=1),
    Case(8192, 1, "on", "f16", "all", 1, n_cpu_moe=1, ubatch=256),
    Case(4096, 1, "on", "f16", "all", 1, overrides=("exps=CPU",)),
    Case(8192, 4, "on", "q8_0", "all", 1, n_cpu_moe=4),
    Case(8192, 1, "on", "f16", "all", 2, (1.0, 1.0), n_cpu_moe=2),
]


@pytest.mark.parametrize("case", WIDE_EXPERT_CASES, ids=str)
@pytest.mark.parametrize("shape", ["e8x256", "e4x256_d1024"])
def test_cpu_compute_with_wide_experts_in_ram_equals_the_binary(rpc_bin, endpoints, tmp_path_factory, shape, case):
    """Experts in RAM, every layer on one or two RPC devices: the CPU runs the expert matmuls, and
    its compute buffer holds their input, up, gate, swiglu and down (memory.compute.cpu_expert_peak).
    With 8 experts used of width 256 that is 17 MiB where the graph inputs alone are 10 (the miss
    was 5-7 MiB): compute within the tolerances, weights, KV and output exact."""
    dims = {"e8x256": dict(n_expert=16, n_expert_used=8, n_ff_exp=256),
            "e4x256_d1024": dict(n_embd=1024, n_head=8, n_expert=8, n_expert_used=4, n_ff_exp=256)}[shape]
    model = tmp_path_factory.getbasetemp() / f"moe_{shape}.gguf"
    if not model.exists():
        write_moe(model, **dims)
    facts = read_model_facts(model)
    result = run_case(rpc_bin, model, facts, case, endpoints)
    assert result["started"], result["error"]
    cpu = [c for c in result["checks"] if c["device"] == "CPU"]
    assert {c["kind"] for c in cpu} >= {"model", "output", "compute"}
    bad = [c for c in cpu if not c["ok"]] + [c for c in result["checks"] if c["kind"] != "compute" and not c["ok"]]
    assert not bad, bad
