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

clip.cpp's helpers (build_inp, build_norm, build_mm + bias, build_attn, build_ffn, a block of build_vit's) are
shared/memory/clip_graph.py's ClipBuilder.
"""

from __future__ import annotations

from functools import lru_cache

from shared.memory.clip_graph import ClipBuilder
from shared.memory.graph_alloc import F32, I32, Graph, dup, leaf, new, replay, reshape


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
    """clip_graph_llava::build (type mlp) for one image of image_size a side: its own loop, not build_vit's
    (no flattening reshape, the blocks to the second-to-last)."""
    b = ClipBuilder(n_embd, n_ff, n_head, flash_attn)
    n_patches = (image_size // patch_size) ** 2
    n_pos = n_patches + 1  # the class token
    e = n_embd

    cur = b.inp(image_size, image_size, patch_size)  # build_inp, with the patch bias
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
    cur = b.ffn(cur, e, text_embd, text_embd)  # mm.0 + bias, GELU, mm.2 + bias
    return b.gf.expand(cur)
