"""A lane is known by what it runs: the lane key covers every launch field the renderer reads and
nothing that only explains or predicts a lane, and it does not change between versions."""

from __future__ import annotations

import msgspec
import pytest

from shared.lane_key import KEY_FIELDS, lane_key
from shared.llama.flags import lane_args
from shared.messages.hosts import ServerCaps
from shared.messages.plans import LaneLayout, LaneSpec, MemoryBreakdown, SpanWorker

BASE = LaneSpec(lane_id="m-0", model="m", model_path="/models/m.gguf", alias="m", port=8080, ctx_total=4096,
                ctx_per_slot=4096, parallel=1)  # fmt: skip
CAPS = (ServerCaps(), ServerCaps(flash_attn_form="switch", has_no_jinja=False))

# One other value for every field of a lane spec: a field added later must be placed here, in
# the key or out of it.
OTHER = {
    "model_path": "/models/n.gguf", "alias": "n", "bind": "0.0.0.0", "port": 8081,
    "ctx_total": 8192, "parallel": 2, "kv_unified": True, "swa_full": True, "cache_idle_slots": False, "n_ubatch": 1024,
    "n_gpu_layers": 10, "gpu_devices": (0,), "device_names": ("CUDA0",), "tensor_split": (1, 2),
    "split_mode": "layer", "main_gpu": 1, "rpc_servers": ("10.0.0.2:50052",),
    "cache_type_k": "q8_0", "cache_type_v": "q8_0", "flash_attn": "on", "fit_off": True, "n_cpu_moe": 3,
    "threads": 4, "threads_batch": 4, "cpus": (0, 1), "poll": 50,
    "chat_template": "chatml", "cache_ram_mib": 256, "embeddings": True, "pooling": "mean",
    "adapter_paths": ("/models/a.gguf",), "reranking": True,
    "mmproj_path": "/models/mmproj-m.gguf", "mmproj_offload": False, "image_max_tokens": 2116,
    "spec_type": "ngram-mod", "draft_path": "/models/d.gguf", "draft_n_gpu_layers": 7, "draft_cache_type_k": "q8_0",
    "draft_cache_type_v": "q8_0",
    # not launch fields
    "lane_id": "m-1", "model": "n", "ctx_per_slot": 2048, "memory": MemoryBreakdown(kv_bytes=2**20),
    "args": ("--model", "/models/m.gguf"), "reasons": ("why",), "layout": LaneLayout("gpu", (0,)),
    "workers": (SpanWorker(host_id="w", endpoint="10.0.0.2:50052"),), "adapters": ("a",), "draft_model": "d",
    "slot_buddy_host": "h2", "slot_buddy_lane": "m-0", "image_max_aspect": 20,
}  # fmt: skip
NOT_IN_KEY = ("lane_id", "model", "ctx_per_slot", "memory", "args", "reasons", "layout", "workers", "adapters",
              "draft_model", "slot_buddy_host", "slot_buddy_lane", "image_max_aspect")


def test_every_field_is_placed():
    assert set(OTHER) == {f.name for f in msgspec.structs.fields(LaneSpec)}
    assert set(KEY_FIELDS) == set(OTHER) - set(NOT_IN_KEY)


@pytest.mark.parametrize("name", KEY_FIELDS)
def test_a_launch_field_changes_the_key(name):
    assert lane_key(msgspec.structs.replace(BASE, **{name: OTHER[name]})) != lane_key(BASE)


@pytest.mark.parametrize("name", NOT_IN_KEY)
def test_a_field_out_of_the_key_changes_no_argv(name):
    """What the key leaves out, the renderer does not read: a lane the key calls unchanged runs
    the same llama-server."""
    other = msgspec.structs.replace(BASE, **{name: OTHER[name]})
    assert lane_key(other) == lane_key(BASE)
    for caps in CAPS:
        assert lane_args(other, caps) == lane_args(BASE, caps)


def test_the_key_is_stable_across_versions():
    """Recorded: a changed key function restarts every lane of every upgraded host. A field added
    to LaneSpec at its default leaves this value as it is."""
    assert lane_key(BASE) == "c71bc693fe7bca8a7cb0c95f68dd267ab563a3665e4ea6a928fc90a9998b6b08"
    assert lane_key(msgspec.structs.replace(BASE, cpus=(3, 1, 2))) == lane_key(msgspec.structs.replace(BASE, cpus=(1, 2, 3)))
