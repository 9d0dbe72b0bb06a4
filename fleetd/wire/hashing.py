"""FNV-1a 64 as SET_TENSOR_HASH and the cache directory use it (cache files are named %016x)."""

from __future__ import annotations

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def fnv1a_64(data, h: int = FNV_OFFSET) -> int:
    """The reference, and the fallback of the C version (fleetd.compute.native) the server
    uses. FNV-1a is byte-serial, so no vectorised form exists; a plain int loop is the fastest
    pure-Python one (about 15 MB/s). `h` continues a hash: fnv1a_64(b, fnv1a_64(a)) ==
    fnv1a_64(a + b)."""
    for b in memoryview(data).cast("B").tobytes():
        h = ((h ^ b) * FNV_PRIME) & _MASK
    return h


def cache_file_name(h: int) -> str:
    return f"{h:016x}"
