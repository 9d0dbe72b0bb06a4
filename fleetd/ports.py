"""The default ports, defined once: every layer that needs them imports them from here."""

DEFAULT_RPC_PORT = 50052  # the stock ggml-rpc-server's default
DEFAULT_CONTROL_PORT = 50152  # fleetd's loopback control API
