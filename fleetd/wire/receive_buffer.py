"""The bytes a connection has received and not consumed yet (h11's ReceiveBuffer): one for
either side of an RPC connection.

Consumed bytes are dropped when more arrive, so what is held stays bounded by one unread
message plus one chunk whatever the chunk boundaries (deleting a bytearray's front moves no
bytes). Offsets below are relative to the first unconsumed byte.
"""

from __future__ import annotations

import struct


class ReceiveBuffer:
    """Received bytes not consumed yet; the connection parses frames from them in place."""

    __slots__ = ("_data", "_pos")

    def __init__(self) -> None:
        self._data = bytearray()
        self._pos = 0  # the first unconsumed byte

    def append(self, data) -> None:
        if self._pos:
            del self._data[: self._pos]
            self._pos = 0
        self._data += data

    def __len__(self) -> int:
        """Bytes received and not consumed."""
        return len(self._data) - self._pos

    @property
    def held(self) -> int:
        """Bytes kept in memory, consumed ones not yet dropped included."""
        return len(self._data)

    @property
    def raw(self) -> bytearray:
        """The bytes themselves (consumed ones first): for a reader working in place."""
        return self._data

    @property
    def start(self) -> int:
        """Where the unconsumed bytes start in `raw`."""
        return self._pos

    def byte(self, offset: int = 0) -> int:
        return self._data[self._pos + offset]

    def unpack(self, layout: struct.Struct, offset: int = 0) -> tuple:
        return layout.unpack_from(self._data, self._pos + offset)

    def view(self, offset: int, n: int) -> memoryview:
        """`n` bytes from `offset`, without a copy: release the view before the next append."""
        start = self._pos + offset
        return memoryview(self._data)[start : start + n]

    def consume(self, n: int) -> None:
        self._pos += n

    def move_into(self, dst: memoryview, limit: int | None = None) -> int:
        """Copy up to len(dst) (and `limit`) buffered bytes into `dst` and consume them."""
        n = min(len(dst), len(self._data) - self._pos)
        if limit is not None:
            n = min(n, limit)
        if n:
            dst[:n] = self._data[self._pos : self._pos + n]
            self._pos += n
        return n
