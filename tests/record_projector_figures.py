"""Record the real llama-server's projector figures (tests/llama_figures.json, keys `mmproj|...`).

For each projector shape in SHAPES, generates the projector (tests/tinyprojectors.py) and a
text model of the width it feeds, runs the real llama-server (`lanes install-llama`) with
--mmproj on the CPU, and keeps the two lines clip prints: `load_hparams: model size` (its
weights) and `reserve_compute_meta: CPU compute buffer size` (its warm-up graph).
tests/test_projector_memory.py compares the memory model with them. To record new shapes (--all:
every shape again):

  .venv/bin/python tests/record_projector_figures.py
"""

from __future__ import annotations

import json
import re
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from launcher_agent.probe import find_llama_server  # noqa: E402
from record_llama_figures import run_until_loaded  # noqa: E402
from tinymodels import write_llama  # noqa: E402
from tinyprojectors import write_projector  # noqa: E402

FIGURES = Path(__file__).with_name("llama_figures.json")
_WEIGHTS = re.compile(r"load_hparams: model size: +([\d.]+) MiB")
_COMPUTE = re.compile(r"reserve_compute_meta: +(\S+) compute buffer size = +([\d.]+) MiB")
_FA = re.compile(r"warmup: flash attention is (enabled|disabled)")

