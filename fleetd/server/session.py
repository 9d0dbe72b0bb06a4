"""One session per connection: the wsproto-style blocking loop over a ServerConnection.

recv_into -> receive_data -> next_event -> HANDLERS[type(event)] -> a reply event sent through the
connection. A session reads and writes the daemon's ServerState (never the daemon) and owns its
peer links. A peer's protocol error closes this socket with one log line; our own bug logs a
traceback and closes this socket; the daemon and every other session carry on.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetd.compute import native
from fleetd.compute.buffers import Buffer
from fleetd.compute.ggml.channel import REPLY_REFUSED
from fleetd.compute.ggml.workers import WorkerDied
from fleetd.compute.views import check_extent
from fleetd.errors import ComputeError, FleetdError, RemoteProtocolError
from fleetd.server import fast_path, regions
from fleetd.server.fast_path import RECOMPUTE_BYTES, FastPath
from fleetd.server.fast_path import SMALLEST as FAST_SMALLEST
from fleetd.server.graph_bounds import check_graph
from fleetd.server.peer import PeerLinks, serve_copy
from fleetd.server.peer_async import AsyncCopies
from fleetd.server.stats import CommandCounters
from fleetd.transport.stream import closed_by_peer, set_recv_timeout, set_send_timeout
from fleetd.wire import (
    NEED_DATA,
    PROTOCOL_VERSION,
    AllocBuffer,
    AllocBufferReply,
    BufferClear,
    BufferGetBase,
    BufferGetBaseReply,
    Cmd,
    CopyTensor,
    CopyTensorReply,
    CopyTensorTo,
    CopyTensorToAsync,
    CopyTensorToReply,
    DataReply,
    DeviceCount,
    DeviceCountReply,
    FreeBuffer,
    GetAlignment,
    GetAlignmentReply,
    GetAllocSize,
    GetAllocSizeReply,
    GetDeviceMemory,
    GetDeviceMemoryReply,
    GetMaxSize,
    GetMaxSizeReply,
    GetTensor,
    GraphCompute,
    GraphRecompute,
    Hello,
    HelloReply,
    InitTensor,
    MemsetTensor,
    PeerBarrier,
    PeerBarrierReply,
    PeerGate,
    PeerPush,
    PeerPushReply,
    PeerResume,
    PeerStream,
    PeerStreamReply,
    PeerTake,
    PeerWait,
    PeerWaitReply,
    Reply,
    RpcTensor,
    ServerConnection,
    SetTensor,
    SetTensorHash,
    SetTensorHashReply,
    check_type,
)

if TYPE_CHECKING:
    from fleetd.compute.device import Device
    from fleetd.server.state import ServerState

log = logging.getLogger("fleetd.session")

RECV_CHUNK = 64 * 1024
# A read that starts a new request asks for less: every fixed-size request fits (GET_ALLOC_SIZE,
# the largest, is 3269 bytes), and of a SET_TENSOR no more than this of its data takes the
# buffered path; the rest goes with recv_into straight into the tensor's buffer.
FIRST_READ = 4 * 1024
# Responses up to this size are joined with their header into one send (one segment, one syscall).
SMALL_RESPONSE = 64 * 1024
# A stint's answer comes within its budget, one graph and an idle wait; this much later the
# worker is killed.
STINT_SLACK_S = 2.0
# Graphs a session keeps planned for a GRAPH_COMPUTE of the same bytes (its worker keeps as many
# built: workers.HELD_PLANS)
PLANNED_GRAPHS = 4


_UNKNOWN = object()  # Session.local_addr not asked yet


class SessionTimeout(FleetdError):
    """The client was too slow: no HELLO, idle past the limit, or a request that stalls."""


@dataclass(slots=True)
class StoredGraph:
    """A device's last GRAPH_COMPUTE, kept for GRAPH_RECOMPUTE."""

    plan: Any  # what the device's build_plan made
    buffers: list[Buffer]  # the buffers it reaches
    # The registry's free count when `buffers` were last checked (-1: check at the next
    # recompute): a free since then (by any session) is looked for before a GRAPH_RECOMPUTE.
    frees: int

    def still_live(self, registry) -> bool:
        """False when a buffer it reaches was freed since it was last checked; else True, with
        the registry's free count noted as checked."""
        if self.frees != registry.frees:  # something was freed since the last check
            frees = registry.frees
            if any(b.freed for b in self.buffers):
                return False
            self.frees = frees
        return True


