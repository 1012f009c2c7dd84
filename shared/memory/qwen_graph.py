"""Qwen2-VL's family of vision projectors (clip.projector_type `qwen2vl_merger`, `qwen2.5vl_merger`,
`qwen3vl_merger`): the compute buffer clip allocates for one image, to the byte. Pure.

The graph (b11434: tools/mtmd/models/qwen2vl.cpp clip_graph_qwen2vl::build for Qwen2-VL and 2.5-VL,
models/qwen3vl.cpp clip_graph_qwen3vl::build for 3-VL, with clip.cpp's build_norm, build_ffn, build_attn:
shared/memory/clip_graph.py):

- the image (inp_raw, W x H x 3 f32) through two patch convolutions (ggml_conv_2d: im2col to f16, f32
  when the kernel is bf16, and mul_mat; a still image feeds both frames' kernels) added, then
  reordered so each 2 x 2 block of patches is contiguous (cont, reshape, permute, cont);
- Qwen3-VL: a patch bias, and learned positions from a side x side table (48 x 48 in Qwen3-VL's files)
  bilinearly resized to the patch grid (ggml_interpolate; skipped when the grid is the table's) and
  reordered the same way;
- Qwen2.5-VL (window attention, clip.vision.n_wa_pattern > 0): the patches gathered into window order
  (get_rows of 2 x 2 blocks by inv_window_idx), an n_pos x n_pos f32 window mask (an f16 copy with flash
  attention, and another copy in every windowed block's build_attn), blocks il with (il + 1) %
  n_wa_pattern != 0 attending in windows, and the merger's output put back in order (get_rows by
  window_idx);
- n_layer pre-norm blocks (LayerNorm with biases; 2.5-VL RMS norms without) with separate Q, K, V
  (3-VL: one fused QKV read through three views), M-RoPE (ggml_rope_multi on 4 i32 positions a patch) on
  Q and K, attention (ggml_flash_attn_ext over f16 copies of K and V with flash attention on; else the
  f32 scores n_pos x n_pos x n_head, soft_max, and V transposed), a GELU FFN (2.5-VL gated: GEGLU /
  SwiGLU of gate and up), residuals;
- Qwen3-VL's deepstack: the blocks with v.deepstack.N tensors (clip.vision.is_deepstack_layers) each
  feed their output, 2 x 2 merged, through their own LayerNorm + fc1 + GELU + fc2 to the text width;
  nothing later reads them, so ggml orders all of these after the main merger (the blocks' outputs stay
  live until then), concatenated one by one and then after the merger's output;
- the post-norm, then the merger: 2 x 2 patches (4 n_embd) through mm.0, GELU, mm.2 to the text width.

build_attn fixes the order of Q, K and V (ggml_build_forward_order), so this module builds the same
tensors in ggml's order and replays ggml-alloc on them (shared/memory/graph_alloc.py). Every size
follows the patch count alone (the image, im2col, the positions, the mask, the resized position table:
W x H = n_pos * patch^2), not the grid's shape: any image of a given number of merged tokens needs the
same buffer, the one exception being Qwen3-VL at exactly the position table's grid (no resize).

Which buffer: with --no-mmproj-offload the CPU's (inputs are leafs, allocated first); on a device (an
RPC server) the device's, where the scheduler's copies of the host inputs are the split's first nodes
(offload=True). clip reserves the warm-up image (46 x 46 merged tokens: clip.cpp set_warmup_n_tokens, or
the side of --image-max-tokens when that is smaller) and the buffer grows when a larger image's graph
needs more (ggml_gallocr: reallocated only larger), so a lane's buffer is the largest over the warm-up
and every image it takes (qwen_planned_bytes).

Measured (tests/llama_figures.json and the table in tests/test_qwen_graph.py, b11434): byte-exact on all 23
recorded warm-ups (CPU, printed MiB: 4 to 5 blocks, widths 64 to 1,152, flash attention on and off) and on
14 device buffers (RPC server, exact bytes: warm-ups at 44 x 44 and 46 x 46 tokens, images of 1 x 2,000,
40 x 50, 23 x 92, 24 x 24 at Qwen3-VL's table grid, and 1 x 2,340 tokens; Qwen2.5-VL at 7B's widths).

The largest image: every image of n merged tokens needs the same buffer, so a lane's largest is the
largest over n. With --image-max-tokens 2116 it is the warm-up's own count, 2,116 (46 x 46, or any shape
of 2,116), on every recorded shape and on Qwen2-VL-7B, 2.5-VL-3B/7B, 3-VL-2B/8B widths: no smaller image
needs more, though the buffer is not monotone in n with window attention. But mtmd's resize
(calc_size_preserved_ratio) bounds only images within limit:1: a longer one keeps one token across and
about sqrt(limit * aspect) along, up to 65,536 pixels (image_grid): 2,340 tokens at 14-pixel patches
(measured: a 59,524 x 23 image with --image-max-tokens 2116 encodes 2,340 tokens and grows Qwen2.5-VL's
buffer 22% past the warm-up's; 17% at 7B's widths), 2,048 at 16 (Qwen3-VL: never past 2,116). Without a
gateway refusing such images, a lane must plan the strips (qwen_planned_bytes(strips=True), the default).
"""

