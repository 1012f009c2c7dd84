"""The projector per device against the real llama-server with an RPC device (no GPU needed): with
--mmproj-offload its weights and compute land on the lane's first device and the warm-up image
(a graph input) in host RAM; with --no-mmproj-offload all in host RAM. The planned bytes per device
are the printed ones (clip prints the weights unpadded: the plan holds each tensor's padding)."""

from __future__ import annotations

import msgspec
import pytest
from record_llama_figures import run_until_loaded
from record_projector_figures import measure_largest
from rpc_harness import rpc_servers
from tinymodels import write_llama
from tinyprojectors import IDEFICS3_TOKENS, write_projector

from shared.gguf_facts import read_model_facts
from shared.gguf_projector import projector_facts
from shared.llama.logs import devices_from_lines
from shared.memory import LaneShape, lane_memory

MIB = 2**20
CASES = [  # (projector type, n_embd, n_ff, image size, offload)
    ("gemma3", 128, 256, 224, True),
    ("gemma3", 256, 1024, 448, True),
    ("gemma3", 256, 1024, 448, False),
    ("idefics3", 192, 768, 448, True),
    ("idefics3", 192, 768, 448, False),
    ("internvl", 192, 768, 448, True),
    ("internvl", 128, 256, 224, False),
]


@pytest.fixture(scope="module")
def endpoint(rpc_bin):
    with rpc_servers(rpc_bin, 1) as eps:
        yield eps[0]


def _printed(rpc_bin, endpoint: str, model, path, offload: bool, *extra: str) -> dict[str, int]:
    """The projector's bytes per device, as the real llama-server printed them with one RPC device."""
    lines = run_until_loaded([str(rpc_bin / "llama-server"), "-m", str(model), "--mmproj", str(path), "--rpc", endpoint,
                              "-ngl", "all", "-c", "512", "-fit", "off", "--flash-attn", "on", "--verbosity", "4",
                              "--port", "0", "--mmproj-offload" if offload else "--no-mmproj-offload", *extra])  # fmt: skip
    assert any("CLIP using" in line for line in lines), lines[-5:]
    return {d.device: d.projector_bytes for d in devices_from_lines(lines)}


def _planned_as_printed(model, proj, printed: dict[str, int], offload: bool) -> dict[str, int]:
    """The lane's projector bytes per device (one RPC device), checked against what was printed: the
    holder's compute and weights (clip prints them unpadded), the other's (host RAM holds the input when
    the projector is on the device). The per-device plan, for the caller's own checks."""
    planned = lane_memory(msgspec.structs.replace(read_model_facts(model), mmproj=proj), LaneShape(
        ctx=512, flash_attn=True, mmproj=True, mmproj_offload=offload, n_gpu_layers="all", devices=("rpc",)))  # fmt: skip
    by_device = {d.device: d.projector_bytes for d in planned.devices}
    holder, other = ("GPU0", "CPU") if offload else ("CPU", "GPU0")
    padding = proj.weight_bytes - proj.file_weight_bytes
    assert abs(by_device[holder] - padding - printed[holder]) <= 0.01 * MIB, (by_device, printed)
    assert abs(by_device[other] - printed.get(other, 0)) <= 0.005 * MIB, (by_device, printed)
    return by_device


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_projector_bytes_per_device_are_the_printed_ones(rpc_bin, endpoint, tmp_path, case):
    proj_type, n_embd, n_ff, image, offload = case
    model = write_llama(tmp_path / "m.gguf", special=IDEFICS3_TOKENS)
    path = write_projector(tmp_path / "mmproj-m.gguf", proj_type=proj_type, n_embd=n_embd, n_ff=n_ff, image_size=image,
                           patch_size=16 if proj_type == "idefics3" else 14)  # fmt: skip
    proj = projector_facts(path)
    assert 0 <= proj.weight_bytes - proj.file_weight_bytes < 32 * 64
    by_device = _planned_as_printed(model, proj, _printed(rpc_bin, endpoint, model, path, offload), offload)
    assert by_device["CPU" if offload else "GPU0"] == (image * image * 3 * 4 if offload else 0)


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "host"])
def test_llavas_projector_per_device_is_the_printed_bytes(rpc_bin, endpoint, tmp_path, offload):
    """LLaVA's (type mlp, its graph replayed: shared/memory/llava_graph.py) on an RPC device or in host
    RAM: the holder's plan is what was printed; the warm-up image in host RAM."""
    model = write_llama(tmp_path / "m.gguf", n_embd=2048)
    path = write_projector(tmp_path / "mmproj-m.gguf", proj_type="mlp", text_embd=2048, n_embd=256, n_ff=768,
                           n_head=2, n_layer=3, image_size=336)  # fmt: skip
    printed = _printed(rpc_bin, endpoint, model, path, offload)
    proj = projector_facts(path)
    assert proj.projector_type == "mlp" and proj.n_mmproj_embd == 2048
    _planned_as_printed(model, proj, printed, offload)


