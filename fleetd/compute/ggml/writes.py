"""Which node last wrote a byte range, as a graph's nodes are walked in order.

Plan building asks, for every checked tensor a node reads (row ids, padded reads), whether a
node before it writes those bytes. Asked by scanning every write per use, 8,000 GET_ROWS nodes
took 6 s. Here the question costs O(log n): all ranges are known before the walk, so each
buffer's range ends are compressed into elementary intervals under a segment tree that keeps,
per interval, the latest node that wrote it (node numbers only grow: a write is a range max).
"""

from __future__ import annotations

from collections.abc import Iterable


class _Tree:
    """Range "raise to at least v" and range max over n elementary intervals, bottom-up."""

    def __init__(self, n: int) -> None:
        self.size = 1
        while self.size < n:
            self.size *= 2
        self.best = [-1] * (2 * self.size)  # max over the subtree, own tag included
        self.tag = [-1] * (2 * self.size)  # applies to every interval of the subtree

    def raise_to(self, lo: int, hi: int, value: int, counter: list) -> None:
        lo0, hi0 = lo + self.size, hi - 1 + self.size
        lo, hi = lo0, hi + self.size
        while lo < hi:
            counter[0] += 1
            if lo & 1:
                self._apply(lo, value)
                lo += 1
            if hi & 1:
                hi -= 1
                self._apply(hi, value)
            lo, hi = lo >> 1, hi >> 1
        for leaf in (lo0, hi0):
            i = leaf >> 1
            while i:
                counter[0] += 1
                self.best[i] = max(self.tag[i], self.best[2 * i], self.best[2 * i + 1])
                i >>= 1

    def _apply(self, i: int, value: int) -> None:
        if value > self.best[i]:
            self.best[i] = value
        if value > self.tag[i]:
            self.tag[i] = value

    def max(self, lo: int, hi: int, counter: list) -> int:
        out = -1
        # every canonical node's ancestors lie on the paths of the first and last leaf, and a
        # tag there covers a byte of the range
        for leaf in (lo + self.size, hi - 1 + self.size):
            i = leaf >> 1
            while i:
                counter[0] += 1
                out = max(out, self.tag[i])
                i >>= 1
        lo, hi = lo + self.size, hi + self.size
        while lo < hi:
            counter[0] += 1
            if lo & 1:
                out = max(out, self.best[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                out = max(out, self.best[hi])
            lo, hi = lo >> 1, hi >> 1
        return out


class WriteLog:
    """`write(j, buffer, lo, hi)` as node j is walked, `last(buffer, lo, hi)`: the latest node
    logged so far that wrote a byte of [lo, hi), or -1. Every range used is named up front."""

    def __init__(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        ends: dict[int, set[int]] = {}
        for buffer, lo, hi in ranges:
            if lo < hi:
                ends.setdefault(buffer, set()).update((lo, hi))
        self._index: dict[int, dict[int, int]] = {}
        self._trees: dict[int, _Tree] = {}
        for buffer, points in ends.items():
            ordered = sorted(points)
            self._index[buffer] = {p: k for k, p in enumerate(ordered)}
            self._trees[buffer] = _Tree(max(1, len(ordered) - 1))
        self.steps = [0]  # tree nodes visited: what plan building costs here (tests count it)

    def write(self, j: int, buffer: int, lo: int, hi: int) -> None:
        if lo < hi:
            index = self._index[buffer]
            self._trees[buffer].raise_to(index[lo], index[hi], j, self.steps)

    def last(self, buffer: int, lo: int, hi: int) -> int:
        if lo >= hi or buffer not in self._trees:
            return -1
        index = self._index[buffer]
        return self._trees[buffer].max(index[lo], index[hi], self.steps)
