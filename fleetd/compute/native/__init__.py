"""libfleetd-native (the C files next to this file) through ctypes: FNV-1a 64 at C speed for the
cache directory (fnv1a.c), and the sessions' fast path for whole SET_TENSOR / GET_TENSOR requests
(fastpath.c, used by fleetd.server.fast_path). scripts/build-llama.sh builds it into the ggml
libraries' directory and it is found the same way (fleetd.compute.ggml.lib.library_dirs).
Without it fleetd.wire.hashing's pure Python FNV-1a (the reference, ~15 MB/s) runs, with one
warning, and every request takes the Python path.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import numpy as np

from fleetd.compute.ggml.lib import library_dirs
from fleetd.wire import hashing

LIBRARY = "libfleetd-native.so"

log = logging.getLogger("fleetd.native")
_lock = threading.Lock()
_loaded: list = []  # [library or None] once a load was tried


def load() -> ctypes.CDLL:
    """The library from the first directory that has it; OSError says where it looked."""
    tried = []
    for directory in library_dirs():
        path = Path(directory) / LIBRARY
        if path.exists():
            lib = ctypes.CDLL(str(path))
            lib.fleetd_fnv1a_64.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
            lib.fleetd_fnv1a_64.restype = ctypes.c_uint64
            if hasattr(lib, "fleetd_fast_requests"):  # an older build has only the hash
                lib.fleetd_fast_requests.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
                lib.fleetd_fast_requests.restype = ctypes.c_size_t
            return lib
        tried.append(str(directory))
    raise OSError(f"{LIBRARY} not found in {', '.join(tried)} (run scripts/build-llama.sh ggml)")


def _library() -> ctypes.CDLL | None:
    if not _loaded:
        with _lock:
            if not _loaded:
                try:
                    _loaded.append(load())
                except OSError as exc:
                    log.warning("%s; FNV-1a of the cache directory runs in pure Python (~15 MB/s)", exc)
                    _loaded.append(None)
    return _loaded[0]


def _native_fnv():
    lib = _library()
    return lib.fleetd_fnv1a_64 if lib is not None else None


class FastRegion(ctypes.Structure):
    """fastpath.c's `struct fleetd_region`: one buffer of the session (handle, range, memory)."""

    _fields_ = [
        ("handle", ctypes.c_uint64),
        ("base", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("host", ctypes.c_void_p),
        ("written", ctypes.c_uint64),
    ]


class FastServed(ctypes.Structure):
    """fastpath.c's `struct fleetd_served`: what one call served, for the counters."""

    _fields_ = [
        ("set_count", ctypes.c_uint64),
        ("set_bytes", ctypes.c_uint64),
        ("get_count", ctypes.c_uint64),
        ("get_bytes", ctypes.c_uint64),
        ("get_reply_bytes", ctypes.c_uint64),
    ]


class FastContext(ctypes.Structure):
    """fastpath.c's `struct fleetd_fast`: one session's fast path, set up once."""

    _fields_ = [
        ("fd", ctypes.c_int),
        ("n_regions", ctypes.c_int),
        ("regions", ctypes.POINTER(FastRegion)),
        ("blck", ctypes.POINTER(ctypes.c_uint32)),
        ("tsize", ctypes.POINTER(ctypes.c_uint32)),
        ("n_types", ctypes.c_uint32),
        ("error", ctypes.c_int),
        ("served", FastServed),
    ]


def fast_requests():
    """fastpath.c's fleetd_fast_requests(context, data, length) -> bytes served, or None when the
    library is not there (or too old to have it)."""
    lib = _library()
    return getattr(lib, "fleetd_fast_requests", None) if lib is not None else None


def native_available() -> bool:
    return _native_fnv() is not None


def fnv1a_64(data, h: int = hashing.FNV_OFFSET) -> int:
    """FNV-1a 64 of a contiguous buffer (bytes, bytearray, memoryview, numpy array), read in
    place; ctypes drops the GIL for the call, so other sessions run meanwhile. `h` continues
    a hash, as in fleetd.wire.hashing."""
    fn = _native_fnv()
    if fn is None:
        return hashing.fnv1a_64(data, h)
    view = np.frombuffer(memoryview(data).cast("B"), np.uint8)  # no copy; raises if not contiguous
    return fn(view.ctypes.data, view.size, h)
