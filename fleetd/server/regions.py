"""Which bytes a request may touch: buffer handles and tensor regions checked against the
registry. Every failure is the client's and a RemoteProtocolError (its connection closes)."""

from __future__ import annotations

from fleetd.compute.buffers import Buffer, BufferRegistry
from fleetd.compute.views import check_extent
from fleetd.errors import RemoteProtocolError
from fleetd.wire import RpcTensor, check_type


def buffer_of(registry: BufferRegistry, handle: int, what: str) -> Buffer:
    buf = registry.get(handle)
    if buf is None:
        raise RemoteProtocolError(f"{what}: unknown buffer {handle:#x}")
    return buf


def tensor_buffer(registry: BufferRegistry, t: RpcTensor, what: str) -> tuple[Buffer, int]:
    """Deserialize with a non-null buffer, as the memory commands require; returns the buffer
    and the tensor's offset in it."""
    check_type(t, what)
    buf = buffer_of(registry, t.buffer, what)
    return buf, check_extent(buf, t, what)


def region(registry: BufferRegistry, t: RpcTensor, offset: int, size: int, what: str) -> tuple[Buffer, int]:
    """SET/GET region rule of the stock server plus its `offset + size <= nbytes` assert;
    returns the buffer and the region's start in it."""
    buf, start = tensor_buffer(registry, t, what)
    p1 = buf.base + buf.size
    at = t.data + offset
    if at < buf.base or at >= p1 or size > p1 - at:
        raise RemoteProtocolError(f"{what}: region {at:#x}+{size} outside buffer [{buf.base:#x}, {p1:#x})")
    if offset + size > t.nbytes:
        raise RemoteProtocolError(f"{what}: offset {offset} + size {size} beyond tensor of {t.nbytes} bytes")
    return buf, start + offset
