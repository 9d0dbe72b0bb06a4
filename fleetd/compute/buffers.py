"""The shared buffer registry: remote handles mapped to device memory.

Addresses are ours to choose (protocol §5): every buffer gets an aligned range in a private
64-bit address space with a guard page after it, so two buffers never touch and a range check
against the tensor's own buffer is two comparisons.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fleetd.compute.device import Device

ADDRESS_SPACE_START = 0x1000_0000_0000
PAGE = 4096


@dataclass(eq=False)
class Buffer:
    handle: int
    device: int
    base: int
    size: int
    array: object  # flat uint8 array of the device (numpy or cupy)
    owner: int  # session id that allocated it; only it may free it
    generation: int = 0  # bumped on every write
    memory: Device | None = field(default=None, repr=False)  # the Device its bytes live on

    def contains(self, addr: int, n: int) -> bool:
        return self.base <= addr and addr + n <= self.base + self.size

    def touched(self) -> None:
        """A command wrote into the buffer (graph writes go through the plan, with their range)."""
        self.generation += 1
        if self.memory is not None:
            self.memory.buffer_written(self)


class BufferRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_handle: dict[int, Buffer] = {}
        self._next_handle = 0x100
        self._next_base = ADDRESS_SPACE_START

    def alloc(self, device_index: int, device: Device, size: int, owner: int) -> Buffer | None:
        array = device.alloc(size) if size else None
        if size and array is None:
            return None
        with self._lock:
            handle = self._next_handle
            self._next_handle += 0x10
            base = 0
            if size:
                base = self._next_base
                self._next_base += (size + 2 * PAGE - 1) // PAGE * PAGE  # one guard page
            buf = Buffer(handle, device_index, base, size, array, owner, memory=device)
            self._by_handle[handle] = buf
        device.buffer_allocated(buf)
        return buf

    def get(self, handle: int) -> Buffer | None:
        return self._by_handle.get(handle)

    def free(self, buf: Buffer) -> None:
        with self._lock:
            known = self._by_handle.pop(buf.handle, None) is buf
        if known and buf.memory is not None:
            buf.memory.buffer_freed(buf)

    def owned_by(self, owner: int) -> list[Buffer]:
        with self._lock:
            return [b for b in self._by_handle.values() if b.owner == owner]

    def __len__(self) -> int:
        return len(self._by_handle)
