"""Stages of a layer split: a remote fleetd (or stock) server, or the coordinator's own device.

Both kinds answer the same few calls the coordinator needs (alloc, set/get a tensor, compute a
graph), so the coordinator's step loop never asks which one it has. Only a remote stage has a
`client` (and so can be the source or destination of a COPY_TENSOR_TO).
"""

from __future__ import annotations

import time
from typing import Any

from fleetd.client.rpc import RpcClient
from fleetd.client.stats import ClientCounters
from fleetd.compute.buffers import BufferRegistry
from fleetd.compute.device import make_device
from fleetd.compute.views import check_extent
from fleetd.transport.tcp import Timeout
from fleetd.wire import Feature, GraphCompute, RpcTensor

LOCAL_GRAPH_TIMEOUT = 600.0  # seconds one graph of the local device may take (fleetd's default)


class RemoteStage:
    """A stage on an RPC server, through its own client; it can send or receive a COPY_TENSOR_TO."""

    def __init__(
        self, endpoint: str, counters: ClientCounters, timeout: Timeout, peer_endpoint: str | None = None
    ) -> None:
        self.client = RpcClient(endpoint, timeout, counters).open()
        self.endpoint = endpoint
        # The address servers use to reach this one (the coordinator's view by default).
        self.peer_endpoint = peer_endpoint or endpoint
        self.name = f"RPC[{endpoint}]"
        self._stream = 0  # PEER_STREAM, asked at the first asynchronous copy into this stage
        self._seq = 0

    @property
    def peer_copy(self) -> bool:
        return bool(self.client.features & Feature.PEER_COPY)

    @property
    def peer_copy_async(self) -> bool:
        return bool(self.client.features & Feature.PEER_COPY_ASYNC)

    @property
    def peer_gate(self) -> bool:
        return bool(self.client.features & Feature.PEER_GATE)

    def next_copy(self) -> tuple[int, int]:
        """(stream, seq) for the next asynchronous copy into this stage."""
        if not self._stream:
            self._stream = self.client.peer_stream()
        self._seq += 1
        return self._stream, self._seq

    def alignment(self) -> int:
        return self.client.get_alignment()

    def alloc(self, size: int) -> tuple[int, int]:
        ptr, _ = self.client.alloc_buffer(size)
        if ptr == 0:
            raise MemoryError(f"ALLOC_BUFFER: {self.endpoint} could not allocate {size} bytes")
        return ptr, self.client.buffer_get_base(ptr)

    def set_tensor(self, t: RpcTensor, data) -> None:
        self.client.set_tensor(t, data)

    def get_tensor(self, t: RpcTensor) -> bytes:
        return bytes(self.client.get_tensor(t))

    def compute(self, graph: GraphCompute, first: bool) -> None:
        # llama.cpp sends the whole graph once and GRAPH_RECOMPUTE while it is unchanged.
        if first:
            self.client.graph_compute(graph)
        else:
            self.client.graph_recompute(graph.device)

    def close(self) -> None:
        self.client.close()


class LocalStage:
    """The coordinator's own CPU device (ggml kernels, or numpy where they do not load), as fleetd runs."""

    peer_copy = False
    peer_copy_async = False
    peer_gate = False
    client = None

    def __init__(self) -> None:
        self.device = make_device("cpu")  # the same kernels as the remote stages: same bytes
        self.registry = BufferRegistry()
        self.plan: Any = None  # the device's plan of the last graph
        self.name = "LOCAL"

    def alignment(self) -> int:
        return self.device.alignment

    def alloc(self, size: int) -> tuple[int, int]:
        buf = self.registry.alloc(0, self.device, size, owner=0)
        if buf is None:
            raise MemoryError(f"local device could not allocate {size} bytes")
        return buf.handle, buf.base

    def _span(self, t: RpcTensor):
        buf = self.registry.get(t.buffer)
        start = check_extent(buf, t, "local")
        return buf, start

    def set_tensor(self, t: RpcTensor, data) -> None:
        buf, start = self._span(t)
        view = memoryview(data).cast("B")
        buf.array[start : start + len(view)] = view
        buf.touched()

    def get_tensor(self, t: RpcTensor) -> bytes:
        buf, start = self._span(t)
        return buf.array[start : start + t.nbytes].tobytes()

    def compute(self, graph: GraphCompute, first: bool) -> None:
        if first or self.plan is None:
            self.plan = self.device.build_plan(graph, self.registry)
        self.device.run(self.plan, 0, time.monotonic() + LOCAL_GRAPH_TIMEOUT)

    def close(self) -> None:
        self.plan = None
        for buf in self.registry.owned_by(0):
            self.registry.free(buf)
        self.device.close()  # its fork server and workers, if a graph started them
