"""What a llama-server binary accepts, decided from its own --help and --version text.

Pure parsing; running the binary is launcher_agent.probe's job. The flag forms
and the KV layout are read from what --help offers, not from a build number:
distribution builds carry odd version strings, and a wrong flag form makes
llama-server exit at start.
"""

from __future__ import annotations

import re

from shared.memory import BLOCK_BYTES
from shared.messages import ServerCaps

_VERSION = re.compile(r"version:\s*(?:(\d+)\s*\(|[^(]*\(build\s+(\d+))")
_FA_VALUE = re.compile(r"--flash-attn\s+(?:\[?on\|off\|auto|FA\b|\{on,off,auto\})")
_ALLOWED = re.compile(r"allowed values:\s*([a-z0-9_,\s]+)")


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
        has_fit=bool(re.search(r"(^|[\s,])-fit[\s,]|--fit\b", help_text)),
        has_kv_unified="--kv-unified" in help_text,
        has_swa_full="--swa-full" in help_text,
        # Per-slot KV streams and the separate SWA cache arrived together with -kvu.
        kv_layout="streams" if "--kv-unified" in help_text else "shared",
        # The output-first -ngl rule (Dec 2025) came with -ngl taking auto/all besides a count.
        ngl_rule="output_first" if re.search(r"n-gpu-layers N[^\n]*\n?[^\n]*(auto|all)", help_text) else "blocks_first",
        has_device="--device" in help_text,
        has_cpu_range="--cpu-range-batch" in help_text,
        has_poll="--poll-batch" in help_text,
    )


def flash_attn_effective(flag: str | None, caps: ServerCaps, device: str = "cpu") -> bool:
    """Whether llama-server runs with flash attention for this flag (None: no flag passed).

    Current builds default to auto, which resolves to on for CPU lanes (measured); GPU
    backends may lack kernels, so there only an explicit "on" counts. Old switch builds
    default to off.
    """
    if flag == "on":
        return True
    return flag in (None, "auto") and caps.flash_attn_form == "value" and device == "cpu"


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
