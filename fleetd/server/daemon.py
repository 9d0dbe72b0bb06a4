"""The daemon: the listener and one thread per session over one ServerState."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

from fleetd import __version__
from fleetd.errors import TransportError
from fleetd.server.config import ServerConfig
from fleetd.server.control import ControlAPI
from fleetd.server.peer_policy import PeerStats
from fleetd.server.session import Session
from fleetd.server.state import ServerState
from fleetd.wire import PROTOCOL_VERSION

log = logging.getLogger("fleetd")

LISTEN_BACKLOG = 128


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state = ServerState(config)
        self.control: ControlAPI | None = None  # the loopback control API, when enabled
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def address(self) -> tuple[str, int]:
        return self.state.address

    # Read-only views of the state for embedders and tests that check a daemon from outside.
    @property
    def p2p_enabled(self) -> bool:
        return self.state.p2p_enabled

    @property
    def peer_stats(self) -> PeerStats:
        return self.state.peer_stats

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
        self.state.address = sock.getsockname()
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
        self._accept_thread = threading.Thread(target=self._accept_loop, name="fleetd-accept", daemon=True)
        self._accept_thread.start()
        log.info(
            "fleetd %s serving RPC %d.%d.%d on %s:%d, devices: %s, cache: %s",
            __version__, *PROTOCOL_VERSION, *self.address,
            ", ".join(d.describe() for d in self.state.devices), self.state.cache_dir or "n/a",
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
        for s in self.state.live_sessions():
            try:
                s.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)

    def _accept_loop(self) -> None:
        sessions = self.state.sessions
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
            session = Session(self.state, sock, peer, sessions.new_id())
            sessions.add(session)
            log.debug("session %d %s: accepted", session.id, session.peer)
            threading.Thread(target=session.run, name=f"fleetd-session-{session.id}", daemon=True).start()


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
