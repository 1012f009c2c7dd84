"""llama-server's flags: the argv tail of a lane, what a binary accepts, and the rules its flags obey.

`lane_args` is the one renderer: the agent renders each lane's argv from the typed spec
and its own binary's capabilities when it launches it; the planner renders only to show a
plan (and, for an agent too old to render, into the plan's `args`). A plan from an older
planner still carries `args`: the agent checks them by meaning (the same flags with the
same values, in any order; a flag this agent cannot render, or a value the spec
contradicts, is refused) and launches its own rendering. Lanes are compared by
shared.lane_key, never by argv.

What a binary accepts is decided from its own --help and --version text (running it
is launcher_agent.probe's job): the flag forms and the KV layout are read from what
--help offers, not from a build number, since distribution builds carry odd version
strings and a wrong flag form makes llama-server exit at start.
"""

from __future__ import annotations

import re

from shared.memory import BLOCK_BYTES, DEFAULT_N_UBATCH, QUANTIZED
from shared.messages.hosts import ServerCaps
from shared.messages.plans import LaneSpec

DEFAULT_N_BATCH = 2048  # llama-server's; the ubatch is clamped to it
DEFAULT_CACHE_TYPE = "f16"  # what llama-server uses for K and V when no --cache-type flag is passed
# Flags that carry no lane meaning (the agent's own, such as log settings): an older planner's
# args may lack them or render them otherwise. A flag the agent adds for itself belongs here.
_NO_MEANING = {"--verbosity", "--slot-save-path"}


# ------------------------------------------------------------------ rules


def effective_cache_type(cache_type: str | None) -> str:
    """The K or V type llama-server runs with for this flag (None: no flag passed)."""
    return cache_type or DEFAULT_CACHE_TYPE


def cache_pair(type_k: str | None, type_v: str | None) -> str:
    """"K/V" as llama-server runs them, the way plans, reasons and tables show them."""
    return f"{effective_cache_type(type_k)}/{effective_cache_type(type_v)}"


def needs_flash_attn(type_v: str | None) -> bool:
    """A quantized V cache needs flash attention on: llama-server refuses it with flash
    attention off (and turns it on itself from auto)."""
    return type_v in QUANTIZED


# ------------------------------------------------------------------ argv


def lane_args(spec: LaneSpec, caps: ServerCaps, slot_dir: str | None = None, key_file: str | None = None) -> tuple[str, ...]:
    """The argv tail; `slot_dir`: the agent's folder for saved slots (--slot-save-path), where the
    binary has it; `key_file`: the lane's API key (--api-key-file, launcher_agent/lane_secret.py)."""
    args = [
        "--model", spec.model_path,
        "--alias", spec.alias,
        "--host", spec.bind,
        "--port", str(spec.port),
        "--ctx-size", str(spec.ctx_total),
        "--parallel", str(spec.parallel),
        "--n-gpu-layers", str(spec.n_gpu_layers),
        "--metrics",  # /metrics: the agent re-exports its series under lanes_ names
    ]  # fmt: skip
    if spec.rpc_servers:
        args += ["--rpc", ",".join(spec.rpc_servers)]
    if spec.device_names:
        # Pinned: llama-server sees only these devices, so a lane never spreads over every GPU.
        args += ["--device", ",".join(spec.device_names)]
    if spec.split_mode is not None:
        args += ["--split-mode", spec.split_mode]
    if spec.main_gpu is not None:
        args += ["--main-gpu", str(spec.main_gpu)]
    if spec.tensor_split:
        args += ["--tensor-split", ",".join(map(str, spec.tensor_split))]
    if spec.kv_unified:
        args.append("--kv-unified")
    if spec.swa_full:
        args.append("--swa-full")
    if spec.cache_idle_slots is False:
        args.append("--no-cache-idle-slots")
    if spec.cache_type_k is not None:
        args += ["--cache-type-k", spec.cache_type_k]
    if spec.cache_type_v is not None:
        args += ["--cache-type-v", spec.cache_type_v]
    if spec.flash_attn is not None:
        if caps.flash_attn_form == "value":
            args += ["--flash-attn", spec.flash_attn]
        elif spec.flash_attn == "on":
            args.append("--flash-attn")
    if spec.n_cpu_moe:
        args += ["--n-cpu-moe", str(spec.n_cpu_moe)]
    if spec.chat_template is not None:
        # a built-in template's name is only read as a name with jinja off (jinja reads it as text)
        args += (["--no-jinja"] if caps.has_no_jinja else []) + ["--chat-template", spec.chat_template]
    if spec.cache_ram_mib is not None:
        args += ["--cache-ram", str(spec.cache_ram_mib)]
    if spec.embeddings:
        args.append("--embeddings")
    if spec.pooling is not None:
        args += ["--pooling", spec.pooling]
    if spec.reranking:
        args.append("--reranking")
    if spec.adapter_paths:
        # Loaded at scale 0: a request without a `lora` field gets the base model (llama-server applies
        # the launch scales to it; --lora-init-without-apply does not change that), and the gateway
        # sets `lora` to the one adapter a request names.
        args += ["--lora-scaled", ",".join(f"{path}:0" for path in spec.adapter_paths)]
    if spec.mmproj_path is not None:
        args += ["--mmproj", spec.mmproj_path]
        if spec.mmproj_offload is not None:  # without it llama-server offloads to the first GPU it finds
            args.append("--mmproj-offload" if spec.mmproj_offload else "--no-mmproj-offload")
        if spec.image_max_tokens is not None:
            args += ["--image-max-tokens", str(spec.image_max_tokens)]
    if spec.fit_off:
        args += ["-fit", "off"]
    if spec.n_ubatch != DEFAULT_N_UBATCH:  # the plan's compute and sliding-window sizes assume it
        if spec.n_ubatch > DEFAULT_N_BATCH:
            args += ["--batch-size", str(spec.n_ubatch)]
        args += ["--ubatch-size", str(spec.n_ubatch)]
    args += spec_args(spec, caps)
    args += thread_args(spec)
    if slot_dir is not None and caps.has_slot_save:
        args += ["--slot-save-path", slot_dir]
    if key_file is not None:
        args += ["--api-key-file", key_file]
    # Verbosity 4 makes llama-server print its KV size, which the agent checks against the plan.
    args += ["--verbosity", "4"]
    return tuple(args)


