"""The daemon: the listener and one thread per session over one ServerState."""

from __future__ import annotations

import errno
import faulthandler
import ipaddress
import logging
import os
import signal
import socket
import threading
import time

from fleetd import __version__
from fleetd.errors import TransportError
from fleetd.server import privileges
from fleetd.server.config import ServerConfig
from fleetd.server.control import ControlAPI
from fleetd.server.peer_policy import LOOPBACK, PeerCounters, listen_network, parse_allow
from fleetd.server.session import Session
from fleetd.server.state import ServerState
from fleetd.wire import PROTOCOL_VERSION

log = logging.getLogger("fleetd")

LISTEN_BACKLOG = 128
# Accept failures (EMFILE, no thread, no memory) back off from the first to the last delay.
BACKOFF_FIRST, BACKOFF_MAX = 0.01, 1.0
REFUSED_LOG_EVERY = 10.0  # seconds between log lines about refused connections
STOP_GRACE_S = 10.0  # seconds stop() waits for the sessions to close before the workers go
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 60, 10, 6  # seconds, seconds, probes


class ClientPolicy:
    """Which addresses may open RPC connections (`--allow`). Default: loopback when bound to
    loopback, else loopback plus the /24 (/64) of the bound address; on a wildcard bind, the
    subnet of the interface a client came in on."""

    def __init__(self, allow: list[str] | None, listen_host: str) -> None:
        self.default = allow is None
        self.networks = list(LOOPBACK) if allow is None else parse_allow(allow, "--allow")
        if allow is None:
            own = listen_network(listen_host)
            if own is not None and not own.is_loopback:
                self.networks.append(own)
        self.wildcard = self.default and listen_network(listen_host) is None

    def allows(self, sock: socket.socket, ip: str) -> bool:
        """Whether `ip` (the peer of `sock`) may open an RPC connection; IPv4-mapped addresses count
        as IPv4."""
        addr = ipaddress.ip_address(ip)
        if getattr(addr, "ipv4_mapped", None):
            addr = addr.ipv4_mapped
        if any(addr in net for net in self.networks):
            return True
        if self.wildcard:  # the subnet of the local address the client reached
            try:
                local = ipaddress.ip_network(f"{sock.getsockname()[0]}/24", strict=False)
            except (OSError, ValueError):
                return False
            return addr in local
        return False


