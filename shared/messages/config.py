"""Fleet intent: the fleet-wide knobs (FleetConfig), the models to serve (Persona, in a Demand)
and the lane log limits they default to."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from shared import defaults
from shared.messages.wire import FEW, Bytes, CacheType, FlashAttn, Message, Name, Revision, SpecType

# A persona's `speculative`: off, auto (on where bench/spec_bench.py measured a gain), or a type.
SpecMode = Literal["off", "auto"] | SpecType

LANE_LOG_MAX_BYTES = 16 * 1024 * 1024
LANE_LOG_FILES = 3
LogBytes = Annotated[int, msgspec.Meta(ge=64 * 1024, le=1 << 40)]
LogFiles = Annotated[int, msgspec.Meta(ge=1, le=100)]


class FleetConfig(Message, tag="fleet_config", forbid_unknown_fields=True, kw_only=True):
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
    # A lane is not evicted to make room before it has served this many seconds, or ten times its
    # load time where that is shorter (anti-thrash; planner_svc/eviction.residency).
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
    # A sliding-window model's lanes run with --swa-full, so their saved slots read back complete
    # (docs/slot-cache.md): None, where that costs the window nothing (the memory comes off the
    # prompt cache) and slots are saved; True, wherever it fits; False, never.
    swa_full: bool | None = None
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


class Demand(Message, tag="demand", forbid_unknown_fields=True, kw_only=True):
    personas: Annotated[tuple[Persona, ...], msgspec.Meta(max_length=10_000)] = ()
