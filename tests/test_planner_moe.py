"""Expert offload planned: a Mixture-of-Experts model too big for the GPU keeps every layer there
with the experts of the first N blocks in RAM (--n-cpu-moe N, the smallest N that fits at the
floor window), between "split over GPUs" and "partial offload". Pure: host reports in, plans out."""

from __future__ import annotations

import msgspec
import pytest
from test_planner import GIB, MIB, check_invariants, host, llama_8b, only_lane
from test_planner_devices import arg, gpu

from planner_svc.lane_windows import PlannedLane
from planner_svc.layouts import GPU_CONTEXT_BYTES, Layout, cost_vector, describe, rank
from planner_svc.planner import plan
from planner_svc.policy import Flags
from shared.messages.config import FleetConfig, Persona
from shared.messages.hosts import LayerWeights, ModelFacts, ServerCaps

EXPERTS = 330 * MIB  # per block: 128 experts x 768 x 2048 x 3 matrices at about 4.5 bits
DENSE = 20 * MIB  # per block: attention, norms, router


def qwen3_30b_a3b(name: str = "qwen3-30b-a3b") -> ModelFacts:
    """Qwen3-30B-A3B-like: 48 blocks of 350 MiB, 330 MiB of them experts; 300 MiB embeddings/output."""
    layers, experts, offset = [LayerWeights(-1, 300 * MIB, 300 * MIB, 0, 300 * MIB)], [], 300 * MIB
    for il in range(48):
        layers.append(LayerWeights(il, DENSE + EXPERTS, DENSE + EXPERTS, offset, offset + DENSE + EXPERTS))
        experts.append(LayerWeights(il, EXPERTS, EXPERTS, offset + DENSE, offset + DENSE + EXPERTS))
        offset += DENSE + EXPERTS
    layers.append(LayerWeights(48, 300 * MIB, 300 * MIB, offset, offset + 300 * MIB))
    total = offset + 300 * MIB
    return ModelFacts(
        path=f"/models/{name}.gguf", name=name, architecture="qwen3moe", n_layer=48, n_embd=2048, n_head=32,
        n_head_kv=(4,) * 48, head_dim_k=128, head_dim_v=128, n_ctx_train=40960, n_vocab=151936, n_ff=6144,
        weight_bytes=total, file_bytes=total, layer_weights=tuple(layers), n_expert=128, n_expert_used=8,
        n_ff_exp=768, expert_weights=tuple(experts),
    )  # fmt: skip


def _probe_cost(report, lane, n_cpu_moe: int):
    probe = PlannedLane(report.host_id, Persona(model=lane.model), qwen3_30b_a3b(), 0, Flags(None, None, None, ()),
                          Layout("gpu", lane.gpu_devices, (), "all", n_cpu_moe), 2048, 40960, 1.0)  # fmt: skip
    return cost_vector(probe.memory(2048, report, 512), probe.layout, report)


def test_moe_too_big_for_the_gpu_keeps_every_layer_there_with_the_first_experts_in_ram():
    report = host(gpus=(gpu(0, 16, 15.5),), models=(qwen3_30b_a3b(),), ram_available=60 * GIB)
    fleet = plan([report], FleetConfig())
    check_invariants(fleet, [report])
    lane = only_lane(fleet)
    n = lane.n_cpu_moe
    assert 0 < n < 48 and lane.n_gpu_layers == 49 and lane.layout.n_cpu_moe == n
    assert arg(lane, "--n-cpu-moe") == str(n) and arg(lane, "--n-gpu-layers") == "49"
    assert any(f"--n-cpu-moe {n}" in r and "in RAM" in r for r in lane.reasons), lane.reasons
    cpu, gpu0 = lane.memory.devices
    assert cpu.layers == 0 and gpu0.layers == 49
    assert cpu.model_bytes >= n * EXPERTS  # the RAM side is charged to the host
    budget = fleet.hosts[0].budget_gpus[0]
    assert gpu0.total + GPU_CONTEXT_BYTES["cuda"] <= budget
    # the smallest N: one block fewer in RAM would not fit the GPU at the floor window
    assert _probe_cost(report, lane, n - 1)[("gpu", 0)] > budget


def test_expert_offload_ranks_between_split_and_partial_and_plain_models_never_get_it():
    assert rank(Layout("split", (0, 1), (1, 1), "all")) < rank(Layout("gpu", (0,), (), "all", 3))
    assert rank(Layout("gpu", (0,), (), "all", 3)) < rank(Layout("partial", (0,), (), 20))
    assert "experts of blocks 0-2 in RAM (--n-cpu-moe 3)" in describe(Layout("gpu", (0,), (), "all", 3), 48)
    # a dense model that does not fit gets partial offload, never --n-cpu-moe
    lane = only_lane(plan([host(gpus=(gpu(0, 3, 2.5),), models=(llama_8b(),))], FleetConfig()))
    assert lane.n_cpu_moe == 0 and "--n-cpu-moe" not in lane.args and 0 < lane.n_gpu_layers < 33


