"""LLaVA's (clip type `mlp`) and Llama 4's (`llama4`) projectors: the compute buffers shared/memory/llava_graph.py and
shared/memory/llama4_graph.py predict by replaying ggml-alloc on clip's graph (shared/memory/graph_alloc.py), against
the real b11434 binaries: every mlp / llama4 figure in tests/llama_figures.json (the CPU's warm-up buffer, printed in
MiB to 2 decimals) and a table of the RPC device's exact bytes measured the same way (MEASURED)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shared.memory import llama4_graph, llava_graph
from shared.memory.graph_alloc import replay
from shared.memory.llama4_graph import llama4_compute_bytes
from shared.memory.llava_graph import llava_compute_bytes

MIB = 2**20
FIGURES = json.loads((Path(__file__).parent / "llama_figures.json").read_text())
TABLE = {k: v for k, v in FIGURES.items() if k.startswith(("mmproj|type=mlp|", "mmproj|type=llama4|"))}

# Measured with tests/record_projector_figures.py measure_largest (the b11434 RPC server, --mmproj-offload, one image):
# type, n_embd, n_ff, n_head, n_layer, image_size, patch_size, merge (llama4's pixel shuffle), flash_attn, text_embd,
# extra norms (tinyprojectors' file with v.pre_ln / v.post_ln weights and biases added), the image sent (px), its
# tokens (llama4: 144 a tile, a 1000 x 700 image is 9 tiles and the overview), the warm-up's printed RPC0 MiB, and the
# device's compute buffer after the image (bytes). No image grew the buffer: every image is resized (mlp) or cut
# into tiles (llama4) of the warm-up's size, so the warm-up's buffer is the last the device allocated.
MEASURED = [
    ("mlp", 64, 128, 2, 1, 224, 14, 2, False, 1024, (), (64, 64), 256, 2.06, 2162688),
    ("mlp", 64, 128, 2, 1, 224, 14, 2, False, 1024, ("post_ln",), (64, 64), 256, 2.13, 2228480),
    ("mlp", 64, 128, 16, 3, 448, 14, 2, False, 256, (), (64, 64), 1024, 66.43, 69656672),
    ("mlp", 96, 4096, 2, 1, 448, 14, 2, False, 256, (), (64, 64), 1024, 3.45, 3620896),
    ("mlp", 96, 4096, 2, 1, 448, 14, 2, True, 256, (), (64, 64), 1024, 3.45, 3620896),
    ("mlp", 128, 256, 4, 3, 224, 14, 2, False, 256, (), (1000, 700), 256, 1.71, 1792576),
    ("mlp", 128, 256, 4, 3, 224, 14, 2, True, 256, (), (1000, 700), 256, 0.86, 905248),
    ("mlp", 128, 256, 4, 3, 224, 14, 2, True, 256, ("post_ln",), (64, 64), 256, 0.86, 905248),
    ("mlp", 160, 640, 5, 5, 392, 14, 2, False, 640, (), (64, 64), 784, 14.48, 15179584),
    ("mlp", 160, 640, 5, 5, 392, 14, 2, True, 640, (), (1000, 700), 784, 4.31, 4515840),
    ("mlp", 192, 768, 3, 4, 336, 16, 2, False, 512, (), (64, 64), 441, 4.18, 4381632),
    ("mlp", 192, 768, 3, 4, 336, 16, 2, True, 512, (), (1000, 700), 441, 2.91, 3055616),
    ("mlp", 256, 1024, 4, 2, 336, 14, 2, False, 2048, (), (1000, 700), 576, 9.56, 10027008),
    ("mlp", 256, 1024, 4, 3, 336, 14, 2, False, 1024, ("post_ln",), (64, 64), 576, 7.5, 7867968),
    ("mlp", 1024, 4096, 16, 2, 336, 14, 2, False, 4096, (), (64, 64), 576, 32.88, 34479712),
    ("mlp", 1024, 4096, 16, 2, 336, 14, 2, True, 4096, (), (1000, 700), 576, 21.55, 22593056),
    ("mlp", 1024, 4096, 16, 3, 336, 14, 2, False, 4096, (), (64, 64), 576, 32.88, 34479712),
    ("mlp", 1024, 4096, 16, 3, 336, 14, 2, True, 4096, (), (64, 64), 576, 21.55, 22593056),
    ("mlp", 1024, 4096, 16, 4, 336, 14, 2, True, 4096, (), (1000, 700), 576, 21.55, 22593056),
    ("llama4", 64, 128, 2, 1, 336, 14, 2, False, 256, (), (64, 64), 144, 3.39, 3549472),
    ("llama4", 64, 128, 2, 1, 336, 14, 2, True, 4096, (), (64, 64), 144, 4.57, 4792320),
    ("llama4", 64, 128, 2, 1, 336, 14, 2, True, 4096, ("post_ln",), (1000, 700), 1440, 4.71, 4939776),
    ("llama4", 128, 256, 4, 2, 336, 14, 2, False, 256, (), (1000, 700), 1440, 6.94, 7277152),
    ("llama4", 128, 256, 4, 2, 336, 14, 2, True, 256, (), (1000, 700), 1440, 2.59, 2714176),
    ("llama4", 128, 256, 4, 2, 336, 14, 2, True, 256, ("pre_ln", "post_ln"), (64, 64), 144, 2.59, 2714176),
    ("llama4", 128, 512, 4, 4, 336, 14, 3, False, 768, ("pre_ln", "post_ln"), (64, 64), 64, 6.94, 7277152),
    ("llama4", 192, 384, 6, 2, 392, 14, 2, False, 512, (), (1000, 700), 1372, 17.59, 18448352),
    ("llama4", 192, 384, 6, 2, 392, 14, 2, True, 512, (), (64, 64), 196, 3.52, 3694272),
    ("llama4", 256, 1024, 8, 3, 448, 14, 4, False, 1024, (), (1000, 700), 448, 38.37, 40235104),
    ("llama4", 256, 1024, 8, 3, 448, 14, 4, False, 1024, ("pre_ln", "post_ln"), (64, 64), 64, 37.37, 39185504),
    ("llama4", 256, 1024, 8, 3, 448, 14, 4, True, 1024, (), (64, 64), 64, 8.81, 9239104),
    ("llama4", 320, 640, 5, 3, 224, 16, 2, False, 384, (), (64, 64), 49, 2.28, 2388544),
    ("llama4", 320, 640, 5, 3, 224, 16, 7, True, 384, (), (64, 64), 4, 1.54, 1612352),
    ("llama4", 1408, 5632, 16, 1, 336, 14, 2, False, 5120, (), (1000, 700), 1440, 38.4, 40264320),
    ("llama4", 1408, 5632, 16, 1, 336, 14, 2, True, 5120, (), (64, 64), 144, 18.59, 19497984),
    ("llama4", 1408, 5632, 16, 2, 336, 14, 2, True, 5120, (), (64, 64), 144, 19.89, 20857408),
    ("llama4", 1408, 5632, 16, 4, 336, 14, 2, False, 5120, ("pre_ln", "post_ln"), (64, 64), 144, 37.11, 38915200),
]


def _mib(n: int) -> float:
    return round(n / MIB, 2)


def _bytes(proj_type: str, *, merge: int, norms=(), **args) -> int:
    flags = {n: True for n in norms}
    if proj_type == "mlp":
        return llava_compute_bytes(**args, **flags)
    return llama4_compute_bytes(merge=merge, **args, **flags)


def _key_args(key: str) -> tuple[str, dict]:
    parts = dict(p.split("=") for p in key.split("|")[1:])
    args = dict(n_embd=int(parts["n_embd"]), n_ff=int(parts["n_ff"]), n_head=int(parts["n_head"]),
                n_layer=int(parts["n_layer"]), image_size=int(parts["image"]), patch_size=int(parts["patch"]),
                merge=int(parts["merge"]), text_embd=int(parts["text_embd"]),
                flash_attn=parts["flash_attn"] == "on")  # fmt: skip
    return parts["type"], args


def _row_args(row) -> tuple[str, dict]:
    t, e, ff, h, n_layer, image, patch, merge, fa, text, norms = row[:11]
    return t, dict(n_embd=e, n_ff=ff, n_head=h, n_layer=n_layer, image_size=image, patch_size=patch, merge=merge,
                   text_embd=text, flash_attn=fa, norms=norms)  # fmt: skip


def test_both_types_are_recorded():
    types = {_key_args(k)[0] for k in TABLE}
    assert types == {"mlp", "llama4"} and len(TABLE) >= 40


@pytest.mark.parametrize("key", sorted(TABLE))
def test_warm_up_buffer_prints_as_recorded(key):
    """--no-mmproj-offload: the CPU buffer for the warm-up image (image_size a side), as printed."""
    proj_type, args = _key_args(key)
    assert _mib(_bytes(proj_type, **args)) == TABLE[key]["compute_mib"]["CPU"]
    assert TABLE[key]["clip_flash_attn"] == ("enabled" if args["flash_attn"] else "disabled")


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: "-".join(map(str, r[:10] + r[10])))
def test_measured_device_buffers_are_exact(row):
    """--mmproj-offload on an RPC device: the device's buffer, exact, before and after an image (it never grows)."""
    proj_type, args = _row_args(row)
    *_, warm_mib, want = row
    got = _bytes(proj_type, **args, offload=True)
    assert got == want and _mib(got) == warm_mib
    assert _bytes(proj_type, **args, offload=False) == got  # the CPU's graph (inputs as leafs): the same


