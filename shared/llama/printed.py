"""What llama-server printed against what the plan predicted, per device and kind of buffer."""

from __future__ import annotations

from dataclasses import dataclass

from shared.llama.logs import MIB, DeviceBuffers

_KIND_FIELDS = {
    "model": "model_bytes", "KV": "kv_bytes", "compute": "compute_bytes", "output": "output_bytes",
    "LoRA": "adapter_bytes",
}  # fmt: skip
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


def device_lines(spec, printed_devices=()) -> list[str]:
    """One line per device of a lane: planned vs printed MiB for model, KV, compute, output."""
    printed = {d.device: d for d in printed_devices}

    def pair(planned: int, real) -> str:
        return f"{planned / MIB:.2f}" + (f"/{real / MIB:.2f}" if real is not None else "")

    out = []
    for d in spec.memory.devices:
        r = printed.get(d.device)
        where = d.device if d.index < 0 or not spec.gpu_devices else f"{d.device} (host gpu {spec.gpu_devices[d.index]})"
        out.append(
            f"  {spec.lane_id} {where}: layers {d.layers}, MiB planned/printed: model {pair(d.model_bytes, r and r.model_bytes)}"
            f", kv {pair(d.kv_bytes, r and r.kv_bytes)}, compute {pair(d.compute_bytes, r and r.compute_bytes)}"
            f", output {pair(d.output_bytes, r and r.output_bytes)}"
            + (f", LoRA {pair(d.adapter_bytes, r and r.adapter_bytes)}" if d.adapter_bytes else "")
            + (f" (the draft model's {d.draft_bytes / MIB:.2f} among them)" if d.draft_bytes else "")
            + (f", speculator {d.speculator_bytes / MIB:.2f} planned (printed by no line)" if d.speculator_bytes else "")
        )
    return out
