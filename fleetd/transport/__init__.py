"""The one blocking layer: byte streams (TCP, an SSH channel) and the RPC channel over them,
with low-level errors translated once, here (httpx's map_httpcore_exceptions)."""

from fleetd.transport.channel import RpcChannel, mapped_errors
from fleetd.transport.stream import ChannelStream, Stream, TcpStream, send_parts, set_io_timeout
from fleetd.transport.tcp import Timeout, free_port, parse_endpoint, wait_listening

__all__ = [
    "ChannelStream",
    "RpcChannel",
    "Stream",
    "TcpStream",
    "Timeout",
    "free_port",
    "mapped_errors",
    "parse_endpoint",
    "send_parts",
    "set_io_timeout",
    "wait_listening",
]
