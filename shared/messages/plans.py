"""The plan: what the planner decided each host runs (HostPlan, FleetPlan), down to every flag
of every lane (LaneSpec) and the memory it predicted for it."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared import defaults
from shared.messages.config import LANE_LOG_FILES, LANE_LOG_MAX_BYTES, LogBytes, LogFiles
from shared.messages.wire import (
    FEW,
    LINES,
    MANY,
    Bytes,
    CacheType,
    CpuId,
    DeviceName,
    FlashAttn,
    GpuIndex,
    Int32,
    Label,
    Message,
    Name,
    Port,
    Revision,
    RpcEndpoint,
    SpecType,
    Text,
)

Device = Literal["cpu", "gpu"]
# Layers a lane offloads: a count, or every block and the output layer. The wire's
# LaneSpec.n_gpu_layers stays the int -ngl gets (shared.memory.placement.ngl_count).
NGpuLayers = Annotated[int, msgspec.Meta(ge=0, le=65536)] | Literal["all"]
LayoutKind = Literal["gpu", "split", "partial", "cpu"]


class DeviceMemory(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One device's share of a lane: each buffer llama-server allocates there (-lv 4 lines)."""

    device: Label  # "CPU" (host RAM) or "GPU0", "GPU1" ... in llama-server's device order for the lane
    model_bytes: Bytes = 0
    kv_bytes: Bytes = 0
    compute_bytes: Bytes = 0
    output_bytes: Bytes = 0
    recurrent_bytes: Bytes = 0
    layers: Annotated[int, msgspec.Meta(ge=0, le=65538)] = 0  # layers (blocks and output) assigned here
    prompt_cache_bytes: Bytes = 0  # llama-server's host-RAM prompt cache (--cache-ram), at its limit
    # The lane's device: -1 host RAM, k the k-th GPU-type device in llama-server's order for the
    # lane (LaneSpec.gpu_devices[k] on the host). Read this, never the name.
    index: Annotated[int, msgspec.Meta(ge=-1, le=1023)] = -1
    backend: Label = ""  # "cpu" for host RAM; cuda, rocm, metal, rpc, vulkan; "" not known
    adapter_bytes: Bytes = 0  # LoRA adapters' tensors (`LoRA buffer size` lines)
    projector_bytes: Bytes = 0  # the multimodal projector's weights and compute buffer (--mmproj)
    # Of the buffers above, the draft model's (its weights, KV and compute: llama-server prints them
    # as lines of the same kinds); and the n-gram speculator's tables (host RAM, printed by none).
    draft_bytes: Bytes = 0
    speculator_bytes: Bytes = 0

    def __post_init__(self) -> None:
        # Written by an older lanes (no index, no backend): the name is all there is.
        if self.device == "CPU":
            if not self.backend:
                msgspec.structs.force_setattr(self, "backend", "cpu")
        elif self.index < 0 and self.device[3:].isdigit():
            msgspec.structs.force_setattr(self, "index", int(self.device[3:]))

    @property
    def total(self) -> int:
        return (self.model_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes + self.recurrent_bytes
                + self.prompt_cache_bytes + self.adapter_bytes + self.projector_bytes
                + self.speculator_bytes)  # fmt: skip


