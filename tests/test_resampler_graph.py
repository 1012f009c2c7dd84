"""MiniCPM-V's projector (clip type `resampler`): the compute buffer shared/memory/resampler_graph.py predicts by
replaying ggml-alloc on clip's graph (shared/memory/graph_alloc.py), against the real b11434 binaries: every
resampler figure in tests/llama_figures.json (warm-up buffers printed in MiB to 2 decimals; the RPC device's exact
bytes after one image), and a table of more device figures measured the same way (MEASURED)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shared.memory.graph_alloc import F16, F32, DynAlloc, Graph, cast, dup, leaf, mul_mat, replay
from shared.memory.resampler_graph import _bytes, build_graph, resampler_compute_bytes

MIB = 2**20
TABLE = {k: v for k, v in json.loads((Path(__file__).parent / "llama_figures.json").read_text()).items()
         if "type=resampler" in k}  # fmt: skip
# the largest piece (patches across, down) of each image tests/llama_figures.json sends (mtmd-image.cpp llava_uhd:
# 105 x 1911 -> an overview of 112 x 1918 px; 449 x 449 -> two slices of 630 x 322 px)
LARGEST_PIECE = {(105, 1911): (8, 137), (449, 449): (45, 23)}

# Measured with tests/record_projector_figures.py measure_largest (the b11434 RPC server, one image, patch 14):
# n_embd, n_ff, n_head, n_layer, image_size, queries, text_embd, flash_attn, image px, its pieces' patch grids
# (llava_uhd: the overview and the slices; a 64 x 64 image is one warm-up sized piece), the warm-up's printed RPC0
# MiB, and the device's compute buffer after the image (bytes): the warm-up's when no piece outgrew it.
MEASURED = [
    (1152, 4304, 16, 1, 448, 64, 3584, False, (105, 1911), [(8, 137), (11, 97)], 84.31, 99673824),
    (1152, 4304, 16, 27, 448, 64, 3584, False, (105, 1911), [(8, 137), (11, 97)], 84.31, 99673824),
    (1152, 4304, 16, 27, 448, 64, 3584, True, (105, 1911), [(8, 137), (11, 97)], 55.81, 62637792),
    (1152, 4304, 16, 1, 378, 64, 3584, False, (64, 64), [(27, 27)], 53.31, 55894656),
    (1152, 4304, 16, 1, 392, 64, 3584, False, (64, 64), [(28, 28)], 53.07, 55645632),
    (1152, 4304, 16, 2, 448, 64, 2560, False, (449, 449), [(45, 23), (32, 32)], 84.31, 90084896),
    (1152, 4304, 16, 2, 448, 64, 2560, True, (105, 1911), [(8, 137), (11, 97)], 41.31, 46363360),
    (1152, 4304, 16, 2, 448, 64, 3584, True, (105, 1911), [(8, 137), (11, 97)], 53.31, 59832032),
    (1152, 4304, 16, 3, 448, 64, 3584, True, (105, 1911), [(8, 137), (11, 97)], 55.81, 62637792),
    (128, 1024, 4, 2, 560, 64, 512, False, (64, 64), [(40, 40)], 42.67, 44742912),
    (128, 256, 4, 1, 448, 64, 256, False, (105, 1911), [(8, 137), (11, 97)], 18.31, 21810656),
    (128, 256, 4, 1, 448, 64, 256, True, (105, 1911), [(8, 137), (11, 97)], 4.31, 4835808),
    (128, 256, 4, 1, 448, 64, 256, True, (449, 449), [(45, 23), (32, 32)], 4.31, 4566752),
    (128, 256, 4, 2, 224, 64, 256, True, (64, 64), [(16, 16)], 1.08, 1129728),
    (128, 256, 4, 2, 448, 64, 256, False, (1911, 105), [(137, 8), (96, 11)], 18.31, 21810656),
    (128, 256, 4, 2, 448, 64, 256, False, (449, 449), [(45, 23), (32, 32)], 18.31, 19586688),
    (128, 256, 4, 2, 448, 64, 256, True, (1911, 105), [(137, 8), (96, 11)], 4.31, 4835808),
    (128, 256, 4, 3, 448, 64, 256, False, (105, 1911), [(8, 137), (11, 97)], 18.31, 21810656),
    (128, 256, 4, 3, 448, 64, 256, True, (105, 1911), [(8, 137), (11, 97)], 4.31, 4835808),
    (128, 512, 8, 4, 448, 64, 384, False, (3000, 200), [(62, 17), (123, 8)], 34.31, 38041376),
    (128, 512, 8, 4, 448, 64, 384, True, (105, 1911), [(8, 137), (11, 97)], 6.06, 6799968),
    (192, 768, 4, 1, 336, 96, 384, False, (1000, 300), [(25, 23), (44, 13)], 7.63, 7997568),
    (192, 768, 4, 2, 336, 96, 384, True, (1000, 300), [(25, 23), (44, 13)], 2.99, 3131520),
    (256, 1024, 4, 2, 448, 32, 512, False, (3000, 200), [(62, 17), (123, 8)], 20.31, 22425440),
    (256, 1024, 4, 2, 448, 32, 512, True, (3000, 200), [(62, 17), (123, 8)], 7.31, 7888672),
    (256, 256, 4, 1, 336, 64, 1280, True, (64, 64), [(24, 24)], 11.14, 11684864),
    (384, 1536, 6, 1, 448, 64, 1024, False, (105, 1911), [(8, 137), (11, 97)], 30.81, 36471520),
    (384, 1536, 6, 1, 448, 64, 1024, True, (105, 1911), [(8, 137), (11, 97)], 16.31, 18304224),
    (384, 1536, 6, 3, 448, 64, 1024, False, (105, 1911), [(8, 137), (11, 97)], 30.81, 36471520),
    (64, 128, 2, 2, 448, 16, 128, False, (640, 480), [(37, 28), (26, 39)], 10.31, 11035648),
]


def _args(key: str) -> tuple[dict, int, int, tuple[int, int] | None]:
    """A llama_figures.json key -> (the function's arguments but n_pos, image_size, patch_size, image px or None)."""
    parts = dict(p.split("=") for p in key.split("|")[1:])
    patch = int(parts["patch"])
    args = dict(n_embd=int(parts["n_embd"]), n_ff=int(parts["n_ff"]), n_head=int(parts["n_head"]),
                n_layer=int(parts["n_layer"]), patch_size=patch, text_embd=int(parts["text_embd"]),
                queries=int(parts["merge"]), flash_attn=parts["flash_attn"] == "on")  # fmt: skip
    px = tuple(map(int, parts["image_px"].split("x"))) if "image_px" in parts else None
    return args, int(parts["image"]), patch, px


def _mib(n: int) -> float:
    return round(n / MIB, 2)


def test_both_kinds_of_figure_are_recorded():
    """Warm-up buffers (printed MiB) and device buffers after an image (bytes), each of the latter with its largest
    piece known here."""
    images = [k for k in TABLE if "image_px" in k]
    assert images and len(TABLE) > len(images)
    assert {_args(k)[3] for k in images} <= set(LARGEST_PIECE)


@pytest.mark.parametrize("key", sorted(k for k in TABLE if "image_px" not in k))
def test_warm_up_buffer_prints_as_recorded(key):
    """--no-mmproj-offload: the CPU buffer for the warm-up piece, (image / patch)^2 patches."""
    args, image, patch, _ = _args(key)
    got = resampler_compute_bytes(n_pos=(image // patch) ** 2, **args)
    assert _mib(got) == TABLE[key]["compute_mib"]["CPU"]
    assert TABLE[key]["clip_flash_attn"] == ("enabled" if args["flash_attn"] else "disabled")


@pytest.mark.parametrize("key", sorted(k for k in TABLE if "image_px" in k))
def test_device_buffer_after_an_image_is_exact(key):
    """--mmproj-offload on an RPC device: the warm-up's buffer (printed), then grown to the largest piece's, exact."""
    args, image, patch, px = _args(key)
    fig = TABLE[key]
    warm = resampler_compute_bytes(n_pos=(image // patch) ** 2, **args)
    nx, ny = LARGEST_PIECE[px]
    largest = resampler_compute_bytes(n_pos=nx * ny, **args)
    assert _mib(warm) == fig["warmup_compute_mib"]["RPC0"]
    assert fig["grew"] and largest > warm
    assert largest == fig["largest_bytes"]


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: "-".join(map(str, r[:8] + r[8])))
def test_measured_device_buffers_are_exact(row):
    n_embd, n_ff, n_head, n_layer, image, queries, text, fa, _, grids, warm_mib, want = row
    args = dict(n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, patch_size=14, text_embd=text,
                queries=queries, flash_attn=fa)  # fmt: skip
    warm = resampler_compute_bytes(n_pos=(image // 14) ** 2, **args)
    pieces = [resampler_compute_bytes(n_pos=nx * ny, **args) for nx, ny in grids]
    assert _mib(warm) == warm_mib
    assert max(warm, *pieces) == want


def test_fragmentation_follows_the_graph_order():
    """At n_embd 1152 / text 3584 with flash attention two layers need less than one or three (measured): the
    freed blocks the second layer leaves decide where the widest piece's tensors land."""
    args = dict(n_embd=1152, n_ff=4304, n_head=16, patch_size=14, text_embd=3584, queries=64, flash_attn=True)
    by_layers = {n: resampler_compute_bytes(n_pos=8 * 137, n_layer=n, **args) for n in (1, 2, 3, 27)}
    assert by_layers == {1: 62637792, 2: 59832032, 3: 62637792, 27: 62637792}


def test_more_patches_can_need_less():
    """Not monotone in the patch count (measured: 27 x 27 patches 55,894,656 bytes, 28 x 28 55,645,632): a bound for
    every piece up to N patches is the largest buffer over n_pos <= N, not the buffer at N."""
    args = dict(n_embd=1152, n_ff=4304, n_head=16, n_layer=1, patch_size=14, text_embd=3584, queries=64,
                flash_attn=False)  # fmt: skip
    assert resampler_compute_bytes(n_pos=27 * 27, **args) - resampler_compute_bytes(n_pos=28 * 28, **args) == 249024


@pytest.mark.parametrize("fa", [True, False])
def test_the_pieces_shape_and_the_buffer_do_not_matter(fa):
    """Only the patch count enters the sizes; the CPU's graph (inputs as leafs) and the device's (the scheduler's
    copies of the host inputs as the first nodes) give the same buffer."""
    args = dict(n_embd=128, n_ff=256, n_head=4, n_layer=2, n_pos=1096, patch_size=14, text_embd=256, queries=64,
                flash_attn=fa)  # fmt: skip
    sizes = {replay(build_graph(shape=shape, **args), offload_inputs=dev).size
             for shape in [(8, 137), (137, 8), (1096, 1), (2, 548)] for dev in (False, True)}  # fmt: skip
    assert sizes == {resampler_compute_bytes(**args)}
    with pytest.raises(ValueError):
        build_graph(shape=(8, 136), **args)


def test_flash_attention_leaves_the_scores_out():
    """Without flash attention the encoder's f32 scores (n_pos^2 x n_head) are live at the peak."""
    args = dict(n_embd=128, n_ff=256, n_head=4, n_layer=1, patch_size=14, text_embd=256, queries=64)
    on, off = (resampler_compute_bytes(n_pos=1024, flash_attn=fa, **args) for fa in (True, False))
    assert off - on > 1024 * 1024 * 4 * 4 // 2
    assert resampler_compute_bytes(n_pos=0, flash_attn=True, **args) == 0
    with pytest.raises(ValueError):
        resampler_compute_bytes(n_pos=64, flash_attn=True, **{**args, "text_embd": 200})


def test_a_call_is_fast_and_cached():
    args = dict(n_embd=1152, n_ff=4304, n_head=16, n_layer=27, patch_size=14, text_embd=3584, queries=64,
                flash_attn=False, n_pos=1093)  # fmt: skip
    _bytes.cache_clear()
    start = time.perf_counter()
    first = resampler_compute_bytes(**args)
    built = time.perf_counter() - start
    start = time.perf_counter()
    assert resampler_compute_bytes(**args) == first
    assert time.perf_counter() - start < built / 10 and built < 1.0


# --- graph_alloc's allocator on small graphs ---


def test_in_place_only_for_the_last_child_of_the_same_layout():
    """MUL and ADD reuse their first source's block when they are its last reader (an input's too); a source
    with a reader still to run keeps its block."""
    x = leaf((256,), F32, "x", input=True)
    w = leaf((256,), F32, "w", weight=True)
    b = dup(dup(x, "MUL", w), "ADD", w)
    assert replay(b).size == 1024  # x, x * w, x * w + w: one block
    a = dup(x, "MUL", w)
    c = dup(a, "ADD", w)  # a is read again by d: c takes a new block
    d = dup(c, "ADD", a)  # c's last reader: in place
    rep = replay(d)
    assert rep.size == 2048 and rep.live == [("MUL", 0, 1024), ("ADD", 1024, 1024)]


def test_freed_blocks_are_reused_best_fit_and_merged():
    """ggml_dyn_tallocr: sizes padded to 32; the smallest freed block that fits (the tail only when none does);
    a freed block merges with its neighbours."""
    al = DynAlloc(32)
    a, b, c, d, e = (al.alloc(n) for n in (100, 1000, 50, 300, 10))
    assert (a, b, c, d, e) == (0, 128, 1152, 1216, 1536)
    al.free(b, 1000)
    al.free(d, 300)
    assert al.alloc(200) == 1216  # the 320-byte hole, not the 1024-byte one
    assert al.alloc(2000) == 1568 and al.max_size == 1568 + 2016  # neither hole: the tail
    al.free(a, 100)
    assert al.blocks[0] == [0, 1152]
    w = leaf((64, 64), F16, "w", weight=True)
    y = cast(mul_mat(w, leaf((64, 16), F32, "x", input=True)), F16)
    assert y.src[1] is y and Graph().expand(y).nodes[-1] is y  # ggml_cast's self-reference


@pytest.mark.slow
def test_real_binary_matches_a_new_shape(tmp_path, rpc_bin):
    """A shape in neither table (odd widths, 5 layers, 48 queries) through the real llama-server on an RPC device."""
    from record_projector_figures import measure_largest, projector_for

    shape = ("resampler", 160, 640, 5, 5, 392, 14, 48, "off", 640, 105, 1911)
    model, mmproj = projector_for(tmp_path, shape)
    fig = measure_largest(rpc_bin, model, mmproj, "off", None, (105, 1911))
    assert "error" not in fig, fig
    args = dict(n_embd=160, n_ff=640, n_head=5, n_layer=5, patch_size=14, text_embd=640, queries=48, flash_attn=False)
    warm = resampler_compute_bytes(n_pos=28 * 28, **args)
    pieces = [resampler_compute_bytes(n_pos=n, **args) for n in (7 * 119, 11 * 69)]  # the overview, 3 slices
    assert _mib(warm) == fig["warmup_compute_mib"]["RPC0"]
    assert fig["largest_bytes"] == max(warm, *pieces)
