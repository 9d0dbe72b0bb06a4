"""libfleetd-native (the C files next to this file) through ctypes: FNV-1a 64 at C speed for the
cache directory (fnv1a.c), the sessions' fast path for whole SET_TENSOR / GET_TENSOR requests
and the stored graph's GRAPH_RECOMPUTE (fastpath.c, used by fleetd.server.fast_path), and a
compute worker's loop for those recomputes (worker_loop.c, used by fleetd.compute.ggml.worker),
and the asynchronous peer copy's staging (peer_stage.c, used by fleetd.server.peer_streams and
by the sessions' loops).
scripts/build-llama.sh builds it into the ggml libraries' directory and it is found the same
way (fleetd.compute.ggml.lib.library_dirs).
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


# Every function fleetd calls in the library: name -> (argtypes, restype).
_SIGNATURES: dict[str, tuple[list, object]] = {
    "fleetd_fnv1a_64": ([ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64], ctypes.c_uint64),
    "fleetd_fast_requests": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_size_t),
    "fleetd_fast_loop": (
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int],
        ctypes.c_int,
    ),
    "fleetd_atomic_add": ([ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32),
    "fleetd_recv_body": (
        [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_int),
        ],
        ctypes.c_size_t,
    ),
    "fleetd_worker_loop": ([ctypes.c_void_p], ctypes.c_int),
    # peer_stage.c
    "fleetd_streams_new": ([ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint32], ctypes.c_void_p),
    "fleetd_mem_reserve": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64], ctypes.c_int),
    "fleetd_mem_release": ([ctypes.c_void_p, ctypes.c_uint64], None),
    "fleetd_mem_held": ([ctypes.c_void_p], ctypes.c_int64),
    "fleetd_mem_set_limit": ([ctypes.c_void_p, ctypes.c_int64], None),
    "fleetd_streams_open": ([ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64], ctypes.c_int),
    "fleetd_streams_close_owner": ([ctypes.c_void_p, ctypes.c_int64], None),
    "fleetd_streams_vouch": (
        [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64],
        None,
    ),
    "fleetd_streams_admit": (
        [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_void_p),
        ],
        ctypes.c_int,
    ),
    "fleetd_streams_stage": (
        [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
        ],
        None,
    ),
    "fleetd_streams_refuse": (
        [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64],
        None,
    ),
    "fleetd_streams_wait": (
        [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_uint64),
        ],
        ctypes.c_int,
    ),
    "fleetd_streams_settle": (
        [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        ctypes.c_void_p,
    ),
    "fleetd_streams_done": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64], None),
    "fleetd_route_drain": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "fleetd_route_read_answers": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_size_t),
    "fleetd_route_push": (
        [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
        ],
        ctypes.c_int,
    ),
    "fleetd_route_clear": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], None),
    "fleetd_route_layout": ([ctypes.c_int], ctypes.c_size_t),
}


def load() -> ctypes.CDLL:
    """The library from the first directory that has it; OSError says where it looked."""
    tried = []
    for directory in library_dirs():
        path = Path(directory) / LIBRARY
        if path.exists():
            lib = ctypes.CDLL(str(path), use_errno=True)  # WORKER_ERROR reports it
            for name, (argtypes, restype) in _SIGNATURES.items():
                fn = getattr(lib, name, None)  # an older build lacks the later ones
                if fn is not None:
                    fn.argtypes, fn.restype = argtypes, restype
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


def _function(name: str):
    """The library's function `name`, or None without the library (or in an older build)."""
    lib = _library()
    return getattr(lib, name, None) if lib is not None else None


def _native_fnv():
    return _function("fleetd_fnv1a_64")


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
    """fastpath.c's `struct fleetd_served`: what C served, for the counters (only grows)."""

    _fields_ = [
        ("set_count", ctypes.c_uint64),
        ("set_bytes", ctypes.c_uint64),
        ("get_count", ctypes.c_uint64),
        ("get_bytes", ctypes.c_uint64),
        ("get_reply_bytes", ctypes.c_uint64),
        ("recompute_count", ctypes.c_uint64),
        ("recompute_ns", ctypes.c_uint64),
        ("gate_count", ctypes.c_uint64),
        ("push_count", ctypes.c_uint64),
        ("push_bytes", ctypes.c_uint64),
        ("copy_count", ctypes.c_uint64),
        ("copy_bytes", ctypes.c_uint64),
        ("align_count", ctypes.c_uint64),
    ]