from __future__ import annotations

import math
from functools import lru_cache
from math import isqrt

from shared.memory.clip_graph import ClipBuilder, Layer
from shared.memory.graph_alloc import (
    F16,
    F32,
    I32,
    Graph,
    Tensor,
    cast,
    dup,
    leaf,
    new,
    permute,
    replay,
    reshape,
)
from shared.memory.symbolic_sweep import Inexact, largest_by_regions

QWEN_TYPES = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
WARMUP_TOKENS_SIDE = 46  # clip.cpp load_hparams: set_warmup_n_tokens(46*46) for the three types
DEFAULT_MAX_TOKENS = 4096  # clip.cpp: set_limit_image_tokens(8, 4096) without --image-max-tokens
POS_TABLE_SIDE = 48  # Qwen3-VL: v.position_embd is 48 * 48 rows (num_position_embeddings 2304)
MERGE = 2  # qwen2vl.cpp / qwen3vl.cpp hard-code the 2 x 2 merge (n_embd * 4, n_pos / 4)
MAX_RESIZE_SIDE = 65536  # mtmd-image.cpp: a resize target's side ("is out of range (max 65536)")


def qwen_compute_bytes(*, proj_type: str, n_embd: int, n_ff: int, n_head: int, n_layer: int, patch_size: int,
                       text_embd: int, flash_attn: bool, grid: tuple[int, int], merge: int = MERGE,
                       n_wa_pattern: int | None = None, deepstack: tuple[int, ...] | None = None,
                       pos_side: int = POS_TABLE_SIDE, kernel_bf16: bool = False,
                       offload: bool = False) -> int:  # fmt: skip
    """The compute buffer (bytes) clip allocates for one image of grid = (patches across, patches down)
    (each even): the CPU's with --no-mmproj-offload, the device's (offload=True) when offloaded.

    The file's facts beyond the widths (clip.vision.*: embedding_length, feed_forward_length,
    attention.head_count, block_count, patch_size, and text_embd = mm.2's rows, the text model's n_embd):
    n_wa_pattern, clip.vision.n_wa_pattern (Qwen2-VL's graph reads it too; None: 4 for 2.5-VL, 0 for the
    others, as tests/tinyprojectors.py writes them; Qwen2.5-VL's real files say 8); deepstack, the blocks
    with v.deepstack.N tensors (clip.vision.is_deepstack_layers; None: blocks 1..3 but the last two, as
    tests/tinyprojectors.py writes them; Qwen3-VL-8B's are 8, 16, 24); pos_side, the side of 3-VL's
    v.position_embd (sqrt of its rows, 48); kernel_bf16, v.patch_embd.weight is bf16 (im2col in f32).
    flash_attn: clip's own (its log's "flash attention is enabled"). Raises ValueError on what clip's
    graph cannot build."""
    if proj_type not in QWEN_TYPES:
        raise ValueError(f"projector type {proj_type!r}: one of {QWEN_TYPES}")
    gx, gy = grid
    if merge != MERGE:
        raise ValueError(f"merge {merge}: clip's Qwen graphs merge 2 x 2 patches")
    if gx <= 0 or gy <= 0 or gx % 2 or gy % 2:
        raise ValueError(f"grid {gx} x {gy}: patches across and down, each a positive even number")
    if n_head <= 0 or n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} over {n_head} heads")
    if n_wa_pattern is None:
        n_wa_pattern = default_wa_pattern(proj_type)
    if deepstack is None:
        deepstack = default_deepstack(proj_type, n_layer)
    if proj_type == "qwen3vl_merger":
        n_wa_pattern = 0  # clip_graph_qwen3vl has no window attention
    else:
        deepstack = ()
    return _bytes(proj_type, n_embd, n_ff, n_head, n_layer, patch_size, text_embd, bool(flash_attn), gx, gy,
                  int(n_wa_pattern), tuple(sorted(set(deepstack))), pos_side, bool(kernel_bf16),
                  bool(offload))  # fmt: skip


