"""Python RPC client, graph builder and client-side counters."""

from fleetd.client.graph import GraphBuilder, Tensor
from fleetd.client.rpc import RpcClient
from fleetd.client.stats import ClientCounters

__all__ = ["ClientCounters", "GraphBuilder", "RpcClient", "Tensor"]