class Session:
    """One RPC connection: its socket, its ServerConnection, its counters and stored graphs, its
    peer links. `run()` serves it on its own thread."""

    def __init__(self, state: ServerState, sock: socket.socket, peer: tuple, sid: int) -> None:
        self.state = state
        self.sock = sock
        self.peer = f"{peer[0]}:{peer[1]}"
        self.address = peer[0]
        self.id = sid
        self.started = time.time()
        self.limits = state.limits
        self.conn = ServerConnection(max_request=self.limits.max_request_bytes)
        self.counters = CommandCounters()
        self.graphs: dict[int, StoredGraph] = {}  # by device index
        # graphs planned lately, by (device, their wire bytes), the most recently used last
        self.planned: dict[tuple[int, tuple[int, ...], bytes], StoredGraph] = {}
        self.plans_reused = 0  # GRAPH_COMPUTEs that ran a plan from `planned`
        self.layers: set[int] = set()  # model layers whose weights this session wrote (blk.N.*)
        self._connected = time.monotonic()
        self._greeted = False  # HELLO answered (greet): the idle timeout applies between requests
        self._recv_timeout: float | None = None  # SO_RCVTIMEO as last set
        # The request in progress: seconds spent waiting in recv for its bytes (only the sender's
        # slowness; never fleetd's own work between reads) and the bytes those reads brought.
        self._request_waited = 0.0
        self._request_got = 0
        self._charged = 0  # bytes charged to the daemon's receive budget
        self.peer_links = PeerLinks(
            state.limits.max_peer_links
        )  # this session's links to COPY_TENSOR_TO destinations
        # this session's COPY_TENSOR_TO_ASYNC copies: pushers, unsettled and kept copies
        self.async_copies = AsyncCopies(state, f"session {sid} {self.peer}")
        # A PEER_GATE answered 0: every command until PEER_RESUME is skipped (the client sends
        # them again once it wrote the copy itself).
        self.skipping = False
        # whole SET_TENSOR / GET_TENSOR requests on this session's own buffers, served in C
        self.fast = FastPath(sock, self.counters, state.config.count_commands)
        self.fast.set_request_rules(self.limits.request_timeout, self.limits.min_request_rate)
        self.fast.set_peer(state.peer_streams.handle, self.id, state.p2p_cell, state.registry.frees_cell)
        self.fast.set_alignments([d.alignment for d in state.devices])
        self._scratch = bytearray(RECV_CHUNK)
        self._scratch_view = memoryview(self._scratch)
        # where C's fast loop reads into (the same bytes; the export keeps the array in place)
        self._scratch_c = (ctypes.c_char * RECV_CHUNK).from_buffer(self._scratch)
        self._scratch_address = ctypes.addressof(self._scratch_c)
        self._recv_body = native.recv_body()  # request bodies read in C (None: in Python)
        # Stints (the worker serves the connection): on, unless switched off for the daemon
        # (FLEETD_STINTS=0, for A/B) or once the session sends peer commands (the daemon's).
        self._stints = os.environ.get("FLEETD_STINTS", "1") != "0"
        self._local_addr: str | None | object = _UNKNOWN

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Serve the connection until the client leaves or breaks a rule: every way out is one log
        line (a traceback only for our own bug) and close()."""
        # Log the text of an error, never the exception: a handler that keeps records would
        # keep its traceback's frames, and with them the buffers of a closed session.
        try:
            self._serve()
        except RemoteProtocolError as exc:
            log.warning("session %d %s: closed: %s", self.id, self.peer, str(exc))
        except SessionTimeout as exc:
            log.info("session %d %s: closed: %s", self.id, self.peer, str(exc))
        except BlockingIOError:  # SO_SNDTIMEO: the client stopped reading our response
            log.info(
                "session %d %s: closed: client took no response bytes for %gs",
                self.id,
                self.peer,
                self.limits.request_timeout,
            )
        except ComputeError as exc:
            log.warning("session %d %s: graph failed, closed: %s", self.id, self.peer, str(exc))
        except (ConnectionError, TimeoutError) as exc:
            log.info("session %d %s: connection lost: %s", self.id, self.peer, str(exc))
        except FleetdError as exc:
            log.warning("session %d %s: closed: %s", self.id, self.peer, str(exc))
        except OSError as exc:
            log.info("session %d %s: socket error: %s", self.id, self.peer, str(exc))
        except Exception:
            log.exception("session %d %s: internal error, closing this session", self.id, self.peer)
        finally:
            self.close()

    def _serve(self) -> None:
        conn = self.conn
        record = self.counters.record if self.state.config.count_commands else _not_counted
        set_send_timeout(self.sock, self.limits.request_timeout)
        floor = self.state.receive_budget.FLOOR
        idle = self.limits.idle_timeout
        fast = self.fast
        looping = fast.loop_available
        while True:
            if (
                looping
                and not conn.buffered
                and not self.skipping
                and self._greeted
                and conn.pending_requests() is not None
            ):
                answer = self._fast_loop()
                if answer == native.LOOP_EOF:
                    if conn.buffered:
                        raise ConnectionError("peer closed in the middle of a request")
                    return
                # the request at the front, or the next recv, is Python's; then C again
                looping = answer in (native.LOOP_BUDGET, native.LOOP_WORKER)
                if conn.buffered and (conn.held > floor or self._charged):
                    self._charge(conn.held)
                continue
            if conn.buffered >= FAST_SMALLEST and not self.skipping and fast.serve(conn):
                # then C's loop again: after an idle wait Python read this request, and a
                # stream of SET/GET_TENSOR alone never reaches a handler that would re-arm it
                looping = fast.loop_available
                continue
            event = conn.next_event()
            if event is NEED_DATA:
                if conn.buffered or not self._greeted:
                    n = self.recv_in_request(
                        self._scratch_view[: RECV_CHUNK if conn.buffered else FIRST_READ]
                    )
                else:  # between requests: the hot path, one recv and nothing else
                    if self._charged:
                        conn.receive_data(b"")  # drop the consumed request before we wait
                        self._charge(conn.held)
                    n = self._recv_within(self._scratch_view[:FIRST_READ], idle)
                    if n is None:
                        raise SessionTimeout(f"idle for {idle:g}s")
                if n == 0:
                    if conn.buffered:
                        raise ConnectionError("peer closed in the middle of a request")
                    return
                conn.receive_data(self._scratch_view[:n])
                if conn.held > floor or self._charged:
                    self._charge(conn.held)
                continue
            cmd = event.cmd
            if self.skipping and cmd != Cmd.PEER_RESUME:
                sent = self._skip(event)
            else:
                sent = HANDLERS[type(event)](self, event)
            self._request_waited, self._request_got = 0.0, 0  # the next request starts afresh
            record(cmd, conn.request_bytes, sent)
            looping = fast.loop_available

    def _fast_loop(self) -> int:
        """Serve in C (FastPath.loop) until a request is Python's, the stored graph's
        GRAPH_RECOMPUTE included when it can go straight to the worker; the bytes C read of the
        next request go into the receive buffer. Returns the loop's LOOP_* answer."""
        fast = self.fast
        held = self._arm_recompute()
        copies = self.async_copies
        if held is not None and self._stints and not copies.routed:
            pool, worker, _ = held
            # The only session with a worker, and computing alone: the worker takes the
            # connection until another session starts computing (counted as computing all
            # along, so that one takes its share of the threads, and asks the stint to end).
            if pool.begin_stint(worker):
                try:
                    return self._stint(pool, worker)
                finally:
                    pool.end_stint(worker)
                    pool.release_fast(worker, used=True)
                    fast.disarm()
        copies.arm_routes(fast)
        answer = 0
        try:
            answer, have = fast.loop(self._scratch_address, RECV_CHUNK)
            if answer == native.LOOP_WORKER:  # handed over; its answer is Python's to read
                assert held is not None
                fast.handovers += 1
                pool, worker, graph = held
                deadline = fast.handed_over_at + self.limits.graph_timeout
                pool.finish_fast(self.id, worker, deadline, self.sock)
                for buf in graph.plan.written:
                    buf.touched()
                self.counters.graph_computes += 1
                self.counters.compute_seconds += time.monotonic() - fast.handed_over_at
                if self.state.config.count_commands:
                    self.counters.record(Cmd.GRAPH_RECOMPUTE, RECOMPUTE_BYTES, 0)
        finally:
            copies.disarm_routes(quiet=answer == native.LOOP_IDLE, client_fd=self.sock.fileno())
            if held is not None:
                pool, worker, _ = held
                pool.release_fast(worker, used=True)
                fast.disarm()
        if have:
            self.conn.receive_data(self._scratch_view[:have])
        if answer == native.LOOP_BODY:  # a SET_TENSOR or PEER_PUSH streamed in C was cut
            why, got, waited, cmd = fast.body_cut()
            self._body_cut(why, got, waited, Cmd(cmd).name)
        return answer

    def _stint(self, pool, worker) -> int:
        """Hand the connection to the session's worker (held, armed, this session the only one
        computing) for a stint of STINT_BUDGET_MS at most, ended sooner by another session that
        starts computing (WorkerPool.begin_stint) or an idle client: it serves the loop's
        requests itself and computes the stored graph in place, so a decode step wakes one
        process, not the daemon and then its worker. Returns the loop's answer; what the worker
        read of the next request goes into the receive buffer, and a graph that failed raises
        as finish_fast would."""
        fast = self.fast
        sock = self.sock
        wait_ms = fast_path.LOOP_WAIT_MS
        set_recv_timeout(sock, wait_ms / 1000)  # the worker's recv()s wait this long for a byte
        try:
            # the budget (twice for a request still arriving), an idle wait, one graph
            longest = (2 * fast_path.STINT_BUDGET_MS + wait_ms) / 1000 + self.limits.graph_timeout
            fast.begin_stint(worker.stint_page())
            timeout = self.limits.graph_timeout
            result = pool.stint(self.id, worker, fast.stint_request(), timeout, longest + STINT_SLACK_S, sock)
        except BaseException:
            fast.stint_lost()
            raise
        finally:
            set_recv_timeout(sock, self._recv_timeout)
        try:
            fast.stint_done(result)
        except ValueError as exc:
            worker.kill()
            raise WorkerDied(f"compute worker {worker.pid}: {exc}") from None
        if result.left:
            self.conn.receive_data(result.left)
            if result.answer == native.LOOP_PYTHON and result.left[0] >= Cmd.COPY_TENSOR_TO:
                self._stints = False  # a session on the direct path: its peer commands are the daemon's
        elif result.answer == native.LOOP_PYTHON:
            self._stints = False  # the worker could serve nothing of it (a graph without nodes)
        if result.answer == native.LOOP_WORKER:
            if result.failed == REPLY_REFUSED:
                raise RemoteProtocolError(result.text)
            raise ComputeError(result.text)
        return result.answer

    def _arm_recompute(self):
        """(pool, worker, stored graph) when the session's one stored graph can be recomputed
        in C: a ggml graph whose buffers were not freed since it was checked, whose worker
        holds it, writing only the session's own buffers. None: Python recomputes."""
        if len(self.graphs) != 1:
            return None
        ((index, graph),) = self.graphs.items()
        dev = self.state.devices[index]
        pool = getattr(dev, "workers", None)
        registry = self.state.registry
        if dev.kind != "ggml" or pool is None or graph.frees != registry.frees:
            return None
        written = self.fast.written_regions(graph.plan.written)
        if written is None:
            return None
        worker = pool.hold_for_fast(self.id, graph.plan)
        if worker is None:
            return None
        self.fast.arm(
            index,
            worker.sock.fileno(),
            pool.threads,
            written,
            registry.frees_cell,
            graph.frees,
            pool.computing.cell,
            self.limits.graph_timeout,
        )
        return pool, worker, graph

    def counters_now(self) -> CommandCounters:
        """A copy of the session's counters with what its C loop served up to now (the loop
        folds its counts in only when it returns; a decode stream keeps it in C)."""
        out = CommandCounters()
        out.add(self.counters)
        self.fast.add_pending(out)
        return out

    def reset_counters(self) -> None:
        """Zero the counters (/v1/stats/reset), what C served so far included."""
        with self.fast.lock:
            self.fast.mark_folded()
            self.counters.__init__()  # type: ignore[misc]

    def _skip(self, event) -> int:
        """A command after a failed PEER_GATE: read (its streamed body too) and not served."""
        if self.conn.body_remaining:
            self.discard_body(event.cmd.name)
        elif isinstance(event, CopyTensorToAsync):
            self.async_copies.skipped(event)
        self.state.peer_stats.skipped()
        return 0

    def recv_in_request(self, into: memoryview) -> int:
        """recv_into for bytes of a request already started (or of the first, before HELLO):
        cut when no byte comes for request_timeout, when the request arrives slower than
        min_request_rate after that grace time, or when HELLO is not done by hello_timeout.
        The rate is of the time spent in recv for this request: what fleetd itself does between
        two reads (validation, allocation, page faults, a lock, a compute) is never charged."""
        limits = self.limits
        waited = self._request_waited
        if waited > limits.request_timeout and self._request_got < limits.min_request_rate * waited:
            raise SessionTimeout(
                f"slow sender: {self._request_got} bytes of a request in "
                f"{waited:.0f}s of waiting (minimum {limits.min_request_rate} bytes/s)"
            )
        if self._greeted:
            timeout = limits.request_timeout
        else:
            timeout = self._connected + limits.hello_timeout - time.monotonic()
            if timeout <= 0:
                raise SessionTimeout(self._timeout_reason())
        t0 = time.monotonic()
        try:
            n = self._recv_within(into, timeout)
        finally:
            self._request_waited += time.monotonic() - t0
        if n is None:
            raise SessionTimeout(self._timeout_reason())
        self._request_got += n
        return n

    def _recv_within(self, into: memoryview, seconds: float) -> int | None:
        """recv_into that gives up after `seconds` without a byte (None). SO_RCVTIMEO stays at
        one value, the shorter of the idle and request timeouts, and a longer wait is that
        many recvs: no setsockopt per request (two per request cost ~5% of a decode step when
        every request arrives in two reads, as the stock client sends them)."""
        step = min(self.limits.request_timeout, self.limits.idle_timeout)
        if not self._greeted:
            step = min(step, seconds)
        if self._recv_timeout != step:
            self._set_recv_timeout(step)
        deadline = time.monotonic() + seconds
        while True:
            try:
                return self.sock.recv_into(into)
            except BlockingIOError:
                if time.monotonic() >= deadline - 1e-3:
                    return None

    def _timeout_reason(self) -> str:
        if self._greeted:
            return f"no byte of a started request for {self.limits.request_timeout:g}s"
        return f"no HELLO within {self.limits.hello_timeout:g}s of connecting"

    def _set_recv_timeout(self, seconds: float) -> None:
        # SO_RCVTIMEO, not settimeout(): the socket stays blocking, so a recv stays one syscall.
        set_recv_timeout(self.sock, seconds)
        self._recv_timeout = seconds

    def _charge(self, held: int) -> None:
        """Charge what this connection holds to the daemon-wide receive budget."""
        want = held if held > self.state.receive_budget.FLOOR else 0
        if want != self._charged:
            if not self.state.receive_budget.charge(self._charged, want):
                raise RemoteProtocolError(
                    f"all connections together hold {self.state.receive_budget.held} bytes of "
                    f"unfinished requests, limit {self.state.receive_budget.limit}: this one is cut"
                )
            self._charged = want

    def greet(self) -> int:
        """Answer HELLO: from now on the idle timeout applies between requests."""
        self._greeted = True
        return self.respond(HelloReply(PROTOCOL_VERSION, self.state.features()))

    def drop_plans_using(self, buf: Buffer) -> None:
        """A buffer was freed (by any session): stored graphs that reach it are gone."""
        for device, graph in list(self.graphs.items()):
            if any(b is buf for b in graph.buffers):
                self.graphs.pop(device, None)

    def close(self) -> None:
        """Close the socket and the peer links, free the buffers this session allocated and fold its
        counters into the daemon's."""
        try:
            self.sock.close()
        except OSError:
            pass
        self.peer_links.close()
        self.async_copies.close()
        self.state.peer_streams.close_owner(self.id)
        for dev in self.state.devices:
            dev.session_ended(self.id)
        self.graphs.clear()
        self.planned.clear()
        self.fast.set_buffers([])
        for buf in self.state.registry.owned_by(self.id):
            self.state.registry.free(buf)
        if self._charged:
            self.state.receive_budget.charge(self._charged, 0)
            self._charged = 0
        self.state.session_ended(self)
        log.info("session %d %s: closed", self.id, self.peer)
        if log.isEnabledFor(logging.DEBUG):  # where a session's requests were served
            log.debug(
                "session %d: %s; %d graphs run from their plan",
                self.id,
                self.fast.summary(),
                self.plans_reused,
            )

    # -- helpers ----------------------------------------------------------------------------

    def respond(self, reply: Reply) -> int:
        data = self.conn.send(reply)
        self.sock.sendall(data)
        return len(data)

    def device(self, index: int, what: str):
        devices = self.state.devices
        if index >= len(devices):
            raise RemoteProtocolError(f"{what}: device {index} out of range (have {len(devices)})")
        return devices[index]

    def buffer(self, handle: int, what: str) -> Buffer:
        return regions.buffer_of(self.state.registry, handle, what)

    def tensor_buffer(self, t: RpcTensor, what: str) -> tuple[Buffer, int]:
        return regions.tensor_buffer(self.state.registry, t, what)

    def region(self, t: RpcTensor, offset: int, size: int, what: str) -> tuple[Buffer, int]:
        return regions.region(self.state.registry, t, offset, size, what)

    def read_body(self, dst: memoryview, what: str) -> None:
        """A streamed request body (SET_TENSOR's, PEER_PUSH's data) read straight into `dst`."""
        got = self.conn.read_body_into(dst)
        if got < len(dst) and self._recv_body is not None and self._greeted:
            got += self._read_body_in_c(dst[got:], what)
        while got < len(dst):
            n = self.recv_in_request(dst[got:])
            if n == 0:
                raise ConnectionError(f"peer closed in the middle of {what} data")
            self.conn.body_received(n)
            got += n

    def _read_body_in_c(self, dst: memoryview, what: str) -> int:
        """read_body's bytes from the socket in one C call (fastpath.c's fleetd_recv_body: no
        interpreter per read), under recv_in_request's rules and with its error texts."""
        limits = self.limits
        waited = ctypes.c_int64(int(self._request_waited * 1e9))
        got = ctypes.c_uint64(self._request_got)
        why = ctypes.c_int(0)
        n = self._recv_body(
            self.sock.fileno(),
            np.frombuffer(dst, np.uint8).ctypes.data,
            len(dst),
            max(1, int(limits.request_timeout * 1000)),
            limits.min_request_rate,
            ctypes.byref(waited),
            ctypes.byref(got),
            ctypes.byref(why),
        )
        self._request_waited, self._request_got = waited.value / 1e9, got.value
        if n:
            self.conn.body_received(n)
        self._body_cut(why.value, got.value, waited.value / 1e9, what)
        return n

    def _body_cut(self, reason: int, got: int, waited: float, what: str) -> None:
        """Raise what recv_in_request raises for fleetd_recv_body's `reason` (0: nothing)."""
        if reason == native.BODY_TOO_SLOW:
            raise SessionTimeout(
                f"slow sender: {got} bytes of a request in {waited:.0f}s of "
                f"waiting (minimum {self.limits.min_request_rate} bytes/s)"
            )
        if reason == native.BODY_NO_BYTE:
            raise SessionTimeout(self._timeout_reason())
        if reason == native.BODY_CLOSED:
            raise ConnectionError(f"peer closed in the middle of {what} data")
        if reason < 0:
            raise OSError(-reason, os.strerror(-reason))

    def discard_body(self, what: str) -> None:
        """A streamed request body read and dropped (a refused PEER_PUSH)."""
        while self.conn.body_remaining:
            chunk = self._scratch_view[: min(RECV_CHUNK, self.conn.body_remaining)]
            self.read_body(chunk, what)

    def client_gone(self) -> bool:
        """The client closed its end of the connection (never blocks)."""
        return closed_by_peer(self.sock)

    def send_data(self, data: memoryview) -> int:
        """A DataReply (GET_TENSOR's, PEER_TAKE's): small ones joined with their header into one
        send, large ones sent from their own memory; returns the bytes sent."""
        header = DataReply.header(len(data))
        if len(data) <= SMALL_RESPONSE:
            self.sock.sendall(header + bytes(data))
        else:
            self.sock.sendall(header)
            self.sock.sendall(data)
        return len(header) + len(data)

    def local_addr(self) -> str | None:
        """The IP address the client reached this daemon on (None off TCP, e.g. a socket pair);
        asked of the socket once, it cannot change while the connection lasts."""
        if self._local_addr is _UNKNOWN:
            self._local_addr = None
            if self.sock.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    self._local_addr = self.sock.getsockname()[0]
                except OSError:
                    pass
        return self._local_addr


