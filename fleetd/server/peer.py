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
    ConnectTimeout,
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
from fleetd.transport.channel import RpcChannel
from fleetd.transport.stream import TcpStream
from fleetd.transport.tcp import parse_endpoint
from fleetd.wire import CopyTensorTo, Feature, PeerBarrier, SetTensor
from fleetd.wire.text import client_text

if TYPE_CHECKING:
    from fleetd.server.state import ServerState

log = logging.getLogger("fleetd.peer")


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
    """A client connection from this daemon to a destination daemon: HELLO, then pushes, on
    the one RpcChannel (blocking, bounded by SO_RCVTIMEO / SO_SNDTIMEO as a session is)."""

    def __init__(
        self, endpoint: str, addr: tuple[str, int], timeouts: PeerTimeouts, need: Feature = Feature.PEER_COPY
    ) -> None:
        self.endpoint = endpoint
        self.addr = addr
        self.timeouts = timeouts
        self.need = need  # the feature bit the destination must advertise
        self.channel = RpcChannel(self._connect(addr), timeouts.hello)
        try:
            self._hello()
            self.channel.set_timeout(timeouts.transfer)
        except BaseException:
            self.close()
            raise

    def _connect(self, addr: tuple[str, int]) -> TcpStream:
        try:
            return TcpStream.connect(addr, self.timeouts.connect, f"peer {self.endpoint}")
        except ConnectTimeout as exc:
            raise PeerFailure("timeout", f"connect timed out after {self.timeouts.connect}s") from exc
        except TransportError as exc:
            raise PeerFailure("unreachable", str(exc)) from exc

    @property
    def sock(self):
        return self.channel.stream.socket

    @property
    def conn(self):
        return self.channel.conn

    def _hello(self) -> None:
        try:
            self.channel.hello()
        except ReadTimeout as exc:
            raise PeerFailure(
                "timeout",
                f"HELLO not answered within {self.timeouts.hello}s "
                "(a stock server busy with another client?)",
            ) from exc
        except RemoteProtocolError as exc:
            raise PeerFailure("refused", f"HELLO: {exc}") from exc
        except TransportError as exc:
            raise PeerFailure("unreachable", f"HELLO: {exc}") from exc
        if not self.channel.conn.features & self.need:
            what = "asynchronous peer copy" if self.need & Feature.PEER_COPY_ASYNC else "peer copy"
            raise PeerFailure("refused", f"destination does not advertise {what}")

    def stale(self) -> bool:
        """A cached link the destination closed meanwhile (restart, idle close): reconnect."""
        return self.channel.stream.closed_by_peer()

    def push(self, dst, data: memoryview, stats: PeerCounters) -> None:
        """SET_TENSOR then PEER_BARRIER; returns once the destination confirmed the write.

        Both requests and the data between them go out in one write, the data straight from
        `data` (the source tensor's memory) when large: no round trip before the barrier's."""
        try:
            self.channel.send(SetTensor(dst, 0, len(data)), data, PeerBarrier())
            stats.pushed(len(data))
            landed = self.channel.reply("PEER_BARRIER").landed
        except ReadTimeout as exc:
            raise PeerFailure("timeout", str(exc)) from exc
        except (PeerClosed, TransportError, RemoteProtocolError) as exc:
            raise PeerFailure("write_rejected", str(exc)) from exc
        if not landed:
            raise PeerFailure("refused", "PEER_BARRIER answered 0 (peer copy off at destination)")

    def close(self) -> None:
        self.channel.close()


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
            log.info("peer link to %s closed by the destination: reconnecting", link.endpoint)
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


def copy_endpoint(endpoint: str, what: str = "COPY_TENSOR_TO") -> tuple[str, int]:
    """(host, port) of a copy's destination; a malformed one is the request's fault."""
    try:
        return parse_endpoint(endpoint)
    except ValueError as exc:
        raise RemoteProtocolError(f"{what}: {exc}") from None


def _link_for(
    state: ServerState, links: PeerLinks, endpoint: str, host: str, port: int, local_addr: str | None
) -> PeerLink:
    addr = resolve(host, port)
    if not state.peer_policy.allows(addr[0], local_addr):
        raise PeerFailure("not_allowed", f"{addr[0]} is outside --peer-allow")
    link = links.get(addr)
    if link is not None:
        return link
    link = PeerLink(endpoint, addr, state.peer_timeouts)
    log.info("peer link to %s (%s:%d) opened", client_text(endpoint), *addr)
    state.peer_stats.link_opened()
    links.put(link)
    return link


def serve_copy(
    state: ServerState, links: PeerLinks, ev: CopyTensorTo, local_addr: str | None = None, who: str = "copy"
) -> int:
    """Handle one COPY_TENSOR_TO; returns 1 when the write landed, 0 on a recoverable failure.

    `links`: the client session's cached links; `local_addr`: the address the client reached
    this daemon on (the default allow list uses it on a wildcard bind); `who` names the client
    session in the log."""
    buf, start = region(state.registry, ev.src, 0, ev.size, "COPY_TENSOR_TO")
    host, port = copy_endpoint(ev.endpoint)
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
        except PeerFailure as exc:
            log.info("peer link to %s dropped: %s", client_text(ev.endpoint), client_text(str(exc), 200))
            links.drop(link.addr)  # the stream state is unknown now
            raise
    except PeerFailure as exc:
        state.peer_stats.fallback(exc.reason)
        log.info(
            "%s: COPY_TENSOR_TO %s -> 0 (%s): %s",
            who,
            client_text(ev.endpoint),
            exc.reason,
            client_text(str(exc), 200),
        )
        return 0
    except FleetdError as exc:  # anything else on the peer side is still the peer's, not ours
        state.peer_stats.fallback("unreachable")
        log.info(
            "%s: COPY_TENSOR_TO %s -> 0 (unreachable): %s",
            who,
            client_text(ev.endpoint),
            client_text(str(exc), 200),
        )
        return 0
    state.peer_stats.ok(ev.size)
    return 1
