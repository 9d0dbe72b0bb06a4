"""Peer copy: COPY_TENSOR_TO served by the source of a stage boundary (DESIGN.md "Peer copy").

    client --COPY_TENSOR_TO(src, dst, size, "host:port")--> source
    source --HELLO (once per link), SET_TENSOR(dst), PEER_BARRIER--> destination
    source --result u8--> client            (1 only after the barrier proved the write landed)

Rules, in the order `serve_copy` applies them:

- The source region is validated exactly like GET_TENSOR, and the endpoint must parse as
  "host:port": a malformed request or an out-of-bounds source raises RemoteProtocolError, which
  closes that client's connection only.
- Everything else that can go wrong is recoverable: the answer is 0, the reason is counted in
  `PeerCounters` (one of `FALLBACK_REASONS`) and the client falls back to GET_TENSOR + SET_TENSOR.
- The source bytes are sent straight from the buffer, read as GET_TENSOR reads them (no copy,
  no execution lock), so no peer I/O holds the lock and a ring of servers pushing to each other
  cannot deadlock. SET_TENSOR, its data and PEER_BARRIER go out in one write.
- The destination gets a push only when its HELLO advertises Feature.PEER_COPY. A stock
  ggml-rpc-server never does (and keeps buffers per connection, so the write could never land);
  a busy one accepts the TCP connect from its backlog but never answers HELLO, hence the bounded
  HELLO timeout. Links to such destinations are closed at once, never cached, so a stock server
  is not held away from its real client.
- Links are cached per client session and resolved destination address (ip, port), so 200
  spellings of one endpoint share one link; a session keeps at most `max_peer_links` (the
  least recently used goes first) and closes them all when it ends. A link that failed in any
  way is dropped, never reused.
- The allow-list check comes before any connect: a destination outside it answers 0 at once
  whatever its port state, so timing tells a client about ports only where it may push anyway.

Which destinations are allowed (`--peer-allow`, ServerConfig.peer_allow): a list of IP
addresses, CIDRs or host names (resolved once, at start). The default (None) is loopback
(127.0.0.0/8, ::1) plus the /24 (IPv4) or /64 (IPv6) around the address the daemon listens on;
a daemon bound to a wildcard address uses the address the client reached it on instead. So out
of the box a node pushes only to itself and to its neighbours on the fleet's subnet, never to
an arbitrary host a client names. The destination host is resolved once per copy and the
connection goes to the address that was checked (no second lookup between check and connect).
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

from fleetd.errors import (
    FleetdError,
    PeerClosed,
    ReadTimeout,
    RemoteProtocolError,
    TransportError,
)
from fleetd.server.peer_policy import (  # noqa: F401  (re-exported: the peer-copy vocabulary)
    FALLBACK_REASONS,
    PeerCounters,
    PeerPolicy,
    PeerTimeouts,
    parse_allow,
)
from fleetd.server.regions import region
from fleetd.transport.tcp import mapped_errors, parse_endpoint, send_parts, timeval
from fleetd.wire import (
    NEED_DATA,
    ClientConnection,
    CopyTensorTo,
    Feature,
    Hello,
    PeerBarrier,
    Reply,
    Request,
    SetTensor,
)
from fleetd.wire.text import client_text

if TYPE_CHECKING:
    from fleetd.server.state import ServerState

log = logging.getLogger("fleetd.peer")

# Replies on a link are HELLO's (32 bytes) and PEER_BARRIER's (9): one small read each.
REPLY_READ = 256


class PeerFailure(Exception):
    """A recoverable peer-copy failure: the answer is 0 and `reason` is counted."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def resolve(host: str, port: int) -> tuple[str, int]:
    """The first address of `host` (one lookup per copy; the check and the connect use it)."""
    try:
        socket.inet_pton(socket.AF_INET, host)
        return host, port  # a dotted quad is its own address: no getaddrinfo call
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PeerFailure("unreachable", f"cannot resolve {host}: {exc}") from exc
    sockaddr = infos[0][4]
    return sockaddr[0], sockaddr[1]