class FastRecompute(ctypes.Structure):
    """fastpath.c's `struct fleetd_recompute`: the stored graph a loop may hand to the worker."""

    _fields_ = [
        ("device", ctypes.c_int32),
        ("worker_fd", ctypes.c_int32),
        ("threads", ctypes.c_uint32),
        ("n_written", ctypes.c_int32),
        ("written", ctypes.POINTER(ctypes.c_int32)),
        ("frees", ctypes.POINTER(ctypes.c_uint64)),
        ("frees_seen", ctypes.c_uint64),
        ("computing", ctypes.POINTER(ctypes.c_int32)),
        ("timeout_ns", ctypes.c_int64),
        ("started_ns", ctypes.c_int64),
        ("inline_worker", ctypes.c_void_p),  # a WorkerState in the session's worker, else None
        ("inline_status", ctypes.c_int32),
        ("yield_asked", ctypes.c_int32),  # set by the daemon in a stint's page (WorkerPool)
    ]


class FastBody(ctypes.Structure):
    """fastpath.c's `struct fleetd_body`: the rules a large SET_TENSOR streams under, and why
    one was cut."""

    _fields_ = [
        ("timeout_ms", ctypes.c_int32),
        ("why", ctypes.c_int32),
        ("min_rate", ctypes.c_uint64),
        ("waited_ns", ctypes.c_int64),
        ("got", ctypes.c_uint64),
        ("cmd", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


ROUTE_RING, ROUTE_ENDPOINT = 64, 260
PUSH_SENT, PUSH_LANDED, PUSH_FAILED = 1, 2, 3


class FastPush(ctypes.Structure):
    """peer_stage.h's `struct fleetd_push`: one push a loop sent on a route."""

    _fields_ = [
        ("stream", ctypes.c_uint64),
        ("seq", ctypes.c_uint64),
        ("size", ctypes.c_uint64),
        ("data", ctypes.c_void_p),
        ("state", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    ]


class FastRoute(ctypes.Structure):
    """peer_stage.h's `struct fleetd_route`: a (stream, endpoint) whose link a loop pushes on."""

    _fields_ = [
        ("stream", ctypes.c_uint64),
        ("last_seq", ctypes.c_uint64),
        ("fd", ctypes.c_int32),
        ("ep_len", ctypes.c_int32),
        ("ep", ctypes.c_uint8 * ROUTE_ENDPOINT),
        ("broken", ctypes.c_int32),
        ("head", ctypes.c_uint32),
        ("n", ctypes.c_uint32),
        ("answered", ctypes.c_uint32),
        ("pushed_count", ctypes.c_uint64),
        ("pushed_bytes", ctypes.c_uint64),
        ("landed_count", ctypes.c_uint64),
        ("landed_bytes", ctypes.c_uint64),
        ("ring", FastPush * ROUTE_RING),
    ]


class FastPeer(ctypes.Structure):
    """fastpath.c's `struct fleetd_peer`: the peer copy's staging a loop serves PEER_PUSH and
    PEER_GATE from (streams NULL: both are Python's)."""

    _fields_ = [
        ("streams", ctypes.c_void_p),
        ("owner", ctypes.c_int64),
        ("p2p", ctypes.POINTER(ctypes.c_int32)),
        ("frees", ctypes.POINTER(ctypes.c_uint64)),
        ("gate_ms", ctypes.c_int32),
        ("n_routes", ctypes.c_int32),
        ("routes", ctypes.POINTER(ctypes.POINTER(FastRoute))),
    ]


FAST_DEVICES = 8  # fastpath.c's: devices whose GET_ALIGNMENT C answers


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
        ("have", ctypes.c_uint64),
        ("rc", FastRecompute),
        ("body", FastBody),
        ("peer", FastPeer),
        ("align", ctypes.c_uint64 * FAST_DEVICES),
        ("n_align", ctypes.c_int32),
    ]


def type_tables():
    """(blck, tsize): per ggml type, elements per block (0: no such type) and bytes per block,
    as fastpath.c's bounds arithmetic reads them."""
    global _TYPE_TABLES
    if _TYPE_TABLES is None:
        from fleetd.wire import GGML_TYPE_COUNT, TYPE_TRAITS

        _TYPE_TABLES = (
            (ctypes.c_uint32 * GGML_TYPE_COUNT)(
                *(TYPE_TRAITS[t].blck_size if t in TYPE_TRAITS else 0 for t in range(GGML_TYPE_COUNT))
            ),
            (ctypes.c_uint32 * GGML_TYPE_COUNT)(
                *(TYPE_TRAITS[t].type_size if t in TYPE_TRAITS else 0 for t in range(GGML_TYPE_COUNT))
            ),
        )
    return _TYPE_TABLES


_TYPE_TABLES = None


def fast_requests():
    """fastpath.c's fleetd_fast_requests(context, data, length) -> bytes served, or None when the
    library is not there (or too old to have it)."""
    return _function("fleetd_fast_requests")


def fast_loop():
    """fastpath.c's fleetd_fast_loop(context, buffer, capacity, wait_ms, budget_ms) -> LOOP_*, or
    None without the library (or with one too old to have it)."""
    return _function("fleetd_fast_loop")


def recv_body():
    """fastpath.c's fleetd_recv_body(fd, dst, n, timeout_ms, min_rate, &waited_ns, &got, &why)
    -> bytes read, or None without the library."""
    return _function("fleetd_recv_body")


# fleetd_recv_body's reasons to stop early (its *why)
BODY_TOO_SLOW, BODY_NO_BYTE, BODY_CLOSED = 1, 2, 3

# fleetd_fast_loop's answers (fastpath.c)
LOOP_PYTHON, LOOP_IDLE, LOOP_EOF, LOOP_ERROR, LOOP_BUDGET, LOOP_WORKER, LOOP_BODY = range(1, 8)


class SharedCount:
    """An int32 that C (fleetd_fast_loop) and Python both change atomically: the compute pool's
    count of sessions computing now."""

    def __init__(self) -> None:
        self._add = _function("fleetd_atomic_add")
        self.cell = ctypes.c_int32(0)
        self._lock = threading.Lock()  # without the library: nothing in C shares the cell

    def add(self, delta: int) -> int:
        """Add `delta`; the new value."""
        if self._add is not None:
            return self._add(ctypes.byref(self.cell), delta)
        with self._lock:
            self.cell.value += delta
            return self.cell.value

    @property
    def value(self) -> int:
        return self.cell.value


class WorkerCopy(ctypes.Structure):
    """worker_loop.c's `struct fleetd_copy`: a padded tensor's bytes, refreshed per RUN."""

    _fields_ = [("src", ctypes.c_void_p), ("dst", ctypes.c_void_p), ("n", ctypes.c_uint64)]


class WorkerIndexCheck(ctypes.Structure):
    """worker_loop.c's `struct fleetd_index_check`: row ids copied out and checked per RUN."""

    _fields_ = [
        ("src", ctypes.c_void_p),
        ("copy", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_int64 * 4),
        ("bound", ctypes.c_int64),
        ("elem", ctypes.c_int32),
    ]


class WorkerState(ctypes.Structure):
    """worker_loop.c's `struct fleetd_worker`: what one RUN of the built graph takes."""

    _fields_ = [
        ("fd", ctypes.c_int),
        ("backend", ctypes.c_void_p),
        ("graph", ctypes.c_void_p),
        ("compute", ctypes.c_void_p),
        ("set_threads", ctypes.c_void_p),
        ("threads", ctypes.c_uint32),
        ("n_copies", ctypes.c_int32),
        ("copies", ctypes.POINTER(WorkerCopy)),
        ("n_checks", ctypes.c_int32),
        ("checks", ctypes.POINTER(WorkerIndexCheck)),
        ("failed", ctypes.c_int32),
        ("runs", ctypes.c_uint64),
    ]


# fleetd_worker_loop's answers (worker_loop.c)
WORKER_PYTHON, WORKER_REFUSED, WORKER_FAILED, WORKER_CLOSED, WORKER_ERROR = range(1, 6)


def worker_loop():
    """worker_loop.c's fleetd_worker_loop(state) -> WORKER_*, or None without the library. A
    compute worker calls this first in its fork server, so the library is mapped before the
    sandbox forbids opening it."""
    return _function("fleetd_worker_loop")


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


def peer_stage():
    """The library when it has peer_stage.c's functions (fleetd_streams_*, fleetd_mem_*), else
    None: fleetd.server.peer_streams then keeps its pure Python staging."""
    lib = _library()
    return lib if lib is not None and hasattr(lib, "fleetd_streams_settle") else None
