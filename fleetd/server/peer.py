"""Peer copy: COPY_TENSOR_TO served by the source of a stage boundary (DESIGN.md "Peer copy").

    client --COPY_TENSOR_TO(src, dst, size, "host:port")--> source
    source --HELLO (once per link), SET_TENSOR(dst), PEER_BARRIER--> destination
    source --result u8--> client            (1 only after the barrier proved the write landed)

Rules, in the order `serve_copy` applies them:

- The source region is validated exactly like GET_TENSOR, and the endpoint must parse as
  "host:port": a malformed request or an out-of-bounds source raises RemoteProtocolError, which
  closes that client's connection only.
- Everything else that can go wrong is recoverable: the answer is 0, the reason is counted in
  `PeerStats` (one of `FALLBACK_REASONS`) and the client falls back to GET_TENSOR + SET_TENSOR.
- The source bytes are copied out under the execution lock, and the lock is released before any
  peer I/O, so a ring of servers pushing to each other cannot deadlock.
- The destination gets a push only when its HELLO advertises Feature.PEER_COPY. A stock
  ggml-rpc-server never does (and keeps buffers per connection, so the write could never land);
  a busy one accepts the TCP connect from its backlog but never answers HELLO, hence the bounded
  HELLO timeout. Links to such destinations are closed at once, never cached, so a stock server
  is not held away from its real client.
- Links are cached per client session and destination endpoint (`session.peer_links`) and
  closed when that session ends. A link that failed in any way is dropped, never reused.

Which destinations are allowed (`--peer-allow`, ServerConfig.peer_allow): a list of IP
addresses, CIDRs or host names (resolved once, at start). The default (None) is loopback
(127.0.0.0/8, ::1) plus the /24 (IPv4) or /64 (IPv6) around the address the daemon listens on;
a daemon bound to a wildcard address uses the address the client reached it on instead. So out
of the box a node pushes only to itself and to its neighbours on the fleet's subnet, never to
an arbitrary host a client names. The destination host is resolved once per copy and the
connection goes to the address that was checked (no second lookup between check and connect).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetd.errors import (
    FleetdError,
    PeerClosed,
    ReadTimeout,
    RemoteProtocolError,
    TransportError,
)
from fleetd.transport.tcp import mapped_errors, parse_endpoint, recv_exact
from fleetd.wire import ClientConnection, CopyTensorTo, Feature, Hello, PeerBarrier, SetTensor

if TYPE_CHECKING:
    from fleetd.server.daemon import Server
    from fleetd.server.session import Session

log = logging.getLogger("fleetd.peer")

_SIZE = struct.Struct("<Q")

# Closed set of fallback reasons (Prometheus label values, /v1/stats keys).
FALLBACK_REASONS = (
    "disabled",        # P2P switched off on this (source) daemon
    "not_allowed",     # destination outside --peer-allow
    "unreachable",     # resolve or connect failed
    "refused",         # destination answered HELLO without Feature.PEER_COPY, or too old/new,
                       # or (a fleetd) answered PEER_BARRIER 0 because its P2P is off now
    "write_rejected",  # destination closed the link on our SET_TENSOR (e.g. its bounds check)
    "timeout",         # connect, HELLO, push or barrier did not finish in time
)


@dataclass(frozen=True)
class PeerTimeouts:
    """Bounds on peer I/O. HELLO is short because a busy stock server accepts the connect from
    its listen backlog and then never answers; the transfer bound only guards against a hung peer."""

    connect: float = 2.0
    hello: float = 2.0
    transfer: float = 60.0


class PeerStats:
    """Peer-copy counters of one daemon, totals across sessions; read by the control API."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zero()

    def _zero(self) -> None:
        self.copies_ok = 0
        self.bytes_pushed = 0      # SET_TENSOR data written to destinations, landed or not
        self.bytes_confirmed = 0   # data whose PEER_BARRIER answered 1
        self.links_opened = 0
        self.fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)

    def reset(self) -> None:
        with self._lock:
            self._zero()

    def ok(self, nbytes: int) -> None:
        with self._lock:
            self.copies_ok += 1
            self.bytes_confirmed += nbytes

    def pushed(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_pushed += nbytes

    def link_opened(self) -> None:
        with self._lock:
            self.links_opened += 1

    def fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "copies_ok": self.copies_ok,
                "bytes_pushed": self.bytes_pushed,
                "bytes_confirmed": self.bytes_confirmed,
                "links_opened": self.links_opened,
                "fallbacks": dict(self.fallbacks),
            }


