"""Every message lanes puts on the wire, as msgspec Structs.

All structs are frozen and tagged (`kind`) and carry a `schema` version, so a
reader can tell what it holds before trusting it. New fields must get
defaults; a field's type never changes (see docs/schemas/).
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec

from shared import defaults

SCHEMA_VERSION = 2
# A reader accepts messages one schema version older or newer than its own (rolling upgrades).
SCHEMA_SKEW = 1
T = TypeVar("T")

CacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
FlashAttn = Literal["on", "off", "auto"]
FlashAttnForm = Literal["value", "switch"]
KvLayout = Literal["streams", "shared"]
# llama-server's --spec-type names lanes plans (shared/memory/speculative.py sizes each).
SpecType = Literal["draft-simple", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]
# A persona's `speculative`: off, auto (on where bench/spec_bench.py measured a gain), or a type.
SpecMode = Literal["off", "auto"] | SpecType
Device = Literal["cpu", "gpu"]
# "unresponsive": a serving lane stopped answering /health; routers take it out at once.
LaneState = Literal["starting", "loading", "healthy", "unresponsive", "mismatch", "crashed", "failed", "stopped"]
FailureKind = Literal["oom", "unsupported", "over_plan", "crash_loop", "port_busy", "unresponsive", "other"]
HostState = Literal["live", "lost"]
# Layers a lane offloads: a count, or every block and the output layer. The wire's
# LaneSpec.n_gpu_layers stays the int -ngl gets (shared.memory.placement.ngl_count).
NGpuLayers = Annotated[int, msgspec.Meta(ge=0, le=65536)] | Literal["all"]
LayoutKind = Literal["gpu", "split", "partial", "cpu"]

# Every field of every message has a range (bus input is bounded): a value outside it fails the
# decode, and the reader logs the reason and drops the message.
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PortOrNone = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: none
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**60)]  # up to 1 EiB
Int32 = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # model dimensions, token counts (llama.cpp's int32)
Count = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]  # restarts, requests, experts
Revision = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Pid = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
GpuIndex = Annotated[int, msgspec.Meta(ge=0, le=1023)]  # a GPU among the host's reported ones
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]  # a duration or age (about 31 years)
Label = Annotated[str, msgspec.Meta(max_length=256)]  # versions, backends, ids, addresses
Text = Annotated[str, msgspec.Meta(max_length=65536)]  # a reason, an error, a log line, a path, an argument
# llama-server's name for a device (--device): CUDA0, ROCm1, Vulkan0, MTL0, SYCL0, RPC0, RPC0[host:port].
_DEVICE = r"[A-Za-z][A-Za-z0-9_-]*(\[[A-Za-z0-9._:\[\]-]+\])?"
DeviceName = Annotated[str, msgspec.Meta(max_length=128, pattern=f"^{_DEVICE}$")]
# A ggml-rpc-server endpoint (--rpc): host:port, the host a name, an IPv4 address or [IPv6].
_ENDPOINT = r"([A-Za-z0-9][A-Za-z0-9._-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}"
RpcEndpoint = Annotated[str, msgspec.Meta(pattern=f"^{_ENDPOINT}$")]
# Tuple lengths: devices of a host or a lane, lines of text, things of a fleet.
FEW = msgspec.Meta(max_length=64)
LINES = msgspec.Meta(max_length=4096)
MANY = msgspec.Meta(max_length=100_000)
# A CPU as the kernel numbers it; the bound keeps a hostile plan from rendering a huge --cpu-mask.
CpuId = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]


class _Msg(msgspec.Struct, frozen=True, gc=False, kw_only=True, tag_field="kind"):
    schema: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = SCHEMA_VERSION


def schema_problem(msg: _Msg) -> str | None:
    """Why a message's schema version is too far from ours to trust, or None."""
    if abs(msg.schema - SCHEMA_VERSION) > SCHEMA_SKEW:
        return f"schema {msg.schema} is not within {SCHEMA_SKEW} of this reader's {SCHEMA_VERSION}; upgrade it"
    return None


# ---------------------------------------------------------------- host facts