def _not_counted(cmd: int, request_bytes: int, response_bytes: int) -> None:
    """Stands in for CommandCounters.record when counting is off (benchmarks/transfer.py
    measures what counting costs against this)."""


# -- handlers: one per request type, each returns the response bytes it sent ---------------------


def on_hello(s: Session, ev: Hello) -> int:
    return s.greet()


def on_device_count(s: Session, ev: DeviceCount) -> int:
    return s.respond(DeviceCountReply(len(s.state.devices)))


def on_alloc_buffer(s: Session, ev: AllocBuffer) -> int:
    """ALLOC_BUFFER within the daemon's and the session's memory limits; a refusal is logged and
    answered with pointer 0, as a full device answers."""
    dev = s.device(ev.device, "ALLOC_BUFFER")
    buf = s.state.registry.alloc(
        ev.device, dev, ev.size, s.id, limit=s.state.max_memory, owner_limit=s.state.max_session_memory
    )
    if buf is None:
        log.warning(
            "session %d: ALLOC_BUFFER of %d bytes failed on %s (%d of %d bytes allocated "
            "by this daemon, %d by this session)",
            s.id,
            ev.size,
            dev.name,
            s.state.registry.allocated,
            s.state.max_memory,
            s.state.registry.allocated_by(s.id),
        )
        return s.respond(AllocBufferReply(0, 0))
    s.fast.set_buffers(s.state.registry.owned_by(s.id))
    return s.respond(AllocBufferReply(buf.handle, buf.size))