class MemoryBreakdown(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    device: Device = "cpu"
    weights_bytes: Bytes = 0
    kv_bytes: Bytes = 0
    kv_k_bytes: Bytes = 0
    kv_v_bytes: Bytes = 0
    kv_cells: Int32 = 0
    kv_streams: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 1
    swa_cells: Int32 = 0
    recurrent_bytes: Bytes = 0
    compute_bytes: Bytes = 0
    overhead_bytes: Bytes = 0
    prompt_cache_bytes: Bytes = 0  # --cache-ram, in host RAM
    total_bytes: Bytes = 0
    # Per device (CPU first); the totals above are their sums plus the process overhead.
    devices: Annotated[tuple[DeviceMemory, ...], FEW] = ()
    adapter_bytes: Bytes = 0  # LoRA adapters' tensors, summed over devices
    projector_bytes: Bytes = 0  # the multimodal projector's weights and compute (in total_bytes)
    # Speculative decoding's share of the figures above: the draft model's buffers, the n-gram tables.
    draft_bytes: Bytes = 0
    speculator_bytes: Bytes = 0


class LaneLayout(msgspec.Struct, frozen=True, gc=False):
    """Where a lane runs on its host, as the planner chose it (the fastest that fit): one GPU
    whole, split over several, partial offload, or the CPU. A replan starts from it."""

    kind: LayoutKind = "cpu"
    gpus: Annotated[tuple[GpuIndex, ...], FEW] = ()  # host GPU indices, llama-server order
    shares: Annotated[tuple[Bytes, ...], FEW] = ()  # tensor split (MiB of free VRAM) when more than one GPU
    n_gpu_layers: NGpuLayers = 0
    # Every layer on the GPUs, but the expert tensors of the first n_cpu_moe blocks in RAM.
    n_cpu_moe: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0


class SpanWorker(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One worker of a span lane: the host whose ggml-rpc-server holds some of its layers."""

    host_id: Name
    endpoint: RpcEndpoint  # host:port the serving llama-server reaches it on (--rpc)
    device: Label = "CPU"  # the worker's device ggml-rpc-server exposes
    index: GpuIndex = 0  # the lane's device index (DeviceMemory.index, RPC<index> to llama-server)
    model_bytes: Bytes = 0
    kv_bytes: Bytes = 0
    compute_bytes: Bytes = 0
    # Everything reserved on the worker for it (buffers and the ggml-rpc-server process).
    reserved_bytes: Bytes = 0


class RpcWorkerSpec(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What a worker host runs for a span lane of another host: one ggml-rpc-server."""

    lane_id: Name
    serving_host: Name
    bind: Label
    port: Port
    device: Label = "CPU"
    reserved_bytes: Bytes = 0


class LaneSpec(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One llama-server instance, with every flag decided in typed fields: the contract between
    planner and agent. The agent renders argv from it (shared.llama.flags.lane_args); a lane is
    known by shared.lane_key of it."""

    lane_id: Name
    model: Name
    model_path: Text
    alias: Name
    port: Port
    bind: Label = "127.0.0.1"
    ctx_total: Annotated[int, msgspec.Meta(ge=256, le=2**31 - 1)]
    ctx_per_slot: Int32
    parallel: Annotated[int, msgspec.Meta(ge=1, le=256)]
    kv_unified: bool = False
    # --swa-full: a sliding-window model's whole window cached, so a saved slot reads back complete
    swa_full: bool = False
    # False: --no-cache-idle-slots (a unified cache keeps idle and restored slots in place; None:
    # the binary's default, which empties them into the RAM prompt cache at each new task)
    cache_idle_slots: bool | None = None
    n_gpu_layers: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0
    # Indices into the host's reported gpus the lane is pinned to (--device), in order;
    # with more than one, tensor_split gives each its share of the layers (-ts).
    gpu_devices: Annotated[tuple[GpuIndex, ...], FEW] = ()
    # llama-server's names for them (--device), when the host reported them
    device_names: Annotated[tuple[DeviceName, ...], FEW] = ()
    tensor_split: Annotated[tuple[Bytes, ...], FEW] = ()
    split_mode: Literal["layer", "none"] | None = None
    main_gpu: GpuIndex | None = None
    # --rpc, for hosts whose GPU-type devices are ggml-rpc-servers
    rpc_servers: Annotated[tuple[RpcEndpoint, ...], FEW] = ()
    cache_type_k: CacheType | None = None
    cache_type_v: CacheType | None = None
    flash_attn: FlashAttn | None = None
    fit_off: bool = False
    n_ubatch: Annotated[int, msgspec.Meta(ge=1, le=65536)] = defaults.N_UBATCH
    memory: MemoryBreakdown = MemoryBreakdown()
    # CPU threads (--threads, --threads-batch); None: llama-server's default (every core).
    threads: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    threads_batch: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    # CPU ids its threads are pinned to (--cpu-range / --cpu-mask)
    cpus: Annotated[tuple[CpuId, ...], msgspec.Meta(max_length=65536)] = ()
    poll: Annotated[int, msgspec.Meta(ge=0, le=100)] | None = None
    # The argv tail, rendered into plans only for agents too old to render it (and by older
    # planners); an agent that renders checks it by meaning and launches its own rendering.
    args: Annotated[tuple[Text, ...], LINES] = ()
    reasons: Annotated[tuple[Text, ...], LINES] = ()
    # The layout the device fields above were rendered from (None: an older planner wrote the spec).
    layout: LaneLayout | None = None
    # --n-cpu-moe: the expert tensors of the first N blocks stay in RAM (0: none).
    n_cpu_moe: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0
    # --chat-template NAME: one of llama-server's built-in templates, for a file without its own.
    chat_template: Name | None = None
    # --cache-ram in MiB: the host-RAM prompt cache the plan counts (0: off); None: an older planner's
    # spec, without the flag (llama-server's own default, 8192, uncounted).
    cache_ram_mib: Annotated[int, msgspec.Meta(ge=0, le=2**40)] | None = None
    embeddings: bool = False  # --embeddings: the lane serves /v1/embeddings only
    pooling: Literal["mean", "cls", "last", "rank"] | None = None  # --pooling, for a model that declares none
    # A span lane: its layers also lie on these workers' ggml-rpc-servers (rpc_servers, in order).
    workers: Annotated[tuple[SpanWorker, ...], FEW] = ()
    # LoRA adapters it loads (--lora, in this order: a request's `lora` ids index it), by name and path.
    adapters: Annotated[tuple[Name, ...], FEW] = ()
    adapter_paths: Annotated[tuple[Text, ...], FEW] = ()
    reranking: bool = False  # --reranking: the lane serves /v1/rerank only
    # --mmproj: the multimodal projector the lane loads (None: text only), and where it runs:
    # True --mmproj-offload (the lane's first device), False --no-mmproj-offload (host RAM).
    mmproj_path: Text | None = None
    mmproj_offload: bool | None = None
    # --image-max-tokens: the largest image the projector takes, where its buffer would grow past
    # the planned warm-up's for a larger one (Qwen2-VL's family: its warm-up's 46 x 46 tokens).
    image_max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    # The longest image (long side over short) its plan holds, where llama.cpp bounds none and a longer
    # one would grow the projector's buffer past the plan: gateways refuse longer ones. None: any.
    image_max_aspect: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    # Speculative decoding (--spec-type); with draft-simple, the draft model (--spec-draft-model),
    # its layers on the lane's devices (--spec-draft-ngl) and its K/V types (-ctkd/-ctvd: None, f16).
    spec_type: SpecType | None = None
    draft_model: Name | None = None
    draft_path: Text = ""
    draft_n_gpu_layers: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0
    draft_cache_type_k: CacheType | None = None
    draft_cache_type_v: CacheType | None = None
    # Where its saved slots go when it stops or restarts (shared/messages/slots.py): another lane of
    # its model that serves meanwhile (None: none). Not a launch field: a new buddy restarts nothing.
    slot_buddy_host: Name | None = None
    slot_buddy_lane: Name | None = None


class Unplaced(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    model: Label
    reason: Text


class HostPlan(Message, tag="host_plan", kw_only=True):
    host_id: Name
    plan_revision: Revision = 0
    config_revision: Revision = 0
    budget_ram: Bytes = 0
    budget_gpu: Bytes = 0
    # Per GPU (index into the host report's gpus): what lanes may use there.
    budget_gpus: Annotated[tuple[Bytes, ...], FEW] = ()
    # Rollout pace: how many serving lanes the agent may restart at once for a change.
    max_restarts: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1
    # Seconds the agent waits for a draining lane's requests before it restarts or stops it.
    drain_timeout: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = defaults.DRAIN_TIMEOUT
    lanes: Annotated[tuple[LaneSpec, ...], msgspec.Meta(max_length=1000)] = ()  # at most a host's ports
    # Disk the agent may fill with saved slots (launcher_agent/slot_cache.py); 0: none saved.
    slot_cache_bytes: Bytes = defaults.SLOT_CACHE_BYTES
    unplaced: Annotated[tuple[Unplaced, ...], MANY] = ()
    reasons: Annotated[tuple[Text, ...], MANY] = ()
    # The planner that wrote it (its lease holder id): a stand-by adopts only the active one's plans.
    planned_by: Label = ""
    # ggml-rpc-servers this host runs for span lanes of other hosts (agents with --rpc-worker).
    rpc_workers: Annotated[tuple[RpcWorkerSpec, ...], msgspec.Meta(max_length=1000)] = ()
    # Run time only (a change restarts no lane; lanes started after it follow it): log rotation.
    lane_log_max_bytes: LogBytes = LANE_LOG_MAX_BYTES
    lane_log_files: LogFiles = LANE_LOG_FILES


class FleetPlan(Message, tag="fleet_plan", kw_only=True):
    hosts: Annotated[tuple[HostPlan, ...], MANY] = ()
    unplaced: Annotated[tuple[Unplaced, ...], MANY] = ()
