"""MiniCPM-V's vision projector (clip.projector_type `resampler`): the compute buffer clip allocates for
one encoded piece of an image, to the byte. Pure.

The graph (b11434: tools/mtmd/models/minicpmv.cpp clip_graph_minicpmv::build, with clip.cpp's build_inp,
build_vit, build_norm, build_ffn, build_attn and build_mm: shared/memory/clip_graph.py) is a SigLIP
encoder over the piece's n_pos patches (a patch_size convolution as im2col + mul_mat, learned positions
read by bucket with get_rows, LayerNorm blocks with biases, a GELU FFN, a post-norm), then the resampler:
`queries` learned queries (LayerNorm'd) cross-attend in heads of 128 to the patches projected to the text
width (resampler.kv, a LayerNorm, plus a sinusoidal 2-D position embedding built in the graph from the
omega / pos_w / pos_h inputs), then a LayerNorm and a square projection. Attention is ggml_flash_attn_ext
over f16 copies of K and V with flash attention on, else mul_mat + soft_max over the f32 scores (n_pos x
n_pos x n_head in the encoder, n_pos x queries x text/128 in the resampler) and a contiguous copy of V
transposed.

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

from shared.memory.clip_graph import ClipBuilder
from shared.memory.graph_alloc import F32, I32, Graph, dup, leaf, mul_mat, new, replay, reshape

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
    b = ClipBuilder(n_embd, n_ff, n_head, flash_attn)
    nx, ny = shape or (n_pos, 1)
    e, t, p = n_embd, text_embd, patch_size

    omega = leaf((t // 4,), F32, "omega", input=True)
    pos_h = leaf((1, n_pos), F32, "pos_h", input=True)
    pos_w = leaf((1, n_pos), F32, "pos_w", input=True)
    positions = leaf((n_pos,), I32, "positions", input=True)
    pos_table = b.w((e, POS_BUCKETS * POS_BUCKETS), F32, "v.position_embd.weight")
    learned_pos_embd = new((e, n_pos), "GET_ROWS", (pos_table, positions))

    cur = b.inp(nx * p, ny * p, p)  # build_inp, with the patch bias
    # build_vit: positions read by bucket, LayerNorm blocks, v.post_ln
    embeddings = b.vit(cur, n_pos, n_layer, learned_pos=learned_pos_embd, post_ln=True)

    # the resampler
    q = b.w((t, queries), F32, "resampler.query")
    v = mul_mat(b.mat(e, t, "resampler.kv.weight"), embeddings)
    q = b.norm(q, t)
    v = b.norm(v, t)
    omega_b = new((t // 4, n_pos, 1, 1), "REPEAT", (omega,))
    theta_x = dup(omega_b, "MUL", pos_w)
    theta_y = dup(omega_b, "MUL", pos_h)
    pos_x = new((t // 2, n_pos), "CONCAT", (dup(theta_x, "SIN"), dup(theta_x, "COS")))
    pos_y = new((t // 2, n_pos), "CONCAT", (dup(theta_y, "SIN"), dup(theta_y, "COS")))
    pos_embed = new((t, n_pos), "CONCAT", (pos_x, pos_y))
    k = dup(v, "ADD", pos_embed)
    heads = t // D_HEAD_RESAMPLER
    q_r = reshape(b.linear(q, t, t), D_HEAD_RESAMPLER, heads, queries)
    k_r = reshape(b.linear(k, t, t), D_HEAD_RESAMPLER, heads, n_pos)
    v_r = reshape(b.linear(v, t, t), D_HEAD_RESAMPLER, heads, n_pos)
    cur = b.attn(q_r, k_r, v_r)
    cur = b.norm(cur, t)  # resampler.ln_post
    cur = mul_mat(b.mat(t, t, "resampler.proj.weight"), cur)
    return b.gf.expand(cur)