def on_get_alignment(s: Session, ev: GetAlignment) -> int:
    return s.respond(GetAlignmentReply(s.device(ev.device, "GET_ALIGNMENT").alignment))


def on_get_max_size(s: Session, ev: GetMaxSize) -> int:
    return s.respond(GetMaxSizeReply(s.device(ev.device, "GET_MAX_SIZE").max_size))


def on_get_device_memory(s: Session, ev: GetDeviceMemory) -> int:
    """GET_DEVICE_MEMORY: `free` is what ALLOC_BUFFER would grant now (device, daemon and session
    limits); `total` is the device's."""
    free, total = s.device(ev.device, "GET_DEVICE_MEMORY").memory()
    # What ALLOC_BUFFER would really grant: the device, the daemon's limit, this session's.
    # The total stays the device's, as the stock server reports it.
    registry = s.state.registry
    free = max(
        0,
        min(
            free,
            s.state.max_memory - registry.allocated,
            s.state.max_session_memory - registry.allocated_by(s.id),
        ),
    )
    return s.respond(GetDeviceMemoryReply(free, total))


def on_buffer_get_base(s: Session, ev: BufferGetBase) -> int:
    return s.respond(BufferGetBaseReply(s.buffer(ev.remote_ptr, "BUFFER_GET_BASE").base))