def test_llava_runs_to_the_second_to_last_block():
    """n_layer 1 runs no block: the buffer is the stem's and the head's whatever n_ff (measured: 96 x 4096 FFN)."""
    args = dict(n_embd=96, n_head=2, image_size=448, patch_size=14, text_embd=256, flash_attn=False)
    assert llava_compute_bytes(n_ff=4096, n_layer=1, **args) == llava_compute_bytes(n_ff=128, n_layer=1, **args)
    assert llava_compute_bytes(n_ff=4096, n_layer=2, **args) > llava_compute_bytes(n_ff=4096, n_layer=1, **args)


def test_llama4_norms_move_the_peak():
    """Llama 4's own files carry v.pre_ln and v.post_ln: they change where ggml-alloc places the encoder's tensors, and
    so the buffer, in both directions (both measured)."""
    args = dict(n_embd=256, n_ff=1024, n_head=8, n_layer=3, image_size=448, patch_size=14, merge=4, text_embd=1024,
                flash_attn=False)  # fmt: skip
    assert llama4_compute_bytes(**args) - llama4_compute_bytes(pre_ln=True, post_ln=True, **args) == 1049600
    args = dict(n_embd=64, n_ff=128, n_head=2, n_layer=1, image_size=336, patch_size=14, merge=2, text_embd=4096,
                flash_attn=True)  # fmt: skip
    assert llama4_compute_bytes(post_ln=True, **args) - llama4_compute_bytes(**args) == 147456


