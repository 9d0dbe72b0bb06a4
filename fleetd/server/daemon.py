"""The daemon: listener, sessions, shared registry, execution lock, cache directory."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

from fleetd import __version__
from fleetd.compute.buffers import BufferRegistry
from fleetd.compute.device import make_device
from fleetd.errors import TransportError
from fleetd.server.config import ServerConfig
from fleetd.server.peer import PeerPolicy, PeerStats, PeerTimeouts, serve_copy
from fleetd.server.session import Session
from fleetd.server.stats import CommandCounters, StatsBook
from fleetd.wire import Cmd, CopyTensorTo, Feature, PROTOCOL_VERSION
from fleetd.wire.hashing import cache_file_name, fnv1a_64

log = logging.getLogger("fleetd")

LISTEN_BACKLOG = 128


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.devices = [make_device(d) for d in config.devices]
        self.registry = BufferRegistry()
        self.exec_lock = threading.Lock()
        self.stats = StatsBook()
        self.cache_dir: Path | None = Path(config.cache_dir) if config.cache_dir else None
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.p2p_enabled = config.p2p
        self.peer_stats = PeerStats()
        self.peer_policy = PeerPolicy(config.peer_allow, config.host)
        self.peer_timeouts = PeerTimeouts()
        self.started = time.time()
        self._sessions: dict[int, Session] = {}
        self._sessions_lock = threading.Lock()
        self._next_sid = 1
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.control = None  # the loopback control API (fleetd.server.control), when enabled

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> tuple[str, int]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {self.config.host}:{self.config.port} for RPC: "
                                 f"{exc.strerror or exc}") from exc
        self._listener = sock
        self.address = sock.getsockname()
        # The control API is bound before the RPC port listens: whoever sees a HELLO answered
        # (fleetctl deploy's health step) can ask /v1/status at once.
        if self.config.control_port is not None:
            from fleetd.server.control import ControlAPI

            self.control = ControlAPI(self, self.config.control_port)
            try:
                self.control.start()
            except BaseException:
                sock.close()
                raise
        sock.listen(LISTEN_BACKLOG)
        self._accept_thread = threading.Thread(target=self._accept_loop, name="fleetd-accept", daemon=True)
        self._accept_thread.start()
        log.info(
            "fleetd %s serving RPC %d.%d.%d on %s:%d, devices: %s, cache: %s",
            __version__, *PROTOCOL_VERSION, *self.address,
            ", ".join(d.describe() for d in self.devices), self.cache_dir or "n/a",
        )
        return self.address

    def stop(self) -> None:
        self._stopping.set()
        if self.control is not None:
            self.control.stop()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for s in self.sessions():
            try:
                s.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.01)  # e.g. EMFILE: back off instead of spinning
                continue
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            with self._sessions_lock:
                sid = self._next_sid
                self._next_sid += 1
                session = Session(self, sock, peer, sid)
                self._sessions[sid] = session
            log.debug("session %d %s: accepted", sid, session.peer)
            threading.Thread(target=session.run, name=f"fleetd-session-{sid}", daemon=True).start()

    def session_ended(self, session: Session) -> None:
        with self._sessions_lock:
            self._sessions.pop(session.id, None)
        self.stats.fold(session.counters)
        log.debug("session %d %s: closed", session.id, session.peer)

    def sessions(self) -> list[Session]:
        with self._sessions_lock:
            return list(self._sessions.values())

    # -- state read by sessions and the control API -----------------------------------------

    def set_p2p(self, enabled: bool) -> None:
        """Switch peer copy at runtime: off clears the HELLO bit for new connections and makes
        COPY_TENSOR_TO answer 0."""
        self.p2p_enabled = enabled

    def features(self) -> int:
        return int(Feature.PEER_COPY) if self.p2p_enabled and self.peer_copy_served else 0

    # COPY_TENSOR_TO / PEER_BARRIER are served (fleetd.server.peer); p2p_enabled gates them.
    peer_copy_served = True

    def peer_copy(self, session: Session, ev: CopyTensorTo) -> int:
        return session.respond(Cmd.COPY_TENSOR_TO, serve_copy(self, session, ev))

    def total_counters(self) -> CommandCounters:
        return self.stats.total([s.counters for s in self.sessions()])

    # -- cache directory (SET_TENSOR cache flag, SET_TENSOR_HASH) ----------------------------

    def cache_store(self, data) -> None:
        path = self.cache_dir / cache_file_name(fnv1a_64(data))
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # readers never see a half-written file

    def cache_load(self, h: int) -> bytes | None:
        if self.cache_dir is None:
            return None
        try:
            return (self.cache_dir / cache_file_name(h)).read_bytes()
        except OSError:
            return None


def serve_forever(config: ServerConfig) -> int:
    server = Server(config)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a vanished peer is an EPIPE, never a death
    stop.wait()
    log.info("fleetd stopping")
    server.stop()
    return 0