def spec_args(spec: LaneSpec, caps: ServerCaps) -> list[str]:
    """Speculative decoding: --spec-type, and for a draft model the draft's file, layers and K/V
    types (only the planned ones: the plan sized the draft with f16 for an unset type). The planner
    sets spec_type only for a binary whose --help lists it and these flags."""
    if spec.spec_type is None or "--spec-type" not in caps.spec_flags:
        return []
    args = ["--spec-type", spec.spec_type]
    if spec.draft_path:
        args += ["--spec-draft-model", spec.draft_path, "--spec-draft-ngl", str(spec.draft_n_gpu_layers)]
        if spec.draft_cache_type_k is not None:
            args += ["--spec-draft-type-k", spec.draft_cache_type_k]
        if spec.draft_cache_type_v is not None:
            args += ["--spec-draft-type-v", spec.draft_cache_type_v]
    return args


def thread_args(spec: LaneSpec) -> list[str]:
    """--threads/--threads-batch, the pinned CPUs (a range when contiguous, else a hex mask) and
    --poll, each only when the plan decided it. The batch pool copies none of the generation
    pool's settings once --threads-batch is given, so each is passed for both."""
    args = []
    if spec.threads is not None:
        args += ["--threads", str(spec.threads)]
    if spec.threads_batch is not None:
        args += ["--threads-batch", str(spec.threads_batch)]
    if spec.cpus:
        lo, hi = min(spec.cpus), max(spec.cpus)
        if hi - lo + 1 == len(set(spec.cpus)):
            args += ["--cpu-range", f"{lo}-{hi}", "--cpu-range-batch", f"{lo}-{hi}"]
        else:
            mask = hex(sum(1 << c for c in set(spec.cpus)))
            args += ["--cpu-mask", mask, "--cpu-mask-batch", mask]
    if spec.poll is not None:
        args += ["--poll", str(spec.poll), "--poll-batch", str(spec.poll)]
    return args


def _flags(args: tuple[str, ...]) -> tuple[dict[str, str | None], str | None]:
    """{flag: value or None for a switch}, or why the args cannot be read.

    A flag followed by another flag (or by nothing) is a switch; no value lanes render
    starts with a dash (paths are absolute, names start with a letter or digit).
    """
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        if not flag.startswith("-") or flag == "-":
            return out, f"{flag!r} is not a flag"
        if flag in out:
            return out, f"{flag} given twice"
        value = args[i + 1] if i + 1 < len(args) else None
        if value is None or _is_flag(value):
            out[flag] = None
            i += 1
            continue
        out[flag] = value
        i += 2
    return out, None


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)  # a negative number is a value
    except ValueError:
        return True
    return False


