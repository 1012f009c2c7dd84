"""What a host has, as its agent reports it: GPUs, the llama-server binary's abilities, the GGUF
models and LoRA adapters on its disks, and the HostReport that carries them."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared import defaults
from shared.messages.wire import (
    FEW,
    LINES,
    MANY,
    Bytes,
    CacheType,
    Count,
    CpuId,
    Int32,
    Label,
    Message,
    Name,
    Port,
    RpcEndpointOrNone,
    Text,
)

FlashAttnForm = Literal["value", "switch"]
KvLayout = Literal["streams", "shared"]


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
    endpoint: RpcEndpointOrNone = ""


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
    has_image_max_tokens: bool = False  # --image-max-tokens: the largest image a projector takes
    # --no-cache-idle-slots (builds of 2026): without it, a unified cache empties its idle slots
    # into the RAM prompt cache at every new task (False: an older binary, or one not probed)
    has_cache_idle_slots: bool = False
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
    n_mel_bins: Int32 = 0  # clip.audio.num_mel_bins: an audio encoder's input rows
    n_queries: Int32 = 0  # MiniCPM-V's resampler queries (clip.minicpmv_query_num, else its version's)
    stack_factor: Int32 = 0  # an audio head's frames stacked into one (clip.audio.projector.stack_factor)
    proj_hidden: Int32 = 0  # an audio head's MLP width (mm.a.mlp.1's rows; MERaLiON's mm.a.mlp.0's)
    # Qwen2-VL's family: blocks with (i + 1) % n_wa_pattern != 0 attend in windows (clip.vision.n_wa_pattern;
    # 0: the type's default), Qwen3-VL's deepstack blocks (v.deepstack.N), its position table's side
    # (the root of v.position_embd's rows; 0: 48), a bf16 patch kernel (unrolled to f32, not f16)
    n_wa_pattern: Int32 = 0
    deepstack: Annotated[tuple[Int32, ...], msgspec.Meta(max_length=256)] = ()
    pos_side: Int32 = 0
    kernel_bf16: bool = False
    pre_ln: bool = False  # the encoder's norm before its first block (v.pre_ln): Llama 4's files have one
    post_ln: bool = False  # and after its last (v.post_ln): LLaVA's converters drop it, Llama 4's keep it
    # The compute buffer replayed from the file's own graph where its type's buffer follows the file's
    # tensor shapes rather than a few widths (Gemma 3n's MobileNetV5: shared/memory/mobilenet.py)
    graph_compute_bytes: Bytes = 0
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


class HostReport(Message, tag="host_report", kw_only=True):
    host_id: Name
    cpu_cores: Annotated[int, msgspec.Meta(ge=1, le=65536)]  # logical CPUs
    ram_total: Bytes
    ram_available: Bytes
    # Memory the host's own lanes hold now: the planner may hand it out again.
    lanes_rss: Bytes = 0
    lanes_vram: Bytes = 0
    # The lane keys (shared.lane_key) of the lanes serving now, their buffers resident: a window
    # a replan would merely shrink is kept while the host is not pressed (planner_svc/kept_windows.py).
    serving_lanes: Annotated[tuple[Label, ...], LINES] = ()
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
