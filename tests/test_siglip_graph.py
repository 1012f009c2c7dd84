"""SigLIP-style projectors (clip types `gemma3`, `idefics3`, `internvl`): the compute buffers
shared/memory/siglip_graph.py predicts by replaying ggml-alloc on clip's graph (shared/memory/graph_alloc.py), against
the real b11434 binaries: every figure of the three types in tests/llama_figures.json (the CPU's warm-up buffer,
printed in MiB to 2 decimals) and a table of the RPC device's exact bytes (MEASURED)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shared.memory import siglip_graph
from shared.memory.graph_alloc import replay
from shared.memory.siglip_graph import build_graph, siglip_compute_bytes

MIB = 2**20
FIGURES = json.loads((Path(__file__).parent / "llama_figures.json").read_text())
PREFIXES = tuple(f"mmproj|type={t}|" for t in siglip_graph.SIGLIP_TYPES)
TABLE = {k: v for k, v in FIGURES.items() if k.startswith(PREFIXES)}

# Measured with tests/record_projector_figures.py measure_largest (the b11434 RPC server, --mmproj-offload, one 64 x 64
# image; tinyprojectors' files, a tinymodels text model of text_embd, IDEFICS3_TOKENS for idefics3): type, n_embd,
# n_ff, n_head, n_layer, image_size, patch_size, merge (scale_factor), flash_attn, text_embd, the warm-up's printed
# RPC0 MiB and the device's buffer (bytes). No image grew it. Gemma 3's own encoder (1,152 wide, 4,304 FFN, 16 heads,
# 896 px) at 1 and 2 blocks and its text widths; idefics3 at SmolVLM's (768, 512 px, merge 4, text 576); internvl at
# InternVL3-1B's (1,024, 448 px, text 896). Several are where projector.py's closed forms fall short (gemma3 1,152 wide
# at 448 px, text 4,096, flash attention: 48.31 MiB, the closed form 34.81).
MEASURED = [
    ("gemma3", 64, 128, 16, 2, 448, 14, 4, True, 256, 3.45, 3612672),
    ("gemma3", 96, 4096, 2, 1, 448, 14, 2, False, 4096, 18.62, 19529728),
    ("gemma3", 128, 256, 4, 2, 224, 14, 2, False, 256, 1.75, 1835008),
    ("gemma3", 256, 768, 2, 2, 448, 14, 4, False, 4096, 15.0, 15728640),
    ("gemma3", 1152, 4304, 16, 1, 448, 14, 2, True, 4096, 48.31, 50659328),
    ("gemma3", 1152, 4304, 16, 1, 896, 14, 4, False, 256, 1132.0, 1186988032),
    ("gemma3", 1152, 4304, 16, 1, 896, 14, 4, False, 2560, 1132.0, 1186988032),
    ("gemma3", 1152, 4304, 16, 1, 896, 14, 4, True, 256, 103.81, 108855296),
    ("gemma3", 1152, 4304, 16, 2, 896, 14, 4, False, 640, 1132.0, 1186988032),
    ("gemma3", 1152, 4304, 16, 2, 896, 14, 4, True, 640, 121.25, 127139840),
    ("gemma3", 1152, 4304, 16, 2, 896, 14, 4, True, 2560, 121.25, 127139840),
    ("idefics3", 96, 4096, 2, 1, 448, 14, 2, False, 256, 17.12, 17956864),
    ("idefics3", 128, 256, 4, 2, 224, 14, 2, False, 256, 1.5, 1572864),
    ("idefics3", 768, 3072, 12, 1, 512, 16, 4, False, 576, 60.0, 62914560),
    ("idefics3", 768, 3072, 12, 1, 896, 14, 4, True, 256, 84.0, 88080384),
    ("idefics3", 768, 3072, 12, 2, 512, 16, 4, True, 576, 21.0, 22020096),
    ("internvl", 64, 128, 2, 1, 448, 14, 2, True, 256, 3.45, 3612672),
    ("internvl", 256, 768, 2, 2, 448, 14, 2, True, 4096, 9.0, 9437184),
    ("internvl", 256, 1024, 8, 2, 448, 14, 2, False, 2048, 36.07, 37818400),
    ("internvl", 768, 3072, 12, 1, 896, 14, 4, False, 256, 828.38, 868623424),
    ("internvl", 768, 3072, 12, 1, 896, 14, 4, True, 256, 96.02, 100681728),
    ("internvl", 1024, 4096, 16, 1, 448, 14, 2, False, 896, 80.14, 84033600),
    ("internvl", 1024, 4096, 16, 2, 448, 14, 2, False, 896, 80.14, 84033600),
    ("internvl", 1024, 4096, 16, 2, 448, 14, 2, True, 896, 28.03, 29388800),
    # 14 patches a side, merge 4: the warm-up's buffer (the RPC server's log), then the first image aborts
    # (clip_encode: "expected output 12 tokens, got 9"): idefics3 pads to 16 (ggml_pad), gemma3's pool floors to 3
    ("idefics3", 128, 256, 4, 2, 224, 16, 4, False, 256, 0.97, 1016064),
    ("gemma3", 128, 256, 4, 2, 224, 16, 4, True, 256, 0.86, 903168),
]


def _mib(n: int) -> float:
    return round(n / MIB, 2)


def _key_args(key: str) -> dict:
    parts = dict(p.split("=") for p in key.split("|")[1:])
    return dict(proj_type=parts["type"], n_embd=int(parts["n_embd"]), n_ff=int(parts["n_ff"]),
                n_head=int(parts["n_head"]), n_layer=int(parts["n_layer"]), image_size=int(parts["image"]),
                patch_size=int(parts["patch"]), merge=int(parts["merge"]), text_embd=int(parts["text_embd"]),
                flash_attn=parts["flash_attn"] == "on")  # fmt: skip


def _row_args(row) -> dict:
    t, e, ff, h, n_layer, image, patch, merge, fa, text = row[:10]
    return dict(proj_type=t, n_embd=e, n_ff=ff, n_head=h, n_layer=n_layer, image_size=image, patch_size=patch,
                merge=merge, text_embd=text, flash_attn=fa)  # fmt: skip


def test_every_type_is_recorded():
    types = {_key_args(k)["proj_type"] for k in TABLE}
    assert types == set(siglip_graph.SIGLIP_TYPES) and len(TABLE) >= 50


@pytest.mark.parametrize("key", sorted(TABLE))
def test_warm_up_buffer_prints_as_recorded(key):
    """--no-mmproj-offload: the CPU buffer for the warm-up image (image_size a side), as printed."""
    args = _key_args(key)
    assert _mib(siglip_compute_bytes(**args)) == TABLE[key]["compute_mib"]["CPU"]
    assert TABLE[key]["clip_flash_attn"] == ("enabled" if args["flash_attn"] else "disabled")


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: "-".join(map(str, r[:10])))
def test_measured_device_buffers_are_exact(row):
    """--mmproj-offload on an RPC device: the device's buffer, exact; the CPU's graph (inputs as leafs) the same."""
    args = _row_args(row)
    *_, warm_mib, want = row
    graph = build_graph(**args)
    assert replay(graph, offload_inputs=True).size == want == siglip_compute_bytes(**args)
    assert _mib(want) == warm_mib


def test_gemma3_copies_its_input_projection_before_the_last_attention():
    """clip transposes mm.input_projection and copies it (f16, [n_embd, text]) in the graph: ggml visits that copy
    first at the final expand, after the last block's Q, K and V, so it lives from there to the end."""
    args = dict(proj_type="gemma3", n_embd=1152, n_ff=4304, n_head=16, n_layer=1, image_size=448, patch_size=14,
                merge=2, text_embd=4096, flash_attn=True)  # fmt: skip
    graph = build_graph(**args)
    copies = [i for i, n in enumerate(graph.nodes) if n.op == "CONT" and n.type.name == "f16"]
    attention = next(i for i, n in enumerate(graph.nodes) if n.op == "FLASH_ATTN_EXT")
    assert len(copies) == 1 and copies[0] < attention
    assert graph.nodes[copies[0]].ne[:2] == (1152, 4096)
    assert ("CONT", 1152 * 4096 * 2) in {(label, size) for label, _, size in replay(graph).live}


