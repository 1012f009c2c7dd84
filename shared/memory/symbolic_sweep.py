"""The largest of a graph's compute buffer over every token count, without replaying each count. Pure.

Used for Qwen2-VL's family (shared/memory/qwen_graph.py). Every size in its graph is a polynomial in
the image's merged tokens n (n_pos = 4n patches; degree 2 for
the window mask and the scores without flash attention), and so is every offset ggml-alloc computes from
them. Within a residue class n = M k + r (M = 8: every size's padding to 32 bytes is then a polynomial
too) the allocator takes the same decisions for every k where each comparison it makes (a freed block
fits, is smaller than the best so far, adjoins another, ...) comes out the same; the buffer is one
polynomial there. `Poly` runs graph_alloc's replay once on symbolic sizes, keeping the interval of k
around the evaluated one where every comparison keeps its outcome; the largest over the interval is at
one of its ends (or a concave polynomial's vertex). Walking down interval by interval, a class of ~290
counts takes one replay (flash attention without a mask: every size linear, one interval) to a few dozen
(Qwen2.5-VL's mask against the blocks' activations) instead of ~290; it stops where even the sum of every
tensor is no more than the largest found. Exact: tests/test_qwen_graph.py checks it against every count.
"""

from __future__ import annotations

from shared.memory.graph_alloc import ALIGNMENT, Graph


class Inexact(Exception):
    """A size whose padding is not a polynomial in this residue class, or of a degree over 2."""


class Region:
    """The integers k in [lo, hi] around k0 where every comparison made so far keeps its outcome at k0."""

    __slots__ = ("k0", "lo", "hi")

    def __init__(self, k0: int, lo: int, hi: int):
        self.k0, self.lo, self.hi = k0, lo, hi

    def keep_sign(self, a: int, b: int, c: int, s0: int) -> None:
        """Narrow [lo, hi] to where a + b k + c k^2 has the sign s0 (its sign at k0; not constant)."""
        lo, hi, k0 = self.lo, self.hi, self.k0
        if s0 == 0:
            self.lo = self.hi = k0
            return
        # fast: the sign holds at both ends and, for a quadratic, about its vertex inside
        ok = _sign(a + lo * (b + lo * c)) == s0 and _sign(a + hi * (b + hi * c)) == s0
        if ok and c and (lo * 2 * c < -b < hi * 2 * c if c > 0 else hi * 2 * c < -b < lo * 2 * c):
            x = -b // (2 * c)  # the vertex lies in (lo, hi): the integers beside it are the nearest to zero
            ok = all(_sign(a + y * (b + y * c)) == s0 for y in (x, x + 1) if lo <= y <= hi)
        if ok:
            return
        roots = [-a / b] if not c else _quadratic_roots(a, b, c)
        for r in roots:
            base = int(r)
            for y in range(base - 2, base + 3):
                if self.lo <= y <= self.hi and _sign(a + y * (b + y * c)) != s0:
                    if y > k0:
                        self.hi = y - 1
                    elif y < k0:
                        self.lo = y + 1


def _quadratic_roots(a: int, b: int, c: int) -> list[float]:
    disc = b * b - 4 * a * c
    if disc < 0:
        return []
    s = disc**0.5
    return [(-b - s) / (2 * c), (-b + s) / (2 * c)]


def _sign(x: int) -> int:
    return (x > 0) - (x < 0)


