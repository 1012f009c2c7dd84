"""clip.cpp's graph helpers (tools/mtmd/clip.cpp, b11434) over graph_alloc tensors: the pieces every
projector graph module (shared/memory/*_graph.py) rebuilds its model's graph from. Pure.

A module replays ggml-alloc on the graph clip builds (shared/memory/graph_alloc.py), so what counts is
that each helper makes the same tensors (shapes, types, ops, sources in ggml's order) as clip.cpp's:

- `build_norm` (`norm`): ggml_norm or ggml_rms_norm, then the weight (MUL) and the bias (ADD), each
  optional, all in place on the norm's result;
- `build_mm` + bias (`linear`), `build_ffn` (`ffn`: up, an optional gate and its GLU, else the activation as
  a UNARY in place, down);
- `build_attn` (`attn`): Q, K and V ordered first (ggml_build_forward_order, which is why the order of the
  nodes, and so where freed blocks lie, is ggml's), then ggml_flash_attn_ext over f16 copies of K, V (and
  the mask) with flash attention on, else the f32 scores (mul_mat + soft_max) and V made contiguous
  transposed; the output matrix and its bias;
- `build_inp` (`inp`): the patch convolution (ggml_conv_2d: an im2col, f16 unless the kernel is bf16, a
  mul_mat, a contiguous permute), reshaped to [n_patches, n_embd], a contiguous transpose, the patch bias;
- `build_rope_2d` (`rope_2d`: two ROPE ops, the second in place on the first);
- `build_vit`'s loop (`block`, `vit`): one pre-norm block and the whole encoder with its learned positions,
  pre- and post-norms and Whisper's average pool, for the per-layer tensors a `Layer` says the file has;
- `build_patch_merge_permute` (`patch_merge_permute`, `pixel_shuffle`): the pixel shuffle of s x s patches.

Weights are leafs in the model's buffer (never allocated here): matrices f16, vectors f32; a graph input
(ggml_set_input) is a leaf the allocator places first (or, on a device, copies in).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.memory.graph_alloc import (
    F16,
    F32,
    DType,
    Graph,
    Tensor,
    cast,
    dup,
    leaf,
    mul_mat,
    new,
    permute,
    reshape,
    transpose,
    view,
)


@dataclass(frozen=True)
class Layer:
    """What a clip_layer has, as build_vit reads it: the norm type (NORM_TYPE_RMS: ggml_rms_norm), which
    biases exist (ln_1_b / ln_2_b, q_b and v_b, k_b, o_b, the FFN's), a fused QKV matrix (qkv_w, read through
    three views), a gated FFN (ff_gate_w: GLU of gate and up), and InternVL's layer scales (ls_1_w, ls_2_w)."""

    rms: bool = False
    norm_bias: bool = True
    qkv_bias: bool = True
    k_bias: bool = True
    out_bias: bool = True
    fused_qkv: bool = False
    gated: bool = False
    ffn_bias: bool = True
    layer_scale: bool = False


