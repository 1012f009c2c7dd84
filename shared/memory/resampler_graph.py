"""MiniCPM-V's vision projector (clip.projector_type `resampler`): the compute buffer clip allocates for
one encoded piece of an image, to the byte. Pure.

The graph (b11434: tools/mtmd/models/minicpmv.cpp clip_graph_minicpmv::build, with clip.cpp's build_inp,
build_vit, build_norm, build_ffn, build_attn and build_mm) is a SigLIP encoder over the piece's n_pos
patches (a patch_size convolution as im2col + mul_mat, learned positions read by bucket with get_rows,
LayerNorm blocks with biases, a GELU FFN, a post-norm), then the resampler: `queries` learned queries
(LayerNorm'd) cross-attend in heads of 128 to the patches projected to the text width (resampler.kv, a
LayerNorm, plus a sinusoidal 2-D position embedding built in the graph from the omega / pos_w / pos_h
inputs), then a LayerNorm and a square projection. Attention is ggml_flash_attn_ext over f16 copies of
K and V with flash attention on, else mul_mat + soft_max over the f32 scores (n_pos x n_pos x n_head in
the encoder, n_pos x queries x text/128 in the resampler) and a contiguous copy of V transposed.

build_attn fixes the order (ggml_build_forward_order of Q, K and V before the rest of the attention), so
the graph's node order, and with it where ggml-alloc's freed blocks lie, is ggml's: this module builds
the same tensors in the same order and replays the allocator on them (shared/memory/graph_alloc.py).
The piece's sizes depend on its patch count only, not on its width and height (inp_raw is W x H x 3 f32,
W x H = n_pos * patch_size^2; im2col's rows are the patches; pos_w / pos_h are 1 x n_pos), so one n_pos
stands for every shape of the piece.

Which buffer: with --no-mmproj-offload the CPU's, where the inputs (inp_raw, positions, omega, pos_w,
pos_h) are leafs allocated before any node; on a device (an RPC server) the device's, where the
scheduler's copies of those host inputs are the split's first nodes, in the order the graph first reads
them, which is the order the leafs were found in: the same offsets, so the same size
(graph_alloc.replay(..., offload_inputs=True) replays that graph; tests/test_resampler_graph.py checks
both). clip reserves the warm-up piece ((image_size / patch_size)^2 patches) and grows the buffer when a
larger piece arrives (ggml_gallocr_alloc_graph reserves again when a node outgrows its slot; the buffer
is only ever reallocated larger), so after an image the buffer is the largest of the warm-up's and its
pieces' (mtmd-image.cpp llava_uhd slicing: an overview and equal slices).

Measured (tests/llama_figures.json and the table in tests/test_resampler_graph.py, the b11434 RPC
server's exact bytes): byte-exact on every figure, pieces of 256 to 1,096 patches, 1 to 27 layers, flash
attention on and off, including where fragmentation makes 2 layers need less than 1 or 3 (n_embd 1152,
text 3584, flash attention: 59,832,032 bytes against 62,637,792). For the same reason the buffer is not
monotone in n_pos (n_embd 1152, text 3584, one layer, no flash attention: 27 x 27 patches need 55,894,656
bytes, 28 x 28 55,645,632, both measured): to bound every piece up to N patches, take the largest over
n_pos <= N, not the value at N. The graph is small (about 31 nodes a layer, 895 at MiniCPM-V 2.6's 27):
a call builds and replays it in 0.5 ms (1 layer) to 5 ms (27 layers), and results are cached by their
arguments.
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

D_HEAD_RESAMPLER = 128  # minicpmv.cpp: the resampler's heads are 128 wide (n_head = text_embd / 128)
POS_BUCKETS = 70  # v.position_embd: a 70 x 70 table read by bucket


def resampler_compute_bytes(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, n_pos: int, patch_size: int,
                            text_embd: int, queries: int, flash_attn: bool) -> int:  # fmt: skip
    """The compute buffer (bytes) clip allocates for one piece of n_pos patches (the CPU's with
    --no-mmproj-offload, the device's when offloaded: the same); 0 without patches. Raises ValueError on
    widths clip's graph cannot reshape (n_embd by n_head, text_embd by heads of 128)."""
    if n_pos <= 0:
        return 0
    if n_head <= 0 or n_embd % n_head or text_embd <= 0 or text_embd % D_HEAD_RESAMPLER:
        raise ValueError(f"resampler widths: n_embd {n_embd} over {n_head} heads, text_embd {text_embd} "
                         "in heads of 128")  # fmt: skip
    return _bytes(n_embd, n_ff, n_head, n_layer, n_pos, patch_size, text_embd, queries, bool(flash_attn))


@lru_cache(maxsize=4096)
def _bytes(n_embd, n_ff, n_head, n_layer, n_pos, patch_size, text_embd, queries, flash_attn) -> int:
    graph = build_graph(n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, n_pos=n_pos,
                        patch_size=patch_size, text_embd=text_embd, queries=queries, flash_attn=flash_attn)  # fmt: skip
    return replay(graph).size


def build_graph(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, n_pos: int, patch_size: int, text_embd: int,
                queries: int, flash_attn: bool, shape: tuple[int, int] | None = None) -> Graph:  # fmt: skip
    """clip_graph_minicpmv::build for a piece of n_pos patches (shape: its patches across and down, a row of
    n_pos by default: the sizes do not depend on it)."""
    if shape is not None and shape[0] * shape[1] != n_pos:
        raise ValueError(f"a {shape[0]} x {shape[1]} piece is not {n_pos} patches")
    return _Builder(n_embd, n_ff, n_head, n_layer, patch_size, text_embd, queries, flash_attn).build(
        shape or (n_pos, 1))


class _Builder:
    def __init__(self, n_embd, n_ff, n_head, n_layer, patch_size, text_embd, queries, flash_attn):
        self.n_embd, self.n_ff, self.n_head, self.n_layer = n_embd, n_ff, n_head, n_layer
        self.patch, self.text, self.queries, self.fa = patch_size, text_embd, queries, flash_attn
        self.gf = Graph()

    @staticmethod
    def w(ne, dtype=F32, name=""):
        return leaf(ne, dtype, name, weight=True)

    def mat(self, cols, rows, name=""):  # an f16 matrix, ggml shape [cols, rows]
        return self.w((cols, rows), F16, name)

    def vec(self, n, name=""):
        return self.w((n,), F32, name)

    # clip.cpp helpers
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

    def build(self, shape: tuple[int, int]) -> Graph:
        nx, ny = shape
        n_pos, e, t, p = nx * ny, self.n_embd, self.text, self.patch

        omega = leaf((t // 4,), F32, "omega", input=True)
        pos_h = leaf((1, n_pos), F32, "pos_h", input=True)
        pos_w = leaf((1, n_pos), F32, "pos_w", input=True)
        positions = leaf((n_pos,), I32, "positions", input=True)
        pos_table = self.w((e, POS_BUCKETS * POS_BUCKETS), F32, "v.position_embd.weight")
        learned_pos_embd = new((e, n_pos), "GET_ROWS", (pos_table, positions))

        # build_inp: ggml_conv_2d (im2col to f16, mul_mat), then [n_embd, n_pos] and the patch bias
        inp_raw = leaf((nx * p, ny * p, 3, 1), F32, "inp_raw", input=True)
        kernel = self.w((p, p, 3, e), F16, "v.patch_embd.weight")
        im2col = new((3 * p * p, nx, ny, 1), "IM2COL", (kernel, inp_raw), F16)
        cur = mul_mat(reshape(im2col, im2col.ne[0], nx * ny), reshape(kernel, 3 * p * p, e))
        cur = reshape(cur, nx, ny, 1, e)
        cur = dup(permute(cur, 0, 1, 3, 2), "CONT")
        cur = reshape(cur, n_pos, e, 1)
        cur = dup(transpose(cur), "CONT")
        cur = dup(cur, "ADD", self.vec(e, "v.patch_embd.bias"))

        # build_vit
        cur = dup(cur, "ADD", learned_pos_embd)
        inp_l = reshape(cur, e, n_pos)
        d_head = e // self.n_head
        for _ in range(self.n_layer):
            cur = self.norm(inp_l, e)
            q = reshape(self.linear(cur, e, e), d_head, self.n_head, n_pos, 1)
            k = reshape(self.linear(cur, e, e), d_head, self.n_head, n_pos, 1)
            v = reshape(self.linear(cur, e, e), d_head, self.n_head, n_pos, 1)
            cur = self.attn(self.mat(e, e), self.vec(e), q, k, v)
            cur = dup(cur, "ADD", inp_l)
            inp_l = cur
            cur = self.norm(cur, e)
            cur = self.linear(cur, e, self.n_ff)  # build_ffn: up + bias, GELU, down + bias
            cur = dup(cur, "UNARY")
            cur = self.linear(cur, self.n_ff, e)
            inp_l = dup(inp_l, "ADD", cur)
        inp_l = self.norm(inp_l, e)  # v.post_ln
        embeddings = reshape(inp_l, e, n_pos, 1)

        # the resampler
        q = self.w((t, self.queries), F32, "resampler.query")
        v = mul_mat(self.mat(e, t, "resampler.kv.weight"), embeddings)
        q = self.norm(q, t)
        v = self.norm(v, t)
        omega_b = new((t // 4, n_pos, 1, 1), "REPEAT", (omega,))
        theta_x = dup(omega_b, "MUL", pos_w)
        theta_y = dup(omega_b, "MUL", pos_h)
        pos_x = new((t // 2, n_pos), "CONCAT", (dup(theta_x, "SIN"), dup(theta_x, "COS")))
        pos_y = new((t // 2, n_pos), "CONCAT", (dup(theta_y, "SIN"), dup(theta_y, "COS")))
        pos_embed = new((t, n_pos), "CONCAT", (pos_x, pos_y))
        k = dup(v, "ADD", pos_embed)
        heads = t // D_HEAD_RESAMPLER
        q_r = reshape(self.linear(q, t, t), D_HEAD_RESAMPLER, heads, self.queries)
        k_r = reshape(self.linear(k, t, t), D_HEAD_RESAMPLER, heads, n_pos)
        v_r = reshape(self.linear(v, t, t), D_HEAD_RESAMPLER, heads, n_pos)
        cur = self.attn(self.mat(t, t), self.vec(t), q_r, k_r, v_r)
        cur = self.norm(cur, t)  # resampler.ln_post
        cur = mul_mat(self.mat(t, t, "resampler.proj.weight"), cur)
        return self.gf.expand(cur)
