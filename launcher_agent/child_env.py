"""The environment llama-server and ggml-rpc-server start with: an allow-list, in this one place.

A child gets only what the binary and its GPU runtime read, plus the names the operator
gives (`lanes agent --lane-env NAME`, repeatable); never the agent's own settings (LANES_*),
its credentials, or LLAMA_ARG_* (llama-server reads those as flags, and only the plan decides
flags; the official image sets LLAMA_ARG_HOST, for one). Whatever else the agent holds (NATS
passwords, API keys, cloud tokens) would otherwise reach every lane and, through it, any
crash dump or /proc reader.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# Exact names: the process basics (paths, locale, time zone, temporary files, shared libraries).
ALLOWED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",  # CUDA device selection
    "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",  # ROCm / HIP
    "ONEAPI_DEVICE_SELECTOR",  # SYCL
    "DYLD_LIBRARY_PATH",  # Metal builds on macOS load their libraries through it
    "XDG_CACHE_HOME", "XDG_RUNTIME_DIR",  # GPU drivers' shader caches
    "LLAMA_CACHE",  # llama.cpp's cache folder (a path, not a flag)
})  # fmt: skip
# Prefixes: locale (LC_*), the GPU runtimes' settings and llama.cpp's own (GGML_*).
ALLOWED_PREFIXES = (
    "LC_",
    "GGML_",  # llama.cpp's backends (GGML_VK_*, GGML_CUDA_*, GGML_METAL_*, GGML_SYCL_* ...)
    "CUDA_",  # CUDA runtime (CUDA_MPS_*, CUDA_CACHE_* ...)
    "NVIDIA_",  # the NVIDIA container runtime
    "HSA_", "HIP_", "ROCR_", "AMD_",  # ROCm
    "VK_",  # Vulkan loader (VK_ICD_FILENAMES, VK_LOADER_* ...)
    "MTL_", "METAL_",  # Metal
    "SYCL_", "ZE_", "ONEAPI_",  # SYCL / Level Zero
    "MESA_", "RADV_", "ANV_",  # Mesa's Vulkan drivers
    "OMP_", "GOMP_", "KMP_",  # the OpenMP runtime CPU builds use
)  # fmt: skip
# Never passed, not even when named: the agent's own settings and llama-server's flag variables.
FORBIDDEN_PREFIXES = ("LANES_", "LLAMA_ARG_")
# A name that looks like a credential is never passed by a prefix rule (only when the operator names it).
_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIAL", re.IGNORECASE)


def forbidden(name: str) -> bool:
    return name.startswith(FORBIDDEN_PREFIXES)


def allowed(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether a child may see the variable `name` (`extra`: the names the operator gave)."""
    if forbidden(name):
        return False
    if name in ALLOWED_NAMES or name in extra:
        return True
    return name.startswith(ALLOWED_PREFIXES) and not _SECRET.search(name)


def child_environment(environ: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """The allow-listed part of `environ` a llama-server or ggml-rpc-server starts with."""
    names = frozenset(extra)
    return {k: v for k, v in environ.items() if allowed(k, names)}
