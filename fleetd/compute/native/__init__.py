"""libfleetd-native (fnv1a.c next to this file) through ctypes: FNV-1a 64 at C speed for the cache
directory. scripts/build-llama.sh builds it into the ggml libraries' directory and it is found the
same way (fleetd.compute.ggml.lib.library_dirs). Without it fleetd.wire.hashing's pure Python
version (the reference, ~15 MB/s) runs, with one warning.
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
_loaded: list = []  # [fnv function or None] once a load was tried


def load() -> ctypes.CDLL:
    """The library from the first directory that has it; OSError says where it looked."""
    tried = []
    for directory in library_dirs():
        path = Path(directory) / LIBRARY
        if path.exists():
            lib = ctypes.CDLL(str(path))
            lib.fleetd_fnv1a_64.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
            lib.fleetd_fnv1a_64.restype = ctypes.c_uint64
            return lib
        tried.append(str(directory))
    raise OSError(f"{LIBRARY} not found in {', '.join(tried)} (run scripts/build-llama.sh ggml)")


def _native_fnv():
    if not _loaded:
        with _lock:
            if not _loaded:
                try:
                    _loaded.append(load().fleetd_fnv1a_64)
                except OSError as exc:
                    log.warning("%s; FNV-1a of the cache directory runs in pure Python (~15 MB/s)", exc)
                    _loaded.append(None)
    return _loaded[0]


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
