"""Tensors as array views over buffer memory, bounds-checked before the view exists."""

from __future__ import annotations

import numpy as np

from fleetd.compute.buffers import Buffer
from fleetd.errors import RemoteProtocolError
from fleetd.wire import TYPE_TRAITS, GgmlType, RpcTensor, check_type

# Types whose elements are plain array elements. BF16 is kept as raw uint16 and widened by
# kernels (numpy has no bfloat16).
ELEMENT_DTYPES: dict[int, np.dtype] = {
    GgmlType.F32: np.dtype("<f4"),
    GgmlType.F16: np.dtype("<f2"),
    GgmlType.BF16: np.dtype("<u2"),
    GgmlType.F64: np.dtype("<f8"),
    GgmlType.I8: np.dtype("i1"),
    GgmlType.I16: np.dtype("<i2"),
    GgmlType.I32: np.dtype("<i4"),
    GgmlType.I64: np.dtype("<i8"),
}


def check_extent(buf: Buffer, t: RpcTensor, what: str) -> int:
    """The stock deserializer's range check (an abort there, a closed connection here).
    Returns the tensor's byte offset inside its buffer."""
    n = t.nbytes
    if not buf.contains(t.data, n):
        raise RemoteProtocolError(
            f"{what}: tensor {t.describe()} at {t.data:#x}+{n} outside buffer "
            f"[{buf.base:#x}, {buf.base + buf.size:#x})"
        )
    return t.data - buf.base


def tensor_view(buf: Buffer, t: RpcTensor, what: str):
    """An array over the tensor's bytes, numpy order (ne3, ne2, ne1, ne0) with the wire strides.

    Quantized tensors become uint8 arrays of whole rows: (ne3, ne2, ne1, row_bytes).
    """
    check_type(t, what)
    offset = check_extent(buf, t, what)
    if t.nbytes == 0:
        return None
    dtype = ELEMENT_DTYPES.get(t.type)
    ne3, ne2, ne1, ne0 = t.ne[::-1]
    nb3, nb2, nb1, nb0 = t.nb[::-1]
    if dtype is not None:
        shape, strides = (ne3, ne2, ne1, ne0), (nb3, nb2, nb1, nb0)
    else:
        tr = TYPE_TRAITS[t.type]
        if ne0 % tr.blck_size or nb0 != tr.type_size:
            raise RemoteProtocolError(f"{what}: {t.describe()} is not made of whole packed blocks")
        dtype = np.dtype("u1")
        shape, strides = (ne3, ne2, ne1, ne0 // tr.blck_size * tr.type_size), (nb3, nb2, nb1, 1)
    return np.ndarray(shape, dtype, buffer=buf.array, offset=offset, strides=strides)