def test_a_qwen_projector_capped_at_its_warm_up_image_reserves_what_is_planned(rpc_bin, endpoint, tmp_path):
    """--image-max-tokens 2116, as the plan renders it for Qwen2-VL's family: the binary takes it,
    warms up the same image, and its projector on the RPC device is what the plan replays."""
    model = write_llama(tmp_path / "m.gguf")
    path = write_projector(tmp_path / "mmproj-m.gguf", proj_type="qwen2vl_merger", n_embd=64, n_ff=128, n_head=2,
                           image_size=560)  # fmt: skip
    capped = _printed(rpc_bin, endpoint, model, path, True, "--image-max-tokens", str(46 * 46))
    assert capped == _printed(rpc_bin, endpoint, model, path, True)
    proj = projector_facts(path)
    planned = lane_memory(msgspec.structs.replace(read_model_facts(model), mmproj=proj), LaneShape(
        ctx=512, flash_attn=True, mmproj=True, mmproj_offload=True, n_gpu_layers="all", devices=("rpc",)))  # fmt: skip
    by_device = {d.device: d.projector_bytes for d in planned.devices}
    padding = proj.weight_bytes - proj.file_weight_bytes
    assert abs(by_device["GPU0"] - padding - capped["GPU0"]) <= 0.01 * MIB, (by_device, capped)
    assert abs(by_device["CPU"] - capped.get("CPU", 0)) <= 0.01 * MIB, (by_device, capped)


def test_pixtrals_buffer_after_its_largest_image_is_within_the_plan(rpc_bin, tmp_path):
    """Pixtral on an RPC device whose server logs each buffer: the lane at --image-max-tokens 1024, as
    the plan renders it, is sent an image one token wide (the largest it takes, scaled to 1,024 rows);
    the buffer grows past the warm-up's to at most the planned compute, and within 1% of it."""
    model = write_llama(tmp_path / "m.gguf", n_embd=1024)
    path = write_projector(tmp_path / "mmproj-m.gguf", proj_type="pixtral", text_embd=1024, n_embd=192, n_ff=384,
                           n_head=4, n_layer=2, image_size=1024, patch_size=16, scale_factor=1)  # fmt: skip
    got = measure_largest(rpc_bin, model, path, "on", 1024, (1, 1024))
    assert "error" not in got and got["grew"] and got["image_batch_tokens"] == 2047, got
    proj = projector_facts(path)
    planned = lane_memory(msgspec.structs.replace(read_model_facts(model), mmproj=proj), LaneShape(
        ctx=512, flash_attn=True, mmproj=True, mmproj_offload=True, n_gpu_layers="all", devices=("rpc",)))  # fmt: skip
    compute = {d.device: d.projector_bytes for d in planned.devices}["GPU0"] - proj.weight_bytes
    assert got["largest_bytes"] <= compute <= got["largest_bytes"] * 1.01, (compute / MIB, got["largest_bytes"] / MIB)
    assert got["warmup_compute_mib"]["RPC0"] * MIB < got["largest_bytes"]  # the warm-up's (256 tokens) is smaller


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "host"])
@pytest.mark.parametrize("proj_type", ["qwen2a", "ultravox", "voxtral"])
def test_an_audio_projector_per_device_is_the_printed_bytes(rpc_bin, endpoint, tmp_path, offload, proj_type):
    """Whisper-encoder audio projectors (Qwen2-Audio's fc head, Ultravox's frame stack of 8 and SwiGLU,
    Voxtral's stack of 4 and GELU MLP) over a 30 s chunk: the agent reads the head's facts from the
    file; weights and compute on the RPC device or in host RAM as printed; with offload the chunk's mel
    frames (f32) stay in host RAM."""
    from tinyaudio import write_audio_projector

    model = write_llama(tmp_path / "m.gguf", n_embd=1024)
    path = write_audio_projector(tmp_path / "mmproj-m.gguf", proj_type=proj_type, text_embd=1024, n_embd=384,
                                 n_ff=1536, n_head=6, n_layer=2, n_mel=80)  # fmt: skip
    printed = _printed(rpc_bin, endpoint, model, path, offload)
    proj = projector_facts(path)
    assert (proj.audio, proj.vision, proj.n_mel_bins, proj.n_embd, proj.n_mmproj_embd) == (True, False, 80, 384, 1024)
    assert proj.stack_factor == {"qwen2a": 0, "ultravox": 8, "voxtral": 4}[proj_type]
    by_device = _planned_as_printed(model, proj, printed, offload)
    assert by_device["CPU" if offload else "GPU0"] == (80 * 3000 * 4 if offload else 0)


