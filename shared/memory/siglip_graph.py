"""SigLIP-style vision projectors (clip.projector_type `gemma3`, `idefics3`, `internvl`): the compute buffer
clip allocates for its warm-up image, to the byte. Pure.

The graphs (b11434: tools/mtmd/models/siglip.cpp clip_graph_siglip::build for gemma3 and idefics3,
models/internvl.cpp clip_graph_internvl::build, with clip.cpp's build_inp, build_vit, build_norm, build_ffn,
build_attn, build_mm and build_patch_merge_permute: shared/memory/clip_graph.py) over P^2 patches (P =
image_size / patch_size):

- the encoder: the patch convolution and its bias (build_inp), learned positions added, n_layer pre-norm
  blocks (LayerNorms with biases, Q/K/V/O with biases, a biased GELU FFN); InternVL first concatenates a
  class token after the patches (a REPEAT of v.class_embd, then CONCAT: P^2 + 1 positions) and scales
  each block's attention and FFN outputs (ls1, ls2); gemma3 and idefics3 end with the post-norm;
- gemma3: the patches transposed into a P x P x n_embd image (a contiguous copy), an average pool of
  merge x merge (ggml_pool_2d; merge is clip.vision.projector.scale_factor, 4 unless the file says), a
  contiguous transpose back, RMS norm times mm.soft_emb_norm, and mm.input_projection, which clip
  transposes and copies (ggml_cont of an f16 [n_embd, text] copy of the weight) at run time: that copy is
  the first node ggml visits at the final expand, so it is allocated before the last block's attention
  and lives to the end;
- idefics3: the pixel shuffle of merge x merge patches (build_patch_merge_permute), then mm.model.fc;
- internvl: the class token dropped (a view, made contiguous), the same pixel shuffle, then LayerNorm
  (mm.model.mlp.0), mm.model.mlp.1 + bias, GELU, mm.model.mlp.3 + bias. The 6B ViT (n_embd 3200, 45
  blocks) switches to RMS norms, as clip does on those two numbers (its Q/K norms, where a file has
  them, are not replayed).

Attention is ggml_flash_attn_ext over f16 copies of K and V with flash attention on, else mul_mat +
soft_max over the f32 scores (n_pos^2 x n_head) and a contiguous copy of V transposed. This module builds
those tensors in ggml's order (build_attn's ggml_build_forward_order of Q, K and V first) and replays
ggml-alloc on them (shared/memory/graph_alloc.py). The warm-up image is clip.vision.image_size a side
(clip.cpp load_hparams: warmup_image_size = image_size; none of the three overrides it), and every image is
resized (gemma3) or sliced (idefics3, internvl: tiles of that size) to it, so the warm-up's buffer is the
buffer. With --no-mmproj-offload it is the CPU's (inp_raw a leaf allocated first); on a device the
scheduler's copy of inp_raw is the split's first node: the same size on every shape measured.

Measured (tests/llama_figures.json's 51 gemma3, idefics3 and internvl figures, printed MiB, and 26 RPC-device
buffers in tests/test_siglip_graph.py's MEASURED, exact bytes, the b11434 binaries): exact on all, flash
attention on and off, Gemma 3's own encoder (1,152 wide, 16 heads, 896 px) at 1 and 2 blocks among them
(replayed at its 27: 121.25 MiB with flash attention, as at 2, and 1,132 MiB without, as at 1). projector.py's
closed forms (the largest of a few sums of live tensors) are exact on most shapes but not on all: where the
allocator packs the input projection's copy, the pooled or shuffled tensors and the FFN's activations among
freed blocks, a shape can need up to about 14 MiB more than the sums (measured: gemma3 1,152 wide at 448 px with
a 4,096-wide text model, flash attention, 48.31 MiB against 34.81), hence the replay. A call builds and replays
the graph in under 1 ms for a few blocks (Gemma 3's 27: about 5 to 10 ms); results are cached by their
arguments.
"""

from __future__ import annotations

from functools import lru_cache

from shared.memory.clip_graph import ClipBuilder, Layer
from shared.memory.graph_alloc import F16, F32, Graph, dup, mul_mat, new, replay, reshape, transpose, view

SIGLIP_TYPES = ("gemma3", "idefics3", "internvl")
INTERNVL_6B = (3200, 45)  # internvl.cpp: the 6B ViT (n_embd, n_layer) uses RMS norms


