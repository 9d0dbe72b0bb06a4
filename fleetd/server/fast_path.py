"""A session's fast path: whole SET_TENSOR and GET_TENSOR requests on the session's own buffers,
served in C (fleetd/compute/native/fastpath.c) straight from the receive buffer; and between
requests the loop (`loop()`), which reads the socket itself and also hands an armed
GRAPH_RECOMPUTE to the session's compute worker, so a decode step needs no interpreter at all
(docs/DESIGN.md, "The session's fast path").

A decode step sends each node a few small SET_TENSORs and one GET_TENSOR besides its graph; in
Python each costs ~8 us of interpreter time, more than the stock server spends on it in C. The C
side serves only what the Python path (regions.region) would accept and stops at the first
request it is not sure of, which the session then serves as always, with its own error. So it
changes no rule: it makes the common, valid case cheap.

It is limited to buffers the session allocated, because only the session's own thread can free
those: the host pointers it hands to C cannot go away during the call. Writes into another
session's buffer (a peer's COPY_TENSOR_TO destination) keep the Python path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import threading
from collections import Counter
from typing import TYPE_CHECKING

from fleetd.compute import native
from fleetd.compute.ggml.channel import SERVE, SERVE_REGION
from fleetd.wire import GGML_TYPE_COUNT, Cmd

if TYPE_CHECKING:
    import socket

    from fleetd.compute.buffers import Buffer
    from fleetd.server.stats import CommandCounters
    from fleetd.wire import ServerConnection

# The smallest request the C side can serve (a SET_TENSOR of one byte); less buffered than this
# and the call is not worth making.
SMALLEST = 9 + 305 + 1
_FAST_COMMANDS = (Cmd.SET_TENSOR, Cmd.GET_TENSOR)
_SERVED_FIELDS = [name for name, _ in native.FastServed._fields_]
_SERVED_SIZE = ctypes.sizeof(native.FastServed)
_SERVED_OFFSET = native.FastContext.served.offset
RECOMPUTE_BYTES = 9 + 4  # a GRAPH_RECOMPUTE request: header and device
GATE_BYTES = 9 + 16  # a PEER_GATE request: header, stream, seq
ANSWER_BYTES = 8 + 1  # PEER_GATE's and PEER_PUSH's answer: size, one byte
ALIGNMENT_BYTES = 9 + 4  # a GET_ALIGNMENT request: header and device
ALIGNMENT_REPLY_BYTES = 8 + 8  # its answer: size, the alignment
# Between requests, how long C waits for a byte before the session's own recv (and its idle
# timeout) takes over, letting go of the worker's lock; and how long C serves without a break
# (the counters are live meanwhile: this bounds how long the worker stays locked to it).
LOOP_WAIT_MS = 20
LOOP_BUDGET_MS = 100
# A stint's: its counts are live (the worker's page) and a session that starts computing asks
# it to end (WorkerPool.begin_stint), so this only bounds how long the daemon goes without
# seeing the connection; each new stint costs ~0.5-1 ms of Python on both sides (at 500 ms, a
# lab node's daemon spent 12-26 us a token restarting them).
STINT_BUDGET_MS = 5000
_SIZE = struct.Struct("<Q")
_LOOP_NAMES = {
    native.LOOP_PYTHON: "python",
    native.LOOP_IDLE: "idle",
    native.LOOP_EOF: "eof",
    native.LOOP_ERROR: "error",
    native.LOOP_BUDGET: "budget",
    native.LOOP_WORKER: "worker",
    native.LOOP_BODY: "body",
}

_BLCK, _TSIZE = native.type_tables()


class FastPath:
    """One session's C fast path; `serve()` before each next_event, `set_buffers()` whenever the
    session's own buffers change."""

    def __init__(
        self, sock: socket.socket, counters: CommandCounters | None, count_commands: bool = True
    ) -> None:
        self._fn = native.fast_requests()
        # the session's counters: per command when count_commands, graph computes always
        self._counters = counters
        self._count_commands = count_commands and counters is not None
        self._buffers: list[Buffer] = []
        self._regions = (native.FastRegion * 0)()
        self._ctx = native.FastContext()
        self._ctx.fd = sock.fileno()
        self._ctx.blck = _BLCK
        self._ctx.tsize = _TSIZE
        self._ctx.n_types = GGML_TYPE_COUNT
        self._ctx_ref = ctypes.byref(self._ctx)
        # C's counts (ctx.served) only grow; _folded is what the counters hold of them so far.
        # A reader on another thread (the control API) adds the difference (add_pending()).
        self._folded = native.FastServed()
        self.lock = threading.Lock()
        self._loop = native.fast_loop()
        self._ctx.rc.device = -1
        self._written = (ctypes.c_int32 * 0)()
        self._armed: tuple | None = None  # what arm() last set up
        self.handovers = 0  # GRAPH_RECOMPUTEs C handed over whose answer Python read (LOOP_WORKER)
        self.stints = 0  # stints begun: the connection served by the session's worker for a while
        self._live: native.FastServed | None = None  # a stint's counts, in its worker's page
        self._live_folded = native.FastServed()  # what of them a counters reset took
        self.buffer_serves = 0  # serve() calls that served requests Python had read (not the loop)
        self.loop_answers: Counter[int] = Counter()  # LOOP_* -> times the loop gave it back

    def summary(self) -> str:
        """Where this session's requests went, for the debug log: how many C served, and why its
        loop gave the connection back to Python how often."""
        back = ", ".join(f"{_LOOP_NAMES.get(a, a)} {n}" for a, n in sorted(self.loop_answers.items()))
        return (
            f"{self.requests_served} requests served in C; loop gave back: {back or 'never'}; "
            f"{self.buffer_serves} serves from Python's buffer; {self.stints} stints in the worker"
        )

    @property
    def available(self) -> bool:
        return self._fn is not None

    def set_alignments(self, alignments: list[int]) -> None:
        """Each device's GET_ALIGNMENT answer, for C to give (a device beyond FAST_DEVICES, or
        out of range, stays Python's, which closes the connection as before)."""
        n = min(len(alignments), native.FAST_DEVICES)
        for i in range(n):
            self._ctx.align[i] = alignments[i]
        self._ctx.n_align = n

    def set_buffers(self, buffers: list[Buffer]) -> None:
        """The session's own buffers with bytes in host memory, as they are now."""
        own = [b for b in buffers if b.size and not b.freed and hasattr(b.array, "ctypes")]
        regions = (native.FastRegion * len(own))()
        for r, b in zip(regions, own):
            r.handle, r.base, r.size = b.handle, b.base, b.size
            r.host = b.array.ctypes.data  # type: ignore[attr-defined]
        self._buffers, self._regions = own, regions
        self._ctx.regions = regions
        self._ctx.n_regions = len(own)

    def serve(self, conn: ServerConnection) -> int:
        """Serve the whole fast requests at the front of `conn`'s receive buffer; returns how
        many were served (0: the next request is Python's). Raises what sendall would: a
        BlockingIOError when the client took no reply bytes within the send timeout, a
        ConnectionError when it is gone."""
        if self._fn is None or not self._buffers:
            return 0
        pending = conn.pending_requests()
        if pending is None or pending[2] < SMALLEST:
            return 0
        raw, start, n = pending
        # Only a whole SET/GET at the front is worth the call (~1 us of ctypes when it serves
        # nothing): a 16 KiB hidden state arrives in several reads and goes straight into its
        # buffer on the Python path, with no copy through the receive buffer.
        if raw[start] not in _FAST_COMMANDS or _SIZE.unpack_from(raw, start + 1)[0] > n - 9:
            return 0
        front = (ctypes.c_char * n).from_buffer(raw, start)
        try:
            used = self._fn(self._ctx_ref, front, n)
        finally:
            del front  # the receive buffer may grow again
        ctx = self._ctx
        if used:
            self.buffer_serves += 1
            self._account(conn, used)
        if ctx.error:
            code = -ctx.error
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise BlockingIOError(code, os.strerror(code))
            raise ConnectionError(code, f"reply not sent: {os.strerror(code)}")
        return used

    # -- the loop: recv and serve in C, the armed GRAPH_RECOMPUTE included ---------------------

    @property
    def loop_available(self) -> bool:
        # a session without buffers of its own (a source daemon's link) may still have pushes
        return self._loop is not None and (bool(self._buffers) or bool(self._ctx.peer.streams))

    def set_peer(self, streams: int | None, owner: int, p2p, frees) -> None:
        """Let the loop stage PEER_PUSHes and answer PEER_GATEs from `streams` (peer_stage.c's
        table; None: both stay Python's), as session `owner`, under the daemon's P2P switch
        `p2p` and the registry's free count `frees` (ctypes cells)."""
        peer = self._ctx.peer
        if not streams or self._loop is None:
            peer.streams = None
            return
        self._peer_cells = (p2p, frees)  # the cells outlive the loop's pointers to them
        peer.streams, peer.owner = streams, owner
        peer.p2p, peer.frees = ctypes.pointer(p2p), ctypes.pointer(frees)
        peer.gate_ms = LOOP_WAIT_MS

    def set_routes(self, routes: list) -> None:
        """The source side's routes (native.FastRoute, kept alive by the caller) the loop may
        push on: each only while its fd is set (fleetd.server.peer_async arms them)."""
        if self._loop is None or not self._ctx.peer.streams:
            return
        array = (ctypes.POINTER(native.FastRoute) * len(routes))(*(ctypes.pointer(r) for r in routes))
        self._routes = array
        self._ctx.peer.routes = array
        self._ctx.peer.n_routes = len(routes)

    def written_regions(self, buffers) -> list[int] | None:
        """The region indices of `buffers` (what a graph writes); None when one is not the
        session's own (C could not mark it written)."""
        index = {id(b): i for i, b in enumerate(self._buffers)}
        out = [index.get(id(b)) for b in buffers]
        return None if None in out else out  # type: ignore[return-value]

    def arm(
        self,
        device: int,
        worker_fd: int,
        threads: int,
        written: list[int],
        frees,
        frees_seen: int,
        computing,
        timeout_s: float,
    ) -> None:
        """Let the next loop hand GRAPH_RECOMPUTE of `device` to the worker on `worker_fd`."""
        rc = self._ctx.rc
        key = (worker_fd, threads, tuple(written), id(frees), id(computing), timeout_s)
        if key == self._armed:  # as last time: nothing to rebuild
            rc.device, rc.frees_seen = device, frees_seen
            return
        self._armed = key
        self._written = (ctypes.c_int32 * len(written))(*written)
        rc.device, rc.worker_fd, rc.threads = device, worker_fd, threads
        rc.n_written, rc.written = len(written), self._written
        rc.frees, rc.frees_seen = ctypes.pointer(frees), frees_seen
        rc.computing = ctypes.pointer(computing)
        rc.timeout_ns = int(timeout_s * 1e9)

    def set_request_rules(self, timeout_s: float, min_rate: int) -> None:
        """The rules a SET_TENSOR too large for the loop's buffer is streamed under in C (the
        session's for a started request); until called, such SETs are Python's."""
        body = self._ctx.body
        body.timeout_ms, body.min_rate = max(1, int(timeout_s * 1000)), min_rate

    def body_cut(self) -> tuple[int, int, float, int]:
        """After LOOP_BODY: (fleetd_recv_body's reason, the request's bytes, seconds it waited,
        the command)."""
        body = self._ctx.body
        return body.why, body.got, body.waited_ns / 1e9, body.cmd

    def disarm(self) -> None:
        self._ctx.rc.device = -1

    @property
    def handed_over_at(self) -> float:
        """time.monotonic() when the loop handed its last GRAPH_RECOMPUTE to the worker."""
        return self._ctx.rc.started_ns / 1e9

    def loop(self, scratch, capacity: int) -> tuple[int, int]:
        """Serve in C from `scratch` (a ctypes buffer of `capacity` bytes, empty) until a request
        is Python's; (LOOP_* answer, bytes of the next request left at scratch's front). While
        it runs, what it serves is counted where add_pending() reads it; after, it is folded into
        the counters. Raises what serve() raises when a reply could not be sent, OSError when a
        recv failed."""
        ctx = self._ctx
        ctx.have = 0
        answer = self._loop(self._ctx_ref, scratch, capacity, LOOP_WAIT_MS, LOOP_BUDGET_MS)
        self.loop_answers[answer] += 1
        self._fold()
        if answer == native.LOOP_ERROR:
            code = -ctx.error
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise BlockingIOError(code, os.strerror(code))
            raise ConnectionError(code, f"fast loop: {os.strerror(code)}")
        return answer, ctx.have

    # -- a stint: the same loop in the session's worker, which then holds the connection --------

    def stint_request(self) -> bytes:
        """MSG_SERVE's payload for the armed graph: its device and threads, the budget, the
        session's regions (the worker serves those it maps), the regions the graph writes, the
        alignments C answers."""
        ctx, rc = self._ctx, self._ctx.rc
        parts = [SERVE.pack(rc.device, rc.threads, STINT_BUDGET_MS, ctx.n_regions, rc.n_written, ctx.n_align)]
        parts += [SERVE_REGION.pack(r.handle, r.base, r.size) for r in self._regions]
        parts.append(struct.pack(f"<{rc.n_written}I", *self._written))
        parts.append(struct.pack(f"<{ctx.n_align}Q", *ctx.align[: ctx.n_align]))
        return b"".join(parts)

    def begin_stint(self, page) -> None:
        """Before a stint: the worker's loop context will lie at the start of `page` (a shared
        numpy array of the worker's), zeroed here; its counts are read live from there until
        stint_done()."""
        with self.lock:
            page[:] = 0
            self._live = native.FastServed.from_buffer(page, _SERVED_OFFSET)
        self.stints += 1

    def stint_lost(self) -> None:
        """A stint that ended without an answer (its worker died or was killed): what its page
        counted is folded in, and the page let go."""
        if self._live is not None:
            self._fold_stint()

    def _fold_stint(self) -> None:
        """The stint's counts (its page) into the loop's own, the page let go."""
        served = native.FastServed.from_buffer_copy(self._live)
        with self.lock:  # a reader sees the stint's counts live or folded in, never both
            base, folded = self._live_folded, self._folded
            for name in _SERVED_FIELDS:
                setattr(self._ctx.served, name, getattr(self._ctx.served, name) + getattr(served, name))
                setattr(folded, name, getattr(folded, name) + getattr(base, name))
            self._live = None
            self._live_folded = native.FastServed()

    def stint_done(self, result) -> None:
        """Take in what a stint served (a workers.StintResult, and the counts in its page): its
        counts and written regions, folded as after the loop. Raises as loop() does for a reply
        the worker could not send; ValueError for an answer that does not fit this session (the
        caller kills the worker)."""
        self._fold_stint()
        if len(result.written) != len(self._regions):
            raise ValueError(f"{len(result.written)} written flags for {len(self._regions)} regions")
        for r, flag in zip(self._regions, result.written):
            if flag:
                r.written = 1
        self.loop_answers[result.answer] += 1
        self._fold()
        if result.answer == native.LOOP_ERROR:
            code = -result.error
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise BlockingIOError(code, os.strerror(code))
            raise ConnectionError(code, f"fast loop in the worker: {os.strerror(code)}")

    def _account(self, conn: ServerConnection, used: int) -> None:
        self._fold()
        conn.served(used)

    @property
    def requests_served(self) -> int:
        """Requests C served since the session began (tests, diagnostics)."""
        total = 0
        for s in (self._ctx.served, self._live):  # a stint's still in its worker's page
            if s is not None:
                total += s.set_count + s.get_count + s.recompute_count + s.gate_count
                total += s.push_count + s.copy_count + s.align_count
        return total

    def _pending(self) -> dict[str, int]:
        """What C served that the counters do not hold yet, per FastServed field (under `lock`)."""
        served, folded, live = self._ctx.served, self._folded, self._live
        pending = {name: getattr(served, name) - getattr(folded, name) for name in _SERVED_FIELDS}
        if live is not None:
            base = self._live_folded
            for name in _SERVED_FIELDS:
                pending[name] += getattr(live, name) - getattr(base, name)
        return pending

    def add_pending(self, counters: CommandCounters) -> None:
        """Add to `counters` (a copy of the session's) what C served since the last fold."""
        with self.lock:
            self._add(counters, self._pending(), self._count_commands)

    def mark_folded(self) -> None:
        """Count what C served so far as folded in (caller holds `lock`; the session's counters
        are being zeroed)."""
        ctypes.memmove(ctypes.addressof(self._folded), ctypes.addressof(self._ctx.served), _SERVED_SIZE)
        if self._live is not None:  # and of a stint's, what its worker counted so far
            self._live_folded = native.FastServed.from_buffer_copy(self._live)

    @staticmethod
    def _add(c: CommandCounters, d: dict[str, int], per_command: bool) -> None:
        recomputes = d["recompute_count"]
        c.graph_computes += recomputes
        c.compute_seconds += d["recompute_ns"] / 1e9
        if not per_command:
            return
        c.count[Cmd.SET_TENSOR] += d["set_count"]
        c.request_bytes[Cmd.SET_TENSOR] += d["set_bytes"]
        c.count[Cmd.GET_TENSOR] += d["get_count"]
        c.request_bytes[Cmd.GET_TENSOR] += d["get_bytes"]
        c.response_bytes[Cmd.GET_TENSOR] += d["get_reply_bytes"]
        c.count[Cmd.GRAPH_RECOMPUTE] += recomputes
        c.request_bytes[Cmd.GRAPH_RECOMPUTE] += recomputes * RECOMPUTE_BYTES
        gates, pushes = d["gate_count"], d["push_count"]
        c.count[Cmd.PEER_GATE] += gates
        c.request_bytes[Cmd.PEER_GATE] += gates * GATE_BYTES
        c.response_bytes[Cmd.PEER_GATE] += gates * ANSWER_BYTES
        c.count[Cmd.PEER_PUSH] += pushes
        c.request_bytes[Cmd.PEER_PUSH] += d["push_bytes"]
        c.response_bytes[Cmd.PEER_PUSH] += pushes * ANSWER_BYTES
        c.count[Cmd.COPY_TENSOR_TO_ASYNC] += d["copy_count"]
        c.request_bytes[Cmd.COPY_TENSOR_TO_ASYNC] += d["copy_bytes"]
        aligns = d["align_count"]
        c.count[Cmd.GET_ALIGNMENT] += aligns
        c.request_bytes[Cmd.GET_ALIGNMENT] += aligns * ALIGNMENT_BYTES
        c.response_bytes[Cmd.GET_ALIGNMENT] += aligns * ALIGNMENT_REPLY_BYTES

    def _fold(self) -> None:
        """Fold what C served into the counters and the buffers' write generations (the
        session's thread, C not running)."""
        for r, b in zip(self._regions, self._buffers):
            if r.written:
                r.written = 0
                b.touched()
        if self._counters is None:
            return
        with self.lock:
            self._add(self._counters, self._pending(), self._count_commands)
            self.mark_folded()