class GpuInfo(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    name: Label
    vram_total: Bytes
    vram_free: Bytes
    backend: Label = "cuda"  # cuda | metal | rpc | vulkan | rocm
    # llama-server's name for it (--device): CUDA0, MTL0, RPC0[127.0.0.1:50052]; "" if unknown.
    device: Label = ""
    # VRAM this host's own lanes hold on this GPU now: the planner may hand it out again.
    lanes_vram: Bytes = 0
    # Unified memory (Apple Silicon): vram_total is Metal's working-set limit, carved out of RAM.
    unified: bool = False
    # The last GPU query failed (NVML error): these figures are the last good ones, not zero.
    stale: bool = False
    # An RPC device (ggml-rpc-server): its host:port, passed to llama-server as --rpc.
    endpoint: Annotated[str, msgspec.Meta(pattern=f"^({_ENDPOINT})?$")] = ""


class ServerCaps(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What one llama-server binary accepts, read from its own --help/--version."""

    build: Int32 | None = None
    version: Label = ""
    flash_attn_form: FlashAttnForm = "value"
    cache_types: Annotated[tuple[CacheType, ...], FEW] = (
        "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1",
    )  # fmt: skip
    has_fit: bool = True
    has_kv_unified: bool = True
    has_swa_full: bool = True
    # "streams": one KV stream per slot and a separate sliding-window cache (current builds).
    # "shared": one cache shared by all slots and no SWA cache (builds of early 2025).
    kv_layout: KvLayout = "streams"
    # How -ngl N picks layers: "output_first" (current: the output layer, then the last N-1
    # blocks) or "blocks_first" (older builds: the last N blocks; the output only when N > n_layer).
    ngl_rule: Literal["output_first", "blocks_first"] = "output_first"
    has_device: bool = True  # -dev/--device: pin a lane to named devices
    has_cpu_range: bool = True  # -Cr/--cpu-range and -C/--cpu-mask: pin a lane's threads to CPUs
    has_poll: bool = True  # --poll <0...100>: how hard idle threads spin
    has_n_cpu_moe: bool = True  # -ncmoe/--n-cpu-moe N: the experts of the first N blocks in RAM (Aug 2025)
    has_chat_template: bool = True  # --chat-template NAME: a built-in template by name
    has_no_jinja: bool = True  # --no-jinja: jinja is on by default, so a template name needs it first
    has_cache_ram: bool = True  # -cram/--cache-ram N: the host-RAM prompt cache's limit
    has_slot_save: bool = True  # --slot-save-path DIR: POST /slots/{id}?action=save|restore
    # --rpc works: built with the RPC backend (every build lists --rpc in --help; one without it
    # refuses it with "RPC not supported in this build"). Only such a host serves a span lane.
    has_rpc: bool = True
    # --lora-scaled FILE:SCALE[,...] (adapters loaded at scale 0: a request's `lora` field picks
    # them); --reranking (/v1/rerank).
    has_lora: bool = True
    has_reranking: bool = True
    has_mmproj: bool = True  # --mmproj and --mmproj-offload/--no-mmproj-offload
    # --spec-type's values (empty: a binary without speculative decoding), and which of the draft
    # flags lanes renders its --help lists, by their current long names (a removed one never shows).
    spec_types: Annotated[tuple[Label, ...], FEW] = ()
    spec_flags: Annotated[tuple[Label, ...], FEW] = ()


class LayerWeights(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """The weights of one layer index, as llama.cpp groups them onto devices.

    layer -1 is the input (token embeddings, always on the CPU), 0..n_layer-1 the blocks,
    n_layer the output layer. `first`/`end` are file offsets of its tensors (a CPU
    lane maps that range of the file). `repack` lists (ggml type, largest of 8/4/1
    dividing the rows, bytes) of its matrix weights: CPUs with the matching kernels
    copy those into a CPU_REPACK buffer instead of mapping them.
    """

    layer: Annotated[int, msgspec.Meta(ge=-1, le=65536)]
    bytes: Bytes  # each tensor padded to 32 bytes (CPU and RPC buffers)
    cuda_bytes: Bytes  # as CUDA allocates: a quantized tensor gets one row padded to 512 values, 128-byte alignment
    first: Bytes
    end: Bytes
    repack: Annotated[tuple[tuple[Label, Int32, Bytes], ...], FEW] = ()
    # File ranges by repack key: (ggml type, rows multiple, first, end); ("", 0, ...) for tensors no
    # CPU repacks. A CPU maps only the range of what it does not repack (empty: from an older lanes).
    spans: Annotated[tuple[tuple[Label, Int32, Bytes, Bytes], ...], FEW] = ()


class ProjectorFacts(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A multimodal projector (mmproj GGUF, general.architecture = clip) paired with a model:
    what the memory model needs to plan its weights and compute buffer (tools/mtmd/clip.cpp)."""

    path: Text
    projector_type: Label  # clip.projector_type: gemma3, idefics3, qwen2vl_merger ...
    vision: bool = True  # clip.has_vision_encoder: the model takes images
    audio: bool = False  # clip.has_audio_encoder
    weight_bytes: Bytes = 0  # its tensors, each padded to 32 bytes (CPU buffer)
    weight_cuda_bytes: Bytes = 0  # as CUDA allocates them
    file_weight_bytes: Bytes = 0  # the unpadded sum clip.cpp prints as "model size"
    n_embd: Int32 = 0
    n_ff: Int32 = 0
    n_head: Int32 = 0
    n_layer: Int32 = 0
    image_size: Int32 = 0
    patch_size: Int32 = 0
    n_merge: Int32 = 0  # clip.vision.projector.scale_factor (0: the type's default)
    n_mmproj_embd: Int32 = 0  # the text model's n_embd it feeds
    file_bytes: Bytes = 0
    file_mtime_ns: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] = 0


class ModelFacts(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What the memory model needs from a GGUF file; per-layer lists have n_layer entries."""

    path: Text
    name: Name
    architecture: Label
    n_layer: Annotated[int, msgspec.Meta(ge=0, le=65536)]
    n_embd: Int32
    n_head: Int32
    n_head_kv: Annotated[tuple[Int32, ...], msgspec.Meta(max_length=65536)]
    head_dim_k: Int32
    head_dim_v: Int32
    n_ctx_train: Int32
    n_vocab: Int32 = 0
    n_ff: Int32 = 0
    n_swa: Int32 = 0
    swa_layers: Annotated[tuple[bool, ...], msgspec.Meta(max_length=65536)] = ()
    is_mla: bool = False
    recurrent_layers: Annotated[tuple[bool, ...], msgspec.Meta(max_length=65536)] = ()
    recurrent_bytes_per_seq: Bytes = 0
    weight_bytes: Bytes = 0
    file_bytes: Bytes = 0
    # Per-layer weights for placing the model over devices (empty: facts from an older agent).
    layer_weights: Annotated[tuple[LayerWeights, ...], msgspec.Meta(max_length=65538)] = ()
    # No output.weight: llama.cpp uses a duplicate of token_embd on the output layer's device.
    tied_output_bytes: Bytes = 0
    tied_output_cuda_bytes: Bytes = 0
    file_mtime_ns: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] = 0
    # Mixture of Experts: routed experts per layer, how many each token uses, their FFN width,
    # and the shared expert's (0: none). `expert_weights` holds, per block, its expert tensors
    # (the ones --n-cpu-moe and -ot exps=CPU move: blk.N.ffn_{gate,up,down,gate_up}_exps),
    # already counted in that block's layer_weights entry.
    n_expert: Count = 0
    n_expert_used: Count = 0
    n_ff_exp: Int32 = 0
    n_ff_shexp: Int32 = 0
    expert_weights: Annotated[tuple[LayerWeights, ...], msgspec.Meta(max_length=65538)] = ()
    # The file carries tokenizer.chat_template (False: llama-server would fall back to ChatML).
    has_chat_template: bool = True
    # {arch}.pooling_type as llama.cpp names it (mean, cls, last, rank); "" when the file declares
    # none: a model that declares one is an embedding model and its lanes serve embeddings.
    pooling: Label = ""
    # The multimodal projector paired with it (a *mmproj*.gguf beside it); None: text only.
    mmproj: ProjectorFacts | None = None
    # The vocabulary's identity: a hash of tokenizer.ggml.model, pre and the token list ("": an
    # older agent). A draft model must share it (and n_vocab) with its target.
    vocab_id: Label = ""


OUTPUT_LAYER = 65536  # an adapter's output tensors: the layer after its base's last block, whatever n_layer


class AdapterFacts(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A LoRA adapter file (general.type = adapter): the models it fits and what it allocates.

    `layer_weights` groups its lora_a/lora_b tensors by the layer of the base tensor each pair
    modifies (-1 token_embd, the block, OUTPUT_LAYER for output.*): llama.cpp allocates each
    pair in the buffer type of that base tensor (llama_adapter_lora_init_impl)."""

    path: Text
    name: Name
    architecture: Label
    # Models on this host it loads onto (same architecture, every tensor's base present with
    # matching shape): the ones beside it first.
    bases: Annotated[tuple[Name, ...], FEW] = ()
    file_bytes: Bytes = 0
    alpha: Annotated[float, msgspec.Meta(ge=-1e9, le=1e9)] = 0.0
    rank: Int32 = 0
    layer_weights: Annotated[tuple[LayerWeights, ...], msgspec.Meta(max_length=65538)] = ()


class RpcWorkerOffer(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A host whose agent was started with --rpc-worker: it may run ggml-rpc-server for a span
    lane of another host, bound to `address` (the operator's --advertise) on a port of its range."""

    address: Label
    port_base: Port = defaults.RPC_WORKER_PORT_BASE
    port_count: Annotated[int, msgspec.Meta(ge=1, le=1000)] = defaults.RPC_WORKER_PORT_COUNT
    # The device it offers, as ggml-rpc-server exposes it: "CPU" (its RAM) on a CPU-only host.
    device: Label = "CPU"


class HostReport(_Msg, tag="host_report", kw_only=True):
    host_id: Name
    cpu_cores: Annotated[int, msgspec.Meta(ge=1, le=65536)]  # logical CPUs
    ram_total: Bytes
    ram_available: Bytes
    # Memory the host's own lanes hold now: the planner may hand it out again.
    lanes_rss: Bytes = 0
    lanes_vram: Bytes = 0
    gpus: Annotated[tuple[GpuInfo, ...], FEW] = ()
    # Matrix weight types this host's CPU backend repacks into CPU_REPACK, as "TYPE:rows"
    # (rows: the multiple the row count must have). None: unknown, assume x86 AVX2's set.
    cpu_repack: Annotated[tuple[Label, ...], FEW] | None = None
    server: ServerCaps | None = None
    models: Annotated[tuple[ModelFacts, ...], MANY] = ()
    port_base: Port = defaults.LANE_PORT_BASE
    port_count: Annotated[int, msgspec.Meta(ge=1, le=1000)] = defaults.LANE_PORT_COUNT
    # Address lanes listen on: 127.0.0.1 keeps them local, 0.0.0.0 serves the network.
    lane_bind: Label = "127.0.0.1"
    agent_version: Label = ""
    # The agent renders each lane's argv from the typed spec itself (False: an older agent,
    # whose plans the planner still renders `args` into).
    renders_argv: bool = False
    # Seconds between this agent's reports: the planner calls the host lost after a few missed.
    report_interval: Annotated[float, msgspec.Meta(gt=0, le=86400.0)] = defaults.REPORT_INTERVAL
    # Physical cores (the logical count where the platform does not tell); None: an agent too
    # old to render thread flags, whose lanes keep llama-server's default threads.
    cpu_physical: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    # Performance cores of a hybrid CPU (P/E cores), where the host tells them apart.
    cpu_performance: Annotated[int, msgspec.Meta(ge=1, le=65536)] | None = None
    # Logical CPU ids to pin lanes to, one per core this agent may use, performance cores first.
    cpu_ids: Annotated[tuple[CpuId, ...], msgspec.Meta(max_length=65536)] = ()
    # Set when the agent runs with --rpc-worker: it may lend its memory to another host's lane.
    rpc_worker: RpcWorkerOffer | None = None
    # Memory its ggml-rpc-servers hold now (like lanes_rss: the planner may hand it out again).
    workers_rss: Bytes = 0
    # LoRA adapter files under its model folders, each with the models it fits.
    adapters: Annotated[tuple[AdapterFacts, ...], MANY] = ()


# ---------------------------------------------------------------- fleet intent


LANE_LOG_MAX_BYTES = 16 * 1024 * 1024
LANE_LOG_FILES = 3
LogBytes = Annotated[int, msgspec.Meta(ge=64 * 1024, le=1 << 40)]
LogFiles = Annotated[int, msgspec.Meta(ge=1, le=100)]


class FleetConfig(_Msg, tag="fleet_config", forbid_unknown_fields=True, kw_only=True):
    """Fleet-wide knobs. Unset cache types / flash_attn mean: pass no flag at all."""

    # K and V cache type of every lane (--cache-type-k/-v); None: no cache-type flags (f16).
    kv_cache_type: CacheType | None = None
    # The K cache type alone, over kv_cache_type.
    kv_cache_type_k: CacheType | None = None
    # The V cache type alone, over kv_cache_type (a quantized V forces flash attention on).
    kv_cache_type_v: CacheType | None = None
    # Flash attention for every lane (-fa); None: no flag (the binary's default).
    flash_attn: FlashAttn | None = None
    # Memory left free on every host and device, in bytes (with headroom_fraction: the larger).
    headroom_bytes: Bytes = defaults.HEADROOM_BYTES
    # Memory left free on every host and device, as a fraction of it.
    headroom_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=0.9)] = 0.05
    # A running lane keeps its window (and prompt cache) unless a replan moves it by more than this.
    min_gain_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.10
    # llama-server's --ubatch-size, used by the sliding-window and compute sizing.
    n_ubatch: Annotated[int, msgspec.Meta(ge=1, le=65536)] = defaults.N_UBATCH
    # Place a lane on the largest GPU when it fits there entirely.
    use_gpu: bool = True
    # Serving lanes one agent restarts at a time for a change.
    max_restarts_per_host: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1
    # Lanes of one model a fleet-wide change may take out of service at a time, across all hosts:
    # a count, or a fraction of the model's lanes (at least one); the next once they serve again.
    max_unavailable: Annotated[int, msgspec.Meta(ge=1, le=10000)] | Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 1
    # Seconds an agent waits for a draining lane's requests in flight before it restarts it.
    drain_timeout: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = defaults.DRAIN_TIMEOUT
    # Disk each host may fill with saved slots (the KV of a lane's hot prompts, written before a
    # planned restart or stop and restored into its next lane); 0: slots are never saved.
    slot_cache_bytes: Bytes = defaults.SLOT_CACHE_BYTES
    # Seconds of silence (no report or status) after which a host is lost; unset: 3 report intervals.
    host_lost_after: Annotated[float, msgspec.Meta(gt=0, le=86400.0)] | None = None
    # CPU threads per lane (--threads and --threads-batch); None: planned from the host's cores;
    # 0: no thread flags at all (llama-server's default: every core for each lane).
    threads: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    # A running lane's planned threads change only when its share moves by this fraction or more.
    threads_min_gain: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 0.5
    # Give the lanes of a host disjoint CPU sets (--cpu-range / --cpu-mask).
    cpu_pinning: bool = False
    # How hard idle threads spin (--poll, 0-100; llama-server's default 50); None: no flag.
    poll: Annotated[int, msgspec.Meta(ge=0, le=100)] | None = None
    # Models on demand: seconds with no request after which a model's lanes unload (a
    # persona's idle_ttl overrides it); 0: never, lanes stay loaded as planned.
    idle_ttl: Annotated[float, msgspec.Meta(ge=0.0, le=31_536_000.0)] = 0.0
    # A lane loaded less than this many seconds ago is never evicted to make room (anti-thrash).
    min_residency: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 30.0
    # Scaling by demand (personas with max_lanes): a lane is added when a gateway reports a queue
    # wait above scale_up_wait seconds this many reports in a row, and an added lane is removed
    # once its model had no queue and spare slots for scale_down_idle seconds.
    scale_up_wait: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 2.0
    # Reports in a row with a queue wait above scale_up_wait before a lane is added.
    scale_up_reports: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3
    # Seconds of calm (no queue, spare slots) before an added lane is removed, and between changes.
    scale_down_idle: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 60.0
    # Each lane's log rotates at this size, keeping this many files (the current one included).
    lane_log_max_bytes: LogBytes = LANE_LOG_MAX_BYTES
    # Files of a lane's log kept in all (the current one included).
    lane_log_files: LogFiles = LANE_LOG_FILES
    # Counts config changes (1, 2, 3 ...); the planner sets it on each `config set`.
    revision: Revision = 0
    # Speculative decoding for personas that do not set it (planner_svc/speculative.py).
    speculative: SpecMode = defaults.SPECULATIVE


class Persona(msgspec.Struct, frozen=True, gc=False, kw_only=True, forbid_unknown_fields=True):
    """A model to serve. `model` matches a model's name (file stem) on the hosts."""

    # A model's name: its file name without .gguf.
    model: Name
    # Another name clients may ask for (the request's `model`).
    alias: Name | None = None
    # Lanes wanted fleet-wide; None means one on every host that holds the model.
    lanes: Annotated[int, msgspec.Meta(ge=0, le=10000)] | None = None
    # Slots per lane (--parallel).
    parallel: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    # One KV cache shared by the slots (--kv-unified) instead of one window per slot.
    kv_unified: bool = False
    # The window floor per slot: a lane that cannot get it is not placed.
    ctx_min: Annotated[int, msgspec.Meta(ge=256, le=2**31 - 1)] = 2048
    # The window ceiling per slot (also capped at the model's trained context); None: the trained context.
    ctx_max: Annotated[int, msgspec.Meta(ge=256, le=2**31 - 1)] | None = None
    # Higher is placed first and evicted last.
    priority: Annotated[int, msgspec.Meta(ge=-1_000_000, le=1_000_000)] = 0
    # Seconds with no request before this model's lanes unload; None: the fleet's idle_ttl; 0: never.
    idle_ttl: Annotated[float, msgspec.Meta(ge=0.0, le=31_536_000.0)] | None = None
    # Lanes that are never unloaded or evicted (pinned); the model is loaded even before any request.
    min_lanes: Annotated[int, msgspec.Meta(ge=0, le=10000)] = 0
    # Lanes the planner may grow this model to while its queue wait stays above the fleet's
    # scale_up_wait (planner_svc/scaling.py); None: no scaling, its lanes stay as planned.
    max_lanes: Annotated[int, msgspec.Meta(ge=1, le=10000)] | None = None
    # Lanes serve /v1/embeddings only (llama-server --embeddings); None: when the model's GGUF
    # declares a pooling type (an embedding model).
    embeddings: bool | None = None
    # LoRA adapters (file stems) its lanes load (--lora); a request picks one as `model: "name:adapter"`.
    adapters: Annotated[tuple[Name, ...], FEW] = ()
    # Lanes serve /v1/rerank (llama-server --reranking); None: when the GGUF declares rank pooling.
    reranking: bool | None = None
    # Lanes load the model's multimodal projector (--mmproj) and take images; None: when a
    # projector is paired with the model file (a *mmproj*.gguf beside it); False: text only.
    vision: bool | None = None
    # Speculative decoding: off, auto or a --spec-type; None: the fleet's `speculative`.
    speculative: SpecMode | None = None
    # The draft model for draft-simple (a model name on the host); None: found by shared vocabulary.
    draft: Name | None = None


class Demand(_Msg, tag="demand", forbid_unknown_fields=True, kw_only=True):
    personas: Annotated[tuple[Persona, ...], msgspec.Meta(max_length=10_000)] = ()


class LaneFeedback(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """What went wrong with a lane as the agent saw it; the planner corrects for it."""

    lane_id: Name
    model: Name
    kind: FailureKind
    cache_type_k: CacheType | None = None
    cache_type_v: CacheType | None = None
    ctx_total: Int32 = 0
    planned_bytes: Bytes = 0
    actual_bytes: Bytes = 0
    detail: Text = ""
    port: PortOrNone = 0  # port_busy: the port another program holds
    # Unix time the agent noted it; it expires after the agent's feedback TTL
    noted_at: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)] = 0.0
    # The spec this lane last ran healthy with, when the failing one was a change to it:
    # the planner reverts to it rather than guessing a correction.
    last_good: LaneSpec | None = None


# ---------------------------------------------------------------- the plan


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
    # Speculative decoding (--spec-type); with draft-simple, the draft model (--spec-draft-model),
    # its layers on the lane's devices (--spec-draft-ngl) and its K/V types (-ctkd/-ctvd: None, f16).
    spec_type: SpecType | None = None
    draft_model: Name | None = None
    draft_path: Text = ""
    draft_n_gpu_layers: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0
    draft_cache_type_k: CacheType | None = None
    draft_cache_type_v: CacheType | None = None


class Unplaced(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    model: Label
    reason: Text


class HostPlan(_Msg, tag="host_plan", kw_only=True):
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


class FleetPlan(_Msg, tag="fleet_plan", kw_only=True):
    hosts: Annotated[tuple[HostPlan, ...], MANY] = ()
    unplaced: Annotated[tuple[Unplaced, ...], MANY] = ()


# ---------------------------------------------------------------- what runs


class LaneStatus(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    lane_id: Name
    state: LaneState
    port: PortOrNone = 0
    pid: Pid | None = None
    plan_revision: Revision = 0
    ctx_total: Int32 = 0
    planned_bytes: Bytes = 0
    planned_kv_bytes: Bytes = 0
    kv_bytes: Bytes | None = None
    rss_bytes: Bytes | None = None
    restarts: Count = 0
    last_error: Text = ""
    stderr_tail: Annotated[tuple[Text, ...], LINES] = ()
    argv: Annotated[tuple[Text, ...], LINES] = ()
    # shared.lane_key of the spec it runs: a dashboard tells a lane still on its previous spec
    # from argv the agent merely spells differently ("": an agent too old to say).
    lane_key: Annotated[str, msgspec.Meta(max_length=64)] = ""
    failure: FailureKind | None = None
    # Per device, the buffers llama-server printed (-lv 4 lines); the plan's spec.memory.devices
    # holds the predicted ones. Empty until the lane has loaded.
    devices: Annotated[tuple[DeviceMemory, ...], FEW] = ()
    # Set while the agent waits for in-flight requests before a restart or stop:
    # gateways send a draining lane nothing new.
    draining: bool = False
    # Seconds from its process's start to its first healthy answer (None: not loaded yet, or adopted).
    load_seconds: Seconds | None = None


class RpcWorkerStatus(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One ggml-rpc-server a worker host runs for another host's span lane."""

    lane_id: Name
    serving_host: Name
    port: Port
    pid: Pid | None = None
    running: bool = False
    restarts: Count = 0


class HostStatus(_Msg, tag="host_status", kw_only=True):
    host_id: Name
    plan_revision: Revision = 0
    lanes: Annotated[tuple[LaneStatus, ...], msgspec.Meta(max_length=1000)] = ()
    feedback: Annotated[tuple[LaneFeedback, ...], msgspec.Meta(max_length=10_000)] = ()
    nats_connected: bool = True
    # Set when a change broke a lane: the agent rolls no further lanes to this config revision.
    rollout_halted: Text = ""
    # Changes each time the agent starts: tells a fresh status from one a dead agent left.
    agent_session: Label = ""
    # Where gateways reach this host's lanes (the bind address, or the agent's --advertise).
    address: Label = ""
    # The ggml-rpc-servers this host runs for span lanes of other hosts (an agent with --rpc-worker).
    rpc_workers: Annotated[tuple[RpcWorkerStatus, ...], msgspec.Meta(max_length=1000)] = ()


class LaneEvent(_Msg, tag="lane_event", kw_only=True):
    host_id: Name
    lane_id: Name
    event: Literal[
        "started", "healthy", "unresponsive", "crashed", "stopped", "failed", "mismatch", "rejected", "rolled_back",
        "draining", "slots_saved", "slots_restored", "slots_discarded",
    ]
    detail: Text = ""
    pid: Pid | None = None


class PlanRejected(_Msg, tag="plan_rejected", kw_only=True):
    host_id: Name
    plan_revision: Revision = 0
    reason: Text
    applied_revision: Revision = 0  # the plan revision the agent runs: a replacement must be newer


# ---------------------------------------------------------------- request/reply


class ConfigSet(_Msg, tag="config_set", kw_only=True):
    """Partial update: only the named fields change."""

    changes: Annotated[
        dict[
            Annotated[str, msgspec.Meta(max_length=64)],
            Label | Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
            | Annotated[float, msgspec.Meta(ge=-1e18, le=1e18)] | bool | None,
        ],
        msgspec.Meta(max_length=64),
    ]


class HostQuery(_Msg, tag="host_query", kw_only=True):
    host_id: Name


class ErrorReply(_Msg, tag="error", kw_only=True):
    error: Text


class HostLiveness(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A host as the planner sees it: `lost` after a silence; its plan is kept meanwhile."""

    host_id: Name
    state: HostState = "live"
    seen_ago_s: Seconds = 0.0
    rejected: Text = ""  # the agent's reason for refusing its latest plan, if it did


class FleetHosts(_Msg, tag="fleet_hosts", kw_only=True):
    """KV key `hosts`: every host's liveness, put by the active planner when a state changes
    (seen_ago_s is 0 there: the key changes with states, not with time)."""

    hosts: Annotated[tuple[HostLiveness, ...], MANY] = ()


class FleetStatus(_Msg, tag="fleet_status", kw_only=True):
    config_revision: Revision = 0  # counts config changes, as FleetConfig.revision
    config: FleetConfig = FleetConfig()
    reports: Annotated[tuple[HostReport, ...], MANY] = ()
    plans: Annotated[tuple[HostPlan, ...], MANY] = ()
    statuses: Annotated[tuple[HostStatus, ...], MANY] = ()
    hosts: Annotated[tuple[HostLiveness, ...], MANY] = ()
    planner_id: Label = ""  # the planner that answered
    planner_active: bool = True  # False: a stand-by answered (it plans nothing)
    models: Annotated[tuple[ModelState, ...], MANY] = ()  # every servable model and whether it is loaded


# ---------------------------------------------------------------- models on demand

ModelLoad = Literal["loaded", "unloaded", "waking", "failed"]
MAX_ACTIVITY_INTERVAL = 60.0  # seconds: the longest a gateway may say its next activity report is away


class ModelWake(_Msg, tag="model_wake", kw_only=True):
    """A gateway holds requests for a model with no lane: place one (subject lanes.wake.<model>).

    Gateways repeat it while they hold requests; the planner keeps one wake per model, so
    any number of requests and gateways asking is one load."""

    name: Name  # the persona's name: its alias, or the model's name (what lanes' specs call alias)
    gateway: Label = ""  # who asks (logs only)


Tokens = Annotated[float, msgspec.Meta(ge=0.0, le=1e15)]  # weighted tokens (prompt + output x weight)


class TenantActivity(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One tenant's requests for one model on one gateway: whose demand it is."""

    tenant: Name
    priority: Annotated[int, msgspec.Meta(ge=-1000, le=1000)] = 0
    in_flight: Count = 0
    queued: Count = 0


class TenantUsage(_Msg, tag="tenant_usage", kw_only=True):
    """KV bucket lanes-usage, key usage.<tenant>.<gateway>: the tokens one gateway counted for one
    tenant in the current calendar minute and day (UTC). Gateways add up every gateway's key to
    enforce one limit (gateway/tenants/quota.py); the key outlives a gateway restart."""

    tenant: Name
    gateway: Name
    minute: Annotated[int, msgspec.Meta(ge=0, le=2**40)] = 0  # unix time // 60
    day: Annotated[int, msgspec.Meta(ge=0, le=2**32)] = 0  # unix time // 86400
    minute_tokens: Tokens = 0.0
    day_tokens: Tokens = 0.0


class ModelActivity(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One model's requests as one gateway sees them (probes and scrapes never count)."""

    name: Name  # the persona's name, as ModelWake
    in_flight: Count = 0
    queued: Count = 0  # waiting for a slot or held while it loads
    idle_s: Seconds | None = None  # seconds since its last request; None: none yet
    # The longest wait for a slot in the last interval (requests still queued at their age so
    # far); the planner adds lanes on it (planner_svc/scaling.py). 0 from older gateways.
    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 0.0
    # Who the requests are for (tenants of the keys file; "anonymous" without keys).
    tenants: Annotated[tuple[TenantActivity, ...], msgspec.Meta(max_length=10_000)] = ()


class GatewayActivity(_Msg, tag="gateway_activity", kw_only=True):
    """Subject lanes.activity.<gateway>, every few seconds: what each model is doing. Times are
    relative (idle_s), so no clocks are compared across machines."""

    gateway: Name  # must match the subject's gateway (the planner drops it otherwise)
    # Seconds until the next one; its activity counts for a few intervals, so the bound keeps one
    # report from holding a model busy for long.
    interval: Annotated[float, msgspec.Meta(gt=0, le=MAX_ACTIVITY_INTERVAL)] = 2.0
    models: Annotated[tuple[ModelActivity, ...], msgspec.Meta(max_length=10_000)] = ()


class ModelState(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """A model as the planner sees it: loaded (it has planned lanes), unloaded (it has none;
    a request wakes it), waking (woken, not placed yet: `reason` says why), failed (a wake
    that cannot succeed: `reason` carries llama-server's or the planner's reason)."""

    name: Name  # what clients ask for: the persona's alias, or the model's name
    model: Name  # the model's name (file stem)
    state: ModelLoad = "unloaded"
    hosts: Annotated[tuple[Label, ...], MANY] = ()  # where its lanes are planned
    holders: Annotated[tuple[Label, ...], MANY] = ()  # hosts that hold its file
    reason: Text = ""
    file_bytes: Bytes = 0
    # Loaded on request only (it was unloaded once, or no persona names the file): a planner
    # taking over reads it, so a failover does not bring back what was evicted.
    on_demand: bool = False
    # Cold start: predicted from the file's size and the read rate its best holder has shown
    # (planner_svc/coldstart.py), and the last measured load of one of its lanes.
    predicted_load_s: Seconds | None = None
    measured_load_s: Seconds | None = None
    # Its lanes serve /v1/embeddings only (the persona asks, or the file declares a pooling type).
    embeddings: bool = False
    adapters: Annotated[tuple[Name, ...], FEW] = ()  # the persona's LoRA adapters: "name:adapter" asks for one
    reranking: bool = False  # its lanes serve /v1/rerank
    # Its lanes load a multimodal projector that reads images (--mmproj): image requests go to them.
    vision: bool = False


class ModelStates(_Msg, tag="model_states", kw_only=True):
    """KV key `models`, put by the active planner when it changes."""

    models: Annotated[tuple[ModelState, ...], MANY] = ()
    # reason -> lanes this planner evicted (idle, wake)
    evictions: Annotated[dict[Label, Annotated[int, msgspec.Meta(ge=0, le=2**53)]], FEW] = {}


class PlannerLease(_Msg, tag="planner_lease", kw_only=True):
    """The active planner's claim on the fleet (KV key `planner.lease`), renewed by compare-and-set.

    A stand-by takes over once the entry has not changed for `ttl` seconds on its own clock.
    """

    holder: Label
    ttl: Annotated[float, msgspec.Meta(gt=0, le=3600.0)] = defaults.LEASE_TTL


# ---------------------------------------------------------------- the shared prefix view

# A prompt chunk's chained hash (gateway/routing/affinity.py), its 64 bits read as a signed integer.
Hash64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
PREFIX_EVENT_HASHES = 4096  # hashes per event: a longer removal goes in several
PrefixHashes = Annotated[tuple[Hash64, ...], msgspec.Meta(max_length=PREFIX_EVENT_HASHES)]


class PrefixEvent(_Msg, tag="prefix_event", kw_only=True):
    """Stream LANES_PREFIX, subject lanes.prefix.<host>.<lane>: what one gateway learnt of a lane's
    prompt cache. `stored`: a prompt's chunk hashes, in order, as sent to the lane; `removed`:
    hashes its answer showed it no longer holds (it reused less than the index said). Every
    gateway applies every event in the stream's order (docs/routing.md)."""

    gateway: Name
    model: Label
    host_id: Name
    lane_id: Name
    stored: PrefixHashes = ()
    removed: PrefixHashes = ()
    reused: Count = 0  # leading chunks of `stored` the lane's answer confirmed (0: not answered yet)


WIRE_TYPES: tuple[type, ...] = (
    HostReport,
    FleetConfig,
    Demand,
    HostPlan,
    FleetPlan,
    HostStatus,
    LaneEvent,
    PlanRejected,
    ConfigSet,
    HostQuery,
    ErrorReply,
    FleetStatus,
    PlannerLease,
    FleetHosts,
    ModelWake,
    GatewayActivity,
    ModelStates,
    TenantUsage,
    PrefixEvent,
)


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)


def decode(data: bytes | str, kind: type[T]) -> T:
    """Decode and validate; raises msgspec.ValidationError / DecodeError with the reason."""
    return msgspec.json.decode(data, type=kind)