def on_free_buffer(s: Session, ev: FreeBuffer) -> int:
    buf = s.buffer(ev.remote_ptr, "FREE_BUFFER")
    if buf.owner != s.id:
        raise RemoteProtocolError(f"FREE_BUFFER: buffer {ev.remote_ptr:#x} belongs to another session")
    # Stored graphs may point into the freed buffer: drop them, as the stock server does, and
    # the planned ones over it (they would keep its memory).
    s.graphs.clear()
    s.planned = {k: g for k, g in s.planned.items() if all(b is not buf for b in g.buffers)}
    s.state.registry.free(buf)
    s.fast.set_buffers(s.state.registry.owned_by(s.id))
    return 0


def on_buffer_clear(s: Session, ev: BufferClear) -> int:
    buf = s.buffer(ev.remote_ptr, "BUFFER_CLEAR")
    if buf.size:
        buf.array.fill(ev.value)
        buf.touched()
    return 0


def layer_of(name: bytes) -> int | None:
    """The layer a llama.cpp weight belongs to, from its GGUF name ("blk.12.attn_q.weight")."""
    if not name.startswith(b"blk."):
        return None
    digits = name[4:].split(b".", 1)[0]
    return int(digits) if digits.isdigit() and len(digits) < 6 else None


def on_set_tensor(s: Session, ev: SetTensor) -> int:
    """SET_TENSOR: the region checked, the data read from the socket straight into the buffer, then
    stored in the cache directory when the flag asks."""
    buf, start = s.region(ev.tensor, ev.offset, ev.size, "SET_TENSOR")
    if (layer := layer_of(ev.tensor.name)) is not None:  # what status says this node holds
        s.layers.add(layer)
    dst = memoryview(buf.array)[start : start + ev.size]
    s.read_body(dst, "SET_TENSOR")
    buf.touched()
    if ev.cache_flag and s.state.cache_dir is not None:  # even 0 bytes, as stock: an empty file
        s.state.cache_store(dst)
    return 0


