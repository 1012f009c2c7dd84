"""Record what the real llama-server prints for generated LoRA adapters (tests/lora_figures.json).

    .venv/bin/python tests/record_lora_figures.py

Each case writes a base model and its adapters (tests/tinymodels.py), starts the binary built by
`lanes install-llama` with them (--lora-scaled FILE:0, as lanes does), reads its buffer lines
(`LoRA buffer size`, one per buffer type) and stops it. tests/test_adapters.py holds the
memory model to these figures; its slow test measures them again.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tinymodels import write_llama, write_lora  # noqa: E402

from shared.llama.logs import parse_buffers  # noqa: E402

FIGURES = Path(__file__).with_name("lora_figures.json")
ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# name -> (base model's write_llama arguments, [write_lora arguments of each adapter])
CASES: dict[str, tuple[dict, list[dict]]] = {
    "f16-qv-r8": ({}, [{}]),
    "f32-qv-r4": ({}, [{"rank": 4, "dtype": "f32"}]),
    "f16-all-embd-out-r64-v32000": (
        {"n_layer": 4, "n_vocab": 32000},
        [{"n_layer": 4, "n_vocab": 32000, "rank": 64, "targets": ALL, "token_embd": True, "output": True}],
    ),
    "two-adapters": (
        {"n_layer": 4, "n_embd": 512, "n_ff": 1024, "head_dim": 128},
        [{"n_layer": 4, "n_embd": 512, "n_ff": 1024, "head_dim": 128, "rank": 32, "targets": ALL},
         {"n_layer": 4, "n_embd": 512, "n_ff": 1024, "head_dim": 128, "rank": 8, "blocks": (3,), "dtype": "f32",
          "seed": 1}],
    ),  # fmt: skip
    "q8_0-base-odd-rank": ({"matrix_type": "q8_0"}, [{"rank": 13, "targets": ("attn_q", "ffn_up"), "token_embd": True}]),
}


def write_case(folder: Path, name: str) -> tuple[Path, list[Path]]:
    base_kw, adapters_kw = CASES[name]
    folder.mkdir(parents=True, exist_ok=True)
    base = write_llama(folder / "base.gguf", **base_kw)
    return base, [write_lora(folder / f"adapter{i}.gguf", **kw) for i, kw in enumerate(adapters_kw)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(binary: str, base: Path, extra: list[str], timeout: float = 120.0) -> list[str]:
    """The binary's log lines from start until it answers /health (then it is stopped)."""
    port = _free_port()
    argv = [binary, "--model", str(base), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "1024",
            "--n-gpu-layers", "0", "-fit", "off", "--threads", "1", "--verbosity", "4", *extra]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    time.sleep(0.2)  # not listening yet (a recorder, not a test: polling is fine here)
        finally:
            proc.terminate()
            proc.wait(30)
        log.seek(0)
        return log.read().decode(errors="replace").splitlines()


def measure(binary: str, base: Path, adapters: list[Path]) -> dict[str, float]:
    """MiB of LoRA buffers per lane device as the binary prints them, and the CPU compute buffer."""
    printed = parse_buffers(_lines(binary, base, ["--lora-scaled", ",".join(f"{a}:0" for a in adapters)]))
    lora = {dev: kinds["LoRA"] for dev, kinds in printed.mib.items() if "LoRA" in kinds}
    if not lora:
        raise RuntimeError(f"no LoRA buffer line for {base}")
    return lora | {"compute": printed.get("CPU", "compute")}


def measure_compute(binary: str, base: Path) -> float:
    """The compute buffer without adapters (the same: loaded at scale 0 they are not in the graph)."""
    return parse_buffers(_lines(binary, base, [])).get("CPU", "compute")


def main() -> None:
    from launcher_agent.probe import find_llama_server

    binary = find_llama_server()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            base, adapters = write_case(Path(tmp) / name, name)
            out[name] = measure(binary, base, adapters)
            out[name]["compute_without"] = measure_compute(binary, base)
            print(name, out[name], flush=True)
    FIGURES.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
