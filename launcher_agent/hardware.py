"""What this host has: CPU cores and RAM through psutil, NVIDIA GPUs through NVML when present."""

from __future__ import annotations

import psutil

from shared.messages import GpuInfo


def ram() -> tuple[int, int, int]:
    """(cpu cores, RAM total, RAM available) in bytes."""
    vm = psutil.virtual_memory()
    return psutil.cpu_count(logical=True) or 1, vm.total, vm.available


def nvidia_gpus() -> tuple[GpuInfo, ...]:
    """NVIDIA GPUs via NVML (the optional nvidia-ml-py package); none, quietly, without it."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
    except Exception:
        return ()
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            gpus.append(GpuInfo(name=name, vram_total=int(mem.total), vram_free=int(mem.free), backend="cuda"))
        return tuple(gpus)
    except Exception:
        return ()
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
