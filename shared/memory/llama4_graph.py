"""Llama 4's vision projector (clip.projector_type `llama4`): the compute buffer clip allocates for its warm-up
image, to the byte. Pure.

The graph (b11434: tools/mtmd/models/llama4.cpp clip_graph_llama4::build, with clip.cpp's build_vit,
build_rope_2d, build_norm, build_ffn, build_attn and build_mm: shared/memory/clip_graph.py) over P^2 patches
(P = image_size / patch_size) and a class token:

- Llama4UnfoldConvolution: an f32 im2col of the image ([3 patch^2, P, P], the image's own type) and a
  mul_mat with v.patch_embd ([3 patch^2, n_embd]); the class token concatenated after the patches.
- build_vit: learned positions added, then n_layer blocks (LayerNorms with biases, Q/K/V/O with biases,
  a biased GELU FFN), Q and K each rotated by build_rope_2d (two ROPE ops: the first half of each head by
  the i32 pos_w input, the second by pos_h; the second runs in place on the first). The tiny projectors
  (tests/tinyprojectors.py) and this model have no pre- or post-norm; pre_ln / post_ln add them (Llama
  4's own files carry both).
- The class token dropped (a view of the first P^2 rows), a merge x merge pixel shuffle (a permuted
  reshape made contiguous, then a contiguous copy to [n_embd merge^2, P^2 / merge^2]), Llama4VisionMLP2
  (mm.model.mlp.1 to n_ff, GELU, mm.model.mlp.2 to the text width, GELU, no biases), then mm.model.fc.

Attention is build_attn's (flash attention: ggml_flash_attn_ext over f16 copies of K and V; else the f32
scores and soft_max), in ggml's build order; this module builds the tensors in that order and replays
ggml-alloc on them (shared/memory/graph_alloc.py). The warm-up image is clip.vision.image_size a side
(clip.cpp load_hparams: warmup_image_size = image_size; llama4 does not override it) and every image is
cut into tiles of that size (llava_uhd slices, each encoded alone) plus an overview of the same size, so
the warm-up's buffer is the buffer: an image never grows it (measured, tests/test_llava_graph.py). With
--no-mmproj-offload the buffer is the CPU's, inputs (pos_h, pos_w, inp_raw) leafs allocated first; on a
device the scheduler's copies of them are the split's first nodes (offload=True): the same size on every
shape tried.

Measured (tests/llama_figures.json's 9 llama4 figures, and 18 RPC-device figures in tests/test_llava_graph.py's
MEASURED): byte-exact on all, 1 to 4 blocks, merge 2, 3, 4 and 7, flash attention on and off, with and without
the pre- and post-norms (which move the peak either way: 256 wide, merge 4, both norms need 1,049,600 bytes
less). A call takes about 1 ms (Llama 4's 34 blocks: about 6 ms); results are cached by their arguments.
"""

from __future__ import annotations

from functools import lru_cache

from shared.memory.clip_graph import ClipBuilder
from shared.memory.graph_alloc import F32, I32, Graph, dup, leaf, mul_mat, new, permute, replay, reshape, view


def llama4_compute_bytes(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, image_size: int, patch_size: int,
                         merge: int, text_embd: int, flash_attn: bool, offload: bool = False, pre_ln: bool = False,
                         post_ln: bool = False) -> int:  # fmt: skip
    """The compute buffer (bytes) clip allocates for Llama 4's warm-up image (image_size a side), the CPU's
    (--no-mmproj-offload) or, offload=True, a device's. 0 without patches. Raises ValueError on shapes clip's
    graph cannot build (n_embd not split into n_head heads, heads not even for RoPE-2D, patches a side not a
    multiple of merge)."""
    if patch_size <= 0 or image_size < patch_size:
        return 0
    side = image_size // patch_size
    if n_head <= 0 or n_embd % n_head or (n_embd // n_head) % 2 or merge <= 0 or side % merge:
        raise ValueError(f"llama4 widths: n_embd {n_embd} over {n_head} heads, {side} patches a side "
                         f"merged by {merge}")  # fmt: skip
    return _bytes(n_embd, n_ff, n_head, n_layer, image_size, patch_size, merge, text_embd, bool(flash_attn),
                  bool(offload), bool(pre_ln), bool(post_ln))  # fmt: skip


@lru_cache(maxsize=4096)
def _bytes(n_embd, n_ff, n_head, n_layer, image_size, patch_size, merge, text_embd, flash_attn, offload, pre_ln,
           post_ln) -> int:  # fmt: skip
    graph = build_graph(n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer, image_size=image_size,
                        patch_size=patch_size, merge=merge, text_embd=text_embd, flash_attn=flash_attn,
                        pre_ln=pre_ln, post_ln=post_ln)  # fmt: skip
    return replay(graph, offload_inputs=offload).size


def build_graph(*, n_embd: int, n_ff: int, n_head: int, n_layer: int, image_size: int, patch_size: int, merge: int,
                text_embd: int, flash_attn: bool, pre_ln: bool = False, post_ln: bool = False) -> Graph:  # fmt: skip
    """clip_graph_llama4::build for one image of image_size a side."""
    b = ClipBuilder(n_embd, n_ff, n_head, flash_attn)
    p, e, s = patch_size, n_embd, merge
    nx = ny = image_size // p
    n_patches = nx * ny
    n_pos = n_patches + 1  # the class token

    pos_h = leaf((n_pos,), I32, "pos_h", input=True)
    pos_w = leaf((n_pos,), I32, "pos_w", input=True)
    inp_raw = leaf((image_size, image_size, 3, 1), F32, "inp_raw", input=True)

    # Llama4UnfoldConvolution: an im2col in the image's type (f32), then the linear patch embedding
    patch_w = b.mat(3 * p * p, e, "v.patch_embd.weight")
    kernel = reshape(patch_w, p, p, 3, e)
    im2col = new((3 * p * p, nx, ny, 1), "IM2COL", (kernel, inp_raw), F32)
    cur = reshape(mul_mat(patch_w, im2col), e, n_patches)
    cur = new((e, n_pos, 1, 1), "CONCAT", (cur, b.vec(e, "v.class_embd")))

    # build_vit, Q and K rotated by build_rope_2d (the first half by pos_w, the second by pos_h)
    learned_pos = b.w((e, n_pos), F32, "v.position_embd.weight")
    cur = b.vit(cur, n_pos, n_layer, learned_pos=learned_pos, pre_ln=pre_ln, post_ln=post_ln,
                add_pos=lambda t: b.rope_2d(t, pos_w, pos_h))  # fmt: skip

    # drop the class token, pixel shuffle
    cur = view(cur, "VIEW", (e, n_patches), (4, 4 * e, 4 * e * n_patches, 4 * e * n_patches))
    cur = reshape(cur, e * s, nx // s, ny, 1)
    cur = permute(cur, 0, 2, 1, 3)
    cur = new((e * s * s, nx // s, ny // s, 1), "CONT", (cur,))
    cur = new((e * s * s, n_patches // (s * s)), "CONT", (cur,))

    # Llama4VisionMLP2 (GELU after each, no biases), then the projector
    cur = dup(mul_mat(b.mat(e * s * s, n_ff, "mm.model.mlp.1.weight"), cur), "UNARY")
    cur = dup(mul_mat(b.mat(n_ff, text_embd, "mm.model.mlp.2.weight"), cur), "UNARY")
    cur = mul_mat(b.mat(text_embd, text_embd, "mm.model.fc.weight"), cur)
    return b.gf.expand(cur)
