"""ggml's graph allocator, replayed on a graph of tensor shapes: the compute buffer llama.cpp reserves
for a graph, to the byte. Pure.

A compute buffer (`<buffer> compute buffer size`) is ggml-alloc's high-water mark for the graph the
scheduler hands it (ggml-backend.cpp ggml_backend_sched_reserve / _alloc_graph -> ggml-alloc.c
ggml_gallocr_reserve_n). Where there is no closed form worth fitting (the peak moves between tensors
with the widths, and freed blocks are reused best-fit, so fragmentation counts), a module rebuilds the
graph here with ggml's shapes and types and replays the allocator on it:

- Tensors (`Tensor`): ne, nb, type, op, sources; `leaf` makes a weight (already in its own buffer, never
  allocated here) or a graph input (ggml_set_input); `new` an op's result; `view`, `reshape`,
  `permute`, `transpose` views (never allocated: they share their base tensor's memory, and the base is
  freed with the last of them); `dup` an op with its first source's shape; `mul_mat`, `cast` (ggml's
  self-reference in src[1] included).
- Order (`Graph`): ggml_build_forward_expand / ggml_build_forward_order (ggml.c ggml_visit_parents_graph:
  depth first, sources left to right, each tensor once, across calls), which fixes the order nodes are
  allocated and freed in.
- Replay (`replay`): ggml_gallocr_alloc_graph_impl with ggml_dyn_tallocr (one chunk: the CPU and RPC
  buffer types have no maximum size): leafs first, then graph inputs, then node by node: a node takes a
  parent's memory in place when its op may (ggml_op_can_inplace), the parent is its own allocation, of the
  same layout, with this node its last child and no views; otherwise the best-fitting freed block (the
  smallest that fits, the last of equals; the tail block only when none does); a parent is freed when its
  last child has run (a view's base with the last of its views). Sizes are padded to the buffer's
  alignment (32: TENSOR_ALIGNMENT for CPU buffers, and what an RPC server built on the CPU backend reports).
- On a device (`replay(..., offload_inputs=True)`): the graph's inputs stay in host memory
  (ggml_backend_sched assigns GGML_TENSOR_FLAG_INPUT tensors to the CPU backend) and the scheduler
  copies each into the device's buffer at the start of its split (ggml_backend_sched_split_graph pass 5
  and the graph copy: the copies are the split's first nodes, in the order the nodes first use them).
  This assumes one split (every op runs on the device, as on an RPC device); the returned size is the
  device's buffer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ALIGNMENT = 32  # ggml-backend.cpp: the CPU buffer type's alignment (TENSOR_ALIGNMENT)


@dataclass(frozen=True)
class DType:
    name: str
    size: int


F32, F16, I32 = DType("f32", 4), DType("f16", 2), DType("i32", 4)

# ggml-alloc.c ggml_op_can_inplace
INPLACE_OPS = frozenset({
    "FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL", "DIV", "SQR",
    "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM", "RMS_NORM_BACK", "CLAMP", "SOFT_MAX",
    "SOFT_MAX_BACK",
})  # fmt: skip
VIEW_OPS = frozenset({"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})  # ggml_is_view_op


class Tensor:
    """A ggml tensor as far as the allocator sees it. op None: a leaf (a weight when `data`, else an input
    or a constant the allocator places)."""

    __slots__ = ("ne", "nb", "type", "op", "src", "view_src", "data", "name", "input")

    def __init__(self, ne, dtype: DType, op, src=(), view_src=None, nb=None, data=False, name="", input=False):
        self.ne = tuple(ne) + (1,) * (4 - len(ne))
        self.type = dtype
        if nb is None:
            nb = [dtype.size]
            for n in self.ne[:3]:
                nb.append(nb[-1] * n)
        self.nb = tuple(nb)
        self.op, self.src, self.view_src, self.data, self.name, self.input = (
            op, tuple(src), view_src, data, name, input)  # fmt: skip

    @property
    def esize(self) -> int:
        return self.type.size

    def nbytes(self) -> int:
        """ggml_nbytes (block size 1)."""
        if any(n == 0 for n in self.ne):
            return 0
        return self.type.size + sum((n - 1) * b for n, b in zip(self.ne, self.nb))

    def label(self) -> str:
        return self.op or self.name

    def __repr__(self) -> str:
        return f"Tensor({self.label()}, {self.ne}, {self.type.name})"


def leaf(ne, dtype: DType = F32, name: str = "", *, weight: bool = False, input: bool = False) -> Tensor:
    """A weight (weight=True: in the model's buffer) or a graph input (input=True: ggml_set_input)."""
    return Tensor(ne, dtype, None, data=weight, name=name, input=input)


def new(ne, op: str, src: Iterable[Tensor] = (), dtype: DType = F32, name: str = "") -> Tensor:
    return Tensor(ne, dtype, op, src, name=name)


def view(a: Tensor, op: str, ne, nb=None) -> Tensor:
    """A view of a (its base: a's own base if a is a view, as ggml_new_tensor_impl does)."""
    base = a.view_src or a
    return Tensor(ne, a.type, op, (a,), view_src=base, nb=nb, data=a.data)


def reshape(a: Tensor, *ne) -> Tensor:
    return view(a, "RESHAPE", ne)


def permute(a: Tensor, *axes) -> Tensor:
    ne, nb = [0] * 4, [0] * 4
    for i, ax in enumerate(axes):
        ne[ax], nb[ax] = a.ne[i], a.nb[i]
    for i in range(len(axes), 4):
        ne[i], nb[i] = a.ne[i], a.nb[i]
    return view(a, "PERMUTE", ne, nb)


def transpose(a: Tensor) -> Tensor:
    ne, nb = list(a.ne), list(a.nb)
    ne[0], ne[1], nb[0], nb[1] = ne[1], ne[0], nb[1], nb[0]
    return view(a, "TRANSPOSE", ne, nb)


def dup(a: Tensor, op: str, *src: Tensor, name: str = "") -> Tensor:
    """An op whose result has a's shape and type (ggml_dup_tensor): a is its first source."""
    return new(a.ne, op, (a, *src), a.type, name)


def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    return new((a.ne[1], b.ne[1], b.ne[2], b.ne[3]), "MUL_MAT", (a, b))


def cast(a: Tensor, dtype: DType) -> Tensor:
    """ggml_cast: a contiguous copy in dtype, with itself as src[1]."""
    t = new(a.ne, "CPY", (a,), dtype)
    t.src = (a, t)
    return t


class Graph:
    """A ggml_cgraph being built: nodes and leafs in visiting order."""

    def __init__(self):
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()

    def expand(self, root: Tensor) -> Graph:
        """ggml_build_forward_expand (and ggml_build_forward_order, which visits the same way): root and its
        ancestors not yet in the graph, depth first, sources left to right (iterative)."""
        seen = self._seen
        if id(root) in seen:
            return self
        seen.add(id(root))
        stack = [(root, 0)]
        while stack:
            t, i = stack.pop()
            if i < len(t.src):
                stack.append((t, i + 1))
                s = t.src[i]
                if id(s) not in seen:
                    seen.add(id(s))
                    stack.append((s, 0))
                continue
            (self.leafs if t.op is None else self.nodes).append(t)
        return self


def order(root: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """The nodes and leafs of the graph ggml_build_forward_expand(root) builds."""
    g = Graph().expand(root)
    return g.nodes, g.leafs


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class DynAlloc:
    """ggml_dyn_tallocr with one chunk (the buffer type's max size is unbounded)."""

    def __init__(self, alignment: int = ALIGNMENT):
        self.alignment = alignment
        self.blocks: list[list[int]] = [[0, 1 << 62]]  # [offset, size], sorted by offset; the last is the tail
        self.max_size = 0

    def alloc(self, size: int) -> int:
        size = _pad(size, self.alignment)
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
        size = _pad(size, self.alignment)
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


def same_layout(a: Tensor, b: Tensor) -> bool:
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


@dataclass(frozen=True)
class Replay:
    """The buffer (the allocator's high-water mark, bytes) and the tensors live (label, offset, bytes, by
    offset) when it last grew."""

    size: int
    live: list[tuple[str, int, int]]


def _device_copies(nodes: list[Tensor]) -> tuple[list[Tensor], dict[int, Tensor], set[int]]:
    """ggml_backend_sched_split_graph for one device split: a copy of each host tensor (an input, or a view of
    one) a non-view node reads, in the order the nodes first read them; the host tensors' ids."""
    host: set[int] = set()
    copies: dict[int, Tensor] = {}
    prefix: list[Tensor] = []
    for node in nodes:
        if node.op in VIEW_OPS:
            continue
        for s in node.src:
            on_host = s.input or (s.view_src is not None and s.view_src.input)
            if on_host and id(s) not in copies:
                cpy = Tensor(s.ne, s.type, "NONE", nb=s.nb, name=f"copy of {s.label()}")
                copies[id(s)] = cpy
                prefix.append(cpy)
                host.add(id(s))
                if s.view_src is not None:
                    host.add(id(s.view_src))
    return prefix, copies, host


def replay(graph: Graph | Tensor, *, offload_inputs: bool = False, alignment: int = ALIGNMENT) -> Replay:
    """ggml_gallocr_alloc_graph_impl over the graph (a Graph, or a root to expand), on one buffer; with
    offload_inputs the device's buffer of a one-split scheduler graph (inputs copied in from the host)."""
    if isinstance(graph, Tensor):
        graph = Graph().expand(graph)
    nodes, leafs = graph.nodes, graph.leafs
    remap: dict[int, Tensor] = {}
    external: set[int] = set()
    if offload_inputs:
        prefix, remap, external = _device_copies(nodes)
        nodes = prefix + nodes

    def srcs(node: Tensor) -> tuple[Tensor, ...]:
        if remap and node.op not in VIEW_OPS:
            return tuple(remap.get(id(s), s) for s in node.src)
        return node.src

    alloc = DynAlloc(alignment)
    children: dict[int, int] = {}
    views: dict[int, int] = {}
    own: dict[int, bool] = {}
    addr: dict[int, int] = {}
    live: dict[int, tuple[str, int, int]] = {}
    peak: list = [[]]

    def allocate(t: Tensor) -> None:
        if t.data or t.view_src is not None or own.get(id(t)) or id(t) in external:
            return
        own[id(t)] = True
        if t.op in INPLACE_OPS:
            for parent in srcs(t):
                if not own.get(id(parent)) or not same_layout(t, parent):
                    continue
                if children.get(id(parent), 0) == 1 and views.get(id(parent), 0) == 0:
                    addr[id(t)] = addr[id(parent)]
                    own[id(parent)] = False
                    live.pop(id(parent), None)
                    live[id(t)] = (t.label(), addr[id(t)], t.nbytes())
                    return
        before = alloc.max_size
        addr[id(t)] = alloc.alloc(t.nbytes())
        live[id(t)] = (t.label(), addr[id(t)], t.nbytes())
        if alloc.max_size > before:
            peak[0] = sorted(live.values(), key=lambda x: x[1])

    def free(t: Tensor) -> None:
        alloc.free(addr[id(t)], t.nbytes())
        own[id(t)] = False
        live.pop(id(t), None)

    for lf in leafs:
        allocate(lf)
    node_srcs = [srcs(node) for node in nodes]
    for node, ss in zip(nodes, node_srcs):
        if node.view_src is not None and node.op != "NONE":
            views[id(node.view_src)] = views.get(id(node.view_src), 0) + 1
        if node.input:
            allocate(node)
        for s in ss:
            children[id(s)] = children.get(id(s), 0) + 1
            if s.input:
                allocate(s)
    for node, ss in zip(nodes, node_srcs):
        for s in ss:
            allocate(s)
        allocate(node)
        for s in ss:
            children[id(s)] -= 1
            if children[id(s)] == 0 and views.get(id(s), 0) == 0:
                if s.view_src is not None:
                    vs = s.view_src
                    views[id(vs)] -= 1
                    if views[id(vs)] == 0 and children.get(id(vs), 0) == 0 and own.get(id(vs)):
                        free(vs)
                elif own.get(id(s)):
                    free(s)
    return Replay(alloc.max_size, peak[0])
