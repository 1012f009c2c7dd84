"""Every buffer on every device, against the real llama-server with RPC devices (no GPU needed).

The RPC build (`lanes install-llama --rpc`, scripts/test builds it) serves ggml-rpc-server
processes on loopback as GPU0..GPU2. Each case loads the model, reads llama-server's -lv 4
buffer lines and compares them with the memory model for the same spec: model, KV and
output exact, compute within 3% or 4 MiB; real Gemma 3 270M and synthetic 128k-262k vocabularies.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rpc_harness import rpc_servers
from tinymodels import write_gemma3, write_llama

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from device_bench import Case, run_case  # noqa: E402

from shared.gguf_facts import read_model_facts  # noqa: E402
from shared.llama.logs import parse_buffers  # noqa: E402
from shared.memory import placement_for  # noqa: E402


@pytest.fixture(scope="session")
def endpoints(rpc_bin):
    with rpc_servers(rpc_bin, 3) as eps:
        yield eps


@pytest.fixture(scope="session")
def big_vocab_models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("big_vocab")
    return {
        "llama262k": write_llama(folder / "llama262k.gguf", n_layer=6, n_embd=128, n_head=2, n_head_kv=1,
                                 head_dim=64, n_ff=256, n_vocab=262144, n_ctx_train=65536),
        "gemma3_128k_tied": write_gemma3(folder / "gemma3_128k.gguf", n_layer=6, n_embd=128, n_head=2, n_head_kv=1,
                                         head_dim=64, n_ff=256, n_vocab=131072, n_ctx_train=65536),
    }  # fmt: skip


def _check(rpc_bin, endpoints, model: Path, case: Case) -> None:
    facts = read_model_facts(model)
    result = run_case(rpc_bin, model, facts, case, endpoints)
    assert result["started"], result["error"]
    bad = [c for c in result["checks"] if not c["ok"]]
    assert not bad, bad
    kinds = {(c["device"], c["kind"]) for c in result["checks"]}
    assert ("CPU", "model") in kinds and ("CPU", "output") in kinds
    expected = placement_for(facts, case.shape())
    assert result["offloaded"] == (expected.offloaded, facts.n_layer + 1)
    for i in range(case.n_devices):
        layers = expected.layers_on(i)
        if layers:
            assert (f"GPU{i}", "model") in kinds, result["checks"]
        if any(il < facts.n_layer for il in layers):  # the output layer alone has no KV
            assert (f"GPU{i}", "KV") in kinds, result["checks"]


SYNTHETIC_CASES = [
    Case(4096, 1, "on", "f16", 0, 0),
    Case(8192, 1, "off", "f16", "all", 1),
    Case(8192, 4, "on", "q8_0", 3, 1),
    Case(4096, 2, "on", "q4_0", "all", 2, (3.0, 1.0)),
    Case(16384, 1, "off", "f16", 4, 2),
    Case(8192, 3, "on", "q8_0", "all", 3, (1.0, 2.0, 1.0)),
]


@pytest.mark.parametrize("case", SYNTHETIC_CASES, ids=str)
@pytest.mark.parametrize("name", ["llama262k", "gemma3_128k_tied"])
def test_synthetic_large_vocab_per_device(rpc_bin, endpoints, big_vocab_models, name, case):
    _check(rpc_bin, endpoints, big_vocab_models[name], case)


GEMMA_CASES = [
    Case(32768, 1, "on", "f16", 0, 0),
    Case(2048, 1, "off", "f16", 10, 1),  # partial: output + 9 blocks on GPU0, tied output duplicated there
    Case(32768, 4, "on", "q8_0", "all", 2, (1.0, 1.0)),
    Case(8192, 2, "on", "q4_0", 12, 3, (2.0, 1.0, 1.0)),
    # flash attention off, K q8_0 / V f16, pipelined over two devices: the CPU holds the K rotation
    # inputs (one per cache, per pipeline copy: memory.compute.rotation_inputs); 5 MiB low without
    Case(8192, 4, "off", "q8_0", "all", 2, (1.0, 1.0), cache_v="f16"),
    Case(16384, 4, "off", "q8_0", "all", 2, (3.0, 1.0), cache_v="f16"),
    # --swa-full (planner_svc/swa_full.py): the sliding-window layers cache the whole window
    Case(8192, 2, "on", "f16", 0, 0, swa_full=True),
    Case(4096, 2, "off", "f16", "all", 2, (1.0, 1.0), swa_full=True),
]


@pytest.mark.parametrize("case", GEMMA_CASES, ids=str)
def test_real_gemma_per_device(rpc_bin, endpoints, gemma_model, case):
    _check(rpc_bin, endpoints, gemma_model, case)


def test_estimate_cli_equals_the_binary(rpc_bin, endpoints, gemma_model):
    """`lanes estimate --llama-server` with --gpus names the RPC devices: its JSON is what llama-server prints."""
    from measure import load_and_stop

    run = subprocess.run(
        [sys.executable, "-m", "lanes.cli", "estimate", str(gemma_model), "--ctx", "8192", "--parallel", "2",
         "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--flash-attn", "on", "--n-gpu-layers", "12",
         "--gpus", "20GiB,10GiB", "--llama-server", str(rpc_bin / "llama-server"), "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    est = json.loads(run.stdout)
    loaded = load_and_stop(
        str(rpc_bin / "llama-server"),
        ["-m", str(gemma_model), "-c", "8192", "-np", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-ngl", "12",
         "-ts", "20,10", "--rpc", ",".join(endpoints[:2]), "-fit", "off"],
    )  # fmt: skip
    assert loaded.ok, loaded.lines[-5:]
    printed = parse_buffers(loaded.lines)
    for d in est["devices"]:
        for field, kind in (("model_bytes", "model"), ("kv_bytes", "KV"), ("output_bytes", "output")):
            assert round(d[field] / 2**20, 2) == pytest.approx(printed.get(d["device"], kind), abs=0.011), (d, kind)
        assert abs(d["compute_bytes"] / 2**20 - printed.get(d["device"], "compute")) <= max(
            4.0, 0.03 * printed.get(d["device"], "compute")
        )
    assert est["kv_bytes"] == sum(d["kv_bytes"] for d in est["devices"])

