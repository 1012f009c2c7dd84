"""llama-server's own buffer lines (printed at -lv 4), per device: the truth a plan is checked against.

    load_tensors:   CPU_Mapped model buffer size =   235.16 MiB
    load_tensors: RPC0[127.0.0.1:50052] model buffer size =    17.91 MiB
    llama_context:        CPU  output buffer size =     1.00 MiB
    llama_kv_cache:      CUDA0 KV buffer size =     8.00 MiB
    sched_reserve:        CPU compute buffer size =    27.28 MiB

Buffer names map to lanes' device names: every host-memory buffer (CPU, CPU_Mapped,
CPU_REPACK, CUDA_Host, MTL0_Mapped ...) is "CPU"; CUDA<n>, RPC<n>[addr], Vulkan<n>,
ROCm<n>, MTL<n> are "GPU<n>". Pure parsing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MIB = 1024 * 1024
_LINE = re.compile(r"(load_tensors|llama_context|llama_kv_cache\w*|sched_reserve):\s+(\S+?)\s+(model|output|KV|compute) buffer size =\s*([\d.]+) MiB")
_HOST = re.compile(r"^(CPU\w*|\w+_Host|\w+_Mapped|\w+_REPACK)$")
_DEVICE = re.compile(r"^(?:CUDA|RPC|Vulkan|ROCm|MTL|SYCL|CANN|OpenCL)(\d+)")
KINDS = ("model", "KV", "compute", "output")


def device_name(buffer: str) -> str:
    if _HOST.match(buffer) and not buffer.startswith("MTL"):
        return "CPU"
    if buffer.startswith("MTL") and ("_Mapped" in buffer or "_Private" in buffer):
        # Metal: GPU-resident buffers of unified memory; lanes counts them on the GPU.
        match = _DEVICE.match(buffer)
        return f"GPU{match.group(1)}" if match else "GPU0"
    match = _DEVICE.match(buffer)
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


_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers")
_USING = re.compile(r"llama_prepare_model_devices: using device (\S+) \(([^)]*)\)")


def parse_buffers(lines) -> DeviceBuffers:
    """Per device of the lane: GPU<i> is the i-th device llama-server says it uses (`using device`
    lines, in its order), so a lane pinned to CUDA1 shows it as GPU0, and every ggml-rpc-server
    (each names its buffers RPC0[host:port]) is told apart by its endpoint."""
    out = DeviceBuffers()
    order: dict[str, int] = {}
    for line in lines:
        if (m := _USING.search(line)) is not None:
            name, desc = m.groups()
            order.setdefault(f"{name}[{desc}]" if name.startswith("RPC") else name, len(order))
            continue
        if (m := _OFFLOADED.search(line)) is not None:
            out.offloaded = (int(m.group(1)), int(m.group(2)))
            continue
        m = _LINE.search(line)
        if m is None:
            continue
        _, buffer, kind, value = m.groups()
        name = device_name(buffer)
        if name != "CPU" and order:
            key = buffer if buffer.startswith("RPC") else re.sub(r"_.*$", "", buffer)
            rpc = re.match(r"RPC\d+\[(.*)\]$", buffer)
            if rpc:  # match the server by its endpoint, whatever index it gave itself
                key = next((k for k in order if k.endswith(f"[{rpc.group(1)}]")), key)
            if key in order:
                name = f"GPU{order[key]}"
        per = out.mib.setdefault(name, {})
        per[kind] = round(per.get(kind, 0.0) + float(value), 2)
    return out


_KIND_FIELDS = {"model": "model_bytes", "KV": "kv_bytes", "compute": "compute_bytes", "output": "output_bytes"}
COMPUTE_TOLERANCE = (0.03, 4.0)  # within 3% or 4 MiB


@dataclass(frozen=True)
class Check:
    device: str
    kind: str
    predicted_mib: float
    printed_mib: float

    @property
    def ok(self) -> bool:
        diff = abs(self.predicted_mib - self.printed_mib)
        if self.kind == "compute":
            share, floor = COMPUTE_TOLERANCE
            return diff <= max(share * self.printed_mib, floor)
        return diff <= 0.011  # the lines print two decimals


def compare(devices, printed: DeviceBuffers) -> list[Check]:
    """Predicted (DeviceMemory per device) against printed, for every kind on every device."""
    names = {d.device for d in devices} | set(printed.mib)
    by_name = {d.device: d for d in devices}
    out = []
    for name in sorted(names, key=lambda d: (d != "CPU", d)):
        dev = by_name.get(name)
        for kind, attr in _KIND_FIELDS.items():
            predicted = getattr(dev, attr) / MIB if dev else 0.0
            if kind == "KV" and dev is not None:
                predicted += dev.recurrent_bytes / MIB
            shown = printed.get(name, kind)
            if predicted == 0 and shown == 0:
                continue
            out.append(Check(name, kind, round(predicted, 2), shown))
    return out


def devices_from_lines(lines) -> tuple:
    """DeviceMemory per device from printed lines, CPU first (bytes rounded from two-decimal MiB)."""
    from shared.messages import DeviceMemory

    printed = parse_buffers(lines)
    return tuple(
        DeviceMemory(
            device=name,
            model_bytes=round(printed.get(name, "model") * MIB),
            kv_bytes=round(printed.get(name, "KV") * MIB),
            compute_bytes=round(printed.get(name, "compute") * MIB),
            output_bytes=round(printed.get(name, "output") * MIB),
        )
        for name in printed.devices()
    )


def device_lines(spec, printed_devices=()) -> list[str]:
    """One line per device of a lane: planned vs printed MiB for model, KV, compute, output."""
    printed = {d.device: d for d in printed_devices}

    def pair(planned: int, real) -> str:
        return f"{planned / MIB:.2f}" + (f"/{real / MIB:.2f}" if real is not None else "")

    out = []
    for d in spec.memory.devices:
        r = printed.get(d.device)
        where = d.device if d.device == "CPU" or not spec.gpu_devices else f"{d.device} (host gpu {spec.gpu_devices[int(d.device[3:])]})"
        out.append(
            f"  {spec.lane_id} {where}: layers {d.layers}, MiB planned/printed: model {pair(d.model_bytes, r and r.model_bytes)}"
            f", kv {pair(d.kv_bytes, r and r.kv_bytes)}, compute {pair(d.compute_bytes, r and r.compute_bytes)}"
            f", output {pair(d.output_bytes, r and r.output_bytes)}"
        )
    return out
