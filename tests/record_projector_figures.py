"""Record the real llama-server's projector figures (tests/llama_figures.json, keys `mmproj|...`).

For each projector shape in SHAPES, generates the projector (tests/tinyprojectors.py) and a
text model of the width it feeds, runs the real llama-server (`lanes install-llama`) with
--mmproj on the CPU, and keeps the two lines clip prints: `load_hparams: model size` (its
weights) and `reserve_compute_meta: CPU compute buffer size` (its warm-up graph).
tests/test_projector_memory.py compares the memory model with them.

Dynamic-size projectors (Pixtral, PIXTRAL_SHAPES) warm up on a smaller image than the largest they
accept, and llama-server grows the buffer at the first larger image. These are recorded with the
projector on an RPC device whose server logs each buffer it allocates (GGML_RPC_DEBUG): the lane
runs with --image-min-tokens and --image-max-tokens both N, so any image is scaled to N tokens,
one image is sent, and the device's compute buffer after it (`largest_bytes`) is kept beside the
warm-up's printed lines. To record new shapes (--all: every shape again):

  .venv/bin/python tests/record_projector_figures.py
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lanes.install_rpc import rpc_bin_dir  # noqa: E402
from launcher_agent.probe import find_llama_server  # noqa: E402
from record_llama_figures import run_until_loaded, stop  # noqa: E402
from test_vision_real import tiny_png  # noqa: E402
from tinymodels import write_llama  # noqa: E402
from tinyprojectors import MINICPMV_TOKENS, write_projector  # noqa: E402

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
    # InternVL (a class token, layer scales, a 2 x 2 pixel shuffle into mm.model.mlp) and Llama 4 (a linear
    # patch unfold, RoPE-2D, a pixel shuffle into a two-layer MLP and mm.model.fc): one tile a warm-up
    ('internvl', 128, 256, 4, 2, 448, 14, 2, 'on', 256),
    ('internvl', 128, 256, 4, 2, 448, 14, 2, 'off', 256),
    ('internvl', 256, 1024, 4, 3, 448, 14, 2, 'on', 2048),
    ('internvl', 256, 1024, 8, 2, 448, 14, 2, 'off', 2048),
    ('internvl', 512, 512, 2, 2, 448, 14, 2, 'on', 4096),
    ('internvl', 128, 256, 4, 2, 224, 14, 2, 'on', 896),
    ('internvl', 64, 128, 2, 1, 448, 14, 2, 'on', 256),
    ('internvl', 1024, 4096, 16, 1, 448, 14, 2, 'on', 3584),  # InternViT-300M (one block of 24), Qwen2.5-7B's width
    ('internvl', 1024, 4096, 16, 1, 448, 14, 2, 'off', 3584),
    ('llama4', 128, 256, 4, 2, 336, 14, 2, 'on', 256),
    ('llama4', 128, 256, 4, 2, 336, 14, 2, 'off', 256),
    ('llama4', 256, 1024, 4, 3, 336, 14, 2, 'on', 2048),
    ('llama4', 256, 1024, 8, 2, 336, 14, 2, 'off', 2048),
    ('llama4', 512, 512, 2, 2, 336, 14, 2, 'on', 4096),
    ('llama4', 128, 256, 4, 2, 448, 14, 2, 'on', 1024),
    ('llama4', 64, 128, 2, 1, 336, 14, 2, 'on', 256),
    ('llama4', 1408, 5632, 16, 1, 336, 14, 2, 'on', 5120),  # Llama 4's vision encoder (one block of 34)
    ('llama4', 1408, 5632, 16, 1, 336, 14, 2, 'off', 5120),
    # Qwen2-Audio (qwen2a): a Whisper encoder over a 30 s chunk of 3,000 frames; "image" is the mel bins
    ('qwen2a', 128, 256, 4, 2, 128, 0, 0, 'on', 256),
    ('qwen2a', 128, 256, 4, 2, 128, 0, 0, 'off', 256),
    ('qwen2a', 256, 1024, 4, 3, 128, 0, 0, 'on', 2048),
    ('qwen2a', 256, 1024, 8, 2, 80, 0, 0, 'off', 2048),
    ('qwen2a', 512, 512, 2, 2, 128, 0, 0, 'on', 4096),
    ('qwen2a', 64, 128, 2, 1, 128, 0, 0, 'on', 256),
    ('qwen2a', 1280, 5120, 20, 1, 128, 0, 0, 'on', 4096),  # Qwen2-Audio-7B's encoder (one block of 32)
    ('qwen2a', 1280, 5120, 20, 1, 128, 0, 0, 'off', 4096),
    # MiniCPM-V (resampler; "merge" is its queries): a SigLIP encoder at the 448 x 448 warm-up, a resampler
    ('resampler', 128, 256, 4, 2, 448, 14, 64, 'on', 256),
    ('resampler', 128, 256, 4, 2, 448, 14, 64, 'off', 256),
    ('resampler', 128, 1024, 4, 2, 448, 14, 64, 'on', 512),
    ('resampler', 256, 256, 4, 2, 448, 14, 64, 'on', 512),
    ('resampler', 256, 1024, 4, 2, 224, 14, 64, 'off', 512),
    ('resampler', 128, 256, 4, 2, 224, 14, 96, 'on', 1024),
    ('resampler', 192, 768, 4, 2, 336, 14, 64, 'on', 384),
    ('resampler', 384, 1536, 6, 2, 448, 14, 64, 'on', 1024),
    ('resampler', 384, 1536, 6, 2, 448, 14, 64, 'off', 1024),
    ('resampler', 1152, 4304, 16, 1, 448, 14, 64, 'on', 2560),  # SigLIP-400M (one block of 27): MiniCPM-V 4.0
    ('resampler', 1152, 4304, 16, 1, 448, 14, 64, 'on', 3584),  # MiniCPM-V 2.6, MiniCPM-o 2.6
    ('resampler', 1152, 4304, 16, 1, 448, 14, 64, 'off', 3584),
    ('resampler', 1152, 4304, 16, 1, 448, 14, 64, 'on', 4096),  # MiniCPM-V 4.5
]


# Pixtral (merge 1: Pixtral-12B; merge 2: Mistral Small 3.1's patch merger). The shape as above, then
# N, the --image-min-tokens and --image-max-tokens the lane runs with; then, where given, the sent
# image's width and height in pixels (else 64 x 64): 1 x 1024 is scaled to one token a row, N rows.
PIXTRAL_SHAPES = [
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 256, 1024),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "off", 256, 1024),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 256, 256),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "off", 256, 256),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 256, 64),
    ("pixtral", 256, 1024, 4, 2, 1024, 16, 1, "on", 256, 1024),
    ("pixtral", 256, 1024, 8, 3, 1024, 16, 1, "off", 256, 1024),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 2048, 1024),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 4096, 1024),
    ("pixtral", 512, 512, 2, 2, 1024, 16, 1, "off", 256, 1024),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 256, 576),
    ("pixtral", 128, 256, 4, 2, 1540, 14, 2, "on", 256, 1024),
    ("pixtral", 128, 256, 4, 2, 1540, 14, 2, "off", 256, 1024),
    ("pixtral", 256, 1024, 4, 3, 1540, 14, 2, "on", 2048, 1024),
    ("pixtral", 128, 256, 4, 2, 1540, 14, 2, "on", 256, 256),
    ("pixtral", 1024, 4096, 16, 1, 1024, 16, 1, "on", 4096, 1024),  # Pixtral-12B's widths (one block of 24)
    ("pixtral", 128, 256, 4, 2, 1024, 14, 1, "on", 256, 1024),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 2, "on", 256, 1024),
    ("pixtral", 64, 128, 2, 2, 1540, 14, 2, "on", 256, 1024),
    ("pixtral", 512, 256, 8, 2, 1024, 16, 1, "on", 256, 1024),
    ("pixtral", 256, 512, 4, 1, 1540, 14, 2, "on", 1024, 1024),
    ("pixtral", 256, 512, 4, 1, 1540, 14, 2, "off", 1024, 1024),
    ("pixtral", 128, 256, 4, 4, 1024, 16, 1, "off", 256, 2048),
    ("pixtral", 1024, 4096, 16, 1, 1540, 14, 2, "on", 5120, 1024),  # Mistral Small 3.1's widths (one block of 24)
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 4096, 1024, 1, 1024),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "off", 256, 1024, 1, 1024),
    ("pixtral", 128, 256, 4, 2, 1024, 16, 1, "on", 256, 1024, 1, 1024),
    ("pixtral", 1024, 4096, 16, 1, 1024, 16, 1, "on", 5120, 1024, 1, 1024),
    ("pixtral", 128, 256, 4, 2, 1540, 14, 2, "on", 2048, 1024, 1, 1024),
    ("pixtral", 192, 384, 4, 2, 1024, 16, 1, "on", 1024, 1024, 1, 1024),
    ("pixtral", 192, 384, 4, 2, 1024, 16, 1, "on", 1024, 1024),
    ("pixtral", 384, 1536, 6, 3, 1540, 14, 2, "on", 3072, 1024, 1, 1024),
    ("pixtral", 256, 512, 4, 2, 1024, 16, 1, "off", 2048, 1024, 1, 1024),
]


# MiniCPM-V after one image (RPC device, the buffer it grew to): the shape as in SHAPES, then the image's
# width and height in pixels. 105 x 1,911 is sliced into pieces of up to 1,096 patches, 449 x 449 of 1,035.
RESAMPLER_LARGEST = [
    ("resampler", 128, 256, 4, 2, 448, 14, 64, "on", 256, 105, 1911),
    ("resampler", 128, 256, 4, 2, 448, 14, 64, "off", 256, 105, 1911),
    ("resampler", 128, 256, 4, 2, 448, 14, 64, "on", 256, 449, 449),
    ("resampler", 384, 1536, 6, 2, 448, 14, 64, "on", 1024, 105, 1911),
    ("resampler", 1152, 4304, 16, 1, 448, 14, 64, "on", 3584, 105, 1911),
]


def shape_key(proj_type, n_embd, n_ff, n_head, n_layer, image_size, patch_size, scale, flash_attn, text_embd) -> str:
    return (f"mmproj|type={proj_type}|n_embd={n_embd}|n_ff={n_ff}|n_head={n_head}|n_layer={n_layer}|"
            f"image={image_size}|patch={patch_size}|merge={scale}|text_embd={text_embd}|flash_attn={flash_attn}")  # fmt: skip


def resampler_key(*shape) -> str:
    return shape_key(*shape[:10]) + f"|image_px={shape[10]}x{shape[11]}"


def pixtral_key(*shape) -> str:
    return shape_key(*shape[:10]) + f"|max_tokens={shape[10]}" + (f"|image_px={shape[11]}x{shape[12]}" if len(shape) > 11 else "")


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


_BATCH = re.compile(r"decoding image batch \d+/\d+, n_tokens_batch = (\d+)")
_ALLOC = re.compile(r"\[alloc_buffer\] device: 0, size: (\d+) ->")


def measure_largest(bin_dir: Path, model: Path, mmproj: Path, flash_attn: str, tokens: int | None,
                    image_px: tuple = (64, 64), timeout: float = 180.0, threads: int = 1) -> dict:  # fmt: skip
    """The projector on an RPC device, every image scaled to `tokens` (None: as the type slices it): the
    warm-up's printed lines and the device's compute buffer after one image (the last buffer its server
    allocated, or the warm-up's)."""
    with tempfile.TemporaryDirectory() as tmp:
        rpc_log, port = Path(tmp) / "rpc.log", _free_port()
        with rpc_log.open("w") as out:
            rpc = subprocess.Popen([str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                                   stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, GGML_RPC_DEBUG="1"))  # fmt: skip
        try:
            time.sleep(1.0)
            argv = [str(bin_dir / "llama-server"), "-m", str(model), "--mmproj", str(mmproj), "--rpc", f"127.0.0.1:{port}",
                    "-ngl", "0", "-c", str(3 * (tokens or 1024) + 1024), "-fit", "off", "--flash-attn", flash_attn,
                    "--verbosity", "4", "--mmproj-offload",
                    *(["--image-min-tokens", str(tokens), "--image-max-tokens", str(tokens)] if tokens else [])]  # fmt: skip
            lines, after = _serve_one_image(argv, rpc_log, image_px, timeout)
        finally:
            stop(rpc)
    text = "\n".join(lines)
    computes = {m.group(1).split("[")[0]: float(m.group(2)) for m in _COMPUTE.finditer(text)}
    if "RPC0" not in computes or after is None:
        return {"error": [ln for ln in lines if "error" in ln.lower() or "failed" in ln.lower()][-3:] or lines[-2:]}
    before, grown = after
    # the device's compute buffer at the image: grown after it, else still the warm-up's (its last buffer)
    batches = _BATCH.findall(text)  # the image's tokens, with one [IMG_BREAK] a row but the last
    return {"warmup_compute_mib": computes, "warmup_bytes": before[-1], "largest_bytes": (grown or before)[-1],
            "grew": bool(grown),
            "image_batch_tokens": sum(map(int, batches)) if batches else None,
            "clip_flash_attn": (m.group(1) if (m := _FA.search(text)) else "")}  # fmt: skip


def _serve_one_image(argv: list[str], rpc_log: Path, image_px: tuple, timeout: float) -> tuple[list[str], tuple | None]:
    """Start llama-server, send one small image once it listens; its lines, and the sizes of the buffers
    the RPC server allocated before the image and after it (None when the image failed)."""
    port = _free_port()
    server_log = rpc_log.with_name("server.log")
    with server_log.open("w") as out:  # a file, not a pipe: a full pipe would stop the server mid-image
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    after, failure = None, []
    try:
        deadline = time.monotonic() + timeout
        while "listening on http" not in server_log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, server_log.read_text().splitlines()[-3:]
            time.sleep(0.1)
        before = [int(s) for s in _ALLOC.findall(rpc_log.read_text())]
        url = "data:image/png;base64," + base64.b64encode(tiny_png(*image_px)).decode()
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url",
                "image_url": {"url": url}}]}], "max_tokens": 1}  # fmt: skip
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout):
                after = (before, [int(s) for s in _ALLOC.findall(rpc_log.read_text())[len(before):]])
        except OSError as exc:
            failure = [f"error: the image request failed: {exc}"]
    finally:
        stop(proc)
    return server_log.read_text().splitlines() + failure, after


