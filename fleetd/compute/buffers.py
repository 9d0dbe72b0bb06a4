"""The shared buffer registry: remote handles mapped to device memory.

Addresses are ours to choose (protocol §5): every buffer gets an aligned range in a private
64-bit address space with a guard page after it, so two buffers never touch and a range check
against the tensor's own buffer is two comparisons.

Handles and base addresses are random (60 and 50 bits): a session reaches only the buffers
whose handle it was given (by ALLOC_BUFFER, or by a client that hands a peer copy source the
destination's handle); guessing another session's is hopeless.
"""

from __future__ import annotations

import ctypes
import secrets
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fleetd.compute.dequant_cache import DequantCache

ADDRESS_SPACE_START = 0x1000_0000_0000  # 2^44: every base is at or above it
ADDRESS_SPACE_END = 1 << 62  # and every buffer ends below it
PAGE = 4096


class Memory(Protocol):
    """What the registry, and the plans over a buffer, ask of the device its bytes live on
    (compute/device.py's Device is this and what the server asks)."""

    @property
    def xp(self) -> types.ModuleType:
        """The array module of its arrays (numpy, later cupy)."""
        ...

    @property
    def dequant_cache(self) -> DequantCache | None:
        """The f32 copies of weights, on devices that keep them."""
        ...

    def alloc(self, size: int):
        """A flat uint8 array of `size` bytes, or None when the memory is not there."""
        ...

    # The registry reports each buffer's life to the device that holds its memory.

    def buffer_allocated(self, buf: Buffer) -> None: ...

    def buffer_written(self, buf: Buffer) -> None:
        """A command (not a graph node) wrote into `buf`."""
        ...

    def buffer_freed(self, buf: Buffer) -> None: ...


@dataclass(eq=False)
class Buffer:
    """One remote buffer: its handle, its range in our address space and the device array behind it."""

    handle: int
    device: int
    base: int
    size: int
    array: object  # flat uint8 array of the device (numpy or cupy)
    owner: int  # session id that allocated it; only it may free it
    generation: int = 0  # bumped on every write; dequant caches compare it
    memory: Memory | None = field(default=None, repr=False)  # the device its bytes live on
    freed: bool = False  # set when it leaves the registry: stored graphs and caches check it

    def contains(self, addr: int, n: int) -> bool:
        return self.base <= addr and addr + n <= self.base + self.size

    def touched(self) -> None:
        """A command wrote into the buffer (graph writes go through the plan, with their range)."""
        self.generation += 1
        if self.memory is not None:
            self.memory.buffer_written(self)


class BufferRegistry:
    """Every live buffer of the daemon, shared by all sessions: handles, address ranges and the
    bytes each owner holds, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_handle: dict[int, Buffer] = {}
        self._spans: list[tuple[int, int]] = []  # (base, end incl. guard page) of live buffers
        self._allocated = 0
        self._by_owner: dict[int, int] = {}  # bytes allocated per owner
        self._free_hooks: list[Callable[[Buffer], None]] = []
        self.frees = 0  # bumped on every free: a stored graph built before it rechecks
        # the same count where C reads it (a session's fast loop, fleetd.server.fast_path)
        self.frees_cell = ctypes.c_uint64(0)

    def alloc(
        self,
        device_index: int,
        device: Memory,
        size: int,
        owner: int,
        *,
        limit: int | None = None,
        owner_limit: int | None = None,
    ) -> Buffer | None:
        """A new buffer, or None when the device cannot, or when it would take the registry's
        total past `limit` or the owner's past `owner_limit` (as a full device answers)."""
        with self._lock:  # reserve first, so concurrent sessions cannot overshoot together
            if (limit is not None and self._allocated + size > limit) or (
                owner_limit is not None and self._by_owner.get(owner, 0) + size > owner_limit
            ):
                return None
            self._allocated += size
            self._by_owner[owner] = self._by_owner.get(owner, 0) + size
        array = device.alloc(size) if size else None
        if size and array is None:
            self._release(owner, size)
            return None
        with self._lock:
            handle = self._new_handle()
            base = self._new_base(size) if size else 0
            buf = Buffer(handle, device_index, base, size, array, owner, memory=device)
            self._by_handle[handle] = buf
        device.buffer_allocated(buf)
        return buf

    def _new_handle(self) -> int:
        while True:
            handle = secrets.randbits(60) << 4  # 16-aligned, as the sequential ones were
            if handle and handle not in self._by_handle:
                return handle

    def _new_base(self, size: int) -> int:
        span = (size + 2 * PAGE - 1) // PAGE * PAGE  # one guard page
        pages = (ADDRESS_SPACE_END - ADDRESS_SPACE_START - span) // PAGE
        while True:
            base = ADDRESS_SPACE_START + secrets.randbelow(pages) * PAGE
            if all(base >= end or base + span <= start for start, end in self._spans):
                self._spans.append((base, base + span))
                return base

    def owned_bytes(self, owner: int) -> int:
        """Bytes of the buffers `owner` (a session id) has allocated and not freed."""
        with self._lock:
            return self._by_owner.get(owner, 0)

    def _release(self, owner: int, size: int) -> None:
        with self._lock:
            self._allocated -= size
            left = self._by_owner.get(owner, 0) - size
            if left > 0:
                self._by_owner[owner] = left
            else:
                self._by_owner.pop(owner, None)

    def get(self, handle: int) -> Buffer | None:
        return self._by_handle.get(handle)

    def free(self, buf: Buffer) -> None:
        """Take `buf` out of the registry (a second free does nothing), then tell the free hooks and
        its device."""
        with self._lock:
            if self._by_handle.pop(buf.handle, None) is None:
                return
            if buf.size:
                self._spans = [s for s in self._spans if s[0] != buf.base]
            buf.freed = True
            self.frees += 1
            self.frees_cell.value = self.frees
            hooks = list(self._free_hooks)
        self._release(buf.owner, buf.size)
        for hook in hooks:
            hook(buf)
        if buf.memory is not None:  # the device's own cache lets go of it
            buf.memory.buffer_freed(buf)

    def on_free(self, hook: Callable[[Buffer], None]) -> None:
        """Call `hook(buffer)` after every free (dequantisation caches forget the buffer)."""
        with self._lock:
            self._free_hooks.append(hook)

    @property
    def allocated(self) -> int:
        """Bytes in live buffers."""
        return self._allocated

    def allocated_by(self, owner: int) -> int:
        return self._by_owner.get(owner, 0)

    def owned_by(self, owner: int) -> list[Buffer]:
        with self._lock:
            return [b for b in self._by_handle.values() if b.owner == owner]

    def __len__(self) -> int:
        return len(self._by_handle)