def on_set_tensor_hash(s: Session, ev: SetTensorHash) -> int:
    """SET_TENSOR_HASH: the cached file read straight into the region; 0 when there is no such
    file or it was cut short while read."""
    # As the stock server: the file's size is the region's, the bytes are not verified.
    f = s.state.cache_open(ev.hash)
    if f is None:
        return s.respond(SetTensorHashReply(0))
    with f:
        size = os.fstat(f.fileno()).st_size
        buf, start = s.region(ev.tensor, ev.offset, size, "SET_TENSOR_HASH")
        if (layer := layer_of(ev.tensor.name)) is not None:
            s.layers.add(layer)
        dst = memoryview(buf.array)[start : start + size]
        got = 0
        while got < size and (n := f.readinto(dst[got:])):  # straight into the buffer, no copy
            got += n
    buf.touched()
    # A file cut short under us (not by fleetd: it replaces whole files) is a miss; the client
    # then sends the data, which overwrites what was read.
    return s.respond(SetTensorHashReply(1 if got == size else 0))


def on_get_tensor(s: Session, ev: GetTensor) -> int:
    buf, start = s.region(ev.tensor, ev.offset, ev.size, "GET_TENSOR")
    return s.send_data(memoryview(buf.array)[start : start + ev.size])


def on_copy_tensor(s: Session, ev: CopyTensor) -> int:
    """COPY_TENSOR: src's nbytes copied into dst under the execution lock; 0 for a
    zero-size destination buffer, as stock."""
    src_buf, src_start = s.tensor_buffer(ev.src, "COPY_TENSOR")
    dst_buf, dst_start = s.tensor_buffer(ev.dst, "COPY_TENSOR")
    n = ev.src.nbytes
    if ev.dst.data + n > dst_buf.base + dst_buf.size:
        raise RemoteProtocolError(
            f"COPY_TENSOR: {n} bytes at {ev.dst.data:#x} overflow destination buffer "
            f"[{dst_buf.base:#x}, {dst_buf.base + dst_buf.size:#x})"
        )
    # A zero-byte buffer has no array. Stock: its dummy buffer has no copy hook (answer 0);
    # copying nothing into a real buffer is a memcpy of 0 bytes (answer 1).
    if dst_buf.size == 0:
        return s.respond(CopyTensorReply(0))
    if n == 0:
        return s.respond(CopyTensorReply(1))
    with s.state.exec_lock:
        dst_buf.array[dst_start : dst_start + n] = src_buf.array[src_start : src_start + n]
    dst_buf.touched()
    return s.respond(CopyTensorReply(1))