def default_wa_pattern(proj_type: str) -> int:
    return 4 if proj_type == "qwen2.5vl_merger" else 0


def default_deepstack(proj_type: str, n_layer: int) -> tuple[int, ...]:
    return (1, 2, 3)[: max(0, n_layer - 2)] if proj_type == "qwen3vl_merger" else ()


@lru_cache(maxsize=8192)
def _bytes(proj_type, n_embd, n_ff, n_head, n_layer, patch_size, text_embd, flash_attn, gx, gy, n_wa_pattern,
           deepstack, pos_side, kernel_bf16, offload) -> int:  # fmt: skip
    graph = build_graph(proj_type=proj_type, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer,
                        patch_size=patch_size, text_embd=text_embd, flash_attn=flash_attn, grid=(gx, gy),
                        n_wa_pattern=n_wa_pattern, deepstack=deepstack, pos_side=pos_side,
                        kernel_bf16=kernel_bf16)  # fmt: skip
    return replay(graph, offload_inputs=offload).size


def warmup_grid(patch_size: int = 14, image_max_tokens: int = 0) -> tuple[int, int]:
    """The warm-up image's patch grid (clip_model's set_warmup_n_tokens: 46 x 46 merged tokens, or the
    square of whole tokens within --image-max-tokens when that is fewer)."""
    side = WARMUP_TOKENS_SIDE
    if image_max_tokens > 0 and side * side > image_max_tokens:
        side = max(1, isqrt(image_max_tokens))
    return (side * MERGE, side * MERGE)


