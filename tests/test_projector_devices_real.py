"""The projector per device against the real llama-server with an RPC device (no GPU needed): with
--mmproj-offload its weights and compute land on the lane's first device and the warm-up image
(a graph input) in host RAM; with --no-mmproj-offload all in host RAM. The planned bytes per device
are the printed ones (clip prints the weights unpadded: the plan holds each tensor's padding)."""

from __future__ import annotations

import msgspec
import pytest
from record_llama_figures import run_until_loaded
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
]


@pytest.fixture(scope="module")
def endpoint(rpc_bin):
    with rpc_servers(rpc_bin, 1) as eps:
        yield eps[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_projector_bytes_per_device_are_the_printed_ones(rpc_bin, endpoint, tmp_path, case):
    proj_type, n_embd, n_ff, image, offload = case
    model = write_llama(tmp_path / "m.gguf", special=IDEFICS3_TOKENS)
    path = write_projector(tmp_path / "mmproj-m.gguf", proj_type=proj_type, n_embd=n_embd, n_ff=n_ff, image_size=image,
                           patch_size=16 if proj_type == "idefics3" else 14)  # fmt: skip
    lines = run_until_loaded([str(rpc_bin / "llama-server"), "-m", str(model), "--mmproj", str(path), "--rpc", endpoint,
                              "-ngl", "all", "-c", "512", "-fit", "off", "--flash-attn", "on", "--verbosity", "4",
                              "--port", "0", "--mmproj-offload" if offload else "--no-mmproj-offload"])  # fmt: skip
    printed = {d.device: d.projector_bytes for d in devices_from_lines(lines)}
    assert any("CLIP using" in line for line in lines), lines[-5:]
    proj = projector_facts(path)
    facts = read_model_facts(model)
    planned = lane_memory(msgspec.structs.replace(facts, mmproj=proj), LaneShape(
        ctx=512, flash_attn=True, mmproj=True, mmproj_offload=offload, n_gpu_layers="all", devices=("rpc",)))  # fmt: skip
    by_device = {d.device: d.projector_bytes for d in planned.devices}
    holder = "GPU0" if offload else "CPU"
    padding = proj.weight_bytes - proj.file_weight_bytes
    assert 0 <= padding < 32 * 64
    assert abs(by_device[holder] - padding - printed[holder]) <= 0.01 * MIB, (by_device, printed)
    other = "CPU" if offload else "GPU0"
    assert abs(by_device[other] - printed.get(other, 0)) <= 0.005 * MIB, (by_device, printed)
    assert by_device[other] == (image * image * 3 * 4 if offload else 0)
