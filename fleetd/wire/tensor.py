"""The 296-byte packed `rpc_tensor` and its validation against the ggml type table."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from fleetd.errors import RemoteProtocolError
from fleetd.wire.ggml import GGML_MAX_SRC, GGML_TYPE_COUNT, TYPE_TRAITS, nbytes, type_name
from fleetd.wire.text import client_text

# | id u64 | type u32 | buffer u64 | ne u32[4] | nb u32[4] | op u32 | op_params i32[16] | flags i32 |
# | src u64[10] | view_src u64 | view_offs u64 | data u64 | name char[64] | use_count i32 |
RPC_TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
assert RPC_TENSOR.size == 296

# The same layout as a numpy structured dtype, to parse a graph's tensor list in one call.
RPC_TENSOR_DTYPE = np.dtype(
    [
        ("id", "<u8"),
        ("type", "<u4"),
        ("buffer", "<u8"),
        ("ne", "<u4", 4),
        ("nb", "<u4", 4),
        ("op", "<u4"),
        ("op_params", "<i4", 16),
        ("flags", "<i4"),
        ("src", "<u8", 10),
        ("view_src", "<u8"),
        ("view_offs", "<u8"),
        ("data", "<u8"),
        ("name", "S64"),
        ("use_count", "<i4"),
    ]
)
assert RPC_TENSOR_DTYPE.itemsize == 296

_ZERO_SRC = (0,) * GGML_MAX_SRC
_ZERO_PARAMS = (0,) * 16


@dataclass(frozen=True, slots=True)
class RpcTensor:
    """One decoded `rpc_tensor`: its id, type, buffer handle, shape, strides, op and links to other
    tensors by id. `use_count` is not part of equality."""

    id: int
    type: int
    buffer: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: int = 0
    op_params: tuple[int, ...] = _ZERO_PARAMS
    flags: int = 0
    src: tuple[int, ...] = _ZERO_SRC
    view_src: int = 0
    view_offs: int = 0
    data: int = 0
    name: bytes = b""
    use_count: int = field(default=0, compare=False)

    def pack(self) -> bytes:
        """The 296 wire bytes; a name is cut to 63 bytes so its NUL fits."""
        return RPC_TENSOR.pack(
            self.id,
            self.type,
            self.buffer,
            *self.ne,
            *self.nb,
            self.op,
            *self.op_params,
            self.flags,
            *self.src,
            self.view_src,
            self.view_offs,
            self.data,
            self.name[:63],
            self.use_count,
        )

    @classmethod
    def unpack_from(cls, buf, offset: int = 0) -> RpcTensor:
        """The tensor at `offset` in `buf`, its name cut at the first NUL; nothing is validated here."""
        v = RPC_TENSOR.unpack_from(buf, offset)
        name = v[42]
        return cls(  # positional: keywords cost ~0.3 us more on this hot path
            v[0],
            v[1],
            v[2],
            v[3:7],
            v[7:11],
            v[11],
            v[12:28],
            v[28],
            v[29:39],
            v[39],
            v[40],
            v[41],
            name.split(b"\0", 1)[0] if name else name,
            v[43],
        )

    @property
    def nbytes(self) -> int:
        return nbytes(self.type, self.ne, self.nb)

    def describe(self) -> str:
        name = client_text(self.name) if self.name else f"#{self.id:#x}"  # goes into log lines
        return f"{name} {type_name(self.type)} ne={list(self.ne)}"


def check_type(t: RpcTensor, what: str) -> None:
    """The stock deserializer's type checks: known type value with a non-zero block size."""
    if t.type >= GGML_TYPE_COUNT or t.type not in TYPE_TRAITS:
        raise RemoteProtocolError(f"{what}: invalid tensor type {t.type}")