def image_grid(width: int, height: int, patch_size: int, *, image_max_tokens: int = 0,
               image_min_tokens: int = 0) -> tuple[int, int]:  # fmt: skip
    """The patch grid (across, down) clip encodes an image of width x height pixels at (mtmd-image.cpp
    mtmd_image_preprocessor_dyn_size: calc_size_preserved_ratio, aligned to patch_size * 2, between the
    min and max pixels of --image-min-tokens / --image-max-tokens, else 8 and 4,096 tokens; float32 as in
    C++). Raises ValueError where llama.cpp refuses the image (a resized side over 65,536 pixels).

    --image-max-tokens does not bound every image: one more than that many times longer than wide (and
    larger than the limit once aligned) keeps one token across, clamped up from less, and
    sqrt(limit * aspect) tokens along: up to MAX_RESIZE_SIDE // (patch_size * 2) (2,340 at 14-pixel
    patches, 2,048 at 16; strip_tokens)."""
    import numpy as np

    f32 = np.float32
    align = patch_size * MERGE
    area = align * align
    min_px = (image_min_tokens if image_min_tokens > 0 else 8) * area
    max_px = (image_max_tokens if image_max_tokens > 0 else DEFAULT_MAX_TOKENS) * area

    def by(x, rounding) -> int:  # round/ceil/floor_by_factor: float32 x / align, then an int times align
        return int(rounding(float(f32(x) / f32(align)))) * align

    def cround(q: float) -> int:  # std::round of a float32 >= 0 (exact in a double): halves away from zero
        return math.floor(q + 0.5)

    w_bar = max(align, by(width, cround))
    h_bar = max(align, by(height, cround))
    if h_bar * w_bar > max_px:
        beta = np.sqrt(f32(height) * f32(width) / f32(max_px), dtype=f32)
        h_bar = max(align, by(f32(height) / beta, math.floor))
        w_bar = max(align, by(f32(width) / beta, math.floor))
    elif h_bar * w_bar < min_px:
        beta = np.sqrt(f32(min_px) / (f32(height) * f32(width)), dtype=f32)
        h_bar = by(f32(height) * beta, math.ceil)
        w_bar = by(f32(width) * beta, math.ceil)
    if not (0 < w_bar <= MAX_RESIZE_SIDE and 0 < h_bar <= MAX_RESIZE_SIDE):
        raise ValueError(f"resize target {w_bar}x{h_bar} is out of range (max {MAX_RESIZE_SIDE})")
    return (w_bar // patch_size, h_bar // patch_size)


def strip_tokens(patch_size: int) -> int:
    """The most merged tokens an image one token across can keep: its long side at most 65,536 pixels."""
    return MAX_RESIZE_SIDE // (patch_size * MERGE)


def qwen_planned_bytes(*, proj_type: str, n_embd: int, n_ff: int, n_head: int, n_layer: int, patch_size: int,
                       text_embd: int, flash_attn: bool, image_max_tokens: int = 2116, strips: bool = True,
                       merge: int = MERGE, n_wa_pattern: int | None = None, deepstack: tuple[int, ...] | None = None,
                       pos_side: int = POS_TABLE_SIDE, kernel_bf16: bool = False,
                       offload: bool = False) -> int:  # fmt: skip
    """The buffer a lane holds with --image-max-tokens image_max_tokens: the largest over the warm-up and
    every image it takes (largest_image). strips=False: without the images more than image_max_tokens
    times longer than wide that escape the limit (image_grid), for a gateway that refuses them."""
    return largest_image(proj_type=proj_type, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer,
                         patch_size=patch_size, text_embd=text_embd, flash_attn=flash_attn,
                         image_max_tokens=image_max_tokens, strips=strips, merge=merge, n_wa_pattern=n_wa_pattern,
                         deepstack=deepstack, pos_side=pos_side, kernel_bf16=kernel_bf16,
                         offload=offload)[1]  # fmt: skip


def largest_image(*, image_max_tokens: int = 2116, strips: bool = True, **args) -> tuple[tuple[int, int], int]:
    """(the patch grid, its buffer) of the image needing the largest buffer among those a lane with
    --image-max-tokens takes (0: clip's 4,096), the warm-up included (its grid where nothing needs more);
    args as qwen_compute_bytes's but grid.

    The buffer follows the image's merged tokens n alone (Qwen3-VL's position-table grid aside, taken
    too), so this is the largest over n = 1 .. the limit, or .. strip_tokens(patch_size) where that is
    more and strips: one token across stands for every shape of n. Not monotone in n (ggml-alloc reuses
    freed blocks best-fit: replayed drops of 12 MB from n - 1 to n with window attention), hence
    every n: largest_by_regions replays once per interval of n where the allocator decides alike."""
    args = {k: v for k, v in args.items() if v is not None or k not in ("n_wa_pattern", "deepstack")}
    args.setdefault("n_wa_pattern", default_wa_pattern(args["proj_type"]))
    args.setdefault("deepstack", default_deepstack(args["proj_type"], args["n_layer"]))
    args["deepstack"] = tuple(sorted(set(args["deepstack"])))
    limit = image_max_tokens if image_max_tokens > 0 else DEFAULT_MAX_TOKENS
    return _largest(tuple(sorted(args.items())), limit, bool(strips))


@lru_cache(maxsize=256)
def _largest(items: tuple, limit: int, strips: bool) -> tuple[tuple[int, int], int]:
    args = dict(items)
    best_grid = warmup_grid(args["patch_size"], limit)
    best = qwen_compute_bytes(grid=best_grid, **args)
    side = args.get("pos_side", POS_TABLE_SIDE)
    if args["proj_type"] == "qwen3vl_merger" and side % 2 == 0 and (side // 2) ** 2 <= limit:
        size = qwen_compute_bytes(grid=(side, side), **args)  # the table's own grid: no resize
        if size > best:
            best_grid, best = (side, side), size
    most = max(limit, strip_tokens(args["patch_size"])) if strips else limit
    n, size = _largest_over_counts(args, most)
    if size > best:
        best_grid, best = (2, 2 * n), size
    return best_grid, best


def _largest_over_counts(args: dict, limit: int) -> tuple[int, int]:
    """(n, buffer) of the largest buffer over images of n = 1..limit merged tokens, one token across."""
    qwen_compute_bytes(grid=(2, 2), **args)  # the arguments' checks
    graph_args = dict(args)
    offload = bool(graph_args.pop("offload", False))
    graph_args.pop("merge", None)
    if graph_args["proj_type"] == "qwen3vl_merger":  # as qwen_compute_bytes reads them
        graph_args["n_wa_pattern"] = 0
    else:
        graph_args["deepstack"] = ()

    def graph_of(n):
        return build_graph(grid=(2, 2 * n), **graph_args)

    def replay_of(graph):
        return replay(graph, offload_inputs=offload).size

    for step in (8, 32):
        try:
            return largest_by_regions(graph_of, replay_of, limit, step)
        except (Inexact, TypeError):  # a size the intervals cannot follow: every count, one by one
            break
    size, n = max((qwen_compute_bytes(grid=(2, 2 * n), **args), n) for n in range(1, limit + 1))
    return n, size


def build_graph(*, proj_type: str, n_embd: int, n_ff: int, n_head: int, n_layer: int, patch_size: int,
                text_embd: int, flash_attn: bool, grid: tuple[int, int], n_wa_pattern: int = 0,
                deepstack: tuple[int, ...] = (), pos_side: int = POS_TABLE_SIDE,
                kernel_bf16: bool = False) -> Graph:  # fmt: skip
    """clip's graph for one image of grid = (patches across, patches down)."""
    return _Builder(proj_type, n_embd, n_ff, n_head, n_layer, patch_size, text_embd, flash_attn, n_wa_pattern,
                    deepstack, pos_side, kernel_bf16).build(*grid)  # fmt: skip


class _Builder(ClipBuilder):
    """clip_graph_qwen2vl / clip_graph_qwen3vl: ClipBuilder's helpers and blocks (Qwen2.5-VL's RMS-normed and
    gated, without norm biases; Qwen3-VL's with a fused QKV), the 2 x 2 merge order and M-RoPE."""

    def __init__(self, proj_type, n_embd, n_ff, n_head, n_layer, patch_size, text_embd, flash_attn, n_wa_pattern,
                 deepstack, pos_side, kernel_bf16):  # fmt: skip
        self.qwen3 = proj_type == "qwen3vl_merger"
        self.rms = proj_type == "qwen2.5vl_merger"  # RMS norms without biases, a gated FFN
        layer = Layer(rms=self.rms, norm_bias=not self.rms, gated=self.rms, fused_qkv=self.qwen3)
        super().__init__(n_embd, n_ff, n_head, flash_attn, layer)
        self.e, self.n_layer, self.patch, self.text = n_embd, n_layer, patch_size, text_embd
        self.n_wa, self.deep, self.pos_side, self.kernel_bf16 = n_wa_pattern, set(deepstack), pos_side, kernel_bf16

    def conv(self, kernel: Tensor, inp_raw: Tensor, nx: int, ny: int) -> Tensor:
        """ggml_conv_2d, stride = kernel: [nx, ny, n_embd, 1] (the im2col f32 for a bf16 kernel)."""
        return self.conv_2d(kernel, inp_raw, nx, ny, F32 if self.kernel_bf16 else F16)

    def merge_order(self, cur: Tensor, nx: int, ny: int) -> Tensor:
        """[n_embd, nx, ny] -> each 2 x 2 block of patches contiguous: [n_embd, nx * ny]."""
        e = self.e
        cur = new((2 * e, nx // 2, ny, 1), "CONT", (cur,))
        cur = reshape(cur, 2 * e, nx // 2, 2, ny // 2)
        cur = permute(cur, 0, 2, 1, 3)
        return new((e, nx * ny, 1), "CONT", (cur,))

    def build(self, nx: int, ny: int) -> Graph:
        e, p = self.e, self.patch
        n_pos = nx * ny

        inp_raw = leaf((nx * p, ny * p, 3, 1), F32, "inp_raw", input=True)
        k0 = self.w((p, p, 3, e), F16, "v.patch_embd.weight")
        k1 = self.w((p, p, 3, e), F16, "v.patch_embd.weight.1")
        inp = dup(self.conv(k0, inp_raw, nx, ny), "ADD", self.conv(k1, inp_raw, nx, ny))
        inp = permute(inp, 1, 2, 0, 3)  # [w, h, c] -> [c, w, h]
        inp = self.merge_order(inp, nx, ny)

        if self.qwen3:
            inp = dup(inp, "ADD", self.vec(e, "v.patch_embd.bias"))
            side = self.pos_side
            pos = self.w((e, side * side), F32, "v.position_embd.weight")
            if (nx, ny) != (side, side):  # resize_position_embeddings
                pos = permute(reshape(pos, e, side, side), 2, 0, 1, 3)
                pos = new((nx, ny, e, 1), "UPSCALE", (pos,))
                pos = permute(pos, 1, 2, 0, 3)
                pos = new((e, nx * ny), "CONT", (pos,))
            inp = dup(inp, "ADD", self.merge_order(pos, nx, ny))

        positions = leaf((n_pos * 4,), I32, "positions", input=True)
        inp_l = inp
        window_mask = None
        if self.n_wa > 0:
            inv_window_idx = leaf((n_pos // 4,), I32, "inv_window_idx", input=True)
            window_mask = leaf((n_pos, n_pos), F32, "window_mask", input=True)
            if self.fa:
                window_mask = cast(window_mask, F16)
            inp_l = reshape(inp_l, e * 4, n_pos // 4)
            inp_l = new((e * 4, n_pos // 4), "GET_ROWS", (inp_l, inv_window_idx))
            inp_l = reshape(inp_l, e, n_pos, 1)

        deep_features = None
        deep_outputs = []
        for il in range(self.n_layer):
            full = (il + 1) % self.n_wa == 0 if self.n_wa > 0 else True
            inp_l = self.block(inp_l, n_pos, add_pos=lambda t: dup(t, "ROPE", positions),  # ggml_rope_multi
                               mask=None if full else window_mask)  # fmt: skip
            if self.qwen3 and il in self.deep:
                deep_outputs.append(inp_l)

        # deepstack: built in block order (ggml visits them after the merger: nothing else reads them)
        for out in deep_outputs:
            feat = reshape(out, e * 4, n_pos // 4, 1)
            feat = self.norm(feat, e * 4)
            feat = self.ffn(feat, e * 4, e * 4, self.text)
            if deep_features is None:
                deep_features = feat
            else:
                deep_features = new((deep_features.ne[0] + feat.ne[0], n_pos // 4), "CONCAT", (deep_features, feat))

        inp_l = self.norm(inp_l, e, rms=self.rms, bias=not self.rms)  # v.post_ln
        emb = reshape(inp_l, e * 4, n_pos // 4, 1)
        emb = self.ffn(emb, e * 4, e * 4, self.text)  # mm.0, GELU, mm.2
        if self.n_wa > 0:
            window_idx = leaf((n_pos // 4,), I32, "window_idx", input=True)
            emb = reshape(emb, self.text, n_pos // 4)
            emb = new((self.text, n_pos // 4), "GET_ROWS", (emb, window_idx))
            emb = reshape(emb, self.text, n_pos // 4, 1)
        if deep_features is not None:
            emb = new((emb.ne[0] + deep_features.ne[0], n_pos // 4), "CONCAT", (emb, deep_features))
        return self.gf.expand(emb)