# (projector type, n_embd, n_ff, n_head, n_layer, image_size, patch_size, scale_factor, flash_attn, text n_embd)
SHAPES = [
    ("gemma3", 128, 256, 4, 2, 224, 14, 2, "on", 256),
    ("gemma3", 128, 256, 4, 2, 224, 14, 2, "off", 256),
    ("gemma3", 256, 256, 4, 2, 224, 14, 2, "on", 256),
    ("gemma3", 128, 1024, 4, 2, 224, 14, 2, "on", 256),
    ("gemma3", 128, 256, 4, 2, 448, 14, 4, "on", 256),
    ("gemma3", 128, 256, 8, 3, 448, 14, 4, "off", 256),
    ("gemma3", 384, 1536, 6, 2, 896, 14, 4, "on", 256),
    ("gemma3", 128, 2048, 2, 2, 224, 14, 2, "off", 256),
    ("gemma3", 512, 512, 2, 2, 224, 14, 2, "off", 256),
    ("gemma3", 512, 512, 2, 2, 224, 14, 2, "on", 256),
    ("gemma3", 64, 128, 16, 2, 448, 14, 4, "off", 256),
    ("gemma3", 256, 512, 4, 1, 448, 14, 4, "off", 256),
    ("gemma3", 256, 384, 4, 2, 448, 14, 4, "off", 256),
    ("gemma3", 256, 1024, 8, 2, 448, 14, 4, "off", 256),
    ("gemma3", 96, 4096, 2, 2, 448, 14, 4, "off", 256),
    ("gemma3", 1152, 4304, 16, 1, 896, 14, 4, "on", 256),  # Gemma 3's SigLIP (one block of 27)
    ("gemma3", 1152, 4304, 16, 1, 896, 14, 4, "on", 640),  # ... feeding Gemma 3 270M (n_embd 640)
    ("gemma3", 256, 768, 2, 1, 448, 14, 4, "on", 256),
    ("gemma3", 256, 768, 2, 1, 448, 14, 4, "on", 2048),
    ("gemma3", 256, 768, 2, 2, 448, 14, 4, "on", 2048),
    ("gemma3", 256, 768, 2, 3, 448, 14, 4, "on", 2048),
    ("gemma3", 256, 768, 2, 2, 448, 14, 4, "on", 4096),
    ("gemma3", 256, 768, 2, 1, 448, 14, 4, "on", 4096),
    ("gemma3", 512, 512, 2, 1, 224, 14, 2, "on", 256),
    ("gemma3", 512, 512, 2, 2, 224, 14, 2, "on", 4096),
    ("gemma3", 256, 768, 2, 2, 448, 14, 4, "off", 4096),
    ("gemma3", 256, 768, 2, 2, 448, 14, 4, "on", 256),
    ("idefics3", 128, 256, 4, 2, 224, 14, 2, "on", 256),
    ("idefics3", 128, 256, 4, 2, 224, 14, 2, "off", 256),
    ("idefics3", 256, 1024, 4, 2, 448, 16, 4, "on", 256),
    ("idefics3", 192, 768, 3, 2, 512, 16, 2, "off", 256),
    ("idefics3", 128, 2048, 2, 2, 224, 14, 2, "off", 256),
    ("idefics3", 512, 512, 2, 2, 224, 14, 2, "off", 256),
    ("idefics3", 512, 512, 2, 2, 224, 14, 2, "on", 256),
    ("idefics3", 64, 128, 16, 2, 448, 14, 4, "off", 256),
    ("idefics3", 256, 384, 4, 2, 448, 14, 2, "off", 256),
    ("idefics3", 768, 3072, 12, 1, 512, 16, 4, "on", 256),  # SmolVLM's SigLIP (one block of 12)
    ("idefics3", 256, 768, 2, 1, 448, 14, 4, "on", 2048),
    ("idefics3", 256, 768, 2, 2, 448, 14, 4, "on", 2048),
    ("idefics3", 256, 768, 2, 3, 448, 14, 4, "on", 2048),
    ("idefics3", 512, 512, 2, 1, 224, 14, 2, "on", 256),
    ("idefics3", 256, 768, 2, 1, 448, 14, 4, "off", 256),
    # LLaVA (type mlp): a CLIP encoder with a class token, then mm.0, GELU, mm.2 (the text model's width)
    ('mlp', 128, 256, 4, 3, 224, 14, 2, 'on', 256),
    ('mlp', 128, 256, 4, 3, 224, 14, 2, 'off', 256),
    ('mlp', 256, 256, 4, 3, 224, 14, 2, 'on', 256),
    ('mlp', 128, 1024, 4, 3, 224, 14, 2, 'on', 256),
    ('mlp', 128, 256, 4, 3, 336, 14, 2, 'on', 256),
    ('mlp', 128, 256, 8, 3, 336, 14, 2, 'off', 256),
    ('mlp', 128, 256, 4, 2, 224, 14, 2, 'on', 256),
    ('mlp', 128, 256, 4, 4, 224, 14, 2, 'on', 256),
    ('mlp', 128, 256, 4, 3, 224, 14, 2, 'on', 1024),
    ('mlp', 128, 256, 4, 3, 224, 14, 2, 'on', 4096),
    ('mlp', 512, 512, 2, 3, 224, 14, 2, 'off', 256),
    ('mlp', 512, 512, 2, 3, 224, 14, 2, 'on', 256),
    ('mlp', 64, 128, 16, 3, 448, 14, 2, 'off', 256),
    ('mlp', 256, 1024, 4, 2, 336, 14, 2, 'off', 2048),
    ('mlp', 1024, 4096, 16, 2, 336, 14, 2, 'on', 4096),
    ('mlp', 1024, 4096, 16, 2, 336, 14, 2, 'off', 4096),
    ('mlp', 96, 4096, 2, 3, 448, 14, 2, 'off', 256),
    ('mlp', 256, 768, 2, 2, 448, 14, 2, 'on', 2048),
    ('mlp', 128, 256, 4, 3, 224, 16, 2, 'on', 256),
    ('mlp', 256, 768, 2, 3, 448, 14, 2, 'on', 4096),
    ('mlp', 128, 256, 4, 3, 224, 14, 2, 'on', 512),
    ('mlp', 128, 256, 4, 3, 224, 14, 2, 'on', 2048),
    ('mlp', 128, 256, 4, 2, 448, 14, 2, 'on', 1024),
    ('mlp', 128, 256, 4, 2, 448, 14, 2, 'on', 2048),
    ('mlp', 128, 256, 4, 2, 448, 14, 2, 'on', 4096),
    ('mlp', 128, 256, 4, 3, 448, 14, 2, 'on', 2048),
    ('mlp', 128, 256, 4, 4, 448, 14, 2, 'on', 2048),
    ('mlp', 256, 256, 4, 2, 448, 14, 2, 'on', 2048),
    ('mlp', 512, 512, 4, 2, 448, 14, 2, 'on', 2048),
    ('mlp', 128, 256, 4, 2, 448, 14, 2, 'on', 256),
    ('mlp', 128, 256, 4, 2, 336, 14, 2, 'on', 4096),
    ('mlp', 128, 256, 4, 3, 336, 14, 2, 'on', 4096),
    # Qwen2-VL and Qwen2.5-VL: warmed up at 46 x 46 merged tokens whatever the image size
    ('qwen2vl_merger', 64, 128, 2, 2, 560, 14, 2, 'on', 256),
    ('qwen2vl_merger', 64, 128, 2, 2, 560, 14, 2, 'off', 256),
    ('qwen2vl_merger', 128, 256, 2, 2, 560, 14, 2, 'on', 256),
    ('qwen2vl_merger', 256, 1024, 4, 2, 560, 14, 2, 'on', 256),
    ('qwen2vl_merger', 256, 1024, 4, 2, 560, 14, 2, 'on', 2048),
    ('qwen2vl_merger', 64, 128, 2, 2, 336, 14, 2, 'on', 256),
    ('qwen2vl_merger', 128, 512, 4, 3, 560, 14, 2, 'off', 1024),
    ('qwen2vl_merger', 512, 512, 8, 2, 560, 14, 2, 'on', 4096),
    ('qwen2.5vl_merger', 64, 128, 2, 4, 560, 14, 2, 'on', 256),
    ('qwen2.5vl_merger', 128, 512, 2, 4, 560, 14, 2, 'off', 256),
    ('qwen2.5vl_merger', 256, 1024, 4, 4, 560, 14, 2, 'on', 2048),
    ('qwen2.5vl_merger', 128, 256, 2, 4, 560, 14, 2, 'on', 4096),
    # Qwen3-VL: deepstack mergers at blocks 1..3 (two with 4 blocks), 16-pixel patches
    ('qwen3vl_merger', 64, 128, 2, 4, 768, 16, 2, 'on', 256),
    ('qwen3vl_merger', 64, 128, 2, 4, 768, 16, 2, 'off', 256),
    ('qwen3vl_merger', 64, 128, 2, 4, 768, 16, 2, 'on', 2048),
    ('qwen3vl_merger', 64, 128, 2, 4, 768, 16, 2, 'on', 4096),
    ('qwen3vl_merger', 64, 128, 2, 5, 768, 16, 2, 'on', 4096),
    ('qwen3vl_merger', 256, 1024, 4, 4, 768, 16, 2, 'on', 2048),
    ('qwen3vl_merger', 128, 512, 2, 5, 768, 16, 2, 'off', 4096),
    ('qwen3vl_merger', 256, 1024, 4, 5, 768, 16, 2, 'on', 4096),
    ('qwen3vl_merger', 512, 1024, 4, 5, 768, 16, 2, 'on', 4096),
    ('qwen3vl_merger', 1152, 4304, 16, 5, 768, 16, 2, 'on', 2048),
    ('qwen3vl_merger', 128, 256, 2, 5, 768, 16, 2, 'on', 4096),
]