def on_graph_compute(s: Session, ev: GraphCompute) -> int:
    """GRAPH_COMPUTE: bounds checked, plan built and run, then kept for GRAPH_RECOMPUTE with the
    buffers it reaches. A graph the session sent before, byte for byte, over buffers none of
    which was freed since, runs the plan it had (as a GRAPH_RECOMPUTE of it would): llama.cpp
    sends a few graphs in turn (a prompt's micro-batch, a decode step), each whole again."""
    dev = s.device(ev.device, "GRAPH_COMPUTE")
    s.graphs.pop(ev.device, None)
    registry = s.state.registry
    key = (ev.device, ev.nodes, ev.tensors.tobytes())
    stored = s.planned.pop(key, None)
    if stored is not None and stored.still_live(registry):
        s.plans_reused += 1
    else:
        limits = s.limits
        check_graph(ev, limits.max_graph_tensors, limits.view_expansion, limits.view_slack)
        frees = registry.frees
        plan = dev.build_plan(ev, registry)
        handles = np.unique(ev.tensors["buffer"]).tolist() if len(ev.tensors) else []
        bufs = [b for b in map(registry.get, handles) if b is not None]
        # frees -1 when a free raced the build: recheck at the next recompute
        stored = StoredGraph(plan, bufs, frees if registry.frees == frees else -1)
    s.planned[key] = stored  # the most recently used last
    while len(s.planned) > PLANNED_GRAPHS:
        s.planned.pop(next(iter(s.planned)))
    _run(s, stored.plan, dev)
    s.graphs[ev.device] = stored
    return 0


def on_graph_recompute(s: Session, ev: GraphRecompute) -> int:
    """GRAPH_RECOMPUTE: the stored plan run again, unless a buffer it reaches has been freed since
    (then the connection closes, as stock)."""
    dev = s.device(ev.device, "GRAPH_RECOMPUTE")
    graph = s.graphs.get(ev.device)
    if graph is None:
        raise RemoteProtocolError(
            f"GRAPH_RECOMPUTE: no stored graph for device {ev.device} "
            "(none computed, or a buffer it reaches was freed)"
        )
    if not graph.still_live(s.state.registry):
        s.graphs.pop(ev.device, None)
        raise RemoteProtocolError(
            "GRAPH_RECOMPUTE: the stored graph reaches a buffer freed since it was computed"
        )
    _run(s, graph.plan, dev)
    return 0


def _run(s: Session, plan: Any, dev: Device) -> None:
    t0 = time.perf_counter()
    deadline = time.monotonic() + s.limits.graph_timeout
    if dev.kind == "ggml":  # in this session's contained worker, side by side with the others
        dev.run(plan, s.id, deadline, s.sock)
    else:  # the numpy device computes in the daemon, one graph at a time
        with s.state.exec_lock:
            dev.run(plan, s.id, deadline, s.sock)
    s.counters.graph_computes += 1
    s.counters.compute_seconds += time.perf_counter() - t0


def on_init_tensor(s: Session, ev: InitTensor) -> int:
    # The CPU buffer type has no init_tensor hook: validating the tensor is all there is.
    check_type(ev.tensor, "INIT_TENSOR")
    buf = s.state.registry.get(ev.tensor.buffer)
    if buf is not None:
        check_extent(buf, ev.tensor, "INIT_TENSOR")
    return 0


def on_get_alloc_size(s: Session, ev: GetAllocSize) -> int:
    dev = s.device(ev.device, "GET_ALLOC_SIZE")
    check_type(ev.tensor, "GET_ALLOC_SIZE")
    buf = s.state.registry.get(ev.tensor.buffer)
    if buf is not None:
        check_extent(buf, ev.tensor, "GET_ALLOC_SIZE")
    return s.respond(GetAllocSizeReply(dev.alloc_size(ev.tensor.nbytes)))


def on_memset_tensor(s: Session, ev: MemsetTensor) -> int:
    buf, start = s.tensor_buffer(ev.tensor, "MEMSET_TENSOR")
    n = ev.tensor.nbytes
    if ev.offset > n or ev.size > n - ev.offset:
        raise RemoteProtocolError(
            f"MEMSET_TENSOR: offset {ev.offset} + size {ev.size} beyond tensor of {n} bytes"
        )
    if buf.size == 0:  # the stock region check (data within [base, base + size)) fails here
        raise RemoteProtocolError(f"MEMSET_TENSOR: buffer {buf.handle:#x} has no bytes to set")
    buf.array[start + ev.offset : start + ev.offset + ev.size] = ev.value
    buf.touched()
    return 0


def on_copy_tensor_to(s: Session, ev: CopyTensorTo) -> int:
    landed = serve_copy(s.state, s.peer_links, ev, s.local_addr(), f"session {s.id} {s.peer}")
    return s.respond(CopyTensorToReply(landed))