def siglip_compute_bytes(*, proj_type: str, n_embd: int, n_ff: int, n_head: int, n_layer: int, image_size: int,
                         patch_size: int, merge: int, text_embd: int, flash_attn: bool) -> int:  # fmt: skip
    """The compute buffer (bytes) clip allocates for the warm-up image (image_size a side) of a gemma3,
    idefics3 or internvl projector: the CPU's with --no-mmproj-offload, a device's when offloaded (the
    same). merge: clip.vision.projector.scale_factor (gemma3's pool kernel, 4 by default; the others' pixel
    shuffle). 0 without patches. Raises ValueError on a type or shapes clip's graph cannot build."""
    if proj_type not in SIGLIP_TYPES:
        raise ValueError(f"projector type {proj_type!r}: one of {SIGLIP_TYPES}")
    if patch_size <= 0 or image_size < patch_size:
        return 0
    side = image_size // patch_size
    if n_head <= 0 or n_embd % n_head or merge <= 0:
        raise ValueError(f"{proj_type} widths: n_embd {n_embd} over {n_head} heads, merge {merge}")
    if proj_type == "internvl" and side % merge:  # internvl.cpp reshapes without padding
        raise ValueError(f"internvl: {side} patches a side do not shuffle by {merge}")
    return _bytes(proj_type, n_embd, n_ff, n_head, n_layer, image_size, patch_size, merge, text_embd,
                  bool(flash_attn))  # fmt: skip


@lru_cache(maxsize=4096)
def _bytes(proj_type, n_embd, n_ff, n_head, n_layer, image_size, patch_size, merge, text_embd, flash_attn) -> int:
    return replay(build_graph(proj_type=proj_type, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_layer=n_layer,
                              image_size=image_size, patch_size=patch_size, merge=merge, text_embd=text_embd,
                              flash_attn=flash_attn)).size  # fmt: skip


def build_graph(*, proj_type: str, n_embd: int, n_ff: int, n_head: int, n_layer: int, image_size: int,
                patch_size: int, merge: int, text_embd: int, flash_attn: bool) -> Graph:  # fmt: skip
    """clip_graph_siglip::build (gemma3, idefics3) or clip_graph_internvl::build for one image of image_size
    a side."""
    internvl = proj_type == "internvl"
    layer = Layer(rms=internvl and (n_embd, n_layer) == INTERNVL_6B, layer_scale=internvl)
    b = ClipBuilder(n_embd, n_ff, n_head, flash_attn, layer)
    side = image_size // patch_size
    n_patches, e, s, t = side * side, n_embd, merge, text_embd
    cur = b.inp(image_size, image_size, patch_size)  # build_inp, with the patch bias

    if internvl:
        n_pos = n_patches + 1
        cls = new((e, 1, 1, 1), "REPEAT", (b.vec(e, "v.class_embd"),))  # ggml_repeat_4d
        cur = new((e, n_pos, 1, 1), "CONCAT", (cur, cls))
        cur = b.vit(cur, n_pos, n_layer, learned_pos=b.w((e, n_pos), F32, "v.position_embd.weight"))
        cur = view(cur, "VIEW", (e, n_patches, 1), (4, cur.nb[1], cur.nb[2], cur.nb[3]))  # the class token dropped
        cur = dup(cur, "CONT")
        cur = b.pixel_shuffle(cur, side, side, s)
        cur = b.norm(cur, e * s * s)  # mm.model.mlp.0
        cur = b.ffn(cur, e * s * s, t, t)  # mm.model.mlp.1 + bias, GELU, mm.model.mlp.3 + bias
        return b.gf.expand(cur)

    cur = b.vit(cur, n_patches, n_layer, learned_pos=b.w((e, n_patches), F32, "v.position_embd.weight"),
                post_ln=True)  # fmt: skip
    if proj_type == "idefics3":
        cur = b.patch_merge_permute(cur, side, side, s)
        cur = mul_mat(b.mat(e * s * s, t, "mm.model.fc.weight"), cur)
        return b.gf.expand(cur)

    # gemma3: average pool of s x s patches, RMS norm, the input projection (its transpose copied)
    cur = new((side, side, e, 1), "CONT", (transpose(cur),))
    pooled = (side - s) // s + 1
    cur = new((pooled, pooled, e, 1), "POOL_2D", (cur,))
    cur = reshape(cur, pooled * pooled, e, 1)
    cur = dup(transpose(cur), "CONT")
    cur = b.norm(cur, e, rms=True, bias=False)  # ggml_rms_norm, mm.soft_emb_norm
    proj = b.w((t, e), F16, "mm.input_projection.weight")
    proj = new((e, t), "CONT", (transpose(proj),), F16)
    cur = mul_mat(proj, cur)
    return b.gf.expand(cur)
