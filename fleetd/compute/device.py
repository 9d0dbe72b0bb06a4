"""Devices own buffers of bytes; everything above sees a buffer as a flat uint8 array.

Thin hooks, fat base class (tinygrad's Allocator): `Device` does bookkeeping and the answers
the RPC protocol needs; `NumpyDevice` says how to get memory, which array module runs kernels
on it, and owns the f32 copies of weights its kernels keep (the dequant cache).
"""

from __future__ import annotations

import logging
import os
import types

import numpy as np

from fleetd.compute.dequant_cache import CacheBudget, DequantCache
from fleetd.compute.host_memory import host_pages


class Device:
    name = "device"
    xp: types.ModuleType = np
    alignment = 32  # TENSOR_ALIGNMENT of ggml's CPU buffer type, which stock clients expect
    max_size = (1 << 64) - 1  # SIZE_MAX: "no limit", as the stock CPU device answers
    dequant_cache: DequantCache | None = None  # f32 copies of weights, on devices that keep them
    library: str | None = None  # the compiled kernels' file, on devices that load one (/v1/status)
    fallback: str | None = None  # why this device stands in for the one asked for (/v1/status)

    def alloc(self, size: int):
        """A flat uint8 array of `size` bytes, or None when the memory is not there."""
        try:
            return self._alloc(size)
        except (MemoryError, ValueError):
            return None

    def _alloc(self, size: int):
        raise NotImplementedError

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes."""
        raise NotImplementedError

    def alloc_size(self, nbytes: int) -> int:
        return nbytes

    def describe(self) -> str:
        free, total = self.memory()
        return f"{self.name} ({total >> 20} MiB, {free >> 20} MiB free)"

    # The buffer registry reports each buffer's life to the device that holds its memory.

    def buffer_allocated(self, buf) -> None:
        if self.dequant_cache is not None:
            self.dequant_cache.adopt(buf)

    def buffer_written(self, buf) -> None:
        """A command (not a graph node) wrote into `buf`."""
        if self.dequant_cache is not None:
            self.dequant_cache.written(buf)

    def worker_stats(self) -> dict | None:
        """Contained compute workers (/v1/status), None where the device computes in-process."""
        return None

    def session_ended(self, session_id: int) -> None:
        """A session closed (the ggml device lets its compute worker go)."""

    def close(self) -> None:
        """The daemon stops."""

    def buffer_freed(self, buf) -> None:
        if self.dequant_cache is not None:
            self.dequant_cache.release(buf)


class NumpyDevice(Device):
    name = "CPU"
    kind = "numpy"  # which engine computes (/v1/status); the ggml device says "ggml"
    xp = np

    def __init__(self, dequant_cache: CacheBudget | str | int | None = None,
                 fallback: str | None = None) -> None:
        """`dequant_cache`: the f32 weight cache's budget, "0.5x" of the live buffer bytes
        by default, or an absolute size ("512M", "0" for none); see CacheBudget.parse.
        `fallback`: why it replaces the ggml device of `cpu`, when it does."""
        self.dequant_cache = DequantCache(dequant_cache)
        self.fallback = fallback

    def _alloc(self, size: int):
        return host_pages(size)

    def memory(self) -> tuple[int, int]:
        # The stock CPU device reports physical memory as both total and free.
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return total, total


def make_device(spec: str, dequant_cache: CacheBudget | str | int | None = None,
                threads: int | None = None) -> Device:
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