def on_peer_barrier(s: Session, ev: PeerBarrier) -> int:
    # Commands on one connection are served in order: reaching this proves earlier writes landed.
    # 0 when P2P is off now, so a source's cached link stops counting as a successful copy.
    return s.respond(PeerBarrierReply(1 if s.state.p2p_enabled else 0))


def on_copy_tensor_to_async(s: Session, ev: CopyTensorToAsync) -> int:
    """COPY_TENSOR_TO_ASYNC: src read now, pushed by this session's pusher for the destination;
    no response (a failed push keeps the bytes for PEER_TAKE)."""
    s.async_copies.submit(ev, s.local_addr())
    return 0


def on_peer_stream(s: Session, ev: PeerStream) -> int:
    return s.respond(PeerStreamReply(s.state.peer_streams.open(s.id)))


def on_peer_push(s: Session, ev: PeerPush) -> int:
    """PEER_PUSH (from a source daemon): the data staged for the stream's PEER_WAIT, or read and
    dropped with an answer of 0. A destination region out of bounds closes this link, after
    the stream's wait was told (it answers 0)."""
    streams = s.state.peer_streams
    arrival = streams.admit(ev, s.state.p2p_enabled)
    if isinstance(arrival, str):
        s.discard_body("PEER_PUSH")
        log.info("session %d %s: PEER_PUSH seq %d refused: %s", s.id, s.peer, ev.seq, arrival)
        return s.respond(PeerPushReply(0))
    try:
        frees = s.state.registry.frees
        s.region(ev.dst, 0, ev.size, "PEER_PUSH")
        s.read_body(arrival.data, "PEER_PUSH")
    except BaseException:
        streams.refuse(arrival)
        raise
    streams.stage(arrival, ev.dst)
    # The stream's next pushes to this destination may be staged by the loop in C, as long as
    # nothing is freed meanwhile (the write at the wait checks the region again either way).
    streams.vouch(ev.stream, ev.dst, ev.size, frees)
    return s.respond(PeerPushReply(1))


def _write_staged(s: Session, ev: PeerWait | PeerGate) -> bool:
    """The staged copy written into its tensor here, in this connection's command order; False
    when it was refused, did not come in time or its buffer is gone."""
    state, what = s.state, ev.cmd.name
    t = state.peer_timeouts
    staged = state.peer_streams.wait(ev.stream, ev.seq, s.id, t.wait, t.transfer, s.client_gone)
    if staged is None:
        log.info("session %d %s: %s seq %d -> 0: not staged in time or refused", s.id, s.peer, what, ev.seq)
        return False
    n = len(staged.data)
    try:
        buf, start = s.region(staged.dst, 0, n, what)
        buf.array[start : start + n] = np.frombuffer(staged.data, np.uint8)
        buf.touched()
    except RemoteProtocolError as exc:  # freed since the push: the client's own doing
        log.info("session %d %s: %s seq %d -> 0: %s", s.id, s.peer, what, ev.seq, str(exc))
        return False
    finally:
        state.peer_streams.done(staged)
    return True


def on_peer_wait(s: Session, ev: PeerWait) -> int:
    """PEER_WAIT: 1 once the copy is written here, 0 when it is not (the client takes it)."""
    return s.respond(PeerWaitReply(int(_write_staged(s, ev))))


def on_peer_gate(s: Session, ev: PeerGate) -> int:
    """PEER_GATE: PEER_WAIT whose client sent on without waiting; on 0 the session skips what
    follows until PEER_RESUME, so nothing after the gate runs on the tensor's old bytes."""
    landed = _write_staged(s, ev)
    if not landed:
        s.skipping = True
        s.state.peer_stats.gate_failed()
    return s.respond(PeerWaitReply(int(landed)))


def on_peer_resume(s: Session, ev: PeerResume) -> int:
    s.skipping = False
    return 0


def on_peer_take(s: Session, ev: PeerTake) -> int:
    """PEER_TAKE: the bytes a failed asynchronous copy kept, as GET_TENSOR's reply."""
    return s.send_data(memoryview(s.async_copies.take(ev.stream, ev.seq, ev.size)))


HANDLERS = {
    Hello: on_hello,
    DeviceCount: on_device_count,
    AllocBuffer: on_alloc_buffer,
    GetAlignment: on_get_alignment,
    GetMaxSize: on_get_max_size,
    GetDeviceMemory: on_get_device_memory,
    BufferGetBase: on_buffer_get_base,
    FreeBuffer: on_free_buffer,
    BufferClear: on_buffer_clear,
    SetTensor: on_set_tensor,
    SetTensorHash: on_set_tensor_hash,
    GetTensor: on_get_tensor,
    CopyTensor: on_copy_tensor,
    GraphCompute: on_graph_compute,
    GraphRecompute: on_graph_recompute,
    InitTensor: on_init_tensor,
    GetAllocSize: on_get_alloc_size,
    MemsetTensor: on_memset_tensor,
    CopyTensorTo: on_copy_tensor_to,
    PeerBarrier: on_peer_barrier,
    CopyTensorToAsync: on_copy_tensor_to_async,
    PeerStream: on_peer_stream,
    PeerPush: on_peer_push,
    PeerWait: on_peer_wait,
    PeerTake: on_peer_take,
    PeerGate: on_peer_gate,
    PeerResume: on_peer_resume,
}