def test_flash_attention_leaves_the_scores_out():
    """Without flash attention the f32 scores (n_pos^2 x n_head, the class token included) are live at the peak."""
    args = dict(n_embd=64, n_ff=128, n_head=16, n_layer=3, image_size=448, patch_size=14, text_embd=256)
    on, off = (llava_compute_bytes(flash_attn=fa, **args) for fa in (True, False))
    assert off > 1025 * 1025 * 16 * 4 > on
    args = dict(n_embd=1408, n_ff=5632, n_head=16, n_layer=1, image_size=336, patch_size=14, merge=2, text_embd=5120)
    on, off = (llama4_compute_bytes(flash_attn=fa, **args) for fa in (True, False))
    assert off > 577 * 577 * 16 * 4 > on


def test_shapes_clip_cannot_build_are_refused():
    base = dict(n_ff=256, n_layer=2, patch_size=14, text_embd=256, flash_attn=True)
    with pytest.raises(ValueError):
        llava_compute_bytes(n_embd=100, n_head=3, image_size=224, **base)
    with pytest.raises(ValueError):  # 24 patches a side do not merge by 5
        llama4_compute_bytes(n_embd=128, n_head=4, image_size=336, merge=5, **base)
    with pytest.raises(ValueError):  # RoPE-2D halves each head
        llama4_compute_bytes(n_embd=96, n_head=32, image_size=336, merge=2, **base)
    assert llava_compute_bytes(n_embd=128, n_head=4, image_size=0, **base) == 0
    assert llama4_compute_bytes(n_embd=128, n_head=4, image_size=0, merge=2, **base) == 0


