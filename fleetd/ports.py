"""The default ports, defined once: every layer that needs them imports them from here."""

DEFAULT_RPC_PORT = 50052  # the stock ggml-rpc-server's default
# The loopback control API sits this far above the RPC port, so two fleetd on one host (one per
# GPU) given only their own --port get their own control ports too.
CONTROL_PORT_OFFSET = 100


def control_port_for(rpc_port: int) -> int:
    """The default control API port of a fleetd serving RPC on `rpc_port`."""
    return rpc_port + CONTROL_PORT_OFFSET


DEFAULT_CONTROL_PORT = control_port_for(DEFAULT_RPC_PORT)  # 50152
