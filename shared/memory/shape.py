"""What a lane's memory depends on apart from the model: its context, slots, cache types, flags and
devices (`LaneShape`). Every room of the memory model reads it (buffers, compute, speculative)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.memory.kv import DEFAULT_N_UBATCH
from shared.memory.placement import NglRule, SplitMode
from shared.messages.hosts import AdapterFacts, KvLayout
from shared.messages.plans import NGpuLayers


@dataclass(frozen=True)
class LaneShape:
    """What a lane's memory depends on, apart from the model. The device fields (n_gpu_layers
    to ngl_rule) place the layers when the caller gives lane_memory no placement of its own."""

    ctx: int
    parallel: int = 1
    kv_unified: bool = False
    swa_full: bool = False  # --swa-full: the sliding-window layers cache the whole window
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    layout: KvLayout = "streams"
    n_ubatch: int = DEFAULT_N_UBATCH
    n_gpu_layers: NGpuLayers = 0
    tensor_split: tuple[float, ...] = ()  # one share per device; () with devices: equal shares
    devices: tuple[str, ...] = ()  # backend of each GPU-type device in llama-server's order: cuda, rpc, metal
    split_mode: SplitMode = "layer"
    main_gpu: int = 0
    no_kv_offload: bool = False
    ngl_rule: NglRule = "output_first"
    n_cpu_moe: int = 0  # --n-cpu-moe: the expert tensors of the first N blocks in RAM
    tensor_overrides: tuple[tuple[str, str], ...] = ()  # -ot PATTERN=BUFFER pairs (only =CPU on experts)
    cache_ram: int = 0  # bytes: the prompt cache's limit (--cache-ram), see prompt_cache_bytes
    llama_build: int = 0  # the build whose graph rules apply (shared.llama.builds); 0: the current rules
    adapters: tuple[AdapterFacts, ...] = ()  # LoRA adapters loaded with --lora
    pooled: bool = False  # --embeddings or --reranking: every ubatch token is an output (shared.memory.pooled)
    mmproj: bool = False  # --mmproj: the model's projector (facts.mmproj) is loaded
    mmproj_offload: bool = False  # --mmproj-offload: on the lane's first device (else host RAM)
    image_max_tokens: int = 0  # --image-max-tokens: a dynamic-size projector's largest image; 0: its own
    mmproj_device: int = 0  # -mmdev: the GPU-type device that holds the projector with offload
    n_outputs: int = 0  # outputs the context reserves (speculative decoding: every drafted token); 0: one per slot
