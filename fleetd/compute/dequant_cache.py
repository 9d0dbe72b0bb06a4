"""f32 copies of weight regions, owned by one device, held within a byte budget.

A MUL_MAT against Q4_K (or f16) weights would otherwise convert the whole matrix on every
decode step. An entry is keyed by its Buffer object and the region's offset, type, shape and
strides (the plan knows all of them when it binds a step: no guessing from array bases).

An entry lives until
- its buffer is freed (`release`): a departed session's weights leave with it;
- a command writes its buffer (`written`: SET_TENSOR, COPY_TENSOR… carry no range we trust);
- a graph node writes bytes overlapping it (`note_write`): weights that share a buffer with
  activations stay cached;
- the budget needs its bytes: least recently used first.

Eviction never takes an entry the current graph run has already used. Decode walks every
layer's weights in the same order each step, and plain LRU over a cyclic scan larger than the
cache misses on every access; refusing those evictions keeps a fixed share of the weights
cached, so a model larger than the budget runs at the budget's share of the cached speed.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_BUDGET = "0.5x"
_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class CacheBudget:
    """Either a fraction of the bytes of the device's live buffers, or an absolute byte cap."""

    fraction: float | None = None
    nbytes: int | None = None

    @classmethod
    def parse(cls, spec: str | int | float | CacheBudget | None) -> CacheBudget:
        """ "0.5x" (of live buffer bytes), "512M", "2G", "1048576" or "0" (no cache)."""
        if spec is None:
            spec = DEFAULT_BUDGET
        if isinstance(spec, CacheBudget):
            return spec
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            return cls(nbytes=int(spec)) if spec >= 0 else cls._bad(spec)
        text = str(spec).strip().lower()
        m = re.fullmatch(r"(\d+(?:\.\d*)?)x", text)
        if m:
            return cls(fraction=float(m.group(1)))
        m = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?", text)
        if m:
            return cls(nbytes=int(float(m.group(1)) * _SUFFIXES[m.group(2)]))
        return cls._bad(spec)

    @staticmethod
    def _bad(spec):
        raise ValueError(
            f"dequant cache budget {spec!r}: expected a fraction of buffer bytes like 0.5x, "
            "or a size like 512M, 2G, 0"
        )

    def limit(self, live_bytes: int) -> int:
        if self.nbytes is not None:
            return self.nbytes
        return int(self.fraction * live_bytes)

    def __str__(self) -> str:
        return f"{self.fraction:g}x" if self.fraction is not None else f"{self.nbytes} bytes"


@dataclass(eq=False, slots=True)
class _Entry:
    key: tuple
    buffer: object
    start: int
    end: int
    value: object
    nbytes: int
    run: int  # the graph run that used it last


@dataclass(eq=False, slots=True)
class _BufferEntries:
    """One buffer's entries, sorted by start so a write finds what it overlaps by bisection."""

    starts: list[int] = field(default_factory=list)
    entries: list[_Entry] = field(default_factory=list)
    longest: int = 0  # the widest entry ever added: bounds how far back an overlap can start

    def add(self, e: _Entry) -> None:
        i = bisect.bisect_right(self.starts, e.start)
        self.starts.insert(i, e.start)
        self.entries.insert(i, e)
        self.longest = max(self.longest, e.end - e.start)

    def remove(self, e: _Entry) -> None:
        i = bisect.bisect_left(self.starts, e.start)
        while self.entries[i] is not e:
            i += 1
        del self.starts[i], self.entries[i]

    def overlapping(self, start: int, end: int) -> list[_Entry]:
        lo = bisect.bisect_right(self.starts, start - self.longest)
        hi = bisect.bisect_left(self.starts, end)
        return [e for e in self.entries[lo:hi] if e.end > start]