class PeerFailure(Exception):
    """A recoverable peer-copy failure: the answer is 0 and `reason` is counted."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# -- allow list ---------------------------------------------------------------------------------

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


def _neighbourhood(addr: str) -> Network | None:
    ip = ipaddress.ip_address(addr)
    if ip.is_unspecified:
        return None
    return ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False)


def _listen_network(host: str) -> Network | None:
    try:
        return _neighbourhood(socket.gethostbyname(host)) if host else None
    except OSError:
        return None  # an unresolvable listen host fails at bind(), not here


def parse_allow(entries: list[str]) -> list[Network]:
    """IPs, CIDRs or host names (resolved now) as networks; a bad entry raises ValueError."""
    nets: list[Network] = []
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(entry, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError(f"--peer-allow: cannot resolve {entry!r}: {exc}") from exc
        nets.extend(ipaddress.ip_network(info[4][0]) for info in infos)
    return nets


class PeerPolicy:
    """Which destinations this daemon may push to (see the module docstring for the default)."""

    def __init__(self, allow: list[str] | None, listen_host: str) -> None:
        self.default = allow is None
        if allow is None:
            self.networks = list(LOOPBACK)
            own = _listen_network(listen_host)
            if own is not None:
                self.networks.append(own)
        else:
            self.networks = parse_allow(allow)

    def allows(self, ip: str, local_addr: str | None = None) -> bool:
        addr = ipaddress.ip_address(ip)
        if any(addr in net for net in self.networks):
            return True
        # Default policy on a wildcard bind: the subnet of the interface the client came in on.
        if self.default and local_addr:
            own = _neighbourhood(local_addr)
            return own is not None and addr in own
        return False


def resolve(host: str, port: int) -> tuple[str, int]:
    """The first address of `host` (one lookup per copy; the check and the connect use it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise PeerFailure("unreachable", f"cannot resolve {host}: {exc}") from exc
    sockaddr = infos[0][4]
    return sockaddr[0], sockaddr[1]


# -- one link to one destination ------------------------------------------------------------------


class PeerLink:
    """A client connection from this daemon to a destination daemon: HELLO, then pushes."""

    def __init__(self, endpoint: str, addr: tuple[str, int], timeouts: PeerTimeouts) -> None:
        self.endpoint = endpoint
        self.timeouts = timeouts
        self.conn = ClientConnection()
        self.sock = self._connect(addr)
        try:
            self._hello()
        except BaseException:
            self.close()
            raise

    def _connect(self, addr: tuple[str, int]) -> socket.socket:
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeouts.connect)
        try:
            sock.connect(addr)
        except socket.timeout as exc:
            sock.close()
            raise PeerFailure("timeout", f"connect timed out after {self.timeouts.connect}s") from exc
        except OSError as exc:
            sock.close()
            raise PeerFailure("unreachable", f"connect: {exc.strerror or exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _call(self, request, timeout: float) -> tuple:
        """Send a request with a fixed-size response and decode the answer."""
        self.sock.settimeout(timeout)
        with mapped_errors(f"{request.cmd.name} to peer {self.endpoint}"):
            self.sock.sendall(self.conn.send(request))
            header = bytearray(8)
            recv_exact(self.sock, memoryview(header))
            (size,) = _SIZE.unpack(header)
            self.conn.check_response_size(request, size)
            payload = bytearray(size)
            recv_exact(self.sock, memoryview(payload))
        return self.conn.decode_response(request, payload)

    def _hello(self) -> None:
        try:
            self._call(Hello(), self.timeouts.hello)
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
            self.sock.settimeout(0)
            return self.sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def push(self, dst, data: memoryview, stats: PeerStats) -> None:
        """SET_TENSOR then PEER_BARRIER; returns once the destination confirmed the write."""
        request = SetTensor(dst, 0, len(data))
        self.sock.settimeout(self.timeouts.transfer)
        try:
            with mapped_errors(f"SET_TENSOR to peer {self.endpoint}"):
                self.sock.sendall(self.conn.send(request))
                self.sock.sendall(data)
            stats.pushed(len(data))
            (ok,) = self._call(PeerBarrier(), self.timeouts.transfer)
        except ReadTimeout as exc:
            raise PeerFailure("timeout", str(exc)) from exc
        except (PeerClosed, TransportError, RemoteProtocolError) as exc:
            raise PeerFailure("write_rejected", str(exc)) from exc
        if not ok:
            raise PeerFailure("refused", "PEER_BARRIER answered 0 (peer copy off at destination)")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class PeerLinks:
    """The links of one client session, keyed by destination endpoint as the client named it."""

    def __init__(self) -> None:
        self._links: dict[str, PeerLink] = {}

    def get(self, endpoint: str) -> PeerLink | None:
        link = self._links.get(endpoint)
        if link is not None and link.stale():
            self.drop(endpoint)
            return None
        return link

    def put(self, link: PeerLink) -> None:
        self._links[link.endpoint] = link

    def drop(self, endpoint: str) -> None:
        link = self._links.pop(endpoint, None)
        if link is not None:
            link.close()

    def __len__(self) -> int:
        return len(self._links)

    def close(self) -> None:
        for endpoint in list(self._links):
            self.drop(endpoint)


# -- the command ------------------------------------------------------------------------------------


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    try:
        return parse_endpoint(endpoint)
    except ValueError as exc:
        raise RemoteProtocolError(f"COPY_TENSOR_TO: {exc}") from None


def _local_addr(session: Session) -> str | None:
    try:
        return session.sock.getsockname()[0]
    except OSError:
        return None


def _link_for(server: Server, session: Session, endpoint: str, host: str, port: int) -> PeerLink:
    if session.peer_links is None:
        session.peer_links = PeerLinks()
    link = session.peer_links.get(endpoint)
    if link is not None:
        return link
    addr = resolve(host, port)
    if not server.peer_policy.allows(addr[0], _local_addr(session)):
        raise PeerFailure("not_allowed", f"{addr[0]} is outside --peer-allow")
    link = PeerLink(endpoint, addr, server.peer_timeouts)
    server.peer_stats.link_opened()
    session.peer_links.put(link)
    return link


def serve_copy(server: Server, session: Session, ev: CopyTensorTo) -> int:
    """Handle one COPY_TENSOR_TO; returns 1 when the write landed, 0 on a recoverable failure."""
    buf, start = session.region(ev.src, 0, ev.size, "COPY_TENSOR_TO")
    host, port = _parse_endpoint(ev.endpoint)
    try:
        if not server.p2p_enabled:
            raise PeerFailure("disabled", "peer copy is switched off on this daemon")
        # Copy out under the lock (a graph may be writing the buffer), then let it go: no peer
        # I/O ever happens with the execution lock held.
        with server.exec_lock:
            data = buf.array[start : start + ev.size].tobytes()
        link = _link_for(server, session, ev.endpoint, host, port)
        try:
            link.push(ev.dst, memoryview(data), server.peer_stats)
        except PeerFailure:
            session.peer_links.drop(ev.endpoint)  # the stream state is unknown now
            raise
    except PeerFailure as exc:
        server.peer_stats.fallback(exc.reason)
        log.info("session %d %s: COPY_TENSOR_TO %s -> 0 (%s): %s",
                 session.id, session.peer, ev.endpoint, exc.reason, exc)
        return 0
    except FleetdError as exc:  # anything else on the peer side is still the peer's, not ours
        server.peer_stats.fallback("unreachable")
        log.info("session %d %s: COPY_TENSOR_TO %s -> 0 (unreachable): %s",
                 session.id, session.peer, ev.endpoint, exc)
        return 0
    server.peer_stats.ok(ev.size)
    return 1
