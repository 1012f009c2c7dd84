"""Which device each layer of a model lands on, exactly as llama.cpp's load_tensors decides.

Pure; the second room of a lane's memory: layout -> placement (here) -> buffers.
Layer indices 0..n_layer-1 are the repeating blocks, n_layer the output layer;
token embeddings (the input layer) always stay on the CPU.

From src/llama-model.cpp (build b11434):
    i_gpu_start    = max(n_layer + 1 - n_gpu_layers, 0)        # the output layer goes first
    act_gpu_layers = min(n_gpu_layers, n_layer + 1)
    splits         = cumulative float32 shares, normalised to 1
    layer il >= i_gpu_start -> first device with splits[d] > float32(il - i_gpu_start) / act_gpu_layers
`--split-mode none` keeps only the main GPU. Older builds (before Dec 2025) offloaded the
last N blocks and the output layer only when N > n_layer ("blocks_first").

Inside lanes a layer count is `NGpuLayers`: a count of layers, or "all"; `ngl_count` is the
one place "all" becomes a number (for load_tensors' formula and for the wire's int).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shared.messages.plans import NGpuLayers

CPU = -1
SplitMode = Literal["layer", "none"]
NglRule = Literal["output_first", "blocks_first"]


class PlacementError(ValueError):
    """A device layout llama-server would refuse, or one that names devices the host lacks."""


@dataclass(frozen=True)
class Placement:
    n_layer: int
    layer_device: tuple[int, ...]  # n_layer + 1 entries (the last is the output layer); CPU or a device index
    n_devices: int  # GPU-type devices the lane uses, in llama-server's order
    backends: tuple[str, ...] = ()  # each device's backend (cuda, rocm, metal, rpc, vulkan); () unknown
    split_mode: SplitMode = "layer"
    # Blocks whose expert tensors stay in RAM though the block is on a device (--n-cpu-moe, -ot ...=CPU).
    cpu_experts: frozenset[int] = frozenset()

    @property
    def output_device(self) -> int:
        return self.layer_device[-1]

    @property
    def offloaded(self) -> int:
        """What llama-server prints as `offloaded X/Y layers` (X; Y is n_layer + 1)."""
        return len(self.layer_device) - self.layer_device.count(CPU)

    def layers_on(self, device: int) -> list[int]:
        return list(_layers_on(self.layer_device, device))

    def backend(self, device: int) -> str:
        """The backend of a device index (CPU: "cpu"; "" when the caller gave none)."""
        if device == CPU:
            return "cpu"
        return self.backends[device] if device < len(self.backends) else ""


@functools.lru_cache(maxsize=4096)
def _layers_on(layer_device: tuple[int, ...], device: int) -> tuple[int, ...]:
    return tuple(il for il, d in enumerate(layer_device) if d == device)


def ngl_count(n_gpu_layers: NGpuLayers, n_layer: int) -> int:
    """Layers offloaded as the number llama.cpp counts, and the int a lane spec carries on the
    wire (LaneSpec.n_gpu_layers, -ngl's value): "all" is every block and the output layer."""
    if n_gpu_layers == "all":
        return n_layer + 1
    if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int) or n_gpu_layers < 0:
        raise PlacementError(f"--n-gpu-layers {n_gpu_layers}: use a count of layers or 'all'")
    return n_gpu_layers


def normalised_splits(shares: Sequence[float]) -> list[float]:
    """Cumulative shares in float32, as llama.cpp computes them (boundaries must match bit for bit)."""
    values = np.asarray(shares, dtype=np.float32)
    if values.size == 0:
        raise PlacementError("no devices to split over")
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise PlacementError(f"tensor split {','.join(map(str, shares))}: shares must be finite and not negative")
    total = np.float32(0)
    cumulative = []
    for v in values:
        total = np.float32(total + v)
        cumulative.append(total)
    if total <= 0:
        raise PlacementError(f"tensor split {','.join(map(str, shares))}: the shares must not sum to zero")
    return [float(np.float32(c / total)) for c in cumulative]


def place(
    n_layer: int,
    n_gpu_layers: NGpuLayers,
    shares: Sequence[float] = (),
    *,
    split_mode: SplitMode = "layer",
    main_gpu: int = 0,
    rule: NglRule = "output_first",
    backends: Sequence[str] = (),
) -> Placement:
    """Layers to devices; shares (and backends, when given) have one entry per device.
    Pure and cached: the planner places the same few layouts over and over."""
    n_devices = len(shares)
    if backends and len(backends) != n_devices:
        raise PlacementError(f"tensor split has {n_devices} shares for {len(backends)} device(s)")
    n_gpu_layers = ngl_count(n_gpu_layers, n_layer)
    backends = tuple(backends)
    if n_devices == 0 or n_gpu_layers == 0:
        return Placement(n_layer, (CPU,) * (n_layer + 1), n_devices, backends, split_mode)
    if split_mode == "none":
        if not 0 <= main_gpu < n_devices:
            raise PlacementError(f"main GPU {main_gpu} is not one of the {n_devices} device(s)")
        one_hot = [0.0] * n_devices
        one_hot[main_gpu] = 1.0
        shares = one_hot
    splits = np.asarray(normalised_splits(shares), dtype=np.float32)
    if rule == "blocks_first":
        layer_device = _blocks_first(n_layer, n_gpu_layers, splits, n_devices)
        return Placement(n_layer, layer_device, n_devices, backends, split_mode)
    i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer + 1)
    devices = []
    for il in range(n_layer + 1):
        if il < i_gpu_start or il - i_gpu_start >= act:
            devices.append(CPU)
            continue
        x = np.float32(np.float32(il - i_gpu_start) / np.float32(act))
        devices.append(min(int(np.searchsorted(splits, x, side="right")), n_devices - 1))
    return Placement(n_layer, tuple(devices), n_devices, backends, split_mode)


def _blocks_first(n_layer: int, n_gpu_layers: int, splits: np.ndarray, n_devices: int) -> tuple[int, ...]:
    """Builds before Dec 2025: the last N blocks; the output layer only when N > n_layer."""
    i_gpu_start = max(n_layer - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer)
    devices = []
    for il in range(n_layer):
        if il < i_gpu_start:
            devices.append(CPU)
            continue
        x = np.float32(np.float32(il - i_gpu_start) / np.float32(act))
        devices.append(min(int(np.searchsorted(splits, x, side="right")), n_devices - 1))
    if n_gpu_layers > n_layer:
        x = np.float32(np.float32(n_layer - i_gpu_start) / np.float32(act))
        devices.append(min(int(np.searchsorted(splits, x, side="right")), n_devices - 1))
    else:
        devices.append(CPU)
    return tuple(devices)