def args_problem(spec: LaneSpec, caps: ServerCaps) -> str | None:
    """Why the plan's args do not mean what its typed spec says, or None."""
    planned, problem = _flags(tuple(spec.args))
    if problem:
        return problem
    ours, _ = _flags(lane_args(spec, caps))
    for flag, value in planned.items():
        if flag in _NO_MEANING:
            continue
        if flag not in ours:
            return f"flag {flag} is not one this agent renders for this spec (upgrade the agent?)"
        if ours[flag] != value:
            return f"{flag} {value} in args, but the spec says {ours[flag]}"
    missing = [f for f in ours if f not in planned and f not in _NO_MEANING]
    if missing:
        return f"args lack {', '.join(missing[:3])}, which the spec calls for"
    return None


# ------------------------------------------------------------------ what a binary accepts

_VERSION = re.compile(r"version:\s*(?:(\d+)\s*\(|[^(]*\(build\s+(\d+))")
_FA_VALUE = re.compile(r"--flash-attn\s+(?:\[?on\|off\|auto|FA\b|\{on,off,auto\})")
_ALLOWED = re.compile(r"allowed values:\s*([a-z0-9_,\s]+)")
_FIT = re.compile(r"(^|[\s,])-fit[\s,]|--fit\b")
# The output-first -ngl rule (Dec 2025) came with -ngl taking auto/all besides a count.
_NGL_AUTO = re.compile(r"n-gpu-layers N[^\n]*\n?[^\n]*(auto|all)")


def parse_caps(help_text: str, version_text: str = "") -> ServerCaps:
    match = _VERSION.search(version_text)
    build = int(match.group(1) or match.group(2)) if match else None
    if "--flash-attn" not in help_text and "-fa," not in help_text:
        raise ValueError("this does not look like llama-server --help output (no --flash-attn)")
    flash_attn_form = "value" if _FA_VALUE.search(help_text) else "switch"
    return ServerCaps(
        build=build,
        version=_version_line(version_text),
        flash_attn_form=flash_attn_form,
        cache_types=_cache_types(help_text),
        has_fit=bool(_FIT.search(help_text)),
        has_kv_unified="--kv-unified" in help_text,
        has_swa_full="--swa-full" in help_text,
        # Per-slot KV streams and the separate SWA cache arrived together with -kvu.
        kv_layout="streams" if "--kv-unified" in help_text else "shared",
        ngl_rule="output_first" if _NGL_AUTO.search(help_text) else "blocks_first",
        has_device="--device" in help_text,
        has_cpu_range="--cpu-range-batch" in help_text,
        has_poll="--poll-batch" in help_text,
        has_n_cpu_moe="--n-cpu-moe" in help_text,
        has_chat_template="--chat-template" in help_text,
        has_no_jinja="--no-jinja" in help_text,
        has_cache_ram="--cache-ram" in help_text,
        has_lora="--lora-scaled" in help_text,
        has_reranking="--reranking" in help_text,
        has_slot_save="--slot-save-path" in help_text,
        has_mmproj="--no-mmproj-offload" in help_text,
        has_image_max_tokens="--image-max-tokens" in help_text,
        has_cache_idle_slots="--no-cache-idle-slots" in help_text,
        spec_types=_spec_types(help_text),
        spec_flags=tuple(f for f in SPEC_FLAGS if re.search(rf"(^|[\s,]){re.escape(f)}[\s,=]", help_text, re.M)),
    )


# The draft flags lanes renders, by the current long names (b11434: --draft-max and friends were
# renamed to --spec-draft-*; a removed name is never rendered, since --help no longer lists it).
SPEC_FLAGS = (
    "--spec-type", "--spec-draft-model", "--spec-draft-ngl", "--spec-draft-type-k", "--spec-draft-type-v",
    "--spec-draft-device",
)  # fmt: skip
_SPEC_TYPE = re.compile(r"--spec-type\s+\[?([a-z0-9|,\-\[\]]+)")


def _spec_types(help_text: str) -> tuple[str, ...]:
    """--spec-type's values as --help lists them ([none|draft-simple|...|ngram-cache])."""
    match = _SPEC_TYPE.search(help_text)
    if match is None:
        return ()
    return tuple(t for t in re.split(r"[|,\[\]]+", match.group(1)) if t and t != "none")


def _version_line(text: str) -> str:
    """The `version:` line; backends loaded at start may print lines before it."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in lines if "version:" in ln), lines[0] if lines else "")


def _cache_types(help_text: str) -> tuple[str, ...]:
    """The values --cache-type-k lists; K and V share one list in every build seen."""
    at = help_text.find("--cache-type-k")
    if at >= 0:
        match = _ALLOWED.search(help_text, at, at + 800)
        if match:
            listed = [t.strip() for t in match.group(1).replace("\n", " ").split(",")]
            known = tuple(t for t in listed if t in BLOCK_BYTES)
            if known:
                return known
    return ("f32", "f16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
