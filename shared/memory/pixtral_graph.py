"""Pixtral's vision projector (clip.projector_type `pixtral`: Pixtral-12B, and with
clip.vision.spatial_merge_size > 1 Mistral Small 3.x's patch merger): the compute buffer clip allocates for
one image, to the byte. Pure.

The graph (b11434: tools/mtmd/models/pixtral.cpp clip_graph_pixtral::build, with clip.cpp's build_inp,
build_vit, build_norm, build_rope_2d, build_ffn, build_attn and build_mm: shared/memory/clip_graph.py) for
an image of w x h tokens (w*merge x h*merge patches, n_pos of them): the patch convolution (im2col to f16,
mul_mat, two contiguous copies), an RMS pre-norm, n_layer blocks (RMS norms, Q/K/V without biases, a 2-D
RoPE of two ggml_rope_ext on Q and K, attention, a gated SiLU FFN: up, gate, swiglu_split, down), no
post-norm; with merge > 1 the patch merger (an RMS norm, the patches unfolded merge x merge by an f32
im2col, mm.patch_merger); mm.1, GELU, mm.2 (biases, if any, and the GELU in place); then the [IMG_BREAK]
rows: a zeroed [text, 1, h] tensor (a leaf, so the allocator places it first, at offset 0, and it lives to
the end), scaled and added to in place, concatenated after each row of the output ([text, w + 1, h]) and
viewed without the last break. Attention is ggml_flash_attn_ext over f16 copies of K and V with flash
attention on, else mul_mat + soft_max over the f32 scores (n_pos x n_pos x n_head) and a contiguous copy of
V transposed. build_attn fixes the order (ggml_build_forward_order of Q, K and V), so this module builds
the same tensors in the same order and replays ggml-alloc on them (shared/memory/graph_alloc.py).

Which buffer: the device's with the projector offloaded (--mmproj-offload, as the lane runs it), where the
inputs (inp_raw, pos_h, pos_w) stay on the host and the scheduler's copies of them are the split's first
nodes (graph_alloc.replay(..., offload_inputs=True)). clip reserves a warm-up image (16 x 16 tokens, or
floor(sqrt(N)) a side under --image-max-tokens N < 256: pixtral_warmup_grid) and grows the buffer when a
larger image arrives (it is only ever reallocated larger), so after images the buffer is the largest of the
warm-up's and theirs. mtmd scales every image to a grid of tokens (pixtral_grid: calc_size_preserved_ratio,
its float32 arithmetic included).

Measured (tests/llama_figures.json and the table in tests/test_pixtral_graph.py, the b11434 RPC server's
exact bytes after one image, and its printed warm-up MiB): byte-exact on every figure, 1 to 24 blocks
(Pixtral-12B and Mistral Small 3.x whole at 1 x 1,024 tokens: 115,343,360 and 290,684,928 bytes with flash
attention), merge 1 and 2, flash attention on and off, square, one-token-wide and 32 x 10 grids.

The plan (pixtral_planned_bytes): the lane's largest buffer at --image-max-tokens N. For a given number of
tokens the grid one token wide (h = T rows) needs the most: the break rows ([text, 1, h], at offset 0 for
the whole graph) and the concatenation grow with h and nothing else depends on the grid's shape. Over
T <= N the buffer mostly grows with T, but the packing is not monotone: without flash attention, where the
scores of a patch count at or just below the head width are as large as an n_embd-wide activation, a
smaller image can need more (measured: 80 tokens at d_head 80 need 1,702,400 bytes, 100 tokens 1,600,000),
and rarely a few tokens below N; with flash attention the 32-byte padding of odd widths can make N - 1
need a little more than N (measured: a 24-wide encoder, 1,023 tokens 84,049,696 bytes, 1,024 83,984,384).
So the plan replays those few grids (pixtral_planned_grids) and takes the largest: equal to the largest
over every grid of at most N tokens (pixtral_largest_bytes, all of them replayed) on Pixtral-12B's and
Mistral Small 3's widths at N = 1,024 (the 1 x 1,024 image in all four), and for every N <= 1,024 on
random shapes (tests/test_pixtral_graph.py checks small ones). Images thinner than 1:N are not bounded by
N: mtmd keeps one token across and the height that keeps the area (1 x 2,048 px at --image-max-tokens 64
is 1 x 362 tokens, measured), so only the context bounds them.

Cost: one grid builds and replays in about 0.5 ms (1 to 2 blocks) to 5 ms (24 blocks); a plan is 3 grids
with flash attention, 9 without (about 15 and 40 ms at 24 blocks), and is cached by its arguments.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from shared.memory.clip_graph import ClipBuilder, Layer
from shared.memory.graph_alloc import F32, I32, Graph, dup, leaf, mul_mat, new, permute, replay, reshape, view

# Pixtral's blocks: RMS norms with weights alone, Q/K/V/O without biases, a gated SiLU FFN without biases
PIXTRAL_LAYER = Layer(rms=True, norm_bias=False, qkv_bias=False, out_bias=False, gated=True, ffn_bias=False)


def pixtral_compute_bytes(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, patch_size: int, merge: int,
                          text_embd: int, flash_attn: bool, grid: tuple[int, int]) -> int:  # fmt: skip
    """The device's compute buffer (bytes) clip allocates for an image of grid = (tokens across, tokens down)
    (patches: merge x merge a token); 0 for an empty grid. Raises ValueError where clip's graph cannot
    reshape (n_embd by n_head, heads of an odd width for the 2-D RoPE)."""
    w, h = grid
    if w <= 0 or h <= 0:
        return 0
    _check(n_embd, n_head, merge)
    return _bytes(n_embd, n_ff, n_head, n_layer, patch_size, max(1, merge), text_embd, bool(flash_attn), w, h)


def pixtral_planned_bytes(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, patch_size: int, merge: int,
                          text_embd: int, flash_attn: bool, max_tokens: int = 1024) -> int:  # fmt: skip
    """The device's compute buffer once the lane has taken its largest image at --image-max-tokens N: the
    largest over the warm-up and every image of at most N tokens (the buffer only grows). That is the
    image one token wide and N tall, except where ggml-alloc's packing makes a slightly smaller one need
    more (pixtral_planned_grids): the largest over those few grids, equal to the largest over all grids
    of at most N tokens (pixtral_largest_bytes) wherever that was checked."""
    _check(n_embd, n_head, merge)
    return _planned(n_embd, n_ff, n_head, n_layer, patch_size, max(1, merge), text_embd, bool(flash_attn), max_tokens)


@lru_cache(maxsize=1024)
def _planned(n_embd, n_ff, n_head, n_layer, patch_size, merge, text_embd, flash_attn, max_tokens) -> int:
    return max(_bytes(n_embd, n_ff, n_head, n_layer, patch_size, merge, text_embd, flash_attn, w, h)
               for w, h in pixtral_planned_grids(n_embd=n_embd, n_head=n_head, merge=merge, flash_attn=flash_attn,
                                                 max_tokens=max_tokens))  # fmt: skip


def pixtral_planned_grids(*, n_embd: int, n_head: int, merge: int, flash_attn: bool,
                          max_tokens: int) -> list[tuple[int, int]]:  # fmt: skip
    """The grids pixtral_planned_bytes replays: the warm-up; one token wide and T tall for T = N and the
    few T below it where a packing coincidence can need more (with flash attention N - 1: the 32-byte
    padding of odd widths; without it N - 5 .. N, and the T whose patch count is at or just below the
    head width, where the f32 scores [n_pos, n_pos, n_head] are as large as an n_embd-wide activation)."""
    n = max(1, max_tokens)
    rows = set(range(max(1, n - (1 if flash_attn else 5)), n + 1))
    if not flash_attn:
        at = (n_embd // max(1, n_head)) // (max(1, merge) ** 2)
        rows |= {t for t in (at - 1, at) if 1 <= t <= n}
    return [pixtral_warmup_grid(max_tokens), *((1, t) for t in sorted(rows))]


def pixtral_largest_bytes(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, patch_size: int, merge: int,
                          text_embd: int, flash_attn: bool,
                          max_tokens: int) -> tuple[int, tuple[int, int]]:  # fmt: skip
    """The largest buffer over the warm-up and every grid of at most max_tokens tokens, and its grid (the
    tallest of equals): every grid replayed (about N ln N of them, seconds at N = 1024: for checking)."""
    args = dict(n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, patch_size=patch_size, merge=merge,
                text_embd=text_embd, flash_attn=flash_attn)  # fmt: skip
    grids = [pixtral_warmup_grid(max_tokens)] + [(w, h) for w in range(1, max_tokens + 1)
                                                 for h in range(1, max_tokens // w + 1)]  # fmt: skip
    sizes = {g: pixtral_compute_bytes(grid=g, **args) for g in grids}
    best = max(sizes, key=lambda g: (sizes[g], g[1]))
    return sizes[best], best


def pixtral_warmup_grid(max_tokens: int | None = None) -> tuple[int, int]:
    """The warm-up image clip reserves at load (clip-model.h set_warmup_n_tokens(256)): 16 x 16 tokens, or
    floor(sqrt(N)) a side where --image-max-tokens N is below 256."""
    side = 16
    if max_tokens and max_tokens > 0 and max_tokens < side * side:
        side = max(1, math.isqrt(max_tokens))
    return side, side


def pixtral_grid(width_px: int, height_px: int, *, patch_size: int, merge: int, min_tokens: int = 8,
                 max_tokens: int = 1024) -> tuple[int, int]:  # fmt: skip
    """The token grid (across, down) llama.cpp scales an image of width_px x height_px to
    (mtmd-image.cpp mtmd_image_preprocessor_dyn_size, clip.cpp img_tool::calc_size_preserved_ratio, its
    float32 arithmetic included): sides rounded to patch_size * merge pixels, scaled down to at most
    max_tokens (floor) or up to at least min_tokens (ceil) keeping the aspect ratio, each side at least one
    token. So an image thinner than 1:N gets more than N tokens: one token across, and the height that
    keeps its area, e.g. 1 x 2048 px at 64 tokens of 16 px is 1 x 362 tokens."""
    f32 = np.float32
    a = patch_size * max(1, merge)
    min_px, max_px = min_tokens * a * a, max_tokens * a * a
    if width_px <= 0 or height_px <= 0:
        return 0, 0

    def by(rounding, x) -> int:  # round_by_factor, floor_by_factor, ceil_by_factor: x / f in float32
        return int(rounding(float(f32(x) / f32(a)))) * a

    def round_half_away(q: float) -> float:  # std::round (q > 0)
        return math.floor(q + 0.5)

    w_bar = max(a, by(round_half_away, width_px))
    h_bar = max(a, by(round_half_away, height_px))
    if max_px > 0 and h_bar * w_bar > max_px:
        beta = np.sqrt(f32(f32(height_px) * f32(width_px)) / f32(max_px), dtype=f32)
        h_bar = max(a, by(math.floor, f32(height_px) / beta))
        w_bar = max(a, by(math.floor, f32(width_px) / beta))
    elif min_px > 0 and h_bar * w_bar < min_px:
        beta = np.sqrt(f32(min_px) / f32(f32(height_px) * f32(width_px)), dtype=f32)
        h_bar = by(math.ceil, f32(height_px) * beta)
        w_bar = by(math.ceil, f32(width_px) * beta)
    return w_bar // a, h_bar // a


def _check(n_embd: int, n_head: int, merge: int) -> None:
    if n_head <= 0 or n_embd % n_head or (n_embd // n_head) % 2 or merge < 0:
        raise ValueError(f"pixtral widths: n_embd {n_embd} over {n_head} heads (even), merge {merge}")


@lru_cache(maxsize=8192)
def _bytes(n_embd, n_ff, n_head, n_layer, patch_size, merge, text_embd, flash_attn, w, h) -> int:
    graph = build_graph(n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, patch_size=patch_size, merge=merge,
                        text_embd=text_embd, flash_attn=flash_attn, grid=(w, h))  # fmt: skip
    return replay(graph, offload_inputs=True).size


def build_graph(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, patch_size: int, merge: int, text_embd: int,
                flash_attn: bool, grid: tuple[int, int]) -> Graph:  # fmt: skip
    """clip_graph_pixtral::build for an image of grid = (tokens across, tokens down)."""
    b = ClipBuilder(n_embd, n_ff, n_head, flash_attn, PIXTRAL_LAYER)
    tw, th = grid
    m, p, e, t = max(1, merge), patch_size, n_embd, text_embd
    px, py = tw * m, th * m  # patches across, down
    n_pos = px * py

    pos_h = leaf((n_pos,), I32, "pos_h", input=True)
    pos_w = leaf((n_pos,), I32, "pos_w", input=True)
    cur = b.inp(px * p, py * p, p, bias=False)  # build_inp: [n_embd, n_pos]

    # build_vit: an RMS pre-norm, the blocks with build_rope_2d(pos_h, pos_w) on Q and K, no post-norm
    cur = b.vit(cur, n_pos, n_layer, pre_ln=True, add_pos=lambda x: b.rope_2d(x, pos_h, pos_w))

    # Mistral Small 3.1's patch merger: RMS norm, unfold merge x merge patches (im2col, f32), project
    if m > 1:
        cur = b.norm(cur, e, rms=True, bias=False)  # mm.input_norm
        cur = reshape(cur, e, px, py)
        cur = dup(permute(cur, 2, 0, 1, 3), "CONT")  # [px, py, n_embd]
        kern = view(cur, "VIEW", (m, m, e, 1), (4, 0, 0, 0))
        cur = new((e * m * m, tw, th, 1), "IM2COL", (kern, cur), F32)
        cur = reshape(cur, cur.ne[0], tw * th)
        cur = mul_mat(b.mat(e * m * m, e, "mm.patch_merger.weight"), cur)

    cur = b.ffn(cur, e, t, t)  # mm.1 + bias, GELU, mm.2 + bias: the biases and the GELU in place

    # [IMG_BREAK] after each row: a zeroed [text, 1, rows] tensor (a leaf the allocator places first),
    # plus the embedding, concatenated to the rows, viewed without the last row's break
    tmp = reshape(cur, t, tw, th)
    tok = leaf((t, 1, th), F32, "img_break rows")
    tok = dup(tok, "SCALE")
    tok = dup(tok, "ADD", b.vec(t, "v.token_embd.img_break"))
    cat = new((t, tw + 1, th, 1), "CONCAT", (tmp, tok))
    n_out = tw * th + th - 1
    out = view(cat, "VIEW", (t, n_out), (4, 4 * t, 4 * t * n_out, 4 * t * n_out))
    return b.gf.expand(out)