class RateLimitedLog:
    """One log line per `every` seconds about a repeated event, with the count since the last."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last = float("-inf")
        self._count = 0

    def __call__(self, level: int, msg: str, *args) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.every:
            log.log(level, msg + " (%d such since the last line)", *args, self._count)
            self._last, self._count = now, 0


class Server:
    """One fleetd daemon: the RPC listener and its accept loop, the shared state, the control API."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state = ServerState(config)
        self.control: ControlAPI | None = None  # the loopback control API, when enabled
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.clients = ClientPolicy(config.allow, config.host)
        self._log_refused = RateLimitedLog(REFUSED_LOG_EVERY)
        self._trouble: str | None = None  # the accept failure of the episode under way
        self._backoff = BACKOFF_FIRST
        # One fd held in reserve: out of fds, it is given up to accept and close the waiting
        # client (who then sees a close, not a hang), then taken again.
        self._spare_fd: int | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.state.address

    # Read-only views of the state for embedders and tests that check a daemon from outside.
    @property
    def p2p_enabled(self) -> bool:
        return self.state.p2p_enabled

    @property
    def peer_stats(self) -> PeerCounters:
        return self.state.peer_stats

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> tuple[str, int]:
        """Bind the RPC port, drop to the service user (when configured), start compute and the
        control API, then listen and accept; returns the bound address."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as exc:
            sock.close()
            raise TransportError(
                f"cannot listen on {self.config.host}:{self.config.port} for RPC: {exc.strerror or exc}"
            ) from exc
        self._listener = sock
        self.state.address = sock.getsockname()
        try:  # bound, nothing served yet: the moment to stop being root
            if (entry := privileges.service_user(self.config.user)) is not None:
                privileges.drop(entry)
                privileges.check_writable(entry, self.state.cache_dir)
            self.state.start_compute()
        except BaseException:
            sock.close()
            raise
        # The control API is bound before the RPC port listens: whoever sees a HELLO answered
        # (fleetctl deploy's health step) can ask /v1/status at once.
        if self.config.control_port is not None:
            self.control = ControlAPI(self.state, self.config.control_port)
            try:
                self.control.start()
            except BaseException:
                sock.close()
                raise
        sock.listen(LISTEN_BACKLOG)
        self._spare_fd = os.open(os.devnull, os.O_RDONLY)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="fleetd-accept", daemon=True)
        self._accept_thread.start()
        log.info(
            "fleetd %s serving RPC %d.%d.%d on %s:%d, devices: %s, cache: %s",
            __version__,
            *PROTOCOL_VERSION,
            *self.address,
            ", ".join(d.describe() for d in self.state.devices),
            self.state.cache_dir or "n/a",
        )
        return self.address

    def stop(self) -> None:
        """Stop accepting, shut down every live session's socket, wait for the accept loop and close
        the state."""
        self._stopping.set()
        if self.control is not None:
            self.control.stop()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for s in self.state.live_sessions():
            try:
                s.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        if self._spare_fd is not None and not (self._accept_thread and self._accept_thread.is_alive()):
            os.close(self._spare_fd)
            self._spare_fd = None
        # Sessions see their socket shut and close (a graph in a worker is cancelled by the
        # hang-up); only then do the workers go, so none is pulled from under its session.
        if not self.state.sessions.wait_empty(STOP_GRACE_S):
            log.warning(
                "stopping with %d sessions still closing after %gs", self.state.sessions.count(), STOP_GRACE_S
            )
        self.state.close()

    def _accept_loop(self) -> None:
        """Never dies: a failure closes what it holds, backs off, and marks the daemon unhealthy
        (one log line per episode) until a session starts again."""
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except (OSError, MemoryError) as exc:  # EMFILE, ENFILE, ENOBUFS, ...
                if self._stopping.is_set():
                    return
                if getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE):
                    self._shed_one()
                self._failed(f"cannot accept: {getattr(exc, 'strerror', None) or exc!r}")
                continue
            try:
                self._admit(sock, peer)
            except Exception as exc:  # RuntimeError (no thread), MemoryError, OSError
                try:
                    sock.close()
                except OSError:
                    pass
                self._failed(f"cannot start a session: {exc!r}")
                continue
            if self._trouble is not None:
                log.warning("accepting RPC connections again (after: %s)", self._trouble)
                self._trouble, self._backoff = None, BACKOFF_FIRST
                self.state.unhealthy = None

    def _shed_one(self) -> None:
        """Out of fds: close the longest-waiting client with the spare fd's room."""
        if self._spare_fd is None:
            return
        os.close(self._spare_fd)
        self._spare_fd = None
        try:
            sock, _ = self._listener.accept()
            sock.close()
        except OSError:
            pass
        try:
            self._spare_fd = os.open(os.devnull, os.O_RDONLY)
        except OSError:
            pass  # taken again on a later episode

    def _failed(self, reason: str) -> None:
        if self._trouble is None:
            log.error("RPC accept loop: %s; backing off (up to %gs) until it recovers", reason, BACKOFF_MAX)
            self._trouble = reason
        self.state.unhealthy = reason
        self._stopping.wait(self._backoff)
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)

    def _admit(self, sock: socket.socket, peer: tuple) -> None:
        """Serve `sock` in a session thread, or close it when its client is not allowed or the
        daemon has its limit of connections."""
        sessions = self.state.sessions
        if not self.clients.allows(sock, peer[0]):
            self._log_refused(logging.WARNING, "refused RPC connection from %s: not in --allow", peer[0])
            sock.close()
            return
        if sessions.count() >= self.state.limits.max_connections:
            self._log_refused(
                logging.WARNING,
                "refused RPC connection from %s: %d connections open, the limit",
                peer[0],
                self.state.limits.max_connections,
            )
            sock.close()
            return
        per_address = self.state.limits.max_connections_per_address
        if sessions.count_from(peer[0]) >= per_address:
            self._log_refused(
                logging.WARNING,
                "refused RPC connection from %s: %d connections open from that address, the limit",
                peer[0],
                per_address,
            )
            sock.close()
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # An idle client may stay a day (--idle-timeout); one whose host vanished is found by
            # keepalive probes within KEEPALIVE_IDLE + KEEPALIVE_COUNT x KEEPALIVE_INTERVAL s.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        except OSError:  # the client reset already: its business, not the daemon's health
            sock.close()
            return
        session = Session(self.state, sock, peer, sessions.new_id())
        sessions.add(session)
        try:
            threading.Thread(target=session.run, name=f"fleetd-session-{session.id}", daemon=True).start()
        except BaseException:
            sessions.remove(session)
            raise
        log.info("session %d %s: accepted", session.id, session.peer)


def serve_forever(config: ServerConfig) -> int:
    server = Server(config)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a vanished peer is an EPIPE, never a death
    # `kill -USR1`: every thread's Python stack into the log (a wedged session, seen live)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stop.wait()
    log.info("fleetd stopping")
    server.stop()
    return 0
