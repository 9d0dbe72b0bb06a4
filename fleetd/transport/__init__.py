"""Sockets, with low-level errors translated once, here (httpx's map_httpcore_exceptions)."""

from fleetd.transport.tcp import Timeout, connect, free_port, parse_endpoint, wait_listening

__all__ = ["Timeout", "connect", "free_port", "parse_endpoint", "wait_listening"]
