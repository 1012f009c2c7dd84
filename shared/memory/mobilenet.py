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
sources left to right), and replays ggml-alloc's graph allocator on it (ggml-alloc.c,
ggml_gallocr_alloc_graph_impl and ggml_dyn_tallocr_alloc/free_bytes: 32-byte alignment on the CPU
buffer, best fit among freed blocks, in-place reuse of a parent's memory by ADD, MUL, SCALE, RMS_NORM,
UNARY and SOFT_MAX when the parent is this node's only child and has the same layout, views never
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

ALIGNMENT = 32  # ggml-backend.cpp: the CPU buffer type's alignment (TENSOR_ALIGNMENT)
F32, F16 = 4, 2
GGML_TYPE_BF16 = 30
TARGET_OUT_RES = 16  # mobilenetv5.cpp: the MSFA's output resolution
INPLACE_OPS = frozenset({"ADD", "MUL", "SCALE", "RMS_NORM", "UNARY", "SOFT_MAX"})  # ggml_op_can_inplace


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


# --- ggml tensors, as far as the allocator sees them ---


class _T:
    __slots__ = ("ne", "nb", "esize", "op", "src", "view_src", "data", "name", "input")

    def __init__(self, ne, esize, op, src=(), view_src=None, nb=None, data=False, name=""):
        self.ne = tuple(ne) + (1,) * (4 - len(ne))
        self.esize = esize
        if nb is None:
            nb = [esize]
            for n in self.ne[:3]:
                nb.append(nb[-1] * n)
        self.nb = tuple(nb)
        self.op, self.src, self.view_src, self.data, self.name, self.input = op, tuple(src), view_src, data, name, False

    def nbytes(self) -> int:
        return self.esize + sum((n - 1) * b for n, b in zip(self.ne, self.nb))


def _new(ne, op, src, esize=F32, name=""):
    return _T(ne, esize, op, src, name=name)


def _view(a: _T, op: str, ne, nb=None):
    base = a.view_src or a
    return _T(ne, a.esize, op, (a,), view_src=base, nb=nb, data=a.data)


def _reshape(a, *ne):
    return _view(a, "RESHAPE", ne)


def _permute(a, *axes):
    ne, nb = [0] * 4, [0] * 4
    for i, ax in enumerate(axes):
        ne[ax], nb[ax] = a.ne[i], a.nb[i]
    return _view(a, "PERMUTE", ne, nb)


def _dup(a, op, *src, name=""):
    return _new(a.ne, op, (a, *src), a.esize, name)


def _conv_out(size, k, s, p, d=1):
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


