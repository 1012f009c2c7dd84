"""Vision: a projector (*mmproj*.gguf) is paired with its model as llama.cpp's router pairs them, its
weights and compute buffer are planned where llama-server puts them, exact against the figures the
real binary printed (tests/llama_figures.json, `mmproj|` keys, tests/record_projector_figures.py),
and the plan renders --mmproj with the offload flag the binary's --help offers."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import msgspec
import pytest
from test_planner import host, llama_1b, only_lane
from tinymodels import write_llama
from tinyprojectors import write_projector

from planner_svc.layouts import with_layers
from planner_svc.planner import plan
from shared.gguf_facts import scan_models
from shared.gguf_projector import base_name, pair, projector_facts
from shared.llama.flags import lane_args, parse_caps
from shared.llama.logs import devices_from_lines
from shared.memory import LaneShape, lane_memory
from shared.memory.projector import (
    RESAMPLER_WINDOW, WHISPER_TYPES, host_inputs, projector_compute_bytes, resampler_largest_patches,
    resampler_piece_bytes,
)
from shared.memory.pixtral_graph import pixtral_compute_bytes
from shared.messages.config import Demand, FleetConfig, Persona
from shared.messages.hosts import GpuInfo, ProjectorFacts, ServerCaps
from shared.messages.plans import LaneSpec

MIB = 2**20
GIB = 2**30
FIGURES = json.loads(Path(__file__).with_name("llama_figures.json").read_text())
RECORDED = sorted(k for k in FIGURES if k.startswith("mmproj|") and "|max_tokens=" not in k and "|image_px=" not in k)
# Pixtral's buffer at its largest image (tests/record_projector_figures.py, PIXTRAL_SHAPES)
LARGEST = sorted(k for k in FIGURES if k.startswith("mmproj|") and "|max_tokens=" in k)
# MiniCPM-V's after one image, sliced (RESAMPLER_LARGEST)
SLICED = sorted(k for k in FIGURES if k.startswith("mmproj|type=resampler") and "|image_px=" in k)


def _facts(key: str) -> tuple[ProjectorFacts, bool]:
    d = dict(part.split("=", 1) for part in key.split("|")[1:])
    proj = ProjectorFacts(path="/m/mmproj.gguf", projector_type=d["type"], n_embd=int(d["n_embd"]), n_ff=int(d["n_ff"]),
                          n_head=int(d["n_head"]), n_layer=int(d["n_layer"]), image_size=int(d["image"]),
                          patch_size=int(d["patch"]), n_merge=int(d["merge"]), n_mmproj_embd=int(d["text_embd"]))  # fmt: skip
    if d["type"] == "resampler":  # the recorded "merge" is its queries
        proj = msgspec.structs.replace(proj, n_merge=0, n_queries=int(d["merge"]))
    if d["type"] in WHISPER_TYPES:  # an audio encoder: the recorded "image" is its mel bins
        proj = msgspec.structs.replace(proj, vision=False, audio=True, image_size=0, n_mel_bins=int(d["image"]))
    return proj, d["flash_attn"] == "on"


def test_figures_were_recorded_for_eleven_projector_types():
    types = {"gemma3", "idefics3", "mlp", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger", "pixtral",
             "internvl", "llama4", "qwen2a", "resampler"}  # fmt: skip
    assert {dict(p.split("=", 1) for p in k.split("|")[1:])["type"] for k in RECORDED + LARGEST} >= types
    assert all("error" not in FIGURES[k] for k in RECORDED + LARGEST)
    assert len(LARGEST) >= 25 and sum(FIGURES[k]["grew"] for k in LARGEST) >= 20


def _image(key: str) -> tuple[int, int]:
    """The recorded image's tokens and rows: the lane scaled a 64 x 64 picture to N tokens or more,
    ceil(sqrt(N)) a side (llama.cpp rounds the smallest size up); a 1 x H one to one token a row."""
    d = dict(part.split("=", 1) for part in key.split("|")[1:])
    n = int(d["max_tokens"])
    if d.get("image_px", "64x64").startswith("1x"):
        return n, n
    side = math.isqrt(n - 1) + 1  # ceil(sqrt(n))
    return side * side, side


@pytest.mark.parametrize("key", LARGEST)
def test_pixtrals_buffer_at_its_largest_image_is_never_below_the_binarys(key):
    """The device's compute buffer after one image (grown past the warm-up's where the image is larger):
    the graph replayed at that image is it, to the byte; the image's tokens as the binary counted them.
    And the lane's plan at N (an image one token wide, or the few grids ggml-alloc's packing makes need
    more) is at least every recorded one of its N, within 1% of the one-token-wide one's."""
    proj, flash_attn = _facts(key)
    tokens, rows = _image(key)
    assert FIGURES[key]["image_batch_tokens"] == tokens + rows - 1  # one [IMG_BREAK] a row but the last
    grown = FIGURES[key]["largest_bytes"]
    at_image = max(FIGURES[key]["warmup_compute_mib"]["RPC0"] * MIB - 0.005 * MIB, pixtral_compute_bytes(
        n_embd=proj.n_embd, n_ff=proj.n_ff, n_head=proj.n_head, n_layer=proj.n_layer, patch_size=proj.patch_size,
        merge=proj.n_merge or 1, text_embd=proj.n_mmproj_embd, flash_attn=flash_attn, grid=(tokens // rows, rows)))  # fmt: skip
    assert at_image == grown or not FIGURES[key]["grew"], (at_image, grown)
    n = int(key.split("|max_tokens=")[1].split("|")[0])
    if tokens <= n:  # (--image-min-tokens N, which the recorder also passes, rounds a square image past N)
        assert projector_compute_bytes(proj, flash_attn, n) >= grown
    if tokens == n and rows == n:
        assert projector_compute_bytes(proj, flash_attn, n) <= grown * 1.01


@pytest.mark.parametrize("key", RECORDED)
def test_compute_buffer_matches_the_printed_line(key):
    """Every type's graph replayed (shared/memory/*_graph.py): the plan is the printed figure, with flash
    attention and without. MiniCPM-V's is planned at its largest slice, its warm-up's replayed apart;
    Qwen2-VL's family at the largest of every image up to 2,116 merged tokens, on these shapes the 46 x 46
    warm-up's."""
    proj, flash_attn = _facts(key)
    printed = FIGURES[key]["compute_mib"]["CPU"]
    planned = projector_compute_bytes(proj, flash_attn) / MIB
    if proj.projector_type == "resampler":
        at_warmup = resampler_piece_bytes(proj, flash_attn, (proj.image_size // proj.patch_size) ** 2) / MIB
        assert round(at_warmup, 2) == printed and at_warmup <= planned, at_warmup
    else:
        assert round(planned, 2) == printed


def _llava_uhd_pieces(width: int, height: int, size: int = 448, patch: int = 14) -> list[tuple[int, int]]:
    """The pieces (w, h in pixels) clip encodes for a MiniCPM-V image: tools/mtmd/mtmd-image.cpp's
    llava-uhd slicing (get_slice_instructions, get_best_resize, get_best_grid, get_refine_size) as
    written there, its float rounding included, for checking the planned piece against real sizes."""
    def divide(length: float, by: int) -> int:  # ensure_divide: std::round, at least one patch
        return max(int(math.floor(length / by + 0.5)) * by, by)

    def best_resize(w: int, h: int, upscale: bool) -> tuple[int, int]:
        if w * h > size * size or upscale:
            r = w / h
            h = int(size / math.sqrt(r))
            w = int(h * r)
        return divide(w, patch), divide(h, patch)

    if width <= size and height <= size:
        return [(size, size)]
    multiple = min(math.ceil(width * height / (size * size)), 9)
    grids = [(m, n // m) for n in (multiple - 1, multiple, multiple + 1) if n != 1 and n <= 9
             for m in range(1, n + 1) if n % m == 0]  # fmt: skip
    log_ratio = math.log(width / height)
    grid = min(grids, key=lambda g: abs(log_ratio - math.log(g[0] / g[1])))  # the first of equal errors
    slice_w, slice_h = divide(width, grid[0]) // grid[0], divide(height, grid[1]) // grid[1]
    return [best_resize(width, height, False), best_resize(slice_w, slice_h, True)]


@pytest.mark.parametrize("key", SLICED)
def test_minicpmvs_buffer_after_its_largest_slice_is_never_below_the_binarys(key):
    """MiniCPM-V on an RPC device, one image sliced (105 x 1,911 pixels: a slice of 8 x 137 patches;
    449 x 449: 45 x 23): the buffer the device grew to is the replayed graph's at that slice, to the
    byte, and at most the plan, which holds the largest slice of any image up to 20:1 (1,100 patches:
    within 1% of the 1,096-patch slice's)."""
    proj, flash_attn = _facts(key)
    width, height = map(int, key.split("|image_px=")[1].split("x"))
    n_pos = max((w // proj.patch_size) * (h // proj.patch_size) for w, h in _llava_uhd_pieces(width, height))
    grown = FIGURES[key]["largest_bytes"]
    assert grown > FIGURES[key]["warmup_compute_mib"]["RPC0"] * MIB  # the slice is larger than the warm-up
    assert resampler_piece_bytes(proj, flash_attn, n_pos) == grown
    assert grown <= projector_compute_bytes(proj, flash_attn) <= grown * (1.01 if n_pos >= 1090 else 1.10)


def test_a_minicpmv_lane_holds_its_largest_slice_and_says_how_long_an_image_it_takes():
    """The lane's projector bytes hold the largest slice (1,100 patches), more than the warm-up's; the
    spec carries the aspect its plan holds, which gateways enforce (gateway/edge/images.py)."""
    proj = _proj(projector_type="resampler", image_size=448, n_layer=27, n_mmproj_embd=3584, n_queries=64)
    lane = only_lane(plan([host(models=(msgspec.structs.replace(llama_1b("vlm"), mmproj=proj),))], FleetConfig(),
                          Demand(personas=(Persona(model="vlm"),))))  # fmt: skip
    assert lane.image_max_aspect == 20 and any("images up to 20:1" in r for r in lane.reasons)
    assert lane.image_max_tokens is None
    assert lane.memory.projector_bytes == proj.weight_bytes + projector_compute_bytes(proj, True)
    assert projector_compute_bytes(proj, True) >= resampler_piece_bytes(proj, True, 1100)
    assert projector_compute_bytes(proj, True) > resampler_piece_bytes(proj, True, 1024)  # the warm-up's
    assert host_inputs(proj) == 1100 * (14 * 14 * 3 * 4 + 3 * 4)  # the largest piece and its positions


@pytest.mark.slow  # about 1,100 graph replays a shape
@pytest.mark.parametrize("shape", [(1152, 4304, 16, 1, 4096), (1152, 4304, 16, 1, 3584), (128, 256, 4, 2, 256),
                                   (384, 1536, 6, 2, 1024)], ids=str)  # fmt: skip
def test_the_largest_piece_of_all_up_to_the_planned_one_lies_in_the_window_the_plan_replays(shape):
    """The buffer is not monotone in the patches (ggml-alloc's packing), so the plan takes the largest over
    the last RESAMPLER_WINDOW piece sizes and the warm-up's: on these shapes, flash attention on and off,
    that equals the largest over every piece from 1 patch to the planned 1,100."""
    n_embd, n_ff, n_head, n_layer, text = shape
    proj = ProjectorFacts(path="/m.gguf", projector_type="resampler", n_embd=n_embd, n_ff=n_ff, n_head=n_head,
                          n_layer=n_layer, image_size=448, patch_size=14, n_mmproj_embd=text, n_queries=64)  # fmt: skip
    for flash_attn in (True, False):
        every = max(resampler_piece_bytes(proj, flash_attn, n) for n in range(1, 1101))
        assert projector_compute_bytes(proj, flash_attn) == every
    assert RESAMPLER_WINDOW == 32


def test_minicpmvs_planned_slice_is_the_largest_of_any_image_up_to_twenty_to_one():
    """Every piece of every image from 1:1 to 20:1 (long side up to 4,096 pixels, both orientations) has
    at most the planned patches; the largest is within 1% of it. Past 20:1 a piece can have
    more: llama.cpp does not bound the aspect (docs/known-limits.md)."""
    proj = ProjectorFacts(path="/m.gguf", projector_type="resampler", image_size=448, patch_size=14)
    planned = resampler_largest_patches(proj)
    largest = 0
    for short in range(1, 4097, 3):
        for aspect in (1, 1.01, 1.5, 2, 3, 4, 5, 7, 9, 10, 13, 16, 19, 20):
            long = min(int(short * aspect), 4096)
            for w, h in ((long, short), (short, long)):
                pieces = _llava_uhd_pieces(w, h)
                largest = max(largest, *((pw // 14) * (ph // 14) for pw, ph in pieces))
    for w, h in ((105, 1911), (1911, 105)):  # 18.2:1, the largest found by a finer search: 1,096 patches
        largest = max(largest, *((pw // 14) * (ph // 14) for pw, ph in _llava_uhd_pieces(w, h)))
    assert planned == 1100 and planned * 0.99 <= largest <= planned, largest
    assert max((w // 14) * (h // 14) for w, h in _llava_uhd_pieces(49, 4095)) > planned  # 84:1: 1,172 patches


def test_weights_are_the_printed_model_size_padded_as_allocated(tmp_path):
    """clip.cpp prints the unpadded sum ("model size"); the buffer pads each tensor to 32 bytes."""
    for proj_type, n_layer in (("gemma3", 2), ("idefics3", 2), ("mlp", 3)):
        path = write_projector(tmp_path / f"mmproj-{proj_type}.gguf", proj_type=proj_type, n_embd=128, n_ff=256,
                               n_layer=n_layer)  # fmt: skip
        model = write_llama(tmp_path / f"{proj_type}.gguf")
        found, _ = scan_models([tmp_path])
        proj = next(f.mmproj for f in found if f.path == str(model))
        assert proj is not None and proj.path == str(path) and proj.projector_type == proj_type
        key = next(k for k in RECORDED if f"type={proj_type}|n_embd=128|n_ff=256|n_head=4|n_layer={n_layer}|image=224|"
                   f"patch=14|merge=2|text_embd=256|" in k)  # fmt: skip
        assert round(proj.file_weight_bytes / MIB, 2) == FIGURES[key]["weights_mib"]
        assert proj.n_mmproj_embd == 256  # the text model's width it feeds
        assert 0 <= proj.weight_bytes - proj.file_weight_bytes < 32 * 40  # 40 tensors at most, each < 32 B of padding
        (tmp_path / f"{proj_type}.gguf").unlink()
        path.unlink()


def test_pairing_follows_the_router_and_the_base_name(tmp_path):
    """One model in a folder takes the projector beside it (llama.cpp's router: a *.gguf whose
    name contains "mmproj"); a folder of several pairs each by base name; an orphan is reported."""
    (tmp_path / "gemma").mkdir()
    write_llama(tmp_path / "gemma" / "gemma-3-4b-it-Q4_K_M.gguf")
    write_projector(tmp_path / "gemma" / "mmproj-F16.gguf")
    write_llama(tmp_path / "SmolVLM-256M-Instruct-Q8_0.gguf")
    write_projector(tmp_path / "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf", proj_type="idefics3")
    write_llama(tmp_path / "Qwen2.5-VL-3B-Instruct-q4_k_m.gguf")
    write_projector(tmp_path / "Qwen2.5-VL-3B-Instruct-mmproj-f16.gguf")
    write_llama(tmp_path / "plain.gguf")
    write_projector(tmp_path / "mmproj-nobody.gguf")
    found, problems = scan_models([tmp_path])
    by_name = {f.name: f.mmproj.path.rsplit("/", 1)[-1] if f.mmproj else None for f in found}
    assert by_name == {
        "gemma-3-4b-it-Q4_K_M": "mmproj-F16.gguf",
        "SmolVLM-256M-Instruct-Q8_0": "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf",
        "Qwen2.5-VL-3B-Instruct-q4_k_m": "Qwen2.5-VL-3B-Instruct-mmproj-f16.gguf",
        "plain": None,
    }
    assert [p for p in problems if "mmproj-nobody" in p and "no model beside it" in p]
    assert base_name("mmproj-gemma-3-4b-it-f16.gguf") == base_name("gemma-3-4b-it-Q4_K_M.gguf") == "gemma-3-4b-it"
    assert pair(["/a/m.gguf", "/a/n.gguf"], ["/a/mmproj-x.gguf"]) == {}  # several models, no name: no guess


def _proj(**kw) -> ProjectorFacts:
    base = dict(path="/m/mmproj-m.gguf", projector_type="gemma3", weight_bytes=400 * MIB, weight_cuda_bytes=401 * MIB,
                n_embd=1152, n_ff=4304, n_head=16, n_layer=27, image_size=896, patch_size=14, n_mmproj_embd=2048)  # fmt: skip
    return ProjectorFacts(**(base | kw))


def test_the_projector_lands_on_host_ram_or_the_lanes_first_device():
    facts = with_layers(msgspec.structs.replace(llama_1b(), mmproj=_proj()))
    compute = projector_compute_bytes(facts.mmproj, True)
    cpu = lane_memory(facts, LaneShape(ctx=4096, flash_attn=True, mmproj=True))
    assert cpu.devices[0].projector_bytes == 400 * MIB + compute == cpu.projector_bytes
    without = lane_memory(facts, LaneShape(ctx=4096, flash_attn=True))
    assert cpu.total_bytes - without.total_bytes == cpu.projector_bytes
    gpu = lane_memory(facts, LaneShape(ctx=4096, flash_attn=True, mmproj=True, mmproj_offload=True,
                                       n_gpu_layers="all", devices=("cuda", "cuda")))  # fmt: skip
    image = 896 * 896 * 3 * 4  # the warm-up image stays in host memory
    assert [d.projector_bytes for d in gpu.devices] == [image, 401 * MIB + compute, 0]
    kept = lane_memory(facts, LaneShape(ctx=4096, flash_attn=True, mmproj=True, mmproj_offload=False,
                                        n_gpu_layers="all", devices=("cuda",)))  # fmt: skip
    assert [d.projector_bytes for d in kept.devices] == [400 * MIB + compute, 0]


def test_the_plan_renders_mmproj_and_counts_it_in_the_window():
    """The window search sizes the lane with the projector's bytes: with little RAM the lane's window
    shrinks by what the projector takes; a GPU lane offloads it, a CPU lane keeps it in RAM."""
    facts = msgspec.structs.replace(llama_1b("vlm"), mmproj=_proj(weight_bytes=600 * MIB, weight_cuda_bytes=600 * MIB))
    demand = Demand(personas=(Persona(model="vlm", ctx_max=131072),))
    small = host(ram_available=int(4.5 * GIB), ram_total=8 * GIB, models=(facts,))
    lane = only_lane(plan([small], FleetConfig(), demand))
    text_only = only_lane(plan([small], FleetConfig(), Demand(personas=(Persona(model="vlm", ctx_max=131072, vision=False),))))
    assert lane.mmproj_path == "/m/mmproj-m.gguf" and lane.mmproj_offload is False
    assert text_only.mmproj_path is None and text_only.memory.projector_bytes == 0
    # flash attention auto: on for the CPU, as clip turns it on
    assert lane.memory.projector_bytes == 600 * MIB + projector_compute_bytes(facts.mmproj, True)
    assert lane.ctx_total < text_only.ctx_total  # the projector's bytes came out of the window
    assert lane.image_max_aspect is None  # gemma3 resizes every image to its square: any aspect
    assert any("--mmproj" in r for r in lane.reasons)
    args = lane_args(lane, ServerCaps())
    assert args[args.index("--mmproj") + 1] == "/m/mmproj-m.gguf" and "--no-mmproj-offload" in args
    gpu_host = host(models=(facts,), gpus=(GpuInfo(name="g", vram_total=24 * GIB, vram_free=24 * GIB, device="CUDA0"),))
    gpu_lane = only_lane(plan([gpu_host], FleetConfig(), demand))
    assert gpu_lane.mmproj_offload is True and "--mmproj-offload" in lane_args(gpu_lane, ServerCaps())
    gpu0 = next(d for d in gpu_lane.memory.devices if d.index == 0)
    host_ram = next(d for d in gpu_lane.memory.devices if d.index == -1)
    assert gpu0.projector_bytes == 600 * MIB + projector_compute_bytes(facts.mmproj, True)
    assert host_ram.projector_bytes == 896 * 896 * 3 * 4  # the warm-up image, a graph input
    assert gpu_lane.memory.projector_bytes == gpu0.projector_bytes + host_ram.projector_bytes


def test_a_binary_without_the_flags_gets_no_projector():
    facts = msgspec.structs.replace(llama_1b("vlm"), mmproj=_proj())
    old = host(models=(facts,), server=ServerCaps(has_mmproj=False))
    lane = only_lane(plan([old], FleetConfig(), Demand(personas=(Persona(model="vlm"),))))
    assert lane.mmproj_path is None and lane.memory.projector_bytes == 0


def test_the_flags_come_from_the_binarys_help(llama_server):
    """b11434 offers --mmproj-offload/--no-mmproj-offload (and -mmdev, which defaults to the first
    --device: the device lanes plans the projector on)."""
    help_text = subprocess.run([llama_server, "--help"], capture_output=True, text=True, timeout=60).stdout
    assert parse_caps(help_text).has_mmproj and "--mmproj-device" in help_text
    assert parse_caps(help_text).has_image_max_tokens
    assert not parse_caps("--flash-attn [on|off|auto]\n--mmproj FILE\n").has_mmproj
    assert not parse_caps("--flash-attn [on|off|auto]\n--mmproj FILE\n").has_image_max_tokens


def test_the_printed_projector_lines_are_read_per_device():
    lines = [
        "clip_ctx: CLIP using CUDA0 backend",
        "load_hparams: model size:         812.50 MiB",
        "reserve_compute_meta:      CUDA0 compute buffer size =   103.81 MiB",
        "reserve_compute_meta:        CPU compute buffer size =     9.19 MiB",
        "llama_prepare_model_devices: using device CUDA0 (NVIDIA H200)",
        "sched_reserve:      CUDA0 compute buffer size =    27.28 MiB",
    ]
    devices = {d.device: d for d in devices_from_lines(lines)}
    assert devices["GPU0"].projector_bytes == round((812.50 + 103.81) * MIB)
    assert devices["CPU"].projector_bytes == round(9.19 * MIB)
    assert devices["GPU0"].compute_bytes == round(27.28 * MIB)


def test_lane_spec_fields_are_additive():
    spec = LaneSpec(lane_id="m-0", model="m", model_path="/m.gguf", alias="m", port=1, ctx_total=4096, ctx_per_slot=4096,
                    parallel=1)  # fmt: skip
    assert spec.mmproj_path is None and spec.mmproj_offload is None
    assert "--mmproj" not in lane_args(spec, ServerCaps())


def test_a_wake_needs_the_projectors_bytes():
    """On demand: the room a woken model needs (and so what eviction must free) includes its projector."""
    from planner_svc.layouts import CPU_RESOURCE
    from planner_svc.wake_placement import room_on

    proj = _proj(weight_bytes=600 * MIB)
    woken = Persona(model="vlm", ctx_min=4096, ctx_max=4096)
    needs = {}
    for label, facts in (("text", llama_1b("vlm")), ("vision", msgspec.structs.replace(llama_1b("vlm"), mmproj=proj))):
        room, _ = room_on(host(models=(facts,)), FleetConfig(), woken, None, [woken], [])
        needs[label] = room.needs[CPU_RESOURCE]
    assert needs["vision"] - needs["text"] == 600 * MIB + projector_compute_bytes(proj, True)


def test_estimate_counts_a_projector(tmp_path):
    """`lanes estimate MODEL --mmproj FILE`: the projector on the first device, or in RAM with --no-mmproj-offload."""
    import sys

    from shared.gguf_projector import projector_facts

    model = write_llama(tmp_path / "m.gguf")
    proj = projector_facts(write_projector(tmp_path / "mmproj-m.gguf"))
    base = [sys.executable, "-m", "lanes.cli", "estimate", str(model), "--ctx", "2048", "--mmproj", proj.path,
            "--flash-attn", "on", "--json"]  # fmt: skip
    for extra, where in (([], 1), (["--gpus", "8GiB", "-ngl", "all"], 2), (["--gpus", "8GiB", "-ngl", "all", "--no-mmproj-offload"], 1)):
        out = json.loads(subprocess.run(base + extra, capture_output=True, text=True, check=True).stdout)
        per = [d["projector_bytes"] for d in out["devices"]]
        own = proj.weight_bytes + projector_compute_bytes(proj, True)
        # offloaded, the warm-up image (a graph input) stays in host memory
        assert per == ([224 * 224 * 3 * 4, own] if where == 2 else [own] + [0] * (len(per) - 1))
        assert sum(per) == out["projector_bytes"]


def test_a_qwen_projector_is_planned_at_its_warm_up_image_not_its_file_image_size(tmp_path):
    """clip.cpp warms Qwen2-VL's family up at 46 x 46 merged tokens whatever clip.vision.image_size
    says (560 in the generated file, 1,288 pixels a side warmed up): the agent reads the merge, the
    plan follows the warm-up (both recorded sizes printed the same 30.67 MiB), and with the projector
    on a device the host keeps that image."""
    path = write_projector(tmp_path / "mmproj-q.gguf", proj_type="qwen2vl_merger", n_embd=64, n_ff=128, n_head=2,
                           image_size=560)  # fmt: skip
    proj = projector_facts(path)
    assert (proj.projector_type, proj.n_merge or 2, proj.n_mmproj_embd) == ("qwen2vl_merger", 2, 256)
    small = msgspec.structs.replace(proj, image_size=336)
    assert projector_compute_bytes(proj, True) == projector_compute_bytes(small, True) >= 30.67 * MIB
    assert host_inputs(proj) == 1288 * 1288 * 3 * 4 + 92 * 92 * 16  # the image and its M-RoPE positions


def test_a_qwen_lane_takes_no_image_larger_than_its_planned_warm_up():
    """Qwen2-VL's buffer grows with an image larger than its warm-up: the lane is started with
    --image-max-tokens 2116 (46 x 46) where the binary has the flag, so the plan holds; other
    projectors (their warm-up is their largest image) and older binaries get no such flag."""
    qwen = _proj(projector_type="qwen2.5vl_merger", n_embd=1280, n_ff=3420, n_head=16, n_layer=32, image_size=560,
                 n_mmproj_embd=2048, n_merge=2)  # fmt: skip
    demand = Demand(personas=(Persona(model="vlm"),))
    caps = ServerCaps(has_image_max_tokens=True)
    lane = only_lane(plan([host(models=(msgspec.structs.replace(llama_1b("vlm"), mmproj=qwen),), server=caps)],
                          FleetConfig(), demand))  # fmt: skip
    assert lane.image_max_tokens == 46 * 46 and any("--image-max-tokens 2116" in r for r in lane.reasons)
    args = lane_args(lane, caps)
    assert args[args.index("--image-max-tokens") + 1] == "2116"
    assert lane.memory.projector_bytes >= 410 * MIB  # the window mask and its f16 copy, at the warm-up
    # past 2116:1 an image keeps one token across and escapes the cap: the gateway refuses those
    assert lane.image_max_aspect == 2116 and any("images up to 2116:1" in r for r in lane.reasons)
    gemma = only_lane(plan([host(models=(msgspec.structs.replace(llama_1b("vlm"), mmproj=_proj()),), server=caps)],
                           FleetConfig(), demand))  # fmt: skip
    older = only_lane(plan([host(models=(msgspec.structs.replace(llama_1b("vlm"), mmproj=qwen),))], FleetConfig(), demand))
    assert gemma.image_max_tokens is None and older.image_max_tokens is None
    assert "--image-max-tokens" not in lane_args(gemma, caps) + lane_args(older, ServerCaps())


def test_a_pixtral_lane_is_planned_and_started_at_the_largest_image_its_build_takes(tmp_path):
    """Pixtral warms up at 256 tokens and grows its buffer at the first larger image, up to 1,024: the plan
    holds the largest (an image one token wide, where its row breaks are largest) and renders
    --image-max-tokens 1024 so llama-server enforces it; the host holds that image as the graph's input."""
    path = write_projector(tmp_path / "mmproj-p.gguf", proj_type="pixtral", text_embd=5120, n_embd=1024, n_ff=4096,
                           n_head=16, n_layer=1, image_size=1024, patch_size=16, scale_factor=1)  # fmt: skip
    proj = projector_facts(path)
    assert (proj.projector_type, proj.n_merge or 1, proj.n_mmproj_embd, proj.n_ff) == ("pixtral", 1, 5120, 4096)
    key = next(k for k in LARGEST if "n_embd=1024|n_ff=4096|n_head=16|n_layer=1|image=1024" in k and "1x1024" in k)
    assert FIGURES[key]["largest_bytes"] <= projector_compute_bytes(proj, True) <= FIGURES[key]["largest_bytes"] * 1.01
    assert projector_compute_bytes(proj, True, 256) < projector_compute_bytes(proj, True) / 3  # a smaller cap, less
    assert host_inputs(proj) == 1024 * 16 * 16 * 3 * 4 + 1024 * 8  # the image at 1,024 patches, and its positions
    demand = Demand(personas=(Persona(model="vlm"),))
    caps = ServerCaps(has_image_max_tokens=True)
    lane = only_lane(plan([host(models=(msgspec.structs.replace(llama_1b("vlm"), mmproj=proj),), server=caps)],
                          FleetConfig(), demand))  # fmt: skip
    assert lane.image_max_tokens == 1024 and any("--image-max-tokens 1024: the largest" in r for r in lane.reasons)
    assert lane.image_max_aspect == 1024  # one token wide at its largest: the gateway refuses longer strips
    args = lane_args(lane, caps)
    assert args[args.index("--image-max-tokens") + 1] == "1024"
    assert lane.memory.projector_bytes >= proj.weight_bytes + FIGURES[key]["largest_bytes"]