def test_a_projector_on_the_device_mmdev_names_is_planned_there(rpc_bin, tmp_path):
    """Two RPC devices and -mmdev RPC1: the projector's weights and compute land on the second, as
    the plan with mmproj_device=1 puts them; the first holds none of it."""
    model = write_llama(tmp_path / "m.gguf")
    path = write_projector(tmp_path / "mmproj-m.gguf", proj_type="gemma3", n_embd=256, n_ff=1024, image_size=448)
    with rpc_servers(rpc_bin, 2) as eps:
        lines = run_until_loaded([str(rpc_bin / "llama-server"), "-m", str(model), "--mmproj", str(path), "--rpc",
                                  ",".join(eps), "-ngl", "all", "-c", "512", "-fit", "off", "--flash-attn", "on",
                                  "--verbosity", "4", "--port", "0", "-mmdev", "RPC1"])  # fmt: skip
    assert any("CLIP using" in line for line in lines), lines[-5:]
    printed = {d.device: d.projector_bytes for d in devices_from_lines(lines)}
    proj = projector_facts(path)
    planned = lane_memory(msgspec.structs.replace(read_model_facts(model), mmproj=proj), LaneShape(
        ctx=512, flash_attn=True, mmproj=True, mmproj_offload=True, mmproj_device=1, n_gpu_layers="all",
        devices=("rpc", "rpc")))  # fmt: skip
    by_device = {d.device: d.projector_bytes for d in planned.devices}
    padding = proj.weight_bytes - proj.file_weight_bytes
    assert printed["GPU1"] > 0 and printed.get("GPU0", 0) == 0 == by_device["GPU0"], (printed, by_device)
    assert abs(by_device["GPU1"] - padding - printed["GPU1"]) <= 0.01 * MIB, (by_device, printed)
    assert abs(by_device["CPU"] - printed.get("CPU", 0)) <= 0.005 * MIB, (by_device, printed)


def test_gemma3ns_projector_is_planned_as_the_binary_allocates_it(rpc_bin, endpoint, tmp_path):
    """Gemma 3n's MobileNetV5 (a generated projector at 1/8 of its widths) on an RPC device: the agent
    reads the file and replays its graph (ProjectorFacts.graph_compute_bytes); the lane's plan puts the
    weights and that buffer on the device, to the printed figure, and the 768 x 768 image in host RAM."""
    from tinymobilenet import write_gemma3n_projector

    model = write_llama(tmp_path / "m.gguf", n_embd=256)
    path = write_gemma3n_projector(tmp_path / "mmproj-m.gguf", 256, 0.125)
    proj = projector_facts(path)
    assert proj.projector_type == "gemma3nv" and proj.graph_compute_bytes > 0
    printed = _printed(rpc_bin, endpoint, model, path, True)
    planned = lane_memory(msgspec.structs.replace(read_model_facts(model), mmproj=proj), LaneShape(
        ctx=512, flash_attn=True, mmproj=True, mmproj_offload=True, n_gpu_layers="all", devices=("rpc",)))  # fmt: skip
    by_device = {d.device: d.projector_bytes for d in planned.devices}
    padding = proj.weight_bytes - proj.file_weight_bytes
    assert abs(by_device["GPU0"] - padding - printed["GPU0"]) <= 0.01 * MIB, (by_device, printed)
    assert abs(by_device["CPU"] - printed["CPU"]) <= 0.005 * MIB, (by_device, printed)


def test_minicpmvs_buffer_after_a_sliced_image_is_within_the_plan(rpc_bin, tmp_path):
    """MiniCPM-V's resampler on an RPC device whose server logs each buffer: an image of 105 x 1,911
    pixels is sliced into pieces of up to 1,096 patches; the buffer grows past the warm-up's (1,024) to
    the replayed graph's at that slice, to the byte, and within 1% of the planned compute (the largest
    piece of any image up to 20:1)."""
    from tinyprojectors import MINICPMV_TOKENS

    from shared.memory.projector import resampler_piece_bytes

    model = write_llama(tmp_path / "m.gguf", n_embd=3584, special=MINICPMV_TOKENS)  # MiniCPM-V 2.6's widths
    path = write_projector(tmp_path / "mmproj-m.gguf", proj_type="resampler", text_embd=3584, n_embd=1152, n_ff=4304,
                           n_head=16, n_layer=1, image_size=448, patch_size=14, scale_factor=64)  # fmt: skip
    got = measure_largest(rpc_bin, model, path, "on", None, (105, 1911))
    assert "error" not in got and got["grew"], got
    proj = projector_facts(path)
    assert proj.n_queries == 64 and proj.n_mmproj_embd == 3584
    planned = lane_memory(msgspec.structs.replace(read_model_facts(model), mmproj=proj), LaneShape(
        ctx=512, flash_attn=True, mmproj=True, mmproj_offload=True, n_gpu_layers="all", devices=("rpc",)))  # fmt: skip
    compute = {d.device: d.projector_bytes for d in planned.devices}["GPU0"] - proj.weight_bytes
    assert got["largest_bytes"] <= compute <= got["largest_bytes"] * 1.01, (compute / MIB, got["largest_bytes"] / MIB)
    assert got["largest_bytes"] == resampler_piece_bytes(proj, True, 8 * 137)
