"""The asynchronous peer copy (DESIGN.md "Asynchronous peer copy"): both ends of it.

    client --PEER_STREAM--> destination            (once: a stream id the client's connection owns)
    client --COPY_TENSOR_TO_ASYNC(src, dst, size, stream, seq, "host:port")--> source   (no answer)
    source: reads src now, hands the bytes to its pusher for that destination, serves its next command
    source pusher --PEER_PUSH(stream, seq, dst, data)--> destination: staged, answered 1 or 0
    client --PEER_WAIT(stream, seq)--> destination: the staged bytes written into dst, answered 1;
                                       0 when they did not come or were refused
    after a 0: client --PEER_TAKE(stream, seq, size)--> source: the bytes it kept; the client
                                       writes them with SET_TENSOR (the hub path, never stale)

Why the write happens at PEER_WAIT and not when the push arrives: PEER_WAIT sits in the client's
own command order on the destination, so the copy lands exactly where a SET_TENSOR from the
client would have (after the graphs before it have read the old bytes, before the graph that
reads the new ones), whatever order pushes from several sources arrive in. The cost is one
memcpy of the staged bytes on the destination.

Why the source reads at once: the client's next command on the source (the next micro-batch's
graph) may overwrite src; the bytes read in command order are the ones the copy means.

Memory: staged bytes (destination), read-but-not-yet-pushed and kept-after-a-failure bytes
(source) all count against one daemon-wide budget (`max_peer_held_bytes`). A push that does not
fit is refused (the client then takes the bytes from the source); a copy whose bytes the source
cannot hold within the transfer timeout closes the client's connection on the source.

The destination side (PeerStreams) and the budget (PeerMemory) are in fleetd.server.peer_streams.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import queue
import select
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetd.compute import native
from fleetd.errors import FleetdError, PeerClosed, ReadTimeout, RemoteProtocolError, TransportError
from fleetd.server.peer import PeerFailure, PeerLink, copy_endpoint, resolve
from fleetd.server.regions import region
from fleetd.wire import PUSH_FAILED, CopyTensorToAsync, Feature, PeerPush, RpcTensor
from fleetd.wire.text import client_text

if TYPE_CHECKING:
    from fleetd.server.state import ServerState

log = logging.getLogger("fleetd.peer")

STREAMS_REMEMBERED = 1024  # a source's last seq per stream, for this many streams
ROUTES_MAX = 16  # destinations a session's C loop may push to itself
ROUTE_TAKE_WAIT_S = 0.02  # a copy waits this long for a route's pusher to finish its last job
QUIET_ANSWERS_S = 0.5  # a quiet session waits this long for its routes' answers before letting go


# -- the source: read now, push from a worker per destination, keep what failed -------------------


@dataclass
class _Job:
    stream: int
    seq: int
    dst: RpcTensor | None
    data: bytes
    endpoint: str
    notice: bool = False  # only tell the destination this seq will not come (a skipped copy)
    sent: bool = False  # pushed by the session thread already: only its answer is to be read
    route: _Route | None = None  # read the answers of the pushes the loop sent on this route


class _Route:
    """A destination and stream whose copies the session pushes itself, from its C loop or its
    thread (peer_stage.c's fleetd_route): once the pusher's thread opened the link (resolved
    and allowed, as every copy is), the session holds the route (`held`, its fd set, the pusher marked
    busy) and pushes the stream's next copies on that link, reading their answers as they
    come. When it lets go (a failure, a quiet client, anything the pusher must send), its
    pushes still unanswered go to the pusher (a drain job, the fd left unset so that no loop
    pushes meanwhile), failed ones are kept for PEER_TAKE, as the pusher's own."""

    def __init__(self, pusher: _Pusher, stream: int, endpoint: str, last_seq: int) -> None:
        self.c = native.FastRoute()
        self.c.stream, self.c.last_seq, self.c.fd = stream, last_seq, -1
        ep = endpoint.encode()
        self.c.ep_len = len(ep)
        ctypes.memmove(self.c.ep, ep, len(ep))
        self.pusher = pusher
        self.endpoint = endpoint
        self.held = False  # the session holds the link (its pusher marked busy): c.fd is set
        self.folded = (0, 0, 0, 0)  # pushed count and bytes, landed count and bytes, counted

    def entries(self):
        c = self.c
        return [c.ring[(c.head + i) % native.ROUTE_RING] for i in range(c.n)]


class AsyncCopies:
    """The source side of one client session: a pusher thread per destination address, the
    copies not yet settled, and the bytes of those whose push failed (until PEER_TAKE)."""

    def __init__(self, state: ServerState, who: str) -> None:
        self.state = state
        self.who = who
        self._pushers: dict[tuple[str, int], _Pusher] = {}  # insertion order = use order
        self._pending: set[tuple[int, int]] = set()
        self._kept: collections.OrderedDict[tuple[int, int], bytes] = collections.OrderedDict()
        # the last seq sent per stream (session thread only): a stream's seqs increase
        self._last_seq: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._cond = threading.Condition()
        self._closed = False
        # the loop's routes, one per pusher (answers on a link come in its one send order)
        self._routes: dict[tuple[str, int], _Route] = {}
        self._routes_changed = False
        self._lib = native.peer_stage() if state.peer_streams.handle else None

    # -- the session thread ----------------------------------------------------------------

    def submit(self, ev: CopyTensorToAsync, local_addr: str | None) -> None:
        """COPY_TENSOR_TO_ASYNC: the source region read now and queued for its destination. A
        malformed request, an out-of-bounds source, a repeated (stream, seq) or bytes this
        daemon cannot hold in time raise RemoteProtocolError (the connection closes)."""
        buf, start = region(self.state.registry, ev.src, 0, ev.size, "COPY_TENSOR_TO_ASYNC")
        host, port = copy_endpoint(ev.endpoint, "COPY_TENSOR_TO_ASYNC")
        key = (ev.stream, ev.seq)
        last = self._last_seq.pop(ev.stream, 0)
        if ev.seq <= last:
            raise RemoteProtocolError(
                f"COPY_TENSOR_TO_ASYNC: seq {ev.seq} after seq {last} of this stream: seqs must increase"
            )
        self._last_seq[ev.stream] = ev.seq
        while len(self._last_seq) > STREAMS_REMEMBERED:
            self._last_seq.popitem(last=False)
        failure = None
        try:
            addr = resolve(host, port)
            if not self.state.peer_policy.allows(addr[0], local_addr):
                raise PeerFailure("not_allowed", f"{addr[0]} is outside --peer-allow")
            if not self.state.p2p_enabled and addr not in self._pushers:
                raise PeerFailure("disabled", "peer copy is switched off on this daemon")
        except PeerFailure as exc:
            failure = exc
        if failure is None and self._route_push(addr, ev, buf.array.ctypes.data + start):
            return
        if not self.state.peer_memory.reserve(ev.size, self.state.peer_timeouts.transfer):
            raise RemoteProtocolError(
                f"COPY_TENSOR_TO_ASYNC: {ev.size} bytes do not fit the peer-copy memory "
                f"({self.state.peer_memory.held} of {self.state.peer_memory.limit} held)"
            )
        job = _Job(ev.stream, ev.seq, ev.dst, buf.array[start : start + ev.size].tobytes(), ev.endpoint)
        with self._cond:
            self._pending.add(key)
        if failure is not None:
            self.failed(job, failure)
            return
        # P2P off with a pusher there: it refuses the job and tells the destination at once.
        pusher = self._pusher_for(addr)
        self._release_route(addr)  # the link is the pusher's again, behind the route's pushes
        if not pusher.push_inline(job):
            pusher.put(job)

    # -- the routes: pushes the session's C loop sends itself (the session thread) -------------

    def _take_route(self, route: _Route, wait: float = 0.0) -> bool:
        """Hold the route's link for this session (its pusher idle): the loop may push on it.
        With `wait`, a pusher with nothing queued behind its job that only reads the answer of a
        small push (as a while after the first copy of a stream) is waited for that long: on a
        loaded host its thread may wake after the next copy came, and the one after, as often
        as not. A pusher still writing, or waiting on a large push, is not: the session thread
        would stall its client's next commands (a prompt's copy, then decode's)."""
        if route.held:
            return True
        if not self.state.p2p_enabled or self._closed:
            return False
        pusher = route.pusher
        with pusher._idle:
            if wait and pusher._busy and pusher.answering and pusher._queue.empty():
                pusher._idle.wait_for(lambda: not pusher._busy, wait)
            if pusher._busy or pusher.link is None:
                return False
            pusher._busy = True  # this session's thread and loop hold its link now
            fd = pusher.link.sock.fileno()
        c = route.c
        c.last_seq = max(c.last_seq, self._last_seq.get(c.stream, 0))
        c.fd = fd
        route.held = True
        return True

    def _route_push(self, addr: tuple[str, int], ev: CopyTensorToAsync, src: int) -> bool:
        """The copy pushed on its destination's route (taken now if its pusher is idle), as the
        loop would; False when it is the pusher's way (no route, too large, no room)."""
        if not 0 < ev.size <= _Pusher.INLINE_MAX or not self.state.p2p_enabled:
            return False
        route = self._routes.get(addr)
        if route is None:
            route = self._new_route(addr, ev)
            if route is None:
                return False
        if route.c.stream != ev.stream:
            return False
        self._pusher_for(addr)  # most recently used
        if not self._take_route(route, ROUTE_TAKE_WAIT_S):
            return False
        assert self._lib is not None
        c = route.c
        sent = self._lib.fleetd_route_push(
            ctypes.byref(c), self.state.peer_streams.handle, ev.seq, ev.dst.pack(), src, ev.size
        )
        if sent == 0 or c.broken:  # no room in the ring or the budget, or the link failed
            self._release_route(addr)
        return sent != 0

    def _new_route(self, addr: tuple[str, int], ev: CopyTensorToAsync) -> _Route | None:
        """The route for a destination whose pusher opened its link (resolved and allowed as
        every copy is), made for this copy's stream; None: none yet (no native part, no link,
        ROUTES_MAX). The session then pushes this copy itself and reads its answer on the route,
        so its next copies do not wait on the pusher's thread to take the route."""
        pusher = self._pushers.get(addr)
        if self._lib is None or pusher is None or pusher.link is None or len(self._routes) >= ROUTES_MAX:
            return None
        route = _Route(pusher, ev.stream, ev.endpoint, self._last_seq.get(ev.stream, 0))
        self._routes[addr] = route
        self._routes_changed = True
        return route

    @property
    def routed(self) -> bool:
        """Whether this session pushes copies on routes (the loop serves them in the daemon)."""
        return bool(self._routes)

    def arm_routes(self, fast) -> None:
        """Before the loop: its routes, and the idle ones taken."""
        if not self._routes:
            return
        if self._routes_changed:
            fast.set_routes([r.c for r in self._routes.values()])
            self._routes_changed = False
        for route in self._routes.values():
            self._take_route(route)

    def disarm_routes(self, quiet: bool, client_fd: int) -> None:
        """After the loop: its seqs and counts back in Python; a route with a failed push, or
        with pushes unanswered while the client is `quiet` (the loop idled) and stays quiet for
        QUIET_ANSWERS_S more, let go (its pusher then reads the rest). The wait keeps a route a
        late answer would otherwise hand to the pusher, whose thread the next copy then finds
        busy: on a loaded host a scheduling delay is enough for that."""
        if quiet:
            quiet = not self._answers_or_client(client_fd)
        for addr, route in list(self._routes.items()):
            if not route.held:
                continue
            assert self._lib is not None
            c = route.c
            self._last_seq.pop(c.stream, None)
            self._last_seq[c.stream] = c.last_seq
            self._lib.fleetd_route_read_answers(ctypes.byref(c), self.state.peer_streams.handle, 0)
            self._fold_route(route)
            # landed pushes leave the ring's head as they are answered, so an answered one
            # still there means a failed one is (no list of the ring on this path)
            failed = c.answered > 0
            if failed or c.broken or (quiet and c.answered < c.n) or not self.state.p2p_enabled:
                self._release_route(addr)

    def _answers_or_client(self, client_fd: int) -> bool:
        """Wait (QUIET_ANSWERS_S at most) until the held routes' pushes are answered or the
        client sends: True if the client did (it is not quiet after all)."""
        open_routes = [r for r in self._routes.values() if r.held and not r.c.broken]
        if not any(r.c.answered < r.c.n for r in open_routes):
            return False
        poller = select.poll()
        poller.register(client_fd, select.POLLIN)
        for route in open_routes:
            poller.register(route.c.fd, select.POLLIN)
        assert self._lib is not None
        read, streams = self._lib.fleetd_route_read_answers, self.state.peer_streams.handle
        deadline = time.monotonic() + QUIET_ANSWERS_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = {fd for fd, _ in poller.poll(left * 1000)}
            if client_fd in ready:
                return True
            for route in open_routes:
                # readable and nothing read: the link closed (or broke mid-answer), no waiting on it
                if route.c.fd in ready and not read(ctypes.byref(route.c), streams, 0):
                    return False
            if not any(r.c.answered < r.c.n and not r.c.broken for r in open_routes):
                return False

    def release_routes(self) -> None:
        """Every route let go (before PEER_TAKE: its copies then settle as the pusher's do)."""
        for addr in list(self._routes):
            self._release_route(addr)

    def _release_route(self, addr: tuple[str, int]) -> None:
        """The route's link back to its pusher: pushes still unanswered drained there (they are
        pending until then), the rest settled now."""
        route = self._routes.get(addr)
        if route is None or not route.held:
            return
        route.held = False
        c = route.c
        c.fd = -1
        if c.answered < c.n and not c.broken:
            with self._cond:
                self._pending.update((p.stream, p.seq) for p in route.entries()[c.answered :])
            route.pusher.put(_Job(c.stream, 0, None, b"", route.endpoint, route=route))
        else:
            self.collect(route)
            route.pusher._idle_again()

    def _fold_route(self, route: _Route) -> None:
        c, (_, pb, lc, lb) = route.c, route.folded
        stats = self.state.peer_stats
        if c.pushed_bytes != pb:
            stats.pushed(c.pushed_bytes - pb)
        if c.landed_count != lc:
            stats.ok(c.landed_bytes - lb, c.landed_count - lc)
        route.folded = (c.pushed_count, c.pushed_bytes, c.landed_count, c.landed_bytes)

    def collect(self, route: _Route) -> None:
        """The route's pushes all answered (or failed): the failed ones kept for PEER_TAKE, the
        ring emptied; a broken route's link dropped. Whoever holds the route calls this."""
        c = route.c
        self._fold_route(route)
        broken = bool(c.broken)
        entries = route.entries()
        keys = [(p.stream, p.seq) for p in entries]
        failed = [
            _Job(p.stream, p.seq, None, ctypes.string_at(p.data, p.size), route.endpoint)
            for p in entries
            if p.state == native.PUSH_FAILED and p.data
        ]
        assert self._lib is not None
        self._lib.fleetd_route_clear(ctypes.byref(c), self.state.peer_streams.handle, 0)
        c.broken = 0
        if broken:
            route.pusher._drop_link()
        why = "the link failed with the push in flight" if broken else "the destination refused the push"
        for job in failed:  # their budget stays reserved with the kept copy (or is released)
            self.failed(job, PeerFailure("write_rejected" if broken else "refused", why))
        with self._cond:
            self._pending.difference_update(keys)
            self._cond.notify_all()

    def skipped(self, ev: CopyTensorToAsync) -> None:
        """A COPY_TENSOR_TO_ASYNC skipped after a failed PEER_GATE: nothing is read or kept (the
        client sends it again), but a destination this session has a link to is told at once
        that the seq will not come, so its own gate answers 0 now instead of when its wait runs
        out (a failure at one node of a chain must not stall the next)."""
        try:
            addr = resolve(*copy_endpoint(ev.endpoint, "COPY_TENSOR_TO_ASYNC"))
        except (FleetdError, PeerFailure):  # skipped anyway: nobody to tell
            return
        pusher = self._pushers.get(addr)
        if pusher is not None:
            self._release_route(addr)  # the notice goes behind the route's pushes
            pusher.put(_Job(ev.stream, ev.seq, ev.dst, b"", ev.endpoint, notice=True))

    def _pusher_for(self, addr: tuple[str, int]) -> _Pusher:
        pusher = self._pushers.pop(addr, None)
        if pusher is None:
            while len(self._pushers) >= self.state.limits.max_peer_links:
                old = self._pushers.pop(next(iter(self._pushers)))
                self._release_route(old.addr)
                if self._routes.pop(old.addr, None) is not None:
                    self._routes_changed = True
                old.stop()
            pusher = _Pusher(self, addr)
        self._pushers[addr] = pusher  # most recently used last
        return pusher

    def take(self, stream: int, seq: int, size: int) -> bytes:
        """PEER_TAKE: the kept bytes of copy (stream, seq), once it is settled. RemoteProtocolError
        when there are none of that size (it landed, it never was, or it was dropped)."""
        key = (stream, seq)
        self.release_routes()  # the loop's pushes settle as the pusher's do
        timeouts = self.state.peer_timeouts
        deadline = time.monotonic() + timeouts.connect + timeouts.hello + timeouts.transfer
        with self._cond:
            while key in self._pending and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            data = self._kept.pop(key, None)
        if data is None or len(data) != size:
            if data is not None:
                self.state.peer_memory.release(len(data))
            raise RemoteProtocolError(
                f"PEER_TAKE: no kept copy of {size} bytes for seq {seq} "
                "(it landed, was never sent here, or is still in flight)"
            )
        self.state.peer_memory.release(len(data))
        self.state.peer_stats.taken()
        return data

    def close(self) -> None:
        """The client session ended: pushers stop, unsent and kept bytes are let go."""
        with self._cond:
            self._closed = True
            kept = sum(len(d) for d in self._kept.values())
            self._kept.clear()
            self._cond.notify_all()
        self.state.peer_memory.release(kept)
        for route in self._routes.values():  # held ones: nothing is kept now
            if route.held:
                route.held = False
                route.c.fd = -1
                assert self._lib is not None
                self._lib.fleetd_route_clear(ctypes.byref(route.c), self.state.peer_streams.handle, 1)
        for pusher in self._pushers.values():
            pusher.stop()
        self._pushers.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the pushers --------------------------------------------------------------------------

    def landed(self, job: _Job) -> None:
        self.state.peer_memory.release(len(job.data))
        self.state.peer_stats.ok(len(job.data))
        with self._cond:
            self._pending.discard((job.stream, job.seq))
            self._cond.notify_all()

    def failed(self, job: _Job, exc: PeerFailure) -> None:
        """The push did not land: the bytes are kept for PEER_TAKE (none once the session ended)."""
        self.state.peer_stats.fallback(exc.reason)
        log.info(
            "%s: COPY_TENSOR_TO_ASYNC %s seq %d kept (%s): %s",
            self.who,
            client_text(job.endpoint),
            job.seq,
            exc.reason,
            client_text(str(exc), 200),
        )
        key = (job.stream, job.seq)
        with self._cond:
            self._pending.discard(key)
            keep = not self._closed
            if keep:  # its bytes stay reserved with the kept copy
                self._kept[key] = job.data
            self._cond.notify_all()
        if not keep:
            self.state.peer_memory.release(len(job.data))

    def dropped(self, job: _Job) -> None:
        """A queued job after the session ended: nothing to do but let its bytes go."""
        if job.route is not None:  # a route's pushes: the C copies and their budget go
            assert self._lib is not None
            keys = [(p.stream, p.seq) for p in job.route.entries()]
            self._lib.fleetd_route_clear(ctypes.byref(job.route.c), self.state.peer_streams.handle, 1)
            with self._cond:
                self._pending.difference_update(keys)
                self._cond.notify_all()
            return
        self.state.peer_memory.release(len(job.data))
        with self._cond:
            self._pending.discard((job.stream, job.seq))


class _Pusher:
    """One destination's worker thread for one client session: pushes in queue order over its
    own link (never the session thread's), so the session goes on with its next command.

    A small copy while the worker is idle and its link open is written to the link by the
    session thread itself (`push_inline`: the bytes fit the socket's buffer, so it does not
    block), and only its answer is left to the worker: a decode step's hidden state then leaves
    without a thread hand-off on its critical path. Order holds: the session thread writes only
    when nothing is queued or in the worker's hands (`_busy`, under `_lock`)."""

    IDLE_S = 30.0  # a link unused this long is closed (the thread stays, it is cheap)
    INLINE_MAX = 64 * 1024  # bytes the session thread may push itself

    def __init__(self, copies: AsyncCopies, addr: tuple[str, int]) -> None:
        self.copies = copies
        self.addr = addr
        self.link: PeerLink | None = None
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when _busy goes False
        self._busy = False  # a job is queued or in the worker's hands
        # the job in hand waits only for answers to small pushes already written (the worker
        # is about to go idle): what a copy may wait for to take the route (_take_route)
        self.answering = False
        self._thread = threading.Thread(
            target=self._run, name=f"fleetd-push-{addr[0]}:{addr[1]}", daemon=True
        )
        self._thread.start()

    def put(self, job: _Job) -> None:
        with self._lock:
            self._busy = True
            self._queue.put(job)

    def push_inline(self, job: _Job) -> bool:
        """Write `job` to the open link from the session thread, leaving its answer to the
        worker; False (nothing done) when it must be queued instead."""
        state = self.copies.state
        if len(job.data) > self.INLINE_MAX or not state.p2p_enabled:
            return False
        with self._lock:
            if self._busy or self.link is None or self.link.stale() or self.copies.closed:
                return False
            try:
                self._write(self.link, job)
            except FleetdError as exc:
                self._drop_link()
                self.copies.failed(job, PeerFailure("write_rejected", str(exc)))
                return True
            job.sent = True
            self._busy = True
            self._queue.put(job)
        return True

    def _write(self, link: PeerLink, job: _Job) -> None:
        """PEER_PUSH with the copy's bytes onto the link (its answer is read by the worker)."""
        link.channel.send(PeerPush(job.stream, job.seq, job.dst, len(job.data)), job.data)
        self.copies.state.peer_stats.pushed(len(job.data))

    def _idle_again(self) -> None:
        with self._lock:
            if self._queue.empty():
                self._busy = False
                self.answering = False
                self._idle.notify_all()

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        copies = self.copies
        try:
            while True:
                try:
                    job = self._queue.get(timeout=self.IDLE_S)
                except queue.Empty:
                    with self._lock:  # the session thread may be writing to it
                        if not self._busy:
                            self._drop_link()
                    continue
                if job is None:
                    break
                self._serve(job)
                self._idle_again()
        except Exception:  # our own bug: never leave a copy pending
            log.exception("%s: peer pusher to %s:%d failed", copies.who, *self.addr)
        finally:
            self._drop_link()
            while True:  # what is left (stopped, or our bug) settles as failed or dropped
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    copies.dropped(job)

    def _serve(self, job: _Job) -> None:
        copies = self.copies
        self.answering = job.route is not None  # a drain reads the route's answers alone
        if job.route is not None:  # the loop's pushes: their answers, then they settle
            if copies.closed:
                copies.dropped(job)
                return
            lib, timeout = copies._lib, copies.state.peer_timeouts.transfer
            assert lib is not None
            fd = self.link.sock.fileno() if self.link is not None else -1
            lib.fleetd_route_drain(
                ctypes.byref(job.route.c), copies.state.peer_streams.handle, fd, int(timeout * 1000)
            )
            copies.collect(job.route)
            return
        if job.notice:
            self._notify_failed(job)
            return
        if copies.closed:
            copies.dropped(job)
            return
        try:
            self._push(job)
        except PeerFailure as exc:
            if exc.reason == "disabled":  # refused here, before any byte went out
                self._notify_failed(job)
            copies.failed(job, exc)
        except FleetdError as exc:  # anything else on the peer side is still the peer's
            self._drop_link()
            copies.failed(job, PeerFailure("unreachable", str(exc)))
        else:
            copies.landed(job)

    def _push(self, job: _Job) -> None:
        state = self.copies.state
        if job.sent:  # written by push_inline: only the answer is left
            link = self.link
            if link is None:  # not expected: only push_inline writes, and it keeps the link open
                raise PeerFailure("write_rejected", "the link closed after the push was written")
        else:
            if not state.p2p_enabled:
                raise PeerFailure("disabled", "peer copy is switched off on this daemon")
            link = self._link(job.endpoint)
        try:
            if not job.sent:
                self._write(link, job)
            # a large push's answer waits for its bytes to cross the link: not worth a wait
            self.answering = len(job.data) <= self.INLINE_MAX
            staged = link.channel.reply("PEER_PUSH").staged
        except ReadTimeout as exc:
            self._drop_link()
            raise PeerFailure("timeout", str(exc)) from exc
        except (PeerClosed, TransportError, RemoteProtocolError) as exc:
            self._drop_link()
            raise PeerFailure("write_rejected", str(exc)) from exc
        if not staged:
            raise PeerFailure("refused", "the destination refused the push (see its log)")

    def _link(self, endpoint: str) -> PeerLink:
        if self.link is not None and self.link.stale():
            self._drop_link()
        if self.link is None:
            state = self.copies.state
            self.link = PeerLink(endpoint, self.addr, state.peer_timeouts, Feature.PEER_COPY_ASYNC)
            log.info(
                "peer link to %s (%s:%d) opened for asynchronous copies", client_text(endpoint), *self.addr
            )
            state.peer_stats.link_opened()
        return self.link

    def _notify_failed(self, job: _Job) -> None:
        """Tell the destination at once that this copy will not come, over a link already open
        (never a new one: a refusal must not cause traffic), so its PEER_WAIT answers 0 now."""
        if self.link is None:
            return
        try:
            self.link.channel.send(PeerPush(job.stream, job.seq, job.dst, 0, PUSH_FAILED))
            self.link.channel.reply("PEER_PUSH")
        except FleetdError:
            self._drop_link()

    def _drop_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None