def test_graphs_have_ggml_op_counts():
    """A LLaVA block is 32 nodes with flash attention (Q/K/V and their reshapes, 3 permutes, 2 casts, the
    attention and its reshape, O, 2 norms of 3, the FFN of 5, 2 residuals); Llama 4's adds 4 RoPEs."""
    args = dict(n_embd=128, n_ff=256, n_head=4, image_size=224, patch_size=14, text_embd=256, flash_attn=True)
    one, two = (len(llava_graph.build_graph(n_layer=n, **args).nodes) for n in (2, 3))
    assert two - one == 31
    one, two = (len(llama4_graph.build_graph(n_layer=n, merge=2, **args).nodes) for n in (2, 3))
    assert two - one == 35
    graph = llama4_graph.build_graph(n_layer=2, merge=2, **args)
    assert replay(graph).size == replay(graph, offload_inputs=True).size


def test_a_call_is_fast_and_cached():
    """LLaVA 1.5's encoder (24 blocks, 23 run) and Llama 4's (34 blocks, both norms)."""
    llava = dict(n_embd=1024, n_ff=4096, n_head=16, n_layer=24, image_size=336, patch_size=14, text_embd=4096,
                 flash_attn=False)  # fmt: skip
    llama4 = dict(n_embd=1408, n_ff=5632, n_head=16, n_layer=34, image_size=336, patch_size=14, merge=2,
                  text_embd=5120, flash_attn=True, pre_ln=True, post_ln=True)  # fmt: skip
    for fn, args, cache in ((llava_compute_bytes, llava, llava_graph._bytes),
                            (llama4_compute_bytes, llama4, llama4_graph._bytes)):  # fmt: skip
        cache.cache_clear()
        start = time.perf_counter()
        first = fn(**args)
        built = time.perf_counter() - start
        start = time.perf_counter()
        assert fn(**args) == first
        assert time.perf_counter() - start < built / 10 and built < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("shape", [
    ("mlp", 112, 448, 7, 3, 280, 14, 2, "on", 384),
    ("llama4", 96, 192, 3, 2, 280, 14, 2, "off", 320),
], ids=lambda s: s[0])  # fmt: skip
def test_real_binary_matches_a_new_shape(tmp_path, rpc_bin, shape):
    """Shapes in neither table (odd widths and heads, 20 patches a side) through the real llama-server on an RPC
    device, with an image larger than the warm-up's: the buffer is the warm-up's, exact."""
    from record_projector_figures import measure_largest, projector_for

    model, mmproj = projector_for(tmp_path, shape)
    fig = measure_largest(rpc_bin, model, mmproj, shape[8], None, (1000, 700))
    assert "error" not in fig, fig
    proj_type, e, ff, h, n_layer, image, patch, merge, fa, text = shape
    want = _bytes(proj_type, n_embd=e, n_ff=ff, n_head=h, n_layer=n_layer, image_size=image, patch_size=patch,
                  merge=merge, text_embd=text, flash_attn=fa == "on", offload=True)  # fmt: skip
    assert _mib(want) == fig["warmup_compute_mib"]["RPC0"]
    assert fig["warmup_bytes"] == fig["largest_bytes"] == want and not fig["grew"]
