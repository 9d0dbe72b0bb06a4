"""Devices own buffers of bytes; everything above sees a buffer as a flat uint8 array.

`Device` declares what the server calls on a device: the wire's answers, graphs (build_plan
makes what run computes, kept for GRAPH_RECOMPUTE), start and stop, /v1/status, and the
registry's `Memory` hooks. Two implement it: `NumpyDevice` here and the ggml device's
GgmlCpuDevice (fleetd/compute/ggml/device.py, which does not import this module: make_device
imports it).

Thin hooks over the bookkeeping (tinygrad's Allocator): `NumpyDevice` says how to get memory
(`_alloc`), which array module runs kernels on it (`xp`), and owns the f32 copies of weights its
kernels keep (the dequant cache); a cupy device would change the first two.
"""

from __future__ import annotations

import logging
import os
import socket
import types
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fleetd.compute.buffers import BufferRegistry, Memory
from fleetd.compute.dequant_cache import CacheBudget, DequantCache
from fleetd.compute.graph import Plan, build_plan
from fleetd.compute.host_memory import host_pages
from fleetd.wire import GraphCompute


@runtime_checkable
class Device(Memory, Protocol):
    """What the server calls on a device (see the module doc). Its values are read-only here
    (properties), so a class attribute of a narrower type implements one."""

    @property
    def name(self) -> str: ...

    @property
    def kind(self) -> str:
        """Which engine computes (/v1/status): "numpy", "ggml"."""
        ...

    @property
    def alignment(self) -> int:
        """GET_ALIGNMENT's answer."""
        ...

    @property
    def max_size(self) -> int:
        """GET_MAX_SIZE's answer."""
        ...

    @property
    def library(self) -> str | None:
        """The compiled kernels' file, on devices that load one (/v1/status)."""
        ...

    @property
    def fallback(self) -> str | None:
        """Why this device stands in for the one asked for (/v1/status)."""
        ...

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes."""
        ...

    def alloc_size(self, nbytes: int) -> int: ...

    def describe(self) -> str: ...

    def build_plan(self, graph: GraphCompute, registry: BufferRegistry) -> Any:
        """Validate a GRAPH_COMPUTE and make what `run` computes (a plan of this device's)."""
        ...

    def run(self, plan: Any, session_id: int, deadline: float, client: socket.socket | None = None) -> None:
        """Compute `plan` for session `session_id` (0: a caller outside the server) by the
        monotonic `deadline`; `client` is the session's socket, watched for a hang-up meanwhile.
        A device that computes in the daemon (kind "numpy") runs under the server's exec lock,
        which its caller holds."""
        ...

    def start_workers(
        self, user: str | None, max_workers: int, idle_timeout: float, pin: bool = True
    ) -> None:
        """The daemon dropped root: start compute workers, on devices that have them."""
        ...

    def worker_stats(self) -> dict | None:
        """Contained compute workers (/v1/status), None where the device computes in-process."""
        ...

    def session_ended(self, session_id: int) -> None:
        """A session closed (the ggml device lets its compute worker go)."""
        ...

    def close(self) -> None:
        """The daemon stops."""
        ...


class NumpyDevice:
    """The op table (graph.py's plans) over numpy arrays, computed in the daemon."""

    name = "CPU"
    kind = "numpy"
    xp: types.ModuleType = np
    alignment = 32  # TENSOR_ALIGNMENT of ggml's CPU buffer type, which stock clients expect
    max_size = (1 << 64) - 1  # SIZE_MAX: "no limit", as the stock CPU device answers
    library: str | None = None  # no compiled kernels

    def __init__(
        self, dequant_cache: CacheBudget | str | int | None = None, fallback: str | None = None
    ) -> None:
        """`dequant_cache`: the f32 weight cache's budget, "0.5x" of the live buffer bytes
        by default, or an absolute size ("512M", "0" for none); see CacheBudget.parse.
        `fallback`: why it replaces the ggml device of `cpu`, when it does."""
        self.dequant_cache: DequantCache | None = DequantCache(dequant_cache)
        self.fallback = fallback

    def alloc(self, size: int):
        """A flat uint8 array of `size` bytes, or None when the memory is not there."""
        try:
            return self._alloc(size)
        except (MemoryError, ValueError):
            return None

    def _alloc(self, size: int):
        return host_pages(size)

    def memory(self) -> tuple[int, int]:
        # The stock CPU device reports physical memory as both total and free.
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return total, total

    def alloc_size(self, nbytes: int) -> int:
        return nbytes

    def describe(self) -> str:
        free, total = self.memory()
        return f"{self.name} ({total >> 20} MiB, {free >> 20} MiB free)"

    # -- graphs ----------------------------------------------------------------------------------

    def build_plan(self, graph: GraphCompute, registry: BufferRegistry) -> Plan:
        return build_plan(graph, registry)

    def run(self, plan: Plan, session_id: int, deadline: float, client: socket.socket | None = None) -> None:
        """In the caller's thread (it holds the exec lock), to the end: numpy's bounds-checked
        array operations over a validated graph, no worker to kill at the deadline."""
        plan.run(self.xp)

    # -- the daemon's life: no workers here ------------------------------------------------------

    def start_workers(
        self, user: str | None, max_workers: int, idle_timeout: float, pin: bool = True
    ) -> None:
        pass

    def worker_stats(self) -> dict | None:
        return None

    def session_ended(self, session_id: int) -> None:
        pass

    def close(self) -> None:
        pass

    # -- the registry reports each buffer's life: the dequant cache follows it -------------------

    def buffer_allocated(self, buf) -> None:
        if self.dequant_cache is not None:
            self.dequant_cache.adopt(buf)

    def buffer_written(self, buf) -> None:
        if self.dequant_cache is not None:
            self.dequant_cache.written(buf)

    def buffer_freed(self, buf) -> None:
        if self.dequant_cache is not None:
            self.dequant_cache.release(buf)


def make_device(
    spec: str, dequant_cache: CacheBudget | str | int | None = None, threads: int | None = None
) -> Device:
    """The device a `--device` spec names: "cpu" (ggml's kernels, or numpy with a warning when the
    library does not load) or "numpy"; ValueError for anything else."""
    kind = spec.strip().lower()
    if kind == "cpu":  # ggml's CPU kernels where the library loads, else numpy with one warning
        from fleetd.compute.ggml.device import load_device

        try:
            return load_device(threads)
        except OSError as exc:
            logging.getLogger("fleetd").warning("device cpu: %s; using the numpy device", exc)
            return NumpyDevice(dequant_cache, fallback=f"device cpu: {exc}")
    if kind == "numpy":
        return NumpyDevice(dequant_cache)
    raise ValueError(f"unknown device {spec!r} (known: cpu, numpy)")
