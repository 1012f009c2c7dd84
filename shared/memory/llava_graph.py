"""LLaVA's vision projector (clip.projector_type `mlp`): the compute buffer clip allocates for its warm-up
image, to the byte. Pure.

The graph (b11434: tools/mtmd/models/llava.cpp clip_graph_llava::build, with clip.cpp's build_inp,
build_norm, build_ffn, build_attn and build_mm) is a CLIP encoder over P^2 patches (P = image_size /
patch_size) and a class token: the patch convolution (ggml_conv_2d: an f16 im2col and a mul_mat), the
patch bias, the class token concatenated after the patches, learned positions read with get_rows over an
i32 `positions` input, a pre-LayerNorm, then the first n_layer - 1 blocks (LLaVA takes the second-to-last
block's output, with no post-norm: LayerNorms with biases, Q/K/V/O with biases, a biased GELU FFN), then
the P^2 patch rows kept with get_rows over an i32 `patches` input and the head: mm.0 (n_embd to the
text width) + bias, GELU, mm.2 (text to text) + bias. Attention is ggml_flash_attn_ext over f16 copies of
K and V with flash attention on, else mul_mat + soft_max over the f32 scores (n_pos^2 x n_head) and a
contiguous copy of V transposed (clip.cpp build_attn, which fixes the order Q, K, V are built in).

This module builds those tensors in ggml's order and replays ggml-alloc on them
(shared/memory/graph_alloc.py). The warm-up image is clip.vision.image_size a side (clip.cpp
load_hparams: warmup_image_size = image_size; the mlp type does not override it), and every image is
resized (or, with image_grid_pinpoints, sliced) to that size, so the warm-up's buffer is the buffer: an
image never grows it (measured, tests/test_llava_graph.py). With --no-mmproj-offload the buffer is the
CPU's, where the inputs (inp_raw, positions, patches) are leafs allocated before any node; on a device the
scheduler's copies of those host inputs are the split's first nodes (graph_alloc.replay(...,
offload_inputs=True)); both give the same size here.

Measured (tests/llama_figures.json's 32 mlp figures, and 19 RPC-device figures in tests/test_llava_graph.py's
MEASURED, the b11434 binaries): byte-exact on all, 0 to 4 blocks run, flash attention on and off, patches of
14 and 16, with and without a post-norm. A call builds and replays the graph in about 1 ms (LLaVA 1.5's 23
blocks: 3 to 6 ms); results are cached by their arguments.

Helpers shared with shared/memory/llama4_graph.py (ClipBuilder: build_norm, build_mm + bias, build_attn,
build_ffn) live here.
"""

from __future__ import annotations

from functools import lru_cache

from shared.memory.graph_alloc import (
    F16,
    F32,
    I32,
    Graph,
    Tensor,
    cast,
    dup,
    leaf,
    mul_mat,
    new,
    permute,
    replay,
    reshape,
    transpose,
)


def llava_compute_bytes(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, image_size: int, patch_size: int,
                        text_embd: int, flash_attn: bool, offload: bool = False,
                        post_ln: bool = False) -> int:  # fmt: skip
    """The compute buffer (bytes) clip allocates for LLaVA's warm-up image (image_size a side), the CPU's
    (--no-mmproj-offload) or, offload=True, a device's (the same size on every shape tried). post_ln: the
    file keeps CLIP's post-norm (LLaVA's converters drop it). 0 without patches. Raises ValueError when
    n_embd does not split into n_head heads (clip's reshape fails)."""
    if patch_size <= 0 or image_size < patch_size:
        return 0
    if n_head <= 0 or n_embd % n_head:
        raise ValueError(f"llava widths: n_embd {n_embd} over {n_head} heads")
    return _bytes(n_embd, n_ff, n_head, n_layer, image_size, patch_size, text_embd, bool(flash_attn), bool(offload),
                  bool(post_ln))  # fmt: skip


@lru_cache(maxsize=4096)
def _bytes(n_embd, n_ff, n_head, n_layer, image_size, patch_size, text_embd, flash_attn, offload, post_ln) -> int:
    graph = build_graph(n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, image_size=image_size,
                        patch_size=patch_size, text_embd=text_embd, flash_attn=flash_attn, post_ln=post_ln)  # fmt: skip
    return replay(graph, offload_inputs=offload).size


def build_graph(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, image_size: int, patch_size: int,
                text_embd: int, flash_attn: bool, post_ln: bool = False) -> Graph:  # fmt: skip
    """clip_graph_llava::build (type mlp) for one image of image_size a side."""
    b = ClipBuilder(n_embd, n_ff, n_head, flash_attn)
    p = patch_size
    nx = ny = image_size // p
    n_patches = nx * ny
    n_pos = n_patches + 1  # the class token
    e = n_embd

    # build_inp: ggml_conv_2d (an f16 im2col, mul_mat), then [n_embd, n_patches] and the patch bias
    inp_raw = leaf((image_size, image_size, 3, 1), F32, "inp_raw", input=True)
    kernel = b.w((p, p, 3, e), F16, "v.patch_embd.weight")
    cur = b.conv_2d(kernel, inp_raw, nx, ny)
    cur = reshape(cur, n_patches, e, 1)
    cur = dup(transpose(cur), "CONT")
    cur = dup(cur, "ADD", b.vec(e, "v.patch_embd.bias"))
    cur = new((e, n_pos, 1, 1), "CONCAT", (cur, b.vec(e, "v.class_embd")))
    positions = leaf((n_pos,), I32, "positions", input=True)
    pos = new((e, n_pos), "GET_ROWS", (b.w((e, n_pos), F32, "v.position_embd.weight"), positions))
    inp_l = dup(cur, "ADD", pos)
    inp_l = b.norm(inp_l, e)  # v.pre_ln

    for _ in range(n_layer - 1):  # to the second-to-last block
        inp_l = b.block(inp_l, n_pos)
    if post_ln:  # v.post_ln
        inp_l = b.norm(inp_l, e)

    embeddings = reshape(inp_l, e, n_pos)
    patches = leaf((n_patches,), I32, "patches", input=True)
    cur = new((e, n_patches), "GET_ROWS", (embeddings, patches))
    cur = b.linear(cur, e, text_embd)  # mm.0
    cur = dup(cur, "UNARY")  # GELU
    cur = b.linear(cur, text_embd, text_embd)  # mm.2
    return b.gf.expand(cur)


