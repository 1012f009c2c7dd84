"""Gemma 3n's vision projector (clip.projector_type / clip.vision.projector_type `gemma3nv`): the compute
buffer clip reserves for its warm-up graph. Pure (mobilenet_facts reads a file).

The graph (tools/mtmd/models/mobilenetv5.cpp, clip_graph_mobilenetv5::build, b11434) is MobileNetV5: a
3x3 stride-2 stem, four stages of edge-residual (v.blk.S.I.conv_exp), universal-inverted-residual
(dw_start / pw_exp / dw_mid / pw_proj) and multi-query attention blocks (attn.query/key/value), the
multi-scale fusion adapter (v.msfa.*) over the outputs of stages 2 and 3, and Gemma 3n's embedder
(mm.soft_emb_norm, mm.input_projection). It has no closed form worth fitting: over 2,500 nodes, nearly
all of them 4-D activations at up to half the image's resolution, and the peak moves between blocks
with the widths. So this module builds the same graph, tensor by tensor with ggml's shapes and types,
in the order ggml_build_forward_expand visits it (ggml.c ggml_visit_parents_graph: depth first,
sources left to right), and replays ggml-alloc's graph allocator on it (shared/memory/graph_alloc.py:
ggml-alloc.c ggml_gallocr_alloc_graph_impl and ggml_dyn_tallocr_alloc/free_bytes: 32-byte alignment on
the CPU buffer, best fit among freed blocks, in-place reuse of a parent's memory by ADD, MUL, SCALE,
RMS_NORM, UNARY and SOFT_MAX when the parent is this node's only child and has the same layout, views never
allocated and their source freed with the last of them). The buffer is that allocator's high-water
mark, which is what `reserve_compute_meta: CPU compute buffer size` prints (clip.cpp
reserve_compute_meta, one split on the CPU). Every image is resized to clip.vision.image_size
(mtmd.cpp: mtmd_image_preprocessor_fixed_size for PROJECTOR_TYPE_GEMMA3NV), so the warm-up's buffer is
every image's; flash attention does not enter the graph (its attention is mul_mat + soft_max).

Where the peak is (tests/gemma3n_figures.json: byte-exact on all 11 recorded shapes, the replay's
high-water mark equal to the RPC device's allocation; S = image side, mid = stage 1's first block's
expanded width, pw_exp's ne[3]; k = its dw_mid kernel, 5):
- MobileNetV5-300M's widths and down to 1/8 of them: stage 1's first block (mobilenetv5.cpp:118-119,
  build_inverted_residual: dw_mid with stride 2 on the expanded channels). The expansion's output
  (pw_exp -> rms_norm_2d -> gelu, line 108, in place: (S/4)^2 x mid f32) has one child, the
  same-padding's copy (ggml_pad_ext: (S/4+3)^2 x mid f32), so it is freed once the copy exists, but
  ggml_conv_2d_dw's im2col (ggml.c ggml_conv_2d_dw: k*k x (S/8)^2 x mid, f16), too large for that hole,
  lands above the copy: mid x (4 (S/4)^2 + 4 (S/4+3)^2 + 2 k^2 (S/8)^2) bytes, 556.9 MiB at the real
  widths (mid 768, S 768: 113 + 117 + 354 MB, 583,953,408 bytes).
- Narrower blocks (1/16): stage 2's attention scores (line 218, ggml_mul_mat(k, q), then scale and
  soft_max in place, line 222): (S/16)^2 queries x (S/32)^2 keys (key/value stride 2) x 12 heads f32,
  which do not shrink with the widths, above the residual, q and k/v copies and the holes below them.
- A text width large against the blocks (MSFA output 4096 over 1/16 widths, or 2048 over 1/32):
  the fusion adapter's projection (line 359, pw_proj to the vision width at S/16 a side, f32) and
  rms_norm_2d's contiguous copy of it (line 363; lines 9 and 17 of the helper), side by side.
The offsets each lands at are the allocator's (freed blocks left where they were), hence the replay
rather than a sum: the graph's 2,503 nodes (as clip.cpp prints, `graph splits = 1, nodes = 2503`)
replay in about 0.1 s.

Facts read from the file (mobilenet_facts): clip.vision.image_size, and the ggml shape of every v.*
and mm.* tensor by name (the stem, each v.blk.S.I.* block's convolutions, norms and layer scale,
v.msfa.*, mm.soft_emb_norm, mm.input_projection: which exist decides the blocks and their kinds, as
clip.cpp's loader does, lines 2669-2760) and their ggml types (a BF16 depthwise kernel unrolls to f32
instead of f16).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.memory.graph_alloc import F16, F32, Tensor, leaf, new, order, permute, replay, reshape
from shared.memory.graph_alloc import dup as _dup
from shared.memory.graph_alloc import mul_mat as _mul_mat

GGML_TYPE_BF16 = 30
TARGET_OUT_RES = 16  # mobilenetv5.cpp: the MSFA's output resolution


@dataclass(frozen=True)
class MobileNetFacts:
    """What the compute buffer depends on: the image side (clip.vision.image_size) and the shapes (ggml
    order, ne) and ggml types of the graph's tensors (v.* and mm.*) by name."""

    image_size: int
    shapes: Mapping[str, tuple[int, ...]]
    types: Mapping[str, int] = field(default_factory=dict)


