"""Daemon configuration: one object, passed in (never read from module globals)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from fleetd.ports import DEFAULT_CONTROL_PORT, DEFAULT_RPC_PORT

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class ServerLimits:
    """Caps on what clients may hold or send; every session reads them from ServerState.limits.
    Sizes in bytes, times in seconds. fleetd(8), LIMITS, documents each with its flag and key."""

    # ALLOC_BUFFER beyond these answers the null buffer, as a full device does.
    # None: 90% of physical memory for the daemon; the daemon's limit for one session.
    max_memory: int | None = None
    max_session_memory: int | None = None
    # Bytes of unfinished requests held in memory (a GRAPH_COMPUTE arrives whole before it is
    # decoded; SET_TENSOR data goes straight to its buffer and does not count).
    max_request_bytes: int = 64 * MIB  # per connection
    max_buffered_bytes: int = 512 * MIB  # all connections together
    max_connections: int = 256
    # ... and from one client address: one host's flood cannot refuse every other client
    max_connections_per_address: int = 64
    max_graph_tensors: int = 1 << 18  # nodes, and tensors, of one GRAPH_COMPUTE
    # A view's logical bytes (elements x element size) may exceed the bytes it spans by this
    # factor plus the slack; stride-0 broadcasts beyond that are refused.
    view_expansion: float = 16.0
    view_slack: int = 1 * MIB
    hello_timeout: float = 5.0  # from connect to a complete HELLO
    # Between requests. An idle llama-server keeps its connection for as long as it runs and
    # aborts when it is closed: a day, so only the truly abandoned are reaped.
    idle_timeout: float = 24 * 3600.0
    # Inside a request: no byte for this long, or below min_request_rate after it, cuts it.
    request_timeout: float = 10.0
    min_request_rate: int = 4 * KIB
    max_peer_links: int = 16  # COPY_TENSOR_TO destinations one session keeps open
    # Asynchronous peer copies' bytes a daemon holds: staged until their PEER_WAIT, read and not
    # yet pushed, kept after a failed push until PEER_TAKE.
    max_peer_held_bytes: int = 256 * MIB
    # Contained compute (the ggml device): live worker processes, one per computing session;
    # a worker idle this long is reaped (the next graph starts another); a graph still
    # computing after graph_timeout is killed with its worker (no real model comes near it).
    max_workers: int = 64
    worker_idle_timeout: float = 300.0
    graph_timeout: float = 600.0

    @classmethod
    def from_settings(cls, settings: dict) -> ServerLimits:
        """From a dict of field names (the `[limits]` TOML table and the flags); sizes may be
        written 64M, 8G, ... Raises ValueError with one clear line."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, raw in settings.items():
            f = fields.get(key)
            if f is None:
                raise ValueError(f"limits: unknown key {key!r} (known: {', '.join(fields)})")
            try:
                value = parse_size(raw) if f.type in ("int", "int | None") else float(raw)
            except (TypeError, ValueError):
                raise ValueError(f"limits: {key} = {raw!r} is not a number") from None
            if value <= 0:
                raise ValueError(f"limits: {key} = {raw!r} must be positive")
            values[key] = value
        return cls(**values)


def parse_size(raw) -> int:
    """An int, or a string like 512, 64K, 64M, 8G, 1T (powers of 1024)."""
    if isinstance(raw, bool):
        raise ValueError(raw)
    if isinstance(raw, int):
        return raw
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMGT]?)i?B?\s*", str(raw), re.IGNORECASE)
    if not m:
        raise ValueError(raw)
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


@dataclass
class ServerConfig:
    """Everything a daemon is started with: what the config file and the flags resolve to."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_RPC_PORT
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    cache_dir: Path | None = None
    # The cache directory's byte budget: a size, or a share of free space ("0.5x", the default).
    cache_max_bytes: int | str | None = None
    threads: int | None = None
    dequant_cache: str | None = (
        None  # numpy device's f32 weight cache: "0.5x" of buffer bytes (default), "2G", "0"
    )
    control_port: int | None = DEFAULT_CONTROL_PORT
    p2p: bool = True
    # Hosts / CIDRs a COPY_TENSOR_TO may push to. None = loopback plus the daemon's own /24.
    peer_allow: list[str] | None = None
    # Hosts / CIDRs whose RPC connections are served. None = loopback when bound to loopback,
    # else loopback plus the subnet of the bound address.
    allow: list[str] | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    # Started as root: after binding, drop to this user (fleetd.server.privileges).
    user: str | None = None
    # Off only to measure what counting costs (benchmarks/transfer.py); the control API then
    # reports zeros for commands.
    count_commands: bool = True
    # The user compute workers run as when the daemon runs as root (None: fleetd, else nobody);
    # a daemon that is not root runs its workers as itself.
    worker_user: str | None = None
    # Pin each computing session's daemon thread and worker to the same cores
    # (fleetd.compute.ggml.workers.CpuPlacer); off leaves placement to the scheduler.
    pin_workers: bool = True
    # Where the log goes (None: stderr); /v1/status reports it so that fleetctl logs finds it.
    log_file: str | None = None
