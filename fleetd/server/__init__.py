"""The RPC server: the daemon (listener, one session per connection) over one ServerState."""

from fleetd.server.config import ServerConfig
from fleetd.server.daemon import Server
from fleetd.server.state import ServerState

__all__ = ["Server", "ServerConfig", "ServerState"]
