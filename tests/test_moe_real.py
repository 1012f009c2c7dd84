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

from lanes.install_rpc import rpc_bin_dir  # noqa: E402
from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.memory import placement_for  # noqa: E402


@pytest.fixture(scope="session")
def rpc_bin() -> Path:
    found = rpc_bin_dir()
    if found is None:
        pytest.fail("no RPC build of llama.cpp: run `lanes install-llama --rpc` (scripts/test does)")
    return found


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
