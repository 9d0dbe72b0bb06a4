"""Everything a daemon's sessions, its peer copy and its control API share, in one object.

The daemon (fleetd.server.daemon) makes one ServerState from its config and hands it to each
Session and to the ControlAPI; none of them sees the daemon itself. Sessions write only their
own counters and buffers; what is shared across threads is guarded here (the session table, the
stats book) or by the execution lock the compute and copy paths take.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from pathlib import Path
from typing import BinaryIO, Protocol

from fleetd.compute.buffers import BufferRegistry
from fleetd.compute.device import Device, make_device
from fleetd.server.cache_dir import CacheDir
from fleetd.server.config import ServerConfig, ServerLimits  # noqa: F401 (re-exported)
from fleetd.server.peer_policy import PeerCounters, PeerPolicy, PeerTimeouts
from fleetd.server.peer_streams import make_peer_staging
from fleetd.server.stats import CommandCounters, StatsBook
from fleetd.wire import Feature

log = logging.getLogger("fleetd.state")


class LiveSession(Protocol):
    """What the state and the control API read of a session (fleetd.server.session.Session)."""

    id: int
    peer: str
    address: str  # the client's IP address
    started: float
    counters: CommandCounters
    layers: set[int]  # model layers whose weights it wrote (blk.N.*)

    def counters_now(self) -> CommandCounters:
        """A copy of `counters` with what its C fast loop served and has not folded in yet."""
        ...

    def reset_counters(self) -> None: ...


class SessionTable:
    """The live sessions by id; ids are never reused within one daemon."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._by_id: dict[int, LiveSession] = {}
        self._per_address: dict[str, int] = {}
        self._next_id = 1

    def new_id(self) -> int:
        with self._lock:
            sid = self._next_id
            self._next_id += 1
            return sid

    def add(self, session: LiveSession) -> None:
        with self._lock:
            self._by_id[session.id] = session
            self._per_address[session.address] = self._per_address.get(session.address, 0) + 1

    def remove(self, session: LiveSession) -> None:
        with self._lock:
            if self._by_id.pop(session.id, None) is not None:
                left = self._per_address[session.address] - 1
                if left:
                    self._per_address[session.address] = left
                else:
                    del self._per_address[session.address]
            if not self._by_id:
                self._lock.notify_all()

    def wait_empty(self, timeout: float) -> bool:
        """Wait until every session has closed (True) or `timeout` passed (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._by_id, timeout)

    def count_from(self, address: str) -> int:
        """Live sessions whose client connected from `address`."""
        return self._per_address.get(address, 0)

    def count(self) -> int:
        return len(self._by_id)

    def live(self) -> list[LiveSession]:
        with self._lock:
            return list(self._by_id.values())


class ReceiveBudget:
    """Bytes of unfinished requests held by all connections together, against one cap.

    A connection charges only what it holds beyond a small floor (one read of a small command),
    so the usual request costs no lock."""

    FLOOR = 128 * 1024

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self.held = 0

    def charge(self, before: int, after: int) -> bool:
        """Move one connection's charge from `before` to `after` bytes; False (and nothing
        charged) when that would pass the cap."""
        with self._lock:
            if after > before and self.held + after - before > self.limit:
                return False
            self.held += after - before
            return True


class ServerState:
    """What every session of one daemon shares: devices, the buffer registry, the execution lock,
    counters, the cache directory, P2P settings and limits."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.devices: list[Device] = [
            make_device(d, config.dequant_cache, config.threads) for d in config.devices
        ]
        self.registry = BufferRegistry()
        # Held by the numpy device's compute and by COPY_TENSOR's copy inside the daemon (the
        # ggml device computes in workers, side by side); never during I/O
        # (GET_TENSOR and COPY_TENSOR_TO send straight from a buffer without it).
        self.exec_lock = threading.Lock()
        self.stats = StatsBook()  # command counters of closed sessions
        self.sessions = SessionTable()
        self.cache: CacheDir | None = (
            CacheDir(Path(config.cache_dir), config.cache_max_bytes) if config.cache_dir else None
        )
        self.cache_dir: Path | None = self.cache.path if self.cache is not None else None
        # the P2P switch where the sessions' C loops read it (p2p_enabled sets it)
        self.p2p_cell = ctypes.c_int32(0)
        self.p2p_enabled = config.p2p
        self.peer_policy = PeerPolicy(config.peer_allow, config.host)
        self.peer_timeouts = PeerTimeouts()
        self.peer_stats = PeerCounters()
        self.limits = config.limits
        # the asynchronous copies' budget and destinations (over peer_stage.c when it is there)
        self.peer_memory, self.peer_streams = make_peer_staging(self.limits.max_peer_held_bytes)
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        self.max_memory = self.limits.max_memory or physical * 9 // 10
        self.max_session_memory = min(self.limits.max_session_memory or self.max_memory, self.max_memory)
        self.receive_budget = ReceiveBudget(self.limits.max_buffered_bytes)
        # Why the accept loop cannot accept right now (None: healthy); /v1/status reports it.
        self.unhealthy: str | None = None
        self.registry.on_free(self._drop_plans_using)
        # Caches do not keep a freed buffer resident: the registry tells the buffer's device
        # (Device.buffer_freed), whose dequantisation cache releases it.
        self.started = time.time()
        # The RPC address; the daemon sets the bound one (port 0 picks a free port).
        self.address: tuple[str, int] = (config.host, config.port)

    def start_compute(self) -> None:
        """Start the devices' compute workers (the ggml device's fork server): called by the
        daemon once it has dropped root, so not even the fork server keeps root's rights."""
        for dev in self.devices:
            dev.start_workers(
                self.config.worker_user,
                self.limits.max_workers,
                self.limits.worker_idle_timeout,
                self.config.pin_workers,
            )

    def close(self) -> None:
        """The daemon stops: devices let their workers and fork servers go."""
        for dev in self.devices:
            dev.close()

    def _drop_plans_using(self, buf) -> None:
        # A stored graph of any session must not keep a freed buffer alive or write into it.
        for session in self.sessions.live():
            drop = getattr(session, "drop_plans_using", None)
            if drop is not None:
                drop(buf)

    # -- P2P switch and the HELLO feature bits ----------------------------------------------

    def set_p2p(self, enabled: bool) -> None:
        """Switch peer copy at runtime: off clears the HELLO bit for new connections and makes
        COPY_TENSOR_TO and PEER_BARRIER answer 0, asynchronous copies fail (the client takes them)."""
        self.p2p_enabled = enabled

    @property
    def p2p_enabled(self) -> bool:
        return self._p2p_enabled

    @p2p_enabled.setter
    def p2p_enabled(self, enabled: bool) -> None:
        self._p2p_enabled = bool(enabled)
        self.p2p_cell.value = int(enabled)

    def features(self) -> int:
        return int(Feature.ALL) if self.p2p_enabled else 0

    # -- sessions and their counters --------------------------------------------------------

    def live_sessions(self) -> list[LiveSession]:
        return self.sessions.live()

    def session_ended(self, session: LiveSession) -> None:
        self.sessions.remove(session)
        self.stats.fold(session.counters_now())

    def total_counters(self) -> CommandCounters:
        return self.stats.total([s.counters_now() for s in self.sessions.live()])

    def reset_stats(self) -> None:
        """Zero every counter: live sessions, closed ones, peer copy."""
        self.stats.reset()
        for s in self.sessions.live():
            s.reset_counters()
        self.peer_stats.reset()

    # -- cache directory (SET_TENSOR cache flag, SET_TENSOR_HASH) ----------------------------

    def cache_store(self, data) -> None:
        """Store `data` under its hash (fleetd.server.cache_dir.CacheDir.store)."""
        if self.cache is not None:
            self.cache.store(data)

    def cache_open(self, h: int) -> BinaryIO | None:
        """The whole cache file of hash `h`, open, or None (CacheDir.open)."""
        return self.cache.open(h) if self.cache is not None else None
