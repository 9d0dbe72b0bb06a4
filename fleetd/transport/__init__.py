"""Sockets, with low-level errors translated once, here (httpx's map_httpcore_exceptions)."""

from fleetd.transport.tcp import Timeout, connect, parse_endpoint, recv_exact

__all__ = ["Timeout", "connect", "parse_endpoint", "recv_exact"]
