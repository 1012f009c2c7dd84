"""The lines lanes reads from llama-server's log: one regex per fact, pure parsing.

Used by the agent (a lane's log file), the CLI and the benchmarks. Buffer lines are
printed at -lv 4, per device: the truth a plan is checked against.

    load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
    load_tensors: RPC0[127.0.0.1:50052] model buffer size =    17.91 MiB
    llama_context:        CPU  output buffer size =     1.00 MiB
    llama_kv_cache:      CUDA0 KV buffer size =     8.00 MiB
    sched_reserve:        CPU compute buffer size =    27.28 MiB

Buffer names map to lanes' device names: every host-memory buffer (CPU, CPU_Mapped,
CPU_REPACK, CUDA_Host, MTL0_Mapped ...) is "CPU"; CUDA<n>, RPC<n>[addr], Vulkan<n>,
ROCm<n>, MTL<n> are "GPU<n>".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shared.messages.plans import DeviceMemory
from shared.messages.status import FailureKind

MIB = 1024 * 1024

# The KV size (-lv 4; old builds print `KV self size` at the default verbosity). SWA models print two.
_KV_SIZE = re.compile(r"(?:llama_kv_cache\w*:\s+size|KV self size)\s*=\s*([\d.]+) MiB")
_BUFFER = re.compile(
    r"(load_tensors|llama_context|llama_kv_cache\w*|sched_reserve):\s+(\S+?)\s+(model|output|KV|compute)"
    r" buffer size =\s*([\d.]+) MiB"
)
# A LoRA adapter's tensors, one line per buffer type (llama_adapter_lora_init_impl).
_LORA_BUFFER = re.compile(r"(llama_adapter_lora_init\w*):\s+(\S+?)\s+(LoRA) buffer size =\s*([\d.]+) MiB")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers")
# The multimodal projector (tools/mtmd/clip.cpp): its backend, its weights, its warm-up compute buffer
# (printed again when flash attention is turned off after a first try: the last one stands).
_CLIP_USING = re.compile(r"CLIP using (\S+) backend")
_CLIP_WEIGHTS = re.compile(r"load_hparams: model size:\s+([\d.]+) MiB")
_CLIP_COMPUTE = re.compile(r"reserve_compute_meta:\s+(\S+) compute buffer size =\s*([\d.]+) MiB")
_USING = re.compile(r"llama_prepare_model_devices: using device (\S+) \(([^)]*)\)")
_HOST_BUFFER = re.compile(r"^(CPU\w*|\w+_Host|\w+_Mapped|\w+_REPACK)$")
_DEVICE_BUFFER = re.compile(r"^(?:CUDA|RPC|Vulkan|ROCm|MTL|SYCL|CANN|OpenCL)(\d+)")
_RPC_BUFFER = re.compile(r"RPC\d+\[(.*)\]$")
# The build line each run of the binary prints as it starts ("common_params_print_info: build 0
# (unknown) with GNU 12.2.0 ..." on b11434, "build: 4585 (a4417ddd) with cc ..." on older builds):
# a lane's log file holds earlier runs too.
_RUN_START = re.compile(r"\bbuild:? \d+ \(\S*\) with ")
# Printed once the model is loaded (INFO, any verbosity): the lane's memory is all allocated.
_LOADED = re.compile(r"srv    load_model: initializing|main: model loaded|server is listening")
# Memory exhaustion at start, including the address-space kind a container limit or
# `ulimit -v` gives (thread stacks then fail first: "libgomp: Thread creation failed").
_OOM = re.compile(
    r"failed to allocate|out of memory|cudaMalloc failed|unable to allocate|std::bad_alloc|"
    r"Cannot allocate memory|Thread creation failed",
    re.I,
)
# The line after which a lane's log keeps no debug line (launcher_agent/logpump.py): everything
# the agent reads is printed before it, and from then on debug lines carry the requests' prompts.
LOADED_FOR_GOOD = r"(?:main|llama_server): model loaded"
_UNSUPPORTED = re.compile(
    r"Unsupported cache type|invalid argument|unknown value for|requires flash_attn|does not divide|"
    r"V cache quantization requires|expected value for argument"
)
_PORT_BUSY = re.compile(r"couldn't bind HTTP server socket|Address already in use", re.IGNORECASE)


# ------------------------------------------------------------------ which lines to keep


def is_kv_size_line(line: str) -> bool:
    return _KV_SIZE.search(line) is not None


def is_buffer_line(line: str) -> bool:
    """A line parse_buffers reads (buffer sizes, offloaded layers, and the devices in use, which
    number a pinned lane's devices from 0 and tell RPC servers apart by endpoint)."""
    return any(p.search(line) is not None for p in (_BUFFER, _LORA_BUFFER, _OFFLOADED, _USING, _CLIP_USING,
                                                    _CLIP_WEIGHTS, _CLIP_COMPUTE))  # fmt: skip


def is_run_start_line(line: str) -> bool:
    return _RUN_START.search(line) is not None


def is_loaded_line(line: str) -> bool:
    return _LOADED.search(line) is not None


# ------------------------------------------------------------------ KV size and failures


def kv_mib_from_log(lines: Iterable[str]) -> float | None:
    """The KV size llama-server printed (sum of the SWA and non-SWA caches), in MiB."""
    values = [float(m.group(1)) for line in lines if (m := _KV_SIZE.search(line))]
    return sum(values) if values else None


def classify_failure(lines: Sequence[str]) -> tuple[FailureKind, str]:
    """Why a lane died, and llama-server's own line saying so."""
    for pattern, kind in ((_PORT_BUSY, "port_busy"), (_UNSUPPORTED, "unsupported"), (_OOM, "oom")):
        for line in lines:
            if pattern.search(line):
                return kind, line.strip()
    errors = [line.strip() for line in lines if " E " in f" {line} " or "error" in line.lower()]
    return "other", (errors[0] if errors else (lines[-1].strip() if lines else "exited without output"))


# ------------------------------------------------------------------ buffers per device


def device_name(buffer: str) -> str:
    if _HOST_BUFFER.match(buffer) and not buffer.startswith("MTL"):
        return "CPU"
    if buffer.startswith("MTL") and ("_Mapped" in buffer or "_Private" in buffer):
        # Metal: GPU-resident buffers of unified memory; lanes counts them on the GPU.
        match = _DEVICE_BUFFER.match(buffer)
        return f"GPU{match.group(1)}" if match else "GPU0"
    match = _DEVICE_BUFFER.match(buffer)
    return f"GPU{match.group(1)}" if match else "CPU"


@dataclass
class DeviceBuffers:
    """MiB per device and kind, summed over every line of that kind (SWA models print two KV lines)."""

    mib: dict[str, dict[str, float]] = field(default_factory=dict)
    offloaded: tuple[int, int] | None = None

    def get(self, device: str, kind: str) -> float:
        return self.mib.get(device, {}).get(kind, 0.0)

    def devices(self) -> list[str]:
        return sorted(self.mib, key=lambda d: (d != "CPU", d))


def parse_buffers(lines: Iterable[str]) -> DeviceBuffers:
    """Per device of the lane: GPU<i> is the i-th device llama-server says it uses (`using device`
    lines, in its order), so a lane pinned to CUDA1 shows it as GPU0, and every ggml-rpc-server
    (each names its buffers RPC0[host:port]) is told apart by its endpoint."""
    out = DeviceBuffers()
    order: dict[str, int] = {}
    clip_device, clip_weights, clip_compute = "CPU", 0.0, {}
    for line in lines:
        if (m := _CLIP_USING.search(line)) is not None:
            clip_device = _lane_device(m.group(1), order)
            continue
        if (m := _CLIP_WEIGHTS.search(line)) is not None:
            clip_weights = float(m.group(1))
            continue
        if (m := _CLIP_COMPUTE.search(line)) is not None:
            clip_compute[_lane_device(m.group(1), order)] = float(m.group(2))
            continue
        if (m := _USING.search(line)) is not None:
            name, desc = m.groups()
            order.setdefault(f"{name}[{desc}]" if name.startswith("RPC") else name, len(order))
            continue
        if (m := _OFFLOADED.search(line)) is not None:
            out.offloaded = (int(m.group(1)), int(m.group(2)))
            continue
        m = _BUFFER.search(line) or _LORA_BUFFER.search(line)
        if m is None:
            continue
        _, buffer, kind, value = m.groups()
        name = _lane_device(buffer, order)
        per = out.mib.setdefault(name, {})
        per[kind] = round(per.get(kind, 0.0) + float(value), 2)
    for name, mib in [(clip_device, clip_weights), *clip_compute.items()]:
        if mib:
            per = out.mib.setdefault(name, {})
            per["projector"] = round(per.get("projector", 0.0) + mib, 2)
    return out


def _lane_device(buffer: str, order: dict[str, int]) -> str:
    """CPU or GPU<i>, i the buffer's device among the ones the lane uses."""
    name = device_name(buffer)
    if name != "CPU" and order:
        key = buffer if buffer.startswith("RPC") else re.sub(r"_.*$", "", buffer)
        rpc = _RPC_BUFFER.match(buffer)
        if rpc:  # match the server by its endpoint, whatever index it gave itself
            key = next((k for k in order if k.endswith(f"[{rpc.group(1)}]")), key)
        if key in order:
            name = f"GPU{order[key]}"
    return name


def devices_from_lines(lines: Iterable[str]) -> tuple[DeviceMemory, ...]:
    """DeviceMemory per device from printed lines, CPU first (bytes rounded from two-decimal MiB)."""
    printed = parse_buffers(lines)
    return tuple(
        DeviceMemory(
            device=name,
            model_bytes=round(printed.get(name, "model") * MIB),
            kv_bytes=round(printed.get(name, "KV") * MIB),
            compute_bytes=round(printed.get(name, "compute") * MIB),
            output_bytes=round(printed.get(name, "output") * MIB),
            adapter_bytes=round(printed.get(name, "LoRA") * MIB),
            projector_bytes=round(printed.get(name, "projector") * MIB),
        )
        for name in printed.devices()
    )