class ClipBuilder:
    """clip.cpp's graph helpers over graph_alloc tensors (weights f16 matrices, f32 vectors)."""

    def __init__(self, n_embd: int, n_ff: int, n_head: int, flash_attn: bool):
        self.n_embd, self.n_ff, self.n_head, self.fa = n_embd, n_ff, n_head, flash_attn
        self.gf = Graph()

    @staticmethod
    def w(ne, dtype=F32, name=""):
        return leaf(ne, dtype, name, weight=True)

    def mat(self, cols, rows, name=""):  # an f16 matrix, ggml shape [cols, rows]
        return self.w((cols, rows), F16, name)

    def vec(self, n, name=""):
        return self.w((n,), F32, name)

    def conv_2d(self, kernel: Tensor, inp: Tensor, nx: int, ny: int) -> Tensor:
        """ggml_conv_2d with stride = the kernel's side: [nx, ny, OC] (cont of the permuted mul_mat)."""
        kk = kernel.ne[0] * kernel.ne[1] * kernel.ne[2]
        im2col = new((kk, nx, ny, 1), "IM2COL", (kernel, inp), F16)
        cur = mul_mat(reshape(im2col, kk, nx * ny), reshape(kernel, kk, kernel.ne[3]))
        cur = reshape(cur, nx, ny, 1, kernel.ne[3])
        return dup(permute(cur, 0, 1, 3, 2), "CONT")

    def norm(self, cur: Tensor, width: int) -> Tensor:  # build_norm, NORM_TYPE_NORMAL, weight and bias
        cur = dup(cur, "NORM")
        cur = dup(cur, "MUL", self.vec(width))
        return dup(cur, "ADD", self.vec(width))

    def linear(self, cur: Tensor, cols: int, rows: int) -> Tensor:  # build_mm + bias
        return dup(mul_mat(self.mat(cols, rows), cur), "ADD", self.vec(rows))

    def attn(self, wo: Tensor, wo_b: Tensor, q_cur: Tensor, k_cur: Tensor, v_cur: Tensor) -> Tensor:
        """build_attn (no mask, no sinks): q/k/v_cur are [d_head, n_head, n_tokens]."""
        for t in (q_cur, k_cur, v_cur):
            self.gf.expand(t)  # ggml_build_forward_order
        q = permute(q_cur, 0, 2, 1, 3)
        k = permute(k_cur, 0, 2, 1, 3)
        if self.fa:
            v = permute(v_cur, 0, 2, 1, 3)
            k = cast(k, F16)
            v = cast(v, F16)
            cur = new((v.ne[0], q.ne[2], q.ne[1], q.ne[3]), "FLASH_ATTN_EXT", (q, k, v))
            cur = reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            v = permute(v_cur, 1, 2, 0, 3)
            v = dup(v, "CONT")
            kq = mul_mat(k, q)
            kq = dup(kq, "SOFT_MAX")
            kqv = mul_mat(v, kq)
            cur = permute(kqv, 0, 2, 1, 3)
            cur = new((cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]), "CONT", (cur,))
        cur = mul_mat(wo, cur)
        return dup(cur, "ADD", wo_b)

    def block(self, inp_l: Tensor, n_pos: int, add_pos=None) -> Tensor:
        """One pre-norm block (llava.cpp's loop, build_vit's with separate biased Q/K/V): LayerNorm, attention
        (add_pos applied to Q then K after the reshape), the residual, LayerNorm, a biased GELU FFN, the residual."""
        e, d_head = self.n_embd, self.n_embd // self.n_head
        cur = self.norm(inp_l, e)
        q = reshape(self.linear(cur, e, e), d_head, self.n_head, n_pos, 1)
        k = reshape(self.linear(cur, e, e), d_head, self.n_head, n_pos, 1)
        v = reshape(self.linear(cur, e, e), d_head, self.n_head, n_pos, 1)
        if add_pos is not None:
            q, k = add_pos(q), add_pos(k)
        cur = self.attn(self.mat(e, e), self.vec(e), q, k, v)
        cur = dup(cur, "ADD", inp_l)
        inp_l = cur
        cur = self.norm(cur, e)
        cur = self.linear(cur, e, self.n_ff)  # build_ffn: up + bias, GELU, down + bias
        cur = dup(cur, "UNARY")
        cur = self.linear(cur, self.n_ff, e)
        return dup(inp_l, "ADD", cur)
