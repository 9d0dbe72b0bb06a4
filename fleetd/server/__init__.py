"""The RPC server: listener, one session per connection, shared registry, execution lock."""

from fleetd.server.config import ServerConfig
from fleetd.server.daemon import Server

__all__ = ["Server", "ServerConfig"]