class _Graph:
    """clip_graph_mobilenetv5::build over the facts' tensors."""

    def __init__(self, facts: MobileNetFacts):
        self.shapes, self.types = facts.shapes, facts.types
        self.weights: dict[str, _T] = {}
        self.image_size = facts.image_size

    def w(self, name):
        if name not in self.shapes:
            return None
        if name not in self.weights:
            ty = self.types.get(name, 1)
            esize = F16 if ty in (1, GGML_TYPE_BF16) else F32
            self.weights[name] = _T(self.shapes[name], esize, None, data=True, name=name)
        return self.weights[name]

    # ggml ops
    def conv_2d_direct(self, k, x, s, p):
        ne = (_conv_out(x.ne[0], k.ne[0], s, p), _conv_out(x.ne[1], k.ne[1], s, p), k.ne[3], x.ne[3])
        return _new(ne, "CONV_2D", (k, x), x.esize)

    def conv_2d_dw(self, k, x, s, p):
        new_a = _reshape(k, k.ne[0], k.ne[1], 1, k.ne[2] * k.ne[3])
        xb = _reshape(x, x.ne[0], x.ne[1], 1, x.ne[2] * x.ne[3])
        ow, oh = _conv_out(xb.ne[0], new_a.ne[0], s, p), _conv_out(xb.ne[1], new_a.ne[1], s, p)
        bf16 = self.types.get(k.name) == GGML_TYPE_BF16
        kk = new_a.ne[2] * new_a.ne[1] * new_a.ne[0]
        im2col = _new((kk, ow, oh, xb.ne[3]), "IM2COL", (new_a, xb), F32 if bf16 else F16)
        new_b = _reshape(im2col, im2col.ne[0], im2col.ne[2] * im2col.ne[1], x.ne[2], x.ne[3])
        new_a = _reshape(new_a, new_a.ne[0] * new_a.ne[1], new_a.ne[2], new_a.ne[3], 1)
        result = self.mul_mat(new_a, new_b)
        return _reshape(result, im2col.ne[1], im2col.ne[2], x.ne[2], x.ne[3])

    @staticmethod
    def mul_mat(a, b):
        return _new((a.ne[1], b.ne[1], b.ne[2], b.ne[3]), "MUL_MAT", (a, b))

    @staticmethod
    def pad_same(x, k, s):
        ih, iw = x.ne[1], x.ne[0]
        oh, ow = (ih + s - 1) // s, (iw + s - 1) // s
        pad_h = max(0, (oh - 1) * s + (k - 1) + 1 - ih)
        pad_w = max(0, (ow - 1) * s + (k - 1) + 1 - iw)
        if pad_h > 0 or pad_w > 0:
            return _new((x.ne[0] + pad_w, x.ne[1] + pad_h, x.ne[2], x.ne[3]), "PAD", (x,), x.esize)
        return x

    def rms_norm_2d(self, x, weight):
        cur = _dup(_permute(x, 2, 1, 0, 3), "CONT")
        cur = _dup(cur, "RMS_NORM")
        if weight is not None:
            cur = _dup(cur, "MUL", weight)
        return _dup(_permute(cur, 2, 1, 0, 3), "CONT")

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
        q = _reshape(_reshape(q, N, D * n_head, B), N, D, n_head, B)
        q = _dup(_permute(q, 1, 0, 2, 3), "CONT")
        M = k.ne[0] * k.ne[1]
        k = _reshape(_reshape(k, M, D, B), M, D, 1, B)
        k = _dup(_permute(k, 1, 0, 2, 3), "CONT")
        v = _reshape(_reshape(v, M, D, B), M, D, 1, B)
        v = _dup(v, "CONT")
        scores = self.mul_mat(k, q)
        scores = _dup(scores, "SCALE")
        scores = _dup(scores, "SOFT_MAX")
        kqv = self.mul_mat(v, scores)
        kqv = _dup(_permute(kqv, 1, 0, 2, 3), "CONT")
        kqv = _reshape(_reshape(kqv, N, D * n_head, B), W, H, D * n_head, B)
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

    def build(self) -> _T:
        s = self.image_size
        inp = _T((s, s, 3, 1), F32, None, name="inp_raw")
        inp.input = True
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
                    f = _new((f.ne[0] * sc, f.ne[1] * sc, f.ne[2], f.ne[3]), "UPSCALE", (f,))
                resized.append(f)
            cur = resized[0]
            for f in resized[1:]:
                cur = _new((cur.ne[0], cur.ne[1], cur.ne[2] + f.ne[2], cur.ne[3]), "CONCAT", (cur, f), cur.esize)
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
                cur = _new(pooled, "POOL_2D", (cur,))  # ggml_pool_2d: avg, kernel = stride = k
            if (n := self.w("v.msfa.norm.weight")) is not None:
                cur = self.rms_norm_2d(cur, n)

        W, H, C, B = cur.ne
        cur = _permute(_permute(cur, 2, 1, 0, 3), 0, 2, 1, 3)
        cur = _dup(cur, "CONT")
        cur = _dup(_reshape(cur, C, W * H, B), "CONT")
        cur = _dup(cur, "SCALE")
        cur = _dup(cur, "RMS_NORM")
        if (n := self.w("mm.soft_emb_norm.weight")) is not None:
            cur = _dup(cur, "MUL", n)
        if (pj := self.w("mm.input_projection.weight")) is not None:
            cur = self.mul_mat(pj, cur)
        return _dup(cur, "RMS_NORM")


def _order(root: _T) -> tuple[list[_T], list[_T]]:
    """ggml_visit_parents_graph: nodes and leafs, depth first, sources left to right (iterative)."""
    nodes, leafs, seen = [], [], set()
    stack = [(root, 0)]
    seen.add(id(root))
    while stack:
        t, i = stack.pop()
        if i < len(t.src):
            stack.append((t, i + 1))
            s = t.src[i]
            if id(s) not in seen:
                seen.add(id(s))
                stack.append((s, 0))
            continue
        (leafs if t.op is None else nodes).append(t)
    return nodes, leafs


