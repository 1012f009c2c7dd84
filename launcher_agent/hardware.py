"""What this host has: CPU cores and RAM through psutil, NVIDIA GPUs through NVML, Apple
Silicon's Metal working set, the matrix types the CPU backend repacks, and which kind of
GPU-type devices a llama-server binary sees.
"""

from __future__ import annotations

import platform
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import psutil
import structlog

from launcher_agent import cgroup_memory
from shared.memory.cpu_repack import (
    AVX2_REPACK,
    AVX512_REPACK,
    NEON_DOTPROD_REPACK,
    NEON_I8MM_REPACK,
)
from shared.messages.hosts import GpuInfo

log = structlog.get_logger("lanes.agent")


def ram() -> tuple[int, int, int]:
    """(cpu cores, RAM total, RAM available) in bytes: the machine's, or the memory cgroup's where
    the agent runs under a limit (a container's): its lanes are killed at that limit."""
    vm = psutil.virtual_memory()
    total, available = vm.total, vm.available
    group = cgroup_memory.this_group()
    if group is not None:
        total, available = min(total, group.limit), min(available, group.available)
    return psutil.cpu_count(logical=True) or 1, total, available


def cpu_repack(cpuinfo: str | None = None, machine: str | None = None) -> tuple[str, ...]:
    """Matrix types ggml's CPU backend repacks on this CPU (ggml-cpu/repack.cpp), as TYPE:rows."""
    machine = (machine or platform.machine()).lower()
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags.update(line.split(":", 1)[-1].split())
    if machine in ("x86_64", "amd64"):
        if "avx512f" in flags:
            return AVX512_REPACK
        return AVX2_REPACK if "avx2" in flags else ()
    if machine in ("arm64", "aarch64"):
        if "i8mm" in flags or (machine == "arm64" and platform.system() == "Darwin"):
            return NEON_I8MM_REPACK
        return NEON_DOTPROD_REPACK if "asimddp" in flags else ()
    return ()


def gpu_backend_of(binary: str | None) -> str:
    """cuda / metal / vulkan / rocm when the binary lists such devices; else rpc (GPU-type devices
    on a CPU-only build are ggml-rpc-servers). Without a binary: cuda if NVML sees GPUs."""
    if binary:
        try:
            run = subprocess.run([binary, "--list-devices"], capture_output=True, text=True, timeout=20)
            text = run.stdout + run.stderr
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        for prefix, backend in (("CUDA", "cuda"), ("MTL", "metal"), ("Vulkan", "vulkan"), ("ROCm", "rocm")):
            if f"  {prefix}0" in text or f"\n{prefix}0" in text:
                return backend
        return "rpc"
    return "cuda" if nvidia_gpus() else "rpc"


_last_good: tuple[GpuInfo, ...] = ()


def nvidia_gpus(lane_pids: Iterable[int] = ()) -> tuple[GpuInfo, ...]:
    """NVIDIA GPUs via NVML (the optional nvidia-ml-py package); none, quietly, without it.

    `lanes_vram` per GPU is what the given lane processes hold there (NVML's per-process
    figure, CUDA context included). An NVML error is logged and the last good list is
    returned, marked stale: a failed query must not turn a GPU host into a CPU host.
    """
    global _last_good
    try:
        import pynvml
    except ImportError:
        return ()
    pids = set(lane_pids)
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return _stale(exc)
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            held = 0
            if pids:
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if proc.pid in pids and proc.usedGpuMemory:
                        held += int(proc.usedGpuMemory)
            gpus.append(
                GpuInfo(name=name, vram_total=int(mem.total), vram_free=int(mem.free), backend="cuda",
                        device=f"CUDA{i}", lanes_vram=held)  # fmt: skip
            )
        _last_good = tuple(gpus)
        return _last_good
    except Exception as exc:
        return _stale(exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _stale(exc: Exception) -> tuple[GpuInfo, ...]:
    log.warning("NVML query failed; reporting the last good GPU figures", error=str(exc), gpus=len(_last_good))
    import msgspec

    return tuple(msgspec.structs.replace(g, stale=True) for g in _last_good)


def metal_gpu(ram_total: int, wired_limit_mb: int | None = None, allocated: int = 0) -> GpuInfo:
    """Apple Silicon: Metal's working set is the GPU budget, carved out of unified RAM.

    recommendedMaxWorkingSetSize defaults to about 2/3 of RAM up to 36 GiB and 3/4 above;
    `sysctl iogpu.wired_limit_mb=N` raises it (until reboot).
    """
    if wired_limit_mb:
        limit = wired_limit_mb * 1024 * 1024
    else:
        limit = ram_total * 3 // 4 if ram_total > 36 * 1024**3 else ram_total * 2 // 3
    return GpuInfo(name="Apple GPU", vram_total=limit, vram_free=max(0, limit - allocated), backend="metal",
                   device="MTL0", unified=True)  # fmt: skip


def apple_gpus() -> tuple[GpuInfo, ...]:
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return ()
    try:
        out = subprocess.run(["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True, timeout=5)
        wired = int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        wired = 0
    return (metal_gpu(psutil.virtual_memory().total, wired),)


_LISTED = re.compile(r"^\s*(\S+?):\s.*?\((\d+) MiB, (\d+) MiB free\)", re.M)


def listed_devices(text: str) -> list[tuple[str, int, int]]:
    """(name, total, free) per device from `llama-server --list-devices` output."""
    return [(m.group(1), int(m.group(2)) * 2**20, int(m.group(3)) * 2**20) for m in _LISTED.finditer(text)]


_rpc_listed: dict[tuple[str, ...], list[tuple[str, int, int]]] = {}


def rpc_gpus(binary: str, endpoints: Iterable[str], held: dict[int, int] | None = None) -> list[GpuInfo]:
    """ggml-rpc-servers as GPU-type devices, named and sized as llama-server sees them.

    Listed once per agent: a ggml-rpc-server serves one client at a time, so asking it again
    while a lane is connected would wait for that lane to end. Afterwards a loopback server's
    free memory is this host's available RAM (what it reports); a remote one's is its first
    figure less what our lanes hold there (`held`, GPU index -> bytes).
    """
    endpoints = tuple(endpoints)
    held = held or {}
    if endpoints not in _rpc_listed:
        try:
            run = subprocess.run([binary, "--rpc", ",".join(endpoints), "--list-devices"],
                                 capture_output=True, text=True, timeout=10)  # fmt: skip
            listed = [d for d in listed_devices(run.stdout + run.stderr) if d[0].startswith("RPC")]
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("could not list the RPC devices", error=str(exc))
            listed = []
        if len(listed) == len(endpoints):
            _rpc_listed[endpoints] = listed
    listed = _rpc_listed.get(endpoints, [])
    out = []
    for i, endpoint in enumerate(endpoints):
        name, total, free = listed[i] if i < len(listed) else (f"RPC{i}", 0, 0)
        if endpoint.startswith(("127.", "localhost:", "[::1]")):
            free = min(total, psutil.virtual_memory().available)
        else:
            free = max(0, free - held.get(i, 0))
        out.append(GpuInfo(name=f"rpc {endpoint}", vram_total=total, vram_free=free, backend="rpc",
                           device=name, endpoint=endpoint))  # fmt: skip
    return out