def projector_for(folder: Path, shape: tuple) -> tuple[Path, Path]:
    proj_type, n_embd, n_ff, n_head, n_layer, image, patch, scale, _, text_embd = shape[:10]
    special = MINICPMV_TOKENS if proj_type == "resampler" else ()  # the pieces mtmd looks up at start
    model = write_llama(folder / f"text-{text_embd}-{proj_type}.gguf", n_embd=text_embd, special=special)
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
        for shape in PIXTRAL_SHAPES:
            key = pixtral_key(*shape)
            if key in table and not again:
                continue
            rpc = rpc_bin_dir()
            if rpc is None:
                print("no RPC build: run `lanes install-llama --rpc`", file=sys.stderr)
                return 2
            model, mmproj = projector_for(Path(tmp), shape)
            table[key] = fig = measure_largest(rpc, model, mmproj, shape[8], shape[10], tuple(shape[11:13]) or (64, 64))
            print(key, fig.get("error") or (fig["warmup_compute_mib"], fig["largest_bytes"]))
        for shape in RESAMPLER_LARGEST:
            key = resampler_key(*shape)
            if key in table and not again:
                continue
            model, mmproj = projector_for(Path(tmp), shape)
            table[key] = fig = measure_largest(rpc_bin_dir(), model, mmproj, shape[8], None, tuple(shape[10:12]))
            print(key, fig.get("error") or (fig["warmup_compute_mib"], fig["largest_bytes"]))
    FIGURES.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