def test_split_beats_expert_offload_and_expert_offload_beats_partial():
    moe = qwen3_30b_a3b()
    # two 16 GiB GPUs hold it whole: a split, no experts in RAM
    lane = only_lane(plan([host(gpus=(gpu(0, 16, 15.5), gpu(1, 16, 15.5)), models=(moe,))], FleetConfig()))
    assert lane.layout.kind == "split" and lane.n_cpu_moe == 0
    # an 8 GiB GPU: attention and dense weights fit, most experts go to RAM; still every layer on it
    lane = only_lane(plan([host(gpus=(gpu(0, 8, 7.5),), models=(moe,), ram_available=60 * GIB)], FleetConfig()))
    assert lane.n_gpu_layers == 49 and 24 < lane.n_cpu_moe <= 48
    # too little RAM for the experts: the expert layout does not fit the host, partial or nothing
    fleet = plan([host(gpus=(gpu(0, 8, 7.5),), models=(moe,), ram_available=6 * GIB)], FleetConfig())
    assert all(s.n_cpu_moe == 0 for hp in fleet.hosts for s in hp.lanes)


def test_a_build_without_n_cpu_moe_gets_partial_offload():
    caps = ServerCaps(has_n_cpu_moe=False)
    lane = only_lane(plan([host(gpus=(gpu(0, 16, 15.5),), models=(qwen3_30b_a3b(),), server=caps,
                                ram_available=60 * GIB)], FleetConfig()))  # fmt: skip
    assert lane.n_cpu_moe == 0 and 0 < lane.n_gpu_layers < 49


def test_expert_layout_survives_the_wire_and_a_replan_keeps_it():
    report = host(gpus=(gpu(0, 16, 15.5),), models=(qwen3_30b_a3b(),), ram_available=60 * GIB)
    first = plan([report], FleetConfig())
    again = plan([report], FleetConfig(), previous={hp.host_id: hp for hp in first.hosts})
    assert msgspec.json.encode(first) == msgspec.json.encode(again)
    assert only_lane(again).n_cpu_moe == only_lane(first).n_cpu_moe > 0


@pytest.mark.parametrize("free", [12.0, 10.0, 6.0])
def test_more_vram_never_means_more_experts_in_ram(free):
    moe = qwen3_30b_a3b()
    less = only_lane(plan([host(gpus=(gpu(0, 16, free),), models=(moe,), ram_available=60 * GIB)], FleetConfig()))
    more = only_lane(plan([host(gpus=(gpu(0, 16, free + 2),), models=(moe,), ram_available=60 * GIB)], FleetConfig()))
    assert more.n_cpu_moe <= less.n_cpu_moe


def test_gpu_lanes_say_how_flash_attention_auto_resolves():
    from shared.messages.hosts import GpuInfo

    cuda = only_lane(plan([host(gpus=(gpu(0, 24, 23),))], FleetConfig()))
    assert any("flash attention auto resolves to on (cuda" in r for r in cuda.reasons), cuda.reasons
    vulkan = only_lane(plan([host(gpus=(GpuInfo(name="v", vram_total=24 * GIB, vram_free=23 * GIB, backend="vulkan",
                                                 device="Vulkan0"),))], FleetConfig()))  # fmt: skip
    assert any("resolves to off on vulkan" in r for r in vulkan.reasons), vulkan.reasons
    # the compute buffer follows: the same lane planned with FA on has a smaller one, so a larger window fits
    assert cuda.memory.compute_bytes < vulkan.memory.compute_bytes


def test_a_file_without_a_chat_template_gets_the_built_in_one_of_its_architecture():
    gemma = llama_8b("gemma-3-4b", architecture="gemma3", n_vocab=262144, has_chat_template=False)
    lane = only_lane(plan([host(models=(gemma,))], FleetConfig()))
    assert lane.chat_template == "gemma"
    at = lane.args.index("--chat-template")
    assert lane.args[at - 1: at + 2] == ("--no-jinja", "--chat-template", "gemma")
    assert any("chat template gemma (gemma3)" in r and "ChatML" in r for r in lane.reasons), lane.reasons
    # its own template wins; a qwen file without one keeps ChatML, and says so
    assert only_lane(plan([host(models=(llama_8b(),))], FleetConfig())).chat_template is None
    qwen = llama_8b("qwen3-8b", architecture="qwen3", n_vocab=151936, has_chat_template=False)
    lane = only_lane(plan([host(models=(qwen,))], FleetConfig()))
    assert lane.chat_template is None and "--chat-template" not in lane.args
    assert any("ChatML fallback" in r for r in lane.reasons)
    # a llama-server without --chat-template: no flag, and the reason says why
    lane = only_lane(plan([host(models=(gemma,), server=ServerCaps(has_chat_template=False))], FleetConfig()))
    assert lane.chat_template is None and any("no --chat-template" in r for r in lane.reasons)
