"""Daemon configuration: one object, passed in (never read from module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fleetd.ports import DEFAULT_CONTROL_PORT, DEFAULT_RPC_PORT


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_RPC_PORT
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    cache_dir: Path | None = None
    threads: int | None = None
    dequant_cache: str | None = None  # numpy device's f32 weight cache: "0.5x" of buffer bytes (default), "2G", "0"
    control_port: int | None = DEFAULT_CONTROL_PORT
    p2p: bool = True
    # Hosts / CIDRs a COPY_TENSOR_TO may push to. None = loopback plus the daemon's own /24.
    peer_allow: list[str] | None = None
    # Off only to measure what counting costs (benchmarks/transfer.py); the control API then
    # reports zeros for commands.
    count_commands: bool = True