class DequantCache:
    """One device's f32 copies of weight regions, within its budget (see the module docstring)."""

    def __init__(self, budget: CacheBudget | str | None = None) -> None:
        self.budget = CacheBudget.parse(budget)
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple, _Entry] = OrderedDict()  # oldest first
        self._by_buffer: dict[object, _BufferEntries] = {}
        self._live: dict[object, int] = {}  # buffers of the device -> their size
        self._live_bytes = 0
        self._run = 0
        self.nbytes = 0  # f32 bytes held
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    # -- the device tells the cache about its buffers ---------------------------------------

    def adopt(self, buf) -> None:
        """`buf` was allocated on the device: it counts toward a fractional budget."""
        with self._lock:
            self._live[buf] = buf.size
            self._live_bytes += buf.size

    def release(self, buf) -> None:
        """`buf` was freed: its entries go, and the budget shrinks with the live bytes."""
        with self._lock:
            self._live_bytes -= self._live.pop(buf, 0)
            self._drop_buffer(buf)
            self._shrink_to(self.limit())

    def written(self, buf) -> None:
        """A command wrote somewhere in `buf`."""
        with self._lock:
            self._drop_buffer(buf)

    def note_write(self, buf, start: int, end: int) -> None:
        """A graph node wrote bytes [start, end) of `buf`."""
        buf.generation += 1
        if buf not in self._by_buffer:  # most graph writes land in buffers holding no entries
            return
        with self._lock:
            held = self._by_buffer.get(buf)
            if held is not None:
                for e in held.overlapping(start, end):
                    self._drop(e)

    def start_run(self) -> None:
        """A graph run begins: what it uses from now on is protected from eviction until it ends."""
        self._run += 1

    # -- lookups ----------------------------------------------------------------------------

    def get(self, buf, start: int, view, type_: int, convert):
        """`convert(view)`, reusing the copy made earlier while the region is unwritten."""
        key = (buf, start, type_, view.shape, view.strides)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                hit.run = self._run
                self.hits += 1
                return hit.value
            self.misses += 1
        generation = buf.generation
        value = convert(view)
        with self._lock:
            # Written or freed while converting (another thread): do not keep it.
            if buf.generation == generation and buf in self._live:
                self._admit(key, buf, start, start + _extent(view), value)
        return value

    def limit(self) -> int:
        return self.budget.limit(self._live_bytes)

    def buffer_bytes(self, buf) -> int:
        """f32 bytes held for regions of `buf`."""
        with self._lock:
            held = self._by_buffer.get(buf)
            return sum(e.nbytes for e in held.entries) if held is not None else 0

    def entries(self, buf=None) -> int:
        with self._lock:
            if buf is None:
                return len(self._lru)
            held = self._by_buffer.get(buf)
            return len(held.entries) if held is not None else 0

    def clear(self) -> None:
        with self._lock:
            for e in list(self._lru.values()):
                self._drop(e)

    # -- internals (under the lock) ---------------------------------------------------------

    def _admit(self, key, buf, start: int, end: int, value) -> None:
        nbytes = int(value.nbytes)
        limit = self.limit()
        if nbytes > limit or key in self._lru:
            return
        while self.nbytes + nbytes > limit:
            oldest = next(iter(self._lru.values()))
            if oldest.run == self._run:
                return  # everything left was used by this run: keep it, skip the newcomer
            self._drop(oldest)
            self.evictions += 1
        e = _Entry(key, buf, start, end, value, nbytes, self._run)
        self._lru[key] = e
        self._by_buffer.setdefault(buf, _BufferEntries()).add(e)
        self.nbytes += nbytes

    def _drop(self, e: _Entry) -> None:
        del self._lru[e.key]
        held = self._by_buffer[e.buffer]
        held.remove(e)
        if not held.entries:
            del self._by_buffer[e.buffer]
        self.nbytes -= e.nbytes

    def _drop_buffer(self, buf) -> None:
        held = self._by_buffer.get(buf)
        if held is not None:
            for e in list(held.entries):
                self._drop(e)

    def _shrink_to(self, limit: int) -> None:
        while self.nbytes > limit and self._lru:
            self._drop(next(iter(self._lru.values())))
            self.evictions += 1


def _extent(view) -> int:
    """Bytes from the view's first element to one past its last (non-negative strides)."""
    if view.size == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + view.itemsize