def mobilenet_facts(path) -> MobileNetFacts:
    """Read a gemma3nv projector's image size and tensor shapes with the gguf package."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    image = reader.get_field("clip.vision.image_size")
    image_size = int(image.parts[image.data[0]][0]) if image is not None else 0
    shapes, types = {}, {}
    for t in reader.tensors:
        if t.name.startswith(("v.", "mm.")):
            shapes[t.name] = tuple(int(n) for n in t.shape)  # ggml order (ne0 first)
            types[t.name] = int(t.tensor_type)
    return MobileNetFacts(image_size=image_size, shapes=shapes, types=types)


def mobilenet_compute_bytes(facts: MobileNetFacts) -> int:
    """The CPU compute buffer clip reserves for the gemma3nv warm-up graph, in bytes (0 without an image
    size or a block)."""
    if facts.image_size <= 0 or not _Graph(facts).blocks()[0]:
        return 0
    return _replay(facts)[0]


def mobilenet_peak(facts: MobileNetFacts) -> tuple[int, list[tuple[str, int, int]]]:
    """The buffer, and the tensors live (name, offset, bytes) when the allocator last grew it."""
    return _replay(facts)


def _conv_out(size, k, s, p, d=1):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


class _Graph:
    """clip_graph_mobilenetv5::build over the facts' tensors."""

    def __init__(self, facts: MobileNetFacts):
        self.shapes, self.types = facts.shapes, facts.types
        self.weights: dict[str, Tensor] = {}
        self.image_size = facts.image_size

    def w(self, name):
        if name not in self.shapes:
            return None
        if name not in self.weights:
            ty = self.types.get(name, 1)
            dtype = F16 if ty in (1, GGML_TYPE_BF16) else F32
            self.weights[name] = leaf(self.shapes[name], dtype, name, weight=True)
        return self.weights[name]

    # ggml ops
    def conv_2d_direct(self, k, x, s, p):
        ne = (_conv_out(x.ne[0], k.ne[0], s, p), _conv_out(x.ne[1], k.ne[1], s, p), k.ne[3], x.ne[3])
        return new(ne, "CONV_2D", (k, x), x.type)

    def conv_2d_dw(self, k, x, s, p):
        new_a = reshape(k, k.ne[0], k.ne[1], 1, k.ne[2] * k.ne[3])
        xb = reshape(x, x.ne[0], x.ne[1], 1, x.ne[2] * x.ne[3])
        ow, oh = _conv_out(xb.ne[0], new_a.ne[0], s, p), _conv_out(xb.ne[1], new_a.ne[1], s, p)
        bf16 = self.types.get(k.name) == GGML_TYPE_BF16
        kk = new_a.ne[2] * new_a.ne[1] * new_a.ne[0]
        im2col = new((kk, ow, oh, xb.ne[3]), "IM2COL", (new_a, xb), F32 if bf16 else F16)
        new_b = reshape(im2col, im2col.ne[0], im2col.ne[2] * im2col.ne[1], x.ne[2], x.ne[3])
        new_a = reshape(new_a, new_a.ne[0] * new_a.ne[1], new_a.ne[2], new_a.ne[3], 1)
        result = self.mul_mat(new_a, new_b)
        return reshape(result, im2col.ne[1], im2col.ne[2], x.ne[2], x.ne[3])

    mul_mat = staticmethod(_mul_mat)

    @staticmethod
    def pad_same(x, k, s):
        ih, iw = x.ne[1], x.ne[0]
        oh, ow = (ih + s - 1) // s, (iw + s - 1) // s
        pad_h = max(0, (oh - 1) * s + (k - 1) + 1 - ih)
        pad_w = max(0, (ow - 1) * s + (k - 1) + 1 - iw)
        if pad_h > 0 or pad_w > 0:
            return new((x.ne[0] + pad_w, x.ne[1] + pad_h, x.ne[2], x.ne[3]), "PAD", (x,), x.type)
        return x

    def rms_norm_2d(self, x, weight):
        cur = _dup(permute(x, 2, 1, 0, 3), "CONT")
        cur = _dup(cur, "RMS_NORM")
        if weight is not None:
            cur = _dup(cur, "MUL", weight)
        return _dup(permute(cur, 2, 1, 0, 3), "CONT")

    # blocks
    def edge_residual(self, inp, p, stride):
        cur = inp
        if stride == 2:
            cur = self.pad_same(cur, 3, stride)
            cur = self.conv_2d_direct(self.w(f"{p}.conv_exp.weight"), cur, stride, 0)
        else:
            cur = self.conv_2d_direct(self.w(f"{p}.conv_exp.weight"), cur, stride, 1)
        if self.w(f"{p}.bn1.weight"):
            cur = self.rms_norm_2d(cur, self.w(f"{p}.bn1.weight"))
        cur = _dup(cur, "UNARY")
        cur = self.conv_2d_direct(self.w(f"{p}.conv_pwl.weight"), cur, 1, 0)
        if self.w(f"{p}.bn2.weight"):
            cur = self.rms_norm_2d(cur, self.w(f"{p}.bn2.weight"))
        if stride == 1 and inp.ne[2] == cur.ne[2] and inp.ne[0] == cur.ne[0]:
            cur = _dup(cur, "ADD", inp)
        return cur

    def inverted_residual(self, inp, p, stride):
        cur = inp
        if (dw := self.w(f"{p}.dw_start.conv.weight")) is not None:
            cur = self.conv_2d_dw(dw, cur, 1, dw.ne[0] // 2)
            if self.w(f"{p}.dw_start.bn.weight"):
                cur = self.rms_norm_2d(cur, self.w(f"{p}.dw_start.bn.weight"))
        if (pw := self.w(f"{p}.pw_exp.conv.weight")) is not None:
            cur = self.conv_2d_direct(pw, cur, 1, 0)
            if self.w(f"{p}.pw_exp.bn.weight"):
                cur = self.rms_norm_2d(cur, self.w(f"{p}.pw_exp.bn.weight"))
            cur = _dup(cur, "UNARY")
        if (dw := self.w(f"{p}.dw_mid.conv.weight")) is not None:
            k = dw.ne[0]
            if stride > 1:
                cur = self.pad_same(cur, k, stride)
                cur = self.conv_2d_dw(dw, cur, stride, 0)
            else:
                cur = self.conv_2d_dw(dw, cur, stride, k // 2)
            if self.w(f"{p}.dw_mid.bn.weight"):
                cur = self.rms_norm_2d(cur, self.w(f"{p}.dw_mid.bn.weight"))
            cur = _dup(cur, "UNARY")
        if (pw := self.w(f"{p}.pw_proj.conv.weight")) is not None:
            cur = self.conv_2d_direct(pw, cur, 1, 0)
            if self.w(f"{p}.pw_proj.bn.weight"):
                cur = self.rms_norm_2d(cur, self.w(f"{p}.pw_proj.bn.weight"))
        if (ls := self.w(f"{p}.layer_scale.gamma")) is not None:
            cur = _dup(cur, "MUL", ls)
        if inp.ne[0] == cur.ne[0] and inp.ne[1] == cur.ne[1] and inp.ne[2] == cur.ne[2]:
            cur = _dup(cur, "ADD", inp)
        return cur

    def attention(self, inp, p):
        cur = inp
        if (nw := self.w(f"{p}.norm.weight")) is not None:
            cur = self.rms_norm_2d(cur, nw)
        q = self.conv_2d_direct(self.w(f"{p}.attn.query.proj.weight"), cur, 1, 0)
        kv = []
        for part in ("key", "value"):
            x = cur
            if (dw := self.w(f"{p}.attn.{part}.down_conv.weight")) is not None:
                x = self.pad_same(cur, dw.ne[0], 2)
                x = self.conv_2d_dw(dw, x, 2, 0)
                if (n := self.w(f"{p}.attn.{part}.norm.weight")) is not None:
                    x = self.rms_norm_2d(x, n)
            kv.append(self.conv_2d_direct(self.w(f"{p}.attn.{part}.proj.weight"), x, 1, 0))
        k, v = kv
        W, H, B = cur.ne[0], cur.ne[1], cur.ne[3]
        D = k.ne[2]
        n_head = q.ne[2] // D
        N = W * H
        q = reshape(reshape(q, N, D * n_head, B), N, D, n_head, B)
        q = _dup(permute(q, 1, 0, 2, 3), "CONT")
        M = k.ne[0] * k.ne[1]
        k = reshape(reshape(k, M, D, B), M, D, 1, B)
        k = _dup(permute(k, 1, 0, 2, 3), "CONT")
        v = reshape(reshape(v, M, D, B), M, D, 1, B)
        v = _dup(v, "CONT")
        scores = self.mul_mat(k, q)
        scores = _dup(scores, "SCALE")
        scores = _dup(scores, "SOFT_MAX")
        kqv = self.mul_mat(v, scores)
        kqv = _dup(permute(kqv, 1, 0, 2, 3), "CONT")
        kqv = reshape(reshape(kqv, N, D * n_head, B), W, H, D * n_head, B)
        kqv = _dup(kqv, "CONT")
        cur = self.conv_2d_direct(self.w(f"{p}.attn.output.proj.weight"), kqv, 1, 0)
        if inp.ne[0] == cur.ne[0] and inp.ne[2] == cur.ne[2]:
            if (ls := self.w(f"{p}.layer_scale.gamma")) is not None:
                cur = _dup(cur, "MUL", ls)
            cur = _dup(cur, "ADD", inp)
        return cur

    def blocks(self) -> tuple[list[tuple[str, str]], list[int]]:
        """(prefix, kind) of each block, stage by stage as clip.cpp's loader finds them, and the stage ends."""
        out, ends = [], []
        for stage in range(4):
            found = 0
            for i in range(10**6):
                p = f"v.blk.{stage}.{i}"
                if f"{p}.conv_exp.weight" in self.shapes:
                    kind = "er"
                elif f"{p}.attn.query.proj.weight" in self.shapes:
                    kind = "mqa"
                elif f"{p}.dw_start.conv.weight" in self.shapes or f"{p}.pw_exp.conv.weight" in self.shapes:
                    kind = "uir"
                else:
                    break
                out.append((p, kind))
                found += 1
            if found:
                ends.append(len(out) - 1)
        return out, ends

    def build(self) -> Tensor:
        s = self.image_size
        inp = leaf((s, s, 3, 1), F32, "inp_raw", input=True)
        cur = self.pad_same(inp, 3, 2)
        cur = self.conv_2d_direct(self.w("v.conv_stem.conv.weight"), cur, 2, 0)
        if (b := self.w("v.conv_stem.conv.bias")) is not None:
            cur = _dup(cur, "ADD", b)
        if (n := self.w("v.conv_stem.bn.weight")) is not None:
            cur = self.rms_norm_2d(cur, n)
        cur = _dup(cur, "UNARY")

        blocks, ends = self.blocks()
        starts = {0} | {e + 1 for e in ends}
        fusion = {ends[2], ends[3]} if len(ends) >= 4 else {len(blocks) - 1}
        feats = []
        for i, (p, kind) in enumerate(blocks):
            stride = 2 if i in starts else 1
            if kind == "er":
                cur = self.edge_residual(cur, p, stride)
            elif kind == "mqa":
                cur = self.attention(cur, p)
            else:
                cur = self.inverted_residual(cur, p, stride)
            if i in fusion:
                feats.append(cur)

        if feats:
            hw, hh = feats[0].ne[0], feats[0].ne[1]
            resized = []
            for f in feats:
                if f.ne[0] < hw or f.ne[1] < hh:
                    sc = hw // f.ne[0]
                    f = new((f.ne[0] * sc, f.ne[1] * sc, f.ne[2], f.ne[3]), "UPSCALE", (f,))
                resized.append(f)
            cur = resized[0]
            for f in resized[1:]:
                cur = new((cur.ne[0], cur.ne[1], cur.ne[2] + f.ne[2], cur.ne[3]), "CONCAT", (cur, f), cur.type)
            if (e := self.w("v.msfa.ffn.pw_exp.conv.weight")) is not None:
                cur = self.conv_2d_direct(e, cur, 1, 0)
                if (n := self.w("v.msfa.ffn.pw_exp.bn.weight")) is not None:
                    cur = self.rms_norm_2d(cur, n)
                cur = _dup(cur, "UNARY")
            if (pw := self.w("v.msfa.ffn.pw_proj.conv.weight")) is not None:
                cur = self.conv_2d_direct(pw, cur, 1, 0)
                if (n := self.w("v.msfa.ffn.pw_proj.bn.weight")) is not None:
                    cur = self.rms_norm_2d(cur, n)
            if cur.ne[0] > TARGET_OUT_RES:
                k = cur.ne[0] // TARGET_OUT_RES
                pooled = ((cur.ne[0] - k) // k + 1, (cur.ne[1] - k) // k + 1, cur.ne[2], cur.ne[3])
                cur = new(pooled, "POOL_2D", (cur,))  # ggml_pool_2d: avg, kernel = stride = k
            if (n := self.w("v.msfa.norm.weight")) is not None:
                cur = self.rms_norm_2d(cur, n)

        W, H, C, B = cur.ne
        cur = permute(permute(cur, 2, 1, 0, 3), 0, 2, 1, 3)
        cur = _dup(cur, "CONT")
        cur = _dup(reshape(cur, C, W * H, B), "CONT")
        cur = _dup(cur, "SCALE")
        cur = _dup(cur, "RMS_NORM")
        if (n := self.w("mm.soft_emb_norm.weight")) is not None:
            cur = _dup(cur, "MUL", n)
        if (pj := self.w("mm.input_projection.weight")) is not None:
            cur = self.mul_mat(pj, cur)
        return _dup(cur, "RMS_NORM")


def _replay(facts: MobileNetFacts) -> tuple[int, list[tuple[str, int, int]]]:
    """ggml_gallocr_alloc_graph_impl over the graph, on one CPU buffer (shared/memory/graph_alloc.py)."""
    result = replay(_Graph(facts).build())
    return result.size, result.live


def graph_nodes(facts: MobileNetFacts) -> int:
    """The graph's node count (clip.cpp prints it: `reserve_compute_meta: graph splits = 1, nodes = N`)."""
    return len(order(_Graph(facts).build())[0])