def shape_key(proj_type, n_embd, n_ff, n_head, n_layer, image_size, patch_size, scale, flash_attn, text_embd) -> str:
    return (f"mmproj|type={proj_type}|n_embd={n_embd}|n_ff={n_ff}|n_head={n_head}|n_layer={n_layer}|"
            f"image={image_size}|patch={patch_size}|merge={scale}|text_embd={text_embd}|flash_attn={flash_attn}")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(binary: str, model: Path, mmproj: Path, flash_attn: str, timeout: float = 120.0) -> dict:
    argv = [binary, "--model", str(model), "--mmproj", str(mmproj), "--no-mmproj-offload", "--host", "127.0.0.1",
            "--port", str(_free_port()), "--ctx-size", "512", "--n-gpu-layers", "0", "--flash-attn", flash_attn,
            "-fit", "off", "--verbosity", "4"]  # fmt: skip
    lines = run_until_loaded(argv, timeout)
    text = "\n".join(lines)
    weights, fa = _WEIGHTS.search(text), _FA.search(text)
    computes = {m.group(1): float(m.group(2)) for m in _COMPUTE.finditer(text)}  # the last reserve (FA settled)
    if not weights or not computes:
        return {"error": [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()][-3:] or lines[-2:]}
    return {"weights_mib": float(weights.group(1)), "compute_mib": computes, "clip_flash_attn": fa.group(1) if fa else "",
            "argv": argv[1:]}  # fmt: skip


def projector_for(folder: Path, shape: tuple) -> tuple[Path, Path]:
    proj_type, n_embd, n_ff, n_head, n_layer, image, patch, scale, _, text_embd = shape
    model = write_llama(folder / f"text-{text_embd}.gguf", n_embd=text_embd)
    mmproj = write_projector(folder / f"mmproj-{proj_type}-{n_embd}-{n_ff}-{n_head}-{n_layer}-{image}-{patch}-{scale}-{text_embd}.gguf",
                             proj_type=proj_type, text_embd=text_embd, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
                             n_layer=n_layer, image_size=image, patch_size=patch, scale_factor=scale)  # fmt: skip
    return model, mmproj


def main() -> int:
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: run `lanes install-llama`", file=sys.stderr)
        return 2
    table = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    again = "--all" in sys.argv[1:]  # else only the shapes not recorded yet
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            key = shape_key(*shape)
            if key in table and not again:
                continue
            model, mmproj = projector_for(Path(tmp), shape)
            table[key] = fig = measure(binary, model, mmproj, shape[8])
            print(key, fig.get("error") or (fig["weights_mib"], fig["compute_mib"]))
    FIGURES.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
