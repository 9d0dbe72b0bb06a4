"""Responses of protocol 7 plus fleetd's extension, as events: one per response layout.

A reply is what the server sends and the client's `next_event()` returns. Every response is
| payload_size u64 | payload |; `frame()` gives those bytes, `decode(payload)` reads the payload
back. GET_TENSOR's `DataReply` is the one streamed response: its payload is the tensor data,
read by the I/O shell straight into its destination.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

_U64 = struct.Struct("<Q")


class Reply:
    """Base of the reply events: `frame()` gives the response bytes, `decode` reads a payload back."""

    layout: ClassVar[struct.Struct | None] = None
    streamed: ClassVar[bool] = False  # the payload is data the shell reads in place

    def frame(self) -> bytes:
        """| payload_size u64 | payload | as it goes on the wire."""
        raise NotImplementedError

    @classmethod
    def decode(cls, payload) -> Reply:
        raise NotImplementedError


def _fixed(fmt: str):
    """Class decorator for replies whose payload is one packed struct of the dataclass fields."""
    layout = struct.Struct("<" + fmt)
    size = _U64.pack(layout.size)

    def wrap(cls):
        names = [f.name for f in dataclasses.fields(cls)]
        get = operator.attrgetter(*names)
        cls.layout = layout
        if len(names) == 1:

            def frame(self) -> bytes:
                return size + layout.pack(get(self))
        else:

            def frame(self) -> bytes:
                return size + layout.pack(*get(self))

        def decode(klass, payload):
            return klass(*layout.unpack(payload))

        cls.frame = frame
        cls.decode = classmethod(decode)
        return cls

    return wrap


@_fixed("QQ")
@dataclass(frozen=True, slots=True)
class AllocBufferReply(Reply):
    """ALLOC_BUFFER's reply: | remote_ptr u64 | remote_size u64 |, the new buffer's handle and size."""

    remote_ptr: int  # 0: the server could not allocate
    remote_size: int


@_fixed("Q")
@dataclass(frozen=True, slots=True)
class GetAlignmentReply(Reply):
    """GET_ALIGNMENT's reply: | alignment u64 |, in bytes."""

    alignment: int


@_fixed("Q")
@dataclass(frozen=True, slots=True)
class GetMaxSizeReply(Reply):
    """GET_MAX_SIZE's reply: | max_size u64 |; the client splits larger allocations."""

    max_size: int


@_fixed("Q")
@dataclass(frozen=True, slots=True)
class BufferGetBaseReply(Reply):
    """BUFFER_GET_BASE's reply: | base_ptr u64 |, 0 for a zero-size buffer."""

    base: int


@_fixed("B")
@dataclass(frozen=True, slots=True)
class SetTensorHashReply(Reply):
    """SET_TENSOR_HASH's reply: | result u8 |; 0 sends the client back to SET_TENSOR."""

    found: int  # 1: the cache held the data and it was written


@_fixed("B")
@dataclass(frozen=True, slots=True)
class CopyTensorReply(Reply):
    """COPY_TENSOR's reply: | result u8 |, 1 when the destination buffer made the copy."""

    copied: int


@_fixed("QQ")
@dataclass(frozen=True, slots=True)
class GetDeviceMemoryReply(Reply):
    """GET_DEVICE_MEMORY's reply: | free u64 | total u64 |, in bytes."""

    free: int
    total: int


@_fixed("Q")
@dataclass(frozen=True, slots=True)
class GetAllocSizeReply(Reply):
    """GET_ALLOC_SIZE's reply: | alloc_size u64 |, the bytes the tensor needs in its buffer."""

    size: int


@_fixed("I")
@dataclass(frozen=True, slots=True)
class DeviceCountReply(Reply):
    """DEVICE_COUNT's reply: | device_count u32 |."""

    count: int


@_fixed("B")
@dataclass(frozen=True, slots=True)
class CopyTensorToReply(Reply):
    """COPY_TENSOR_TO's reply (fleetd): | result u8 |; 0 tells the client to fall back to GET+SET."""

    landed: int  # 1 only after the destination's PEER_BARRIER proved the write


@_fixed("B")
@dataclass(frozen=True, slots=True)
class PeerBarrierReply(Reply):
    """PEER_BARRIER's reply (fleetd): | result u8 |, sent once every earlier write has landed."""

    landed: int  # 0 when the destination's P2P is switched off


@_fixed("Q")
@dataclass(frozen=True, slots=True)
class PeerStreamReply(Reply):
    """PEER_STREAM's reply (fleetd): | stream u64 |, never 0, unguessable."""

    stream: int


@_fixed("B")
@dataclass(frozen=True, slots=True)
class PeerPushReply(Reply):
    """PEER_PUSH's reply (fleetd): | result u8 |; 1 staged for the stream's PEER_WAIT, 0 refused
    (unknown stream, a seq already waited for, P2P off, no room): the source keeps the bytes."""

    staged: int


@_fixed("B")
@dataclass(frozen=True, slots=True)
class PeerWaitReply(Reply):
    """PEER_WAIT's reply (fleetd): | result u8 |; 1 the copy is written, 0 it is not (take it)."""

    landed: int


_HELLO = struct.Struct("<BBBB24s")
_HELLO_SIZE = _U64.pack(_HELLO.size)


@dataclass(frozen=True, slots=True)
class HelloReply(Reply):
    """| major u8 | minor u8 | patch u8 | features u8 | conn_caps 24 bytes |; the feature byte
    is padding (always 0) on stock servers."""

    layout: ClassVar[struct.Struct] = _HELLO
    version: tuple[int, int, int]
    features: int

    def frame(self) -> bytes:
        return _HELLO_SIZE + _HELLO.pack(*self.version, self.features, bytes(24))

    @classmethod
    def decode(cls, payload) -> HelloReply:
        major, minor, patch, features, _caps = _HELLO.unpack(payload)
        return cls((major, minor, patch), features)


@dataclass(frozen=True, slots=True)
class DataReply(Reply):
    """GET_TENSOR's (and PEER_TAKE's) reply: the bytes, as many as the request asked for."""

    streamed: ClassVar[bool] = True
    data: Buffer  # a bytearray, or the writable buffer the caller asked the data into

    @staticmethod
    def header(size: int) -> bytes:
        """The size prefix; the `size` data bytes follow it."""
        return _U64.pack(size)

    def frame(self) -> bytes:
        view = memoryview(self.data).cast("B")
        return _U64.pack(len(view)) + bytes(view)

    @classmethod
    def decode(cls, payload) -> DataReply:
        return cls(bytearray(payload))