class Poly:
    """a + b k + c k^2 (integers), its value v at the region's k0: what comparisons answer, each narrowing
    the region to where its outcome holds. Arithmetic with a constant result gives an int."""

    __slots__ = ("a", "b", "c", "v", "region")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, a: int, b: int, c: int, region: Region, v: int | None = None):
        self.a, self.b, self.c, self.region = a, b, c, region
        k = region.k0
        self.v = a + k * (b + k * c) if v is None else v

    def _new(self, a, b, c, v):
        if not b and not c:
            return a
        return Poly(a, b, c, self.region, v)

    def __add__(self, o):
        if isinstance(o, int):
            return Poly(self.a + o, self.b, self.c, self.region, self.v + o)
        if isinstance(o, Poly):
            return self._new(self.a + o.a, self.b + o.b, self.c + o.c, self.v + o.v)
        return NotImplemented

    __radd__ = __add__

    def __neg__(self):
        return Poly(-self.a, -self.b, -self.c, self.region, -self.v)

    def __sub__(self, o):
        if isinstance(o, int):
            return Poly(self.a - o, self.b, self.c, self.region, self.v - o)
        if isinstance(o, Poly):
            return self._new(self.a - o.a, self.b - o.b, self.c - o.c, self.v - o.v)
        return NotImplemented

    def __rsub__(self, o):
        return (-self) + o

    def __mul__(self, o):
        if isinstance(o, int):
            return self._new(self.a * o, self.b * o, self.c * o, self.v * o)
        if isinstance(o, Poly):
            if (self.c and (o.b or o.c)) or (o.c and self.b):
                raise Inexact("a size of degree over 2")
            return self._new(self.a * o.a, self.a * o.b + self.b * o.a,
                             self.a * o.c + self.b * o.b + self.c * o.a, self.v * o.v)  # fmt: skip
        return NotImplemented

    __rmul__ = __mul__

    def __floordiv__(self, d):
        if not isinstance(d, int) or d <= 0 or self.b % d or self.c % d:
            raise Inexact(f"({self.a}, {self.b}, {self.c}) // {d}")
        return self._new(self.a // d, self.b // d, self.c // d, None)

    def _cmp(self, o) -> int:
        if isinstance(o, int):
            da, db, dc, dv = self.a - o, self.b, self.c, self.v - o
        elif isinstance(o, Poly):
            da, db, dc, dv = self.a - o.a, self.b - o.b, self.c - o.c, self.v - o.v
        else:
            raise TypeError(f"a symbolic size compared with {type(o).__name__}")
        s0 = _sign(dv)
        if db or dc:
            self.region.keep_sign(da, db, dc, s0)
        return s0

    def __eq__(self, o):
        return self._cmp(o) == 0 if isinstance(o, (int, Poly)) else NotImplemented

    def __ne__(self, o):
        return self._cmp(o) != 0 if isinstance(o, (int, Poly)) else NotImplemented

    def __lt__(self, o):
        return self._cmp(o) < 0

    def __le__(self, o):
        return self._cmp(o) <= 0

    def __gt__(self, o):
        return self._cmp(o) > 0

    def __ge__(self, o):
        return self._cmp(o) >= 0

    def __bool__(self):
        return self._cmp(0) != 0

    def __index__(self):
        raise TypeError("a symbolic size used as an integer")

    def __repr__(self) -> str:
        return f"Poly({self.a} + {self.b} k + {self.c} k^2)"

    def coefficients(self) -> tuple[int, int, int]:
        return self.a, self.b, self.c


def _coefficients(x) -> tuple[int, int, int]:
    return x.coefficients() if isinstance(x, Poly) else (x, 0, 0)


def _at(c: tuple[int, int, int], k: int) -> int:
    return c[0] + k * (c[1] + k * c[2])


def total_bytes(graph: Graph, alignment: int = ALIGNMENT):
    """Every tensor the allocator may place, padded, summed: a bound on its high-water mark (each allocation
    raises it by at most its size), nondecreasing in the token count."""
    total = 0
    for t in (*graph.leafs, *graph.nodes):
        if not t.data and t.view_src is None:
            total = total + (-(-t.nbytes() // alignment)) * alignment
    return total


def largest_by_regions(graph_of, replay_of, limit: int, step: int = 8) -> tuple[int, int]:
    """(n, size) of the largest buffer over n = 1..limit merged tokens: graph_of(n) builds the graph (n a
    Poly), replay_of(graph) its buffer. Each residue class is walked down interval by interval, and left
    once even every tensor's sum (total_bytes) is no more than the largest found. Raises Inexact when a
    size's padding is not polynomial in a class of this step."""
    best_n, best = 0, -1
    for r in sorted(range(1, min(step, limit) + 1), key=lambda r: -((limit - r) // step * step + r)):
        k = (limit - r) // step
        total = None
        while k >= 0:
            region = Region(k, 0, k)
            graph = graph_of(Poly(r, step, 0, region))
            if total is None:
                total = _coefficients(total_bytes(graph))
            if _at(total, k) <= best:
                break
            size = replay_of(graph)
            c = _coefficients(size)
            cands = {region.lo, region.hi}
            if c[2] < 0:  # concave: its vertex may lie inside
                v = -c[1] / (2 * c[2])
                cands |= {x for x in (int(v), int(v) + 1) if region.lo <= x <= region.hi}
            for kk in cands:
                val = _at(c, kk)
                n = step * kk + r
                if val > best or (val == best and n > best_n):
                    best_n, best = n, val
            k = region.lo - 1
    return best_n, best