def test_internvl_keeps_the_class_token_and_scales_its_layers():
    """P^2 + 1 positions (the scores show it without flash attention) and two layer-scale MULs a block."""
    args = dict(proj_type="internvl", n_embd=64, n_ff=128, n_head=2, n_layer=2, image_size=448, patch_size=14,
                merge=2, text_embd=256, flash_attn=False)  # fmt: skip
    graph = build_graph(**args)
    scores = [n for n in graph.nodes if n.op == "SOFT_MAX"]
    assert scores[0].ne[:3] == (1025, 1025, 2)
    gemma3 = build_graph(**{**args, "proj_type": "gemma3"})
    muls = sum(n.op == "MUL" for n in graph.nodes) - sum(n.op == "MUL" for n in gemma3.nodes)
    assert muls == 2 * 2 + 1 - 2  # + ls1, ls2 a block and mm.model.mlp.0; - gemma3's post-norm and soft_emb_norm


def test_internvl_6b_uses_rms_norms():
    """internvl.cpp picks RMS norms for the 6B ViT (n_embd 3200, 45 blocks), on those two numbers alone."""
    args = dict(proj_type="internvl", n_ff=128, n_head=25, image_size=224, patch_size=14, merge=2, text_embd=256,
                flash_attn=True)  # fmt: skip
    six_b = build_graph(n_embd=3200, n_layer=45, **args)
    other = build_graph(n_embd=3200, n_layer=44, **args)
    assert sum(n.op == "RMS_NORM" for n in six_b.nodes) == 90 and not any(n.op == "RMS_NORM" for n in other.nodes)


