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
    check_type(t, what)
    buf = buffer_of(registry, t.buffer, what)
    n = t.nbytes  # once: the hot path of every SET_TENSOR and GET_TENSOR
    base = buf.base
    p1 = base + buf.size
    if t.data < base or t.data + n > p1:
        check_extent(buf, t, what)  # raises, with the message every command gives
    at = t.data + offset
    if at < base or at >= p1 or size > p1 - at:
        raise RemoteProtocolError(f"{what}: region {at:#x}+{size} outside buffer [{base:#x}, {p1:#x})")
    if offset + size > n:
        raise RemoteProtocolError(f"{what}: offset {offset} + size {size} beyond tensor of {n} bytes")
    return buf, at - base
