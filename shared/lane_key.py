"""A lane is known by what it runs: one key of the launch fields that change what llama-server
computes or allocates.

Planner, agent and dashboard compare lanes by this key, never by their rendered argv, so how
argv is spelled (flag order, a flag's form on another build, a log setting the agent adds) can
change between versions without restarting a lane. Left out: what explains or predicts a lane
(reasons, memory, layout, span workers' figures), its id (lanes are matched by id already), and
the argv the agent renders. A field at its default is left out too, so a field added in a
later version (at its default) keeps every existing lane's key.
"""

from __future__ import annotations

import hashlib

import msgspec

from shared.messages.plans import LaneSpec

# The launch fields: every LaneSpec field shared.llama.flags.lane_args reads, and the GPUs the
# lane is placed on (tests/test_lane_key.py holds the list to lane_args).
KEY_FIELDS = (
    "model_path", "alias", "bind", "port",
    "ctx_total", "parallel", "kv_unified", "swa_full", "cache_idle_slots", "n_ubatch",
    "n_gpu_layers", "gpu_devices", "device_names", "tensor_split", "split_mode", "main_gpu", "rpc_servers",
    "cache_type_k", "cache_type_v", "flash_attn", "fit_off", "n_cpu_moe",
    "threads", "threads_batch", "cpus", "poll",
    "chat_template", "cache_ram_mib", "embeddings", "pooling",
    "adapter_paths", "reranking", "mmproj_path", "mmproj_offload", "image_max_tokens",
    "spec_type", "draft_path", "draft_n_gpu_layers", "draft_cache_type_k", "draft_cache_type_v",
)  # fmt: skip
_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(LaneSpec)}


def lane_key(spec: LaneSpec) -> str:
    """sha256 of the canonical JSON of the spec's launch fields that differ from their defaults."""
    fields = {}
    for name in KEY_FIELDS:
        value = getattr(spec, name)
        if value != _DEFAULTS[name]:
            fields[name] = sorted(set(value)) if name == "cpus" else value  # a CPU set, in any order
    return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()