def test_flash_attention_leaves_the_scores_out():
    """Without flash attention the f32 scores (n_pos^2 x n_head) are live at the peak: Gemma 3's 4,096 patches
    and 16 heads make them 1 GiB of its 1,132 MiB."""
    args = dict(proj_type="gemma3", n_embd=1152, n_ff=4304, n_head=16, n_layer=27, image_size=896, patch_size=14,
                merge=4, text_embd=2560)  # fmt: skip
    on, off = (siglip_compute_bytes(flash_attn=fa, **args) for fa in (True, False))
    assert off > 4096 * 4096 * 16 * 4 > on
    assert (_mib(on), _mib(off)) == (121.25, 1132.0)


def test_shapes_clip_cannot_build_are_refused():
    base = dict(n_ff=256, n_layer=2, patch_size=14, text_embd=256, flash_attn=True)
    with pytest.raises(ValueError):
        siglip_compute_bytes(proj_type="mlp", n_embd=128, n_head=4, image_size=224, merge=2, **base)
    with pytest.raises(ValueError):
        siglip_compute_bytes(proj_type="gemma3", n_embd=100, n_head=3, image_size=224, merge=2, **base)
    with pytest.raises(ValueError):  # internvl.cpp does not pad: 16 patches a side do not shuffle by 3
        siglip_compute_bytes(proj_type="internvl", n_embd=128, n_head=4, image_size=224, merge=3, **base)
    assert siglip_compute_bytes(proj_type="idefics3", n_embd=128, n_head=4, image_size=0, merge=2, **base) == 0


def test_a_call_is_fast_and_cached():
    """Gemma 3's whole encoder (27 blocks at 896 px) and InternVL3-1B's (24 at 448) replay in well under a second;
    the same arguments again are a cache hit."""
    gemma3 = dict(proj_type="gemma3", n_embd=1152, n_ff=4304, n_head=16, n_layer=27, image_size=896, patch_size=14,
                  merge=4, text_embd=2560, flash_attn=True)  # fmt: skip
    internvl = dict(proj_type="internvl", n_embd=1024, n_ff=4096, n_head=16, n_layer=24, image_size=448,
                    patch_size=14, merge=2, text_embd=896, flash_attn=False)  # fmt: skip
    siglip_graph._bytes.cache_clear()
    start = time.perf_counter()
    sizes = [siglip_compute_bytes(**args) for args in (gemma3, internvl)]
    assert time.perf_counter() - start < 1.0
    assert [siglip_compute_bytes(**args) for args in (gemma3, internvl)] == sizes
    info = siglip_graph._bytes.cache_info()
    assert (info.misses, info.hits) == (2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    ("gemma3", 160, 640, 5, 3, 336, 14, 4, "off", 384),
    ("idefics3", 96, 384, 3, 2, 384, 16, 2, "on", 320),
    ("internvl", 112, 448, 7, 2, 280, 14, 2, "off", 448),
], ids=lambda s: s[0])  # fmt: skip
def test_real_binary_matches_a_new_shape(tmp_path, rpc_bin, shape):
    """Shapes in neither table (odd widths and heads) through the real llama-server on an RPC device, with one image:
    the device's buffer is the replay's, exact, and never grows."""
    from record_projector_figures import measure_largest
    from tinymodels import write_llama
    from tinyprojectors import IDEFICS3_TOKENS, write_projector

    proj_type, e, ff, h, n_layer, image, patch, merge, fa, text = shape
    special = IDEFICS3_TOKENS if proj_type == "idefics3" else ()  # the pieces mtmd looks up for an idefics3 image
    model = write_llama(tmp_path / "text.gguf", n_embd=text, special=special)
    mmproj = write_projector(tmp_path / "mmproj.gguf", proj_type=proj_type, text_embd=text, n_embd=e, n_ff=ff,
                             n_head=h, n_layer=n_layer, image_size=image, patch_size=patch,
                             scale_factor=merge)  # fmt: skip
    fig = measure_largest(rpc_bin, model, mmproj, fa, None, (64, 64))
    assert "error" not in fig, fig
    want = siglip_compute_bytes(proj_type=proj_type, n_embd=e, n_ff=ff, n_head=h, n_layer=n_layer, image_size=image,
                                patch_size=patch, merge=merge, text_embd=text, flash_attn=fa == "on")  # fmt: skip
    assert _mib(want) == fig["warmup_compute_mib"]["RPC0"]
    assert fig["warmup_bytes"] == fig["largest_bytes"] == want and not fig["grew"]