# -- one link to one destination ------------------------------------------------------------------


class PeerLink:
    """A client connection from this daemon to a destination daemon: HELLO, then pushes.

    The socket stays blocking, bounded by SO_RCVTIMEO / SO_SNDTIMEO as a session's is: with
    Python's settimeout() every send and recv would be a poll() and then the call."""

    def __init__(self, endpoint: str, addr: tuple[str, int], timeouts: PeerTimeouts) -> None:
        self.endpoint = endpoint
        self.addr = addr
        self.timeouts = timeouts
        self.conn = ClientConnection()
        self._scratch = bytearray(REPLY_READ)
        self._scratch_view = memoryview(self._scratch)
        self._timeout: float | None = None  # SO_RCVTIMEO / SO_SNDTIMEO as last set
        self.sock = self._connect(addr)
        try:
            self._hello()
            self._set_timeout(timeouts.transfer)
        except BaseException:
            self.close()
            raise

    def _connect(self, addr: tuple[str, int]) -> socket.socket:
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeouts.connect)
        try:
            sock.connect(addr)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except socket.timeout as exc:
            sock.close()
            raise PeerFailure("timeout", f"connect timed out after {self.timeouts.connect}s") from exc
        except OSError as exc:
            sock.close()
            raise PeerFailure("unreachable", f"connect: {exc.strerror or exc}") from exc
        return sock

    def _set_timeout(self, seconds: float) -> None:
        if seconds != self._timeout:
            tv = timeval(seconds)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._timeout = seconds

    def _write(self, what: str, parts) -> None:
        """Write `parts` (requests framed by the ClientConnection, SET_TENSOR data among them)."""
        with mapped_errors(what):
            try:
                send_parts(self.sock, parts)
            except BlockingIOError:  # SO_SNDTIMEO ran out (EAGAIN on a blocking socket)
                raise socket.timeout(f"no progress for {self._timeout:g}s") from None

    def _reply(self, what: str) -> Reply:
        """Wait for the reply of the oldest request that asks for one."""
        with mapped_errors(what):
            try:
                while (event := self.conn.next_event()) is NEED_DATA:
                    n = self.sock.recv_into(self._scratch)
                    if n == 0:
                        raise PeerClosed(f"{what}: peer closed the connection")
                    self.conn.receive_data(self._scratch_view[:n])
            except BlockingIOError:  # SO_RCVTIMEO ran out
                raise socket.timeout(f"no reply for {self._timeout:g}s") from None
        return event

    def _hello(self) -> None:
        self._set_timeout(self.timeouts.hello)
        what = f"HELLO to peer {self.endpoint}"
        try:
            self._write(what, [self.conn.send(Hello())])
            self._reply(what)
        except ReadTimeout as exc:
            raise PeerFailure("timeout", f"HELLO not answered within {self.timeouts.hello}s "
                              "(a stock server busy with another client?)") from exc
        except RemoteProtocolError as exc:
            raise PeerFailure("refused", f"HELLO: {exc}") from exc
        except TransportError as exc:
            raise PeerFailure("unreachable", f"HELLO: {exc}") from exc
        if not self.conn.features & Feature.PEER_COPY:
            raise PeerFailure("refused", "destination does not advertise peer copy")

    def stale(self) -> bool:
        """A cached link the destination closed meanwhile (restart, idle close): reconnect."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def push(self, dst, data: memoryview, stats: PeerCounters) -> None:
        """SET_TENSOR then PEER_BARRIER; returns once the destination confirmed the write.

        Both requests and the data between them go out in one write, the data straight from
        `data` (the source tensor's memory): no copy, and no round trip before the barrier's."""
        head = self.conn.send(SetTensor(dst, 0, len(data)))
        barrier = self.conn.send(PeerBarrier())
        try:
            self._write(f"SET_TENSOR to peer {self.endpoint}", [head, data, barrier])
            stats.pushed(len(data))
            landed = self._reply(f"PEER_BARRIER to peer {self.endpoint}").landed
        except ReadTimeout as exc:
            raise PeerFailure("timeout", str(exc)) from exc
        except (PeerClosed, TransportError, RemoteProtocolError) as exc:
            raise PeerFailure("write_rejected", str(exc)) from exc
        if not landed:
            raise PeerFailure("refused", "PEER_BARRIER answered 0 (peer copy off at destination)")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class PeerLinks:
    """The links of one client session, keyed by resolved destination address, at most `cap`
    (least recently used closed first)."""

    def __init__(self, cap: int = 16) -> None:
        self.cap = cap
        self._links: dict[tuple[str, int], PeerLink] = {}  # insertion order = use order

    def get(self, addr: tuple[str, int]) -> PeerLink | None:
        link = self._links.pop(addr, None)
        if link is None:
            return None
        if link.stale():
            link.close()
            return None
        self._links[addr] = link  # most recently used last
        return link

    def put(self, link: PeerLink) -> None:
        self.drop(link.addr)
        while len(self._links) >= self.cap:
            self.drop(next(iter(self._links)))
        self._links[link.addr] = link

    def drop(self, addr: tuple[str, int]) -> None:
        link = self._links.pop(addr, None)
        if link is not None:
            link.close()

    def __len__(self) -> int:
        return len(self._links)

    def close(self) -> None:
        for addr in list(self._links):
            self.drop(addr)


# -- the command ------------------------------------------------------------------------------------


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    try:
        return parse_endpoint(endpoint)
    except ValueError as exc:
        raise RemoteProtocolError(f"COPY_TENSOR_TO: {exc}") from None


def _link_for(state: ServerState, links: PeerLinks, endpoint: str, host: str, port: int,
              local_addr: str | None) -> PeerLink:
    addr = resolve(host, port)
    if not state.peer_policy.allows(addr[0], local_addr):
        raise PeerFailure("not_allowed", f"{addr[0]} is outside --peer-allow")
    link = links.get(addr)
    if link is not None:
        return link
    link = PeerLink(endpoint, addr, state.peer_timeouts)
    state.peer_stats.link_opened()
    links.put(link)
    return link


def serve_copy(state: ServerState, links: PeerLinks, ev: CopyTensorTo,
               local_addr: str | None = None, who: str = "copy") -> int:
    """Handle one COPY_TENSOR_TO; returns 1 when the write landed, 0 on a recoverable failure.

    `links`: the client session's cached links; `local_addr`: the address the client reached
    this daemon on (the default allow list uses it on a wildcard bind); `who` names the client
    session in the log."""
    buf, start = region(state.registry, ev.src, 0, ev.size, "COPY_TENSOR_TO")
    host, port = _parse_endpoint(ev.endpoint)
    try:
        if not state.p2p_enabled:
            raise PeerFailure("disabled", "peer copy is switched off on this daemon")
        link = _link_for(state, links, ev.endpoint, host, port, local_addr)
        # The region goes out straight from the buffer, read as GET_TENSOR reads it: no copy,
        # and no execution lock (this session's own graphs are done, commands run in order),
        # so no peer I/O ever waits on or holds it.
        data = memoryview(buf.array)[start : start + ev.size]
        try:
            link.push(ev.dst, data, state.peer_stats)
        except PeerFailure:
            links.drop(link.addr)  # the stream state is unknown now
            raise
    except PeerFailure as exc:
        state.peer_stats.fallback(exc.reason)
        log.info("%s: COPY_TENSOR_TO %s -> 0 (%s): %s", who, client_text(ev.endpoint), exc.reason,
                 client_text(str(exc), 200))
        return 0
    except FleetdError as exc:  # anything else on the peer side is still the peer's, not ours
        state.peer_stats.fallback("unreachable")
        log.info("%s: COPY_TENSOR_TO %s -> 0 (unreachable): %s", who, client_text(ev.endpoint),
                 client_text(str(exc), 200))
        return 0
    state.peer_stats.ok(ev.size)
    return 1
