"""Per-device memory without a server: placement as load_tensors does it, the fast scan against
gguf's own reader, weights/KV per device from per-layer facts, the estimate CLI's contract."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import pytest
from tinymodels import write_llama

from shared.gguf_facts import FactsCache, read_model_facts, scan_models
from shared.gguf_scan import read_header
from shared.memory import CPU, LaneShape, PlacementError, lane_memory, ngl_count, normalised_splits, place, repack_rule

MIB = 2**20


# ------------------------------------------------------------------ placement


def test_ngl_offloads_the_output_layer_first():
    # Gemma 3 270M: 18 blocks + output; -ngl 10 -> output + blocks 9..17 (i_gpu_start = 19 - 10 = 9)
    p = place(18, 10, (1.0,))
    assert p.layer_device[:9] == (CPU,) * 9
    assert p.layer_device[9:] == (0,) * 10
    assert p.offloaded == 10
    assert place(18, 1, (1.0,)).layer_device == (CPU,) * 18 + (0,)  # -ngl 1: only the output layer


def test_ngl_all_and_none():
    assert place(8, "all", (1.0,)).offloaded == 9
    assert place(8, 99, (1.0,)).offloaded == 9
    assert place(8, 0, (1.0,)).offloaded == 0
    assert place(8, "all", ()).offloaded == 0  # no GPU-type device: all on the CPU


def test_ngl_is_a_count_or_all():
    # "all" is the only word for every layer inside lanes: no None, no -1
    assert ngl_count("all", 8) == 9 and ngl_count(5, 8) == 5
    for bad in (-1, None, "auto"):
        with pytest.raises(PlacementError, match="n-gpu-layers"):
            place(8, bad, (1.0,))


def test_split_boundary_goes_to_the_next_device():
    # 9 layers over 3:1 -> cumulative 0.75, 1.0; layer il goes where splits > il/9
    p = place(8, "all", (3.0, 1.0))
    assert p.layer_device == (0, 0, 0, 0, 0, 0, 0, 1, 1)
    # equal split of 4 layers: 0.5 boundary: il/4 = 0.5 is not < 0.5 -> device 1
    assert place(3, "all", (1.0, 1.0)).layer_device == (0, 0, 1, 1)


def test_zero_share_device_gets_nothing_and_split_none_uses_main_gpu():
    assert 1 not in place(8, "all", (1.0, 0.0, 1.0)).layer_device
    assert set(place(8, "all", (1.0, 1.0, 1.0), split_mode="none", main_gpu=2).layer_device) == {2}
    with pytest.raises(PlacementError):
        place(8, "all", (1.0, 1.0), split_mode="none", main_gpu=5)


def test_splits_are_float32_like_llama_cpp():
    assert normalised_splits((1, 1, 1))[0] == pytest.approx(1 / 3, rel=1e-7)
    for bad in ((-1.0, 2.0), (0.0, 0.0), (float("nan"), 1.0)):
        with pytest.raises(PlacementError):
            normalised_splits(bad)


def test_old_builds_offload_blocks_first():
    p = place(8, 4, (1.0,), rule="blocks_first")
    assert p.layer_device == (CPU,) * 4 + (0,) * 4 + (CPU,)


# ------------------------------------------------------------------ the fast scan


def test_scan_matches_gguf_reader(tmp_path):
    path = write_llama(tmp_path / "m.gguf", n_layer=3, n_vocab=5000, tied=True)
    header = read_header(path)
    reader = gguf.GGUFReader(path)
    assert [(t.name, t.offset) for t in header.tensors] == [
        (t.name, int(t.data_offset) - header.data_offset) for t in reader.tensors
    ]
    assert [t.n_bytes for t in header.tensors] == [int(t.n_bytes) for t in reader.tensors]
    assert header.fields["llama.block_count"] == 3
    facts = read_model_facts(path)
    assert facts.n_vocab == 5000 and facts.tied_output_bytes > 0
    assert facts.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    layers = {lw.layer: lw for lw in facts.layer_weights}
    assert sorted(layers) == [-1, 0, 1, 2, 3]  # input, blocks, output (norm only: tied)


def test_facts_cache_survives_a_restart(tmp_path, monkeypatch):
    folder = tmp_path / "models"
    folder.mkdir()
    write_llama(folder / "a.gguf")
    cache_file = tmp_path / "facts.json"
    first, _ = scan_models([folder], FactsCache(cache_file))
    import shared.gguf_facts as gf

    def no_reading(path):
        raise AssertionError(f"read {path} again")

    monkeypatch.setattr(gf, "read_model_facts", no_reading)
    again, problems = scan_models([folder], FactsCache(cache_file))
    assert again == first and not problems


# ------------------------------------------------------------------ weights and KV per device


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    path = write_llama(tmp_path_factory.mktemp("dev") / "l8.gguf", n_layer=8, n_embd=256, n_vocab=20000)
    return read_model_facts(path)


def test_weights_per_device_add_up_to_the_file(llama8):
    cpu = lane_memory(llama8, LaneShape(ctx=4096))
    assert [d.device for d in cpu.devices] == ["CPU"]
    # the whole mapped range of the file; an f16 model has nothing to repack
    layers = llama8.layer_weights
    assert cpu.devices[0].model_bytes == max(lw.end for lw in layers) - min(lw.first for lw in layers)
    split = lane_memory(llama8, LaneShape(ctx=4096, n_gpu_layers="all", devices=("rpc", "rpc"), tensor_split=(1, 1)))
    by = {d.device: d for d in split.devices}
    blocks = {lw.layer: lw.bytes for lw in layers}
    assert by["CPU"].model_bytes == blocks[-1]  # token embeddings only
    assert by["GPU0"].model_bytes + by["GPU1"].model_bytes == sum(b for il, b in blocks.items() if il >= 0)
    assert by["GPU0"].layers + by["GPU1"].layers == 9 and by["CPU"].layers == 0
    assert by["GPU0"].kv_bytes + by["GPU1"].kv_bytes == split.kv_bytes and by["CPU"].kv_bytes == 0
    assert by["CPU"].output_bytes == llama8.n_vocab * 4


def test_kv_follows_layers_and_nkvo_keeps_it_on_the_host(llama8):
    shape = dict(ctx=8192, n_gpu_layers=5, devices=("rpc",))
    partial = {d.device: d for d in lane_memory(llama8, LaneShape(**shape)).devices}
    per_layer = partial["GPU0"].kv_bytes // 4  # -ngl 5: output + 4 blocks
    assert partial["CPU"].kv_bytes == 4 * per_layer
    nkvo = {d.device: d for d in lane_memory(llama8, LaneShape(**shape, no_kv_offload=True)).devices}
    assert nkvo["GPU0"].kv_bytes == 0 and nkvo["CPU"].kv_bytes == 8 * per_layer


def test_devices_carry_their_index_and_backend(llama8):
    split = lane_memory(llama8, LaneShape(ctx=4096, n_gpu_layers="all", devices=("cuda", "rpc"), tensor_split=(1, 1)))
    assert [(d.device, d.index, d.backend) for d in split.devices] == [
        ("CPU", -1, "cpu"), ("GPU0", 0, "cuda"), ("GPU1", 1, "rpc")
    ]


def test_a_given_placement_is_the_one_used(llama8):
    shape = LaneShape(ctx=4096, n_gpu_layers=5, devices=("rpc",))
    placed = place(llama8.n_layer, 5, (1.0,), backends=("rpc",))
    assert lane_memory(llama8, LaneShape(ctx=4096), placement=placed) == lane_memory(llama8, shape)
    with pytest.raises(PlacementError):
        lane_memory(llama8, shape, placement=place(llama8.n_layer + 1, 5, (1.0,)))


def test_cuda_pins_cpu_weights_and_pads_rows(llama8):
    rpc = {d.device: d for d in lane_memory(llama8, LaneShape(ctx=4096, n_gpu_layers="all", devices=("rpc",))).devices}
    cuda = {d.device: d for d in lane_memory(llama8, LaneShape(ctx=4096, n_gpu_layers="all", devices=("cuda",))).devices}
    assert cuda["GPU0"].model_bytes >= rpc["GPU0"].model_bytes


def test_repack_rule_reads_host_sets():
    assert repack_rule(None) == {"Q4_0": 8, "Q4_K": 8, "IQ4_NL": 8, "MXFP4": 8}
    assert repack_rule(()) == {}


# ------------------------------------------------------------------ lanes estimate's contract


def lanes(*args):
    return subprocess.run([sys.executable, "-m", "lanes.cli", *map(str, args)], capture_output=True, text=True)


def test_estimate_json_devices(tiny_models):
    run = lanes("estimate", tiny_models["llama8"], "--ctx", "4096", "--parallel", "2", "--cache-type-k", "q8_0",
                "--cache-type-v", "q8_0", "--flash-attn", "on", "--n-gpu-layers", "all", "--gpus", "8GiB,4GiB",
                "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert {"kv_bytes", "compute_bytes", "total_bytes", "weights_bytes"} <= set(out)
    assert [d["device"] for d in out["devices"]] == ["CPU", "GPU0", "GPU1"]
    for d in out["devices"]:
        assert {"model_bytes", "kv_bytes", "compute_bytes", "output_bytes"} <= set(d)
    assert sum(d["kv_bytes"] for d in out["devices"]) == out["kv_bytes"]
    # without --tensor-split the split follows the sizes: 8:4 -> GPU0 gets two thirds of the layers
    assert out["devices"][1]["layers"] == 6 and out["devices"][2]["layers"] == 3


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (("--gpus", "8GiB,8GiB", "--tensor-split", "-1,2"), "not negative"),
        (("--gpus", "8GiB,8GiB", "--tensor-split", "0,0"), "sum to zero"),
        (("--gpus", "8GiB,8GiB", "--tensor-split", "1,1,1"), "3 shares for 2 device"),
        (("--n-gpu-layers", "-3"), "-3"),
        (("--gpus", "lots"), "--gpus lots"),
    ],
)
def test_estimate_bad_device_input_is_one_line_exit_2(tiny_models, extra, words):
    run = lanes("estimate", tiny_models["llama8"], "--ctx", "4096", "--n-gpu-layers", "all", *extra, "--json")
    if "-3" in extra:
        run = lanes("estimate", tiny_models["llama8"], "--ctx", "4096", *extra, "--json")
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and words in run.stderr, run.stderr


def test_probe_reads_the_ngl_rule_from_help():
    from shared.llama.flags import parse_caps

    new = ("-fa, --flash-attn [on|off|auto]\n-ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers,\n"
           "                                        'auto', or 'all' (default: auto)\n-dev,  --device <dev1,dev2,..>")
    old = "-fa, --flash-attn\n-ngl, --gpu-layers, --n-gpu-layers N   number of layers to store in VRAM\n"
    assert parse_caps(new).ngl_rule == "output_first" and parse_caps(new).has_device
    assert parse_caps(old).ngl_rule == "blocks_first" and not parse_caps(old).has_device


def test_device_lines_show_planned_and_printed():
    from shared.llama.printed import device_lines
    from shared.messages.plans import DeviceMemory, LaneSpec, MemoryBreakdown

    planned = (DeviceMemory(device="CPU", model_bytes=170 * MIB), DeviceMemory(device="GPU0", kv_bytes=8 * MIB, layers=19))
    spec = LaneSpec(lane_id="g-0", model="g", model_path="/m", alias="g", port=8080, ctx_total=4096, ctx_per_slot=4096,
                    parallel=1, gpu_devices=(1,), memory=MemoryBreakdown(devices=planned))  # fmt: skip
    lines = device_lines(spec, (DeviceMemory(device="GPU0", kv_bytes=8 * MIB),))
    assert "CPU: layers 0" in lines[0] and "model 170.00, kv 0.00" in lines[0]
    assert "GPU0 (host gpu 1)" in lines[1] and "kv 8.00/8.00" in lines[1]
