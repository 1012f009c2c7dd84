"""Gemma 3n's vision projector (gemma3nv, MobileNetV5): the compute buffer shared/memory/mobilenet.py predicts
against the real llama-server's figures (tests/gemma3n_figures.json, recorded by `python tests/tinymobilenet.py`
from generated projectors of MobileNetV5-300M's layout at several widths, the real one included)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tinymobilenet import FIGURES, gemma3n_tensors, write_gemma3n_projector

from shared.memory.mobilenet import (
    MobileNetFacts,
    graph_nodes,
    mobilenet_compute_bytes,
    mobilenet_facts,
    mobilenet_peak,
)

MIB = 1024 * 1024
PRINTED = 0.005 * MIB  # clip prints the buffer in MiB to two decimals
TABLE = json.loads(FIGURES.read_text())


def _shape(key: str) -> tuple[float, int, int]:
    """gemma3nv|width_scale=W|text_embd=T|image=S -> (W, T, S)."""
    parts = dict(p.split("=") for p in key.split("|")[1:])
    return float(parts["width_scale"]), int(parts["text_embd"]), int(parts["image"])


def facts_of(width_scale: float, text_embd: int, image_size: int) -> MobileNetFacts:
    """What mobilenet_facts reads from the file write_gemma3n_projector writes, without writing it."""
    tensors = gemma3n_tensors(text_embd, width_scale)
    return MobileNetFacts(
        image_size=image_size,
        shapes={name: tuple(reversed(shape)) for name, shape, _, _ in tensors},
        types={name: 0 if dtype == np.float32 else 1 for name, _, dtype, _ in tensors},
    )


@pytest.mark.parametrize("key", sorted(TABLE))
def test_formula_matches_the_binary(key):
    """Never below the printed buffer, and byte-exact where the RPC server logs it in bytes."""
    fig = TABLE[key]
    got = mobilenet_compute_bytes(facts_of(*_shape(key)))
    for mib in fig["compute_mib"].values():  # flash attention on and off
        assert got >= mib * MIB - PRINTED
        assert abs(got - mib * MIB) <= PRINTED
    assert got == fig["rpc_compute_bytes"]


def test_recorded_shapes_cover_the_real_model_and_every_peak():
    """The real widths (Gemma 3n E2B: MobileNetV5-300M, 2048 wide) are recorded, and each of the three places the
    peak lands (stage 1's strided depthwise im2col, stage 2's attention scores, the MSFA's projection) is."""
    assert "gemma3nv|width_scale=1.0|text_embd=2048|image=768" in TABLE
    kinds = {mobilenet_peak(facts_of(*_shape(k)))[1][-1][0] for k in TABLE}
    assert {"IM2COL", "MUL_MAT", "CONT"} <= kinds


def test_real_widths_peak_in_stage_one():
    """At the real widths: the gelu'd expansion (192^2 x 768 f32, freed, its hole kept), its same-padding copy
    (195^2 x 768 f32) and the dw_mid's unrolled input (25 x 96^2 x 768 f16)."""
    mid = 768
    assert mobilenet_compute_bytes(facts_of(1.0, 2048, 768)) == mid * (4 * 192**2 + 4 * 195**2 + 2 * 25 * 96**2)


@pytest.mark.parametrize("key", sorted(TABLE))
def test_flash_attention_and_images_leave_the_buffer(key):
    """The graph has no flash-attention op, and every image is resized to the warm-up's size."""
    fig = TABLE[key]
    assert fig["compute_mib"]["on"] == fig["compute_mib"]["off"]
    assert fig["clip_flash_attn"] == {"on": "enabled", "off": "disabled"}
    assert not fig["grew"] and fig["rpc_after_image_bytes"] == fig["rpc_compute_bytes"]
    assert graph_nodes(facts_of(*_shape(key))) == fig["nodes"]


def test_facts_read_from_the_file(tmp_path):
    path = write_gemma3n_projector(tmp_path / "mmproj-gemma3n.gguf", 128, 0.0625)
    read = mobilenet_facts(path)
    made = facts_of(0.0625, 128, 768)
    assert read.image_size == 768
    assert dict(read.shapes) == dict(made.shapes)
    fig = TABLE["gemma3nv|width_scale=0.0625|text_embd=128|image=768"]
    assert mobilenet_compute_bytes(read) == fig["rpc_compute_bytes"]


def test_no_image_size_or_blocks_is_nothing():
    assert mobilenet_compute_bytes(MobileNetFacts(image_size=0, shapes={})) == 0
    assert mobilenet_compute_bytes(MobileNetFacts(image_size=768, shapes={"mm.input_projection.weight": (8, 8)})) == 0


@pytest.mark.slow
def test_real_binary_prints_the_formula(tmp_path, llama_server):
    """A shape not in the table (odd widths, the smaller image) through the real llama-server."""
    from record_projector_figures import measure
    from tinymodels import write_llama

    width_scale, text_embd, image = 0.2, 320, 512
    model = write_llama(tmp_path / "text.gguf", n_embd=text_embd)
    mmproj = write_gemma3n_projector(tmp_path / "mmproj-gemma3n.gguf", text_embd, width_scale, image_size=image)
    fig = measure(llama_server, model, mmproj, "auto")
    assert "error" not in fig, fig
    got = mobilenet_compute_bytes(mobilenet_facts(mmproj))
    assert abs(got - fig["compute_mib"]["CPU"] * MIB) <= PRINTED
