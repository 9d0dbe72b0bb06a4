"""fleetd: a ggml RPC server with direct server-to-server transfer, and fleetctl to run fleets of it."""

__version__ = "0.1.0"