class ClipBuilder:
    """clip_graph's helpers for one graph (gf): n_embd wide blocks of n_head heads and an n_ff FFN, the
    per-layer tensors `layer` says, flash attention on or off."""

    def __init__(self, n_embd: int, n_ff: int, n_head: int, flash_attn: bool, layer: Layer = Layer()):
        self.n_embd, self.n_ff, self.n_head, self.fa, self.layer = n_embd, n_ff, n_head, flash_attn, layer
        self.gf = Graph()

    # weights: in the model's buffer, never allocated here
    @staticmethod
    def w(ne, dtype: DType = F32, name: str = "") -> Tensor:
        return leaf(ne, dtype, name, weight=True)

    def mat(self, cols, rows, name: str = "") -> Tensor:
        """An f16 matrix, ggml shape [cols, rows] (mul_mat maps cols to rows)."""
        return self.w((cols, rows), F16, name)

    def vec(self, n, name: str = "") -> Tensor:
        return self.w((n,), F32, name)

    # ops
    def norm(self, cur: Tensor, width, *, rms: bool = False, bias: bool = True) -> Tensor:
        """build_norm with a weight (and a bias): NORM or RMS_NORM, MUL, ADD."""
        cur = dup(cur, "RMS_NORM" if rms else "NORM")
        cur = dup(cur, "MUL", self.vec(width))
        return dup(cur, "ADD", self.vec(width)) if bias else cur

    def linear(self, cur: Tensor, cols, rows, *, bias: bool = True) -> Tensor:
        """build_mm (+ the bias, in place)."""
        cur = mul_mat(self.mat(cols, rows), cur)
        return dup(cur, "ADD", self.vec(rows)) if bias else cur

    def ffn(self, cur: Tensor, cols, hidden, rows, *, gated: bool = False, bias: bool = True) -> Tensor:
        """build_ffn: up (+ bias), with a gate (+ bias) the GLU of gate and up (the gate its src[0]), else the
        activation in place (GELU, SiLU...: a UNARY), then down (+ bias)."""
        tmp = self.linear(cur, cols, hidden, bias=bias)
        if gated:
            gate = self.linear(cur, cols, hidden, bias=bias)
            cur = new(gate.ne, "GLU", (gate, tmp))
        else:
            cur = dup(tmp, "UNARY")
        return self.linear(cur, hidden, rows, bias=bias)

    def attn(self, q_cur: Tensor, k_cur: Tensor, v_cur: Tensor, *, mask: Tensor | None = None,
             out_bias: bool = True) -> Tensor:  # fmt: skip
        """build_attn (no sinks), its output matrix square at the heads' width: q/k/v_cur are [d_head, n_head,
        n_tokens]; mask, the f32 [n_kv, n_q] kq_mask (an f16 copy of it with flash attention)."""
        for t in (q_cur, k_cur, v_cur):
            self.gf.expand(t)  # ggml_build_forward_order
        q = permute(q_cur, 0, 2, 1, 3)
        k = permute(k_cur, 0, 2, 1, 3)
        if self.fa:
            v = permute(v_cur, 0, 2, 1, 3)
            k = cast(k, F16)
            v = cast(v, F16)
            srcs = (q, k, v) if mask is None else (q, k, v, cast(mask, F16))
            cur = new((v.ne[0], q.ne[2], q.ne[1], q.ne[3]), "FLASH_ATTN_EXT", srcs)
            cur = reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            v = permute(v_cur, 1, 2, 0, 3)
            v = dup(v, "CONT")
            kq = mul_mat(k, q)
            kq = dup(kq, "SOFT_MAX", *(() if mask is None else (mask,)))
            kqv = mul_mat(v, kq)
            cur = permute(kqv, 0, 2, 1, 3)
            cur = new((cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3]), "CONT", (cur,))
        width = q_cur.ne[0] * q_cur.ne[1]
        return self.linear(cur, width, width, bias=out_bias)

    @staticmethod
    def conv_2d(kernel: Tensor, inp: Tensor, nx, ny, im2col_type: DType = F16) -> Tensor:
        """ggml_conv_2d with stride = the kernel's side, no padding: the im2col (f16, f32 for a bf16 kernel),
        a mul_mat, the result [nx, ny, OC] made contiguous."""
        kk = kernel.ne[0] * kernel.ne[1] * kernel.ne[2]
        im2col = new((kk, nx, ny, 1), "IM2COL", (kernel, inp), im2col_type)
        cur = mul_mat(reshape(im2col, kk, nx * ny), reshape(kernel, kk, kernel.ne[3]))
        cur = reshape(cur, nx, ny, 1, kernel.ne[3])
        return dup(permute(cur, 0, 1, 3, 2), "CONT")

    def inp(self, width_px, height_px, patch, *, bias: bool = True) -> Tensor:
        """build_inp for an image of width_px x height_px (inp_raw, f32, a graph input) in patches of patch
        pixels: [n_embd, n_patches] (+ v.patch_embd.bias)."""
        e, nx, ny = self.n_embd, width_px // patch, height_px // patch
        inp_raw = leaf((width_px, height_px, 3, 1), F32, "inp_raw", input=True)
        kernel = self.w((patch, patch, 3, e), F16, "v.patch_embd.weight")
        cur = self.conv_2d(kernel, inp_raw, nx, ny)
        cur = reshape(cur, nx * ny, e, 1)
        cur = dup(transpose(cur), "CONT")
        return dup(cur, "ADD", self.vec(e, "v.patch_embd.bias")) if bias else cur

    @staticmethod
    def rope_2d(cur: Tensor, pos_a: Tensor, pos_b: Tensor) -> Tensor:
        """build_rope_2d: ggml_rope_ext of the first half by pos_a, of the second by pos_b (in place)."""
        return dup(dup(cur, "ROPE", pos_a), "ROPE", pos_b)

    def block(self, inp_l: Tensor, n_pos, *, add_pos=None, mask: Tensor | None = None) -> Tensor:
        """One of build_vit's layers: the pre-attention norm, Q/K/V (separate, or views of a fused QKV),
        add_pos applied to Q then K, the attention, the layer scale, the residual, the pre-FFN norm, the FFN,
        the layer scale, the residual."""
        ly, e, n_head = self.layer, self.n_embd, self.n_head
        d_head = e // n_head
        cur = self.norm(inp_l, e, rms=ly.rms, bias=ly.norm_bias)
        if ly.fused_qkv:
            qkv = self.linear(cur, e, 3 * e, bias=ly.qkv_bias)
            nb = (4, 4 * d_head, qkv.nb[1], qkv.nb[1] * n_pos)
            q = view(qkv, "VIEW", (d_head, n_head, n_pos), nb)
            k = view(qkv, "VIEW", (d_head, n_head, n_pos), nb)
            v = view(qkv, "VIEW", (d_head, n_head, n_pos), nb)
        else:
            q = reshape(self.linear(cur, e, e, bias=ly.qkv_bias), d_head, n_head, n_pos)
            k = reshape(self.linear(cur, e, e, bias=ly.qkv_bias and ly.k_bias), d_head, n_head, n_pos)
            v = reshape(self.linear(cur, e, e, bias=ly.qkv_bias), d_head, n_head, n_pos)
        if add_pos is not None:
            q, k = add_pos(q), add_pos(k)
        cur = self.attn(q, k, v, mask=mask, out_bias=ly.out_bias)
        if ly.layer_scale:
            cur = dup(cur, "MUL", self.vec(e, "ls_1"))
        cur = dup(cur, "ADD", inp_l)
        inp_l = cur
        cur = self.norm(cur, e, rms=ly.rms, bias=ly.norm_bias)
        cur = self.ffn(cur, e, self.n_ff, e, gated=ly.gated, bias=ly.ffn_bias)
        if ly.layer_scale:
            cur = dup(cur, "MUL", self.vec(e, "ls_2"))
        return dup(inp_l, "ADD", cur)

    def vit(self, inp: Tensor, n_pos, n_layer: int, *, learned_pos: Tensor | None = None, pre_ln: bool = False,
            post_ln: bool = False, avgpool: bool = False, add_pos=None) -> Tensor:  # fmt: skip
        """build_vit over inp ([n_embd, n_pos]): the learned positions added, flattened to 2-D, the pre-norm,
        n_layer blocks, Whisper's average pool of 2, the post-norm; [n_embd, n_pos', 1]. The norms outside
        the blocks are the blocks' kind, with their biases."""
        e, ly = self.n_embd, self.layer
        if learned_pos is not None:
            inp = dup(inp, "ADD", learned_pos)
        inp_l = reshape(inp, e, n_pos)
        if pre_ln:
            inp_l = self.norm(inp_l, e, rms=ly.rms, bias=ly.norm_bias)
        for _ in range(n_layer):
            inp_l = self.block(inp_l, n_pos, add_pos=add_pos)
        if avgpool:  # clip-model.h audio_has_avgpool: transposed, pooled by 2, transposed back
            cur = dup(transpose(inp_l), "CONT")
            cur = new(((cur.ne[0] - 2) // 2 + 1, cur.ne[1]), "POOL_1D", (cur,))
            inp_l = dup(transpose(cur), "CONT")
        if post_ln:
            inp_l = self.norm(inp_l, e, rms=ly.rms, bias=ly.norm_bias)
        return reshape(inp_l, e, inp_l.ne[1], 1)

    @staticmethod
    def pixel_shuffle(cur: Tensor, nx, ny, s: int) -> Tensor:
        """The shuffle of s x s patches of [n_embd, nx, ny] (any view of it; nx and ny multiples of s): the
        reshape to [n_embd s, nx / s, ny], permuted, made contiguous [n_embd s^2, ny / s, nx / s], permuted
        back, made contiguous [n_embd s^2, nx ny / s^2] (internvl.cpp's, and build_patch_merge_permute's
        after its reshape and padding)."""
        e = cur.ne[0]
        cur = reshape(cur, e * s, nx // s, ny)
        cur = permute(cur, 0, 2, 1, 3)
        cur = new((e * s * s, ny // s, nx // s), "CONT", (cur,))
        cur = permute(cur, 0, 2, 1, 3)
        return new((cur.ne[0], cur.ne[1] * cur.ne[2]), "CONT", (cur,))

    def patch_merge_permute(self, cur: Tensor, nx, ny, s: int) -> Tensor:
        """build_patch_merge_permute: [n_embd, nx * ny] patches as [n_embd, nx, ny], padded with zeros to
        multiples of s (ggml_pad), then pixel_shuffle."""
        e = cur.ne[0]
        cur = reshape(cur, e, nx, ny)
        px, py = -nx % s, -ny % s
        if px or py:
            cur = new((e, nx + px, ny + py), "PAD", (cur,))
        return self.pixel_shuffle(cur, nx + px, ny + py, s)