def _pad(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


class _DynAlloc:
    """ggml_dyn_tallocr with one chunk (the CPU buffer type's max size is unbounded)."""

    def __init__(self):
        self.blocks: list[list[int]] = [[0, 1 << 62]]  # [offset, size], sorted by offset; the last is the tail
        self.max_size = 0

    def alloc(self, size: int) -> int:
        size = _pad(size)
        best, best_size = -1, None
        for i, (_, bsize) in enumerate(self.blocks[:-1]):
            if bsize >= size and (best_size is None or bsize <= best_size):
                best, best_size = i, bsize
        if best < 0:
            best = len(self.blocks) - 1
        block = self.blocks[best]
        addr = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del self.blocks[best]
        self.max_size = max(self.max_size, addr + size)
        return addr

    def free(self, addr: int, size: int) -> None:
        size = _pad(size)
        bl = self.blocks
        for i, block in enumerate(bl):
            if block[0] + block[1] == addr:
                block[1] += size
                if i < len(bl) - 1 and block[0] + block[1] == bl[i + 1][0]:
                    block[1] += bl[i + 1][1]
                    del bl[i + 1]
                return
            if addr + size == block[0]:
                block[0] = addr
                block[1] += size
                if i > 0 and bl[i - 1][0] + bl[i - 1][1] == block[0]:
                    bl[i - 1][1] += block[1]
                    del bl[i]
                return
        pos = 0
        while pos < len(bl) and bl[pos][0] < addr:
            pos += 1
        bl.insert(pos, [addr, size])


def _same_layout(a: _T, b: _T) -> bool:
    return a.esize == b.esize and a.ne == b.ne and a.nb == b.nb


def _replay(facts: MobileNetFacts) -> tuple[int, list[tuple[str, int, int]]]:
    """ggml_gallocr_alloc_graph_impl over the graph, on one CPU buffer."""
    nodes, leafs = _order(_Graph(facts).build())
    alloc = _DynAlloc()
    children: dict[int, int] = {}
    views: dict[int, int] = {}
    own: dict[int, bool] = {}
    addr: dict[int, int] = {}
    live: dict[int, tuple[str, int, int]] = {}
    peak: list = [0, []]

    def allocate(t: _T) -> None:
        if t.data or own.get(id(t)) or t.view_src is not None:
            return
        own[id(t)] = True
        if t.op in INPLACE_OPS:
            for parent in t.src:
                if not own.get(id(parent)) or not _same_layout(t, parent):
                    continue
                if children.get(id(parent), 0) == 1 and views.get(id(parent), 0) == 0:
                    addr[id(t)] = addr[id(parent)]
                    own[id(parent)] = False
                    live[id(t)] = (t.op or t.name, addr[id(t)], t.nbytes())
                    live.pop(id(parent), None)
                    return
        before = alloc.max_size
        addr[id(t)] = alloc.alloc(t.nbytes())
        live[id(t)] = (t.op or t.name, addr[id(t)], t.nbytes())
        if alloc.max_size > before:
            peak[0], peak[1] = alloc.max_size, sorted(live.values(), key=lambda x: x[1])

    def free(t: _T) -> None:
        alloc.free(addr[id(t)], t.nbytes())
        own[id(t)] = False
        live.pop(id(t), None)

    for leaf in leafs:
        allocate(leaf)
    for node in nodes:
        if node.view_src is not None:
            views[id(node.view_src)] = views.get(id(node.view_src), 0) + 1
        for s in node.src:
            children[id(s)] = children.get(id(s), 0) + 1
            if s.input:
                allocate(s)
    for node in nodes:
        for s in node.src:
            allocate(s)
        allocate(node)
        for s in node.src:
            children[id(s)] -= 1
            if children[id(s)] == 0 and views.get(id(s), 0) == 0:
                if s.view_src is not None:
                    vs = s.view_src
                    views[id(vs)] -= 1
                    if views[id(vs)] == 0 and children.get(id(vs), 0) == 0 and own.get(id(vs)):
                        free(vs)
                elif own.get(id(s)):
                    free(s)
    return alloc.max_size, peak[1]


def graph_nodes(facts: MobileNetFacts) -> int:
    """The graph's node count (clip.cpp prints it: `reserve_compute_meta: graph splits = 1, nodes = N`)."""
    return len(_order(_Graph(facts).build())[0])
