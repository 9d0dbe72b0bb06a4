"""Buffer memory as the stock server gets it: anonymous pages straight from mmap, page aligned.

Not numpy's allocator: it asks for transparent huge pages (MADV_HUGEPAGE) on every large array,
which the stock server's malloc does not. Where the kernel hands out huge pages from memory a VM
reported free to its host (free page reporting), every fresh huge page costs a host fault
while it is zeroed: measured by benchmarks/load.py on a freshly booted VM, a model load with a
warm cache directory cost fleetd 2.7-3.8x the stock server's CPU, 0.9-1.5x with these pages
(less apart once most of the VM's memory had been touched). Same pages as stock also means the
same TLB behaviour under the same kernels, and no RSS rounded up to 2 MiB pages.
"""

from __future__ import annotations

import mmap
import os
import weakref

import numpy as np


def host_pages(size: int) -> np.ndarray | None:
    """A writable flat uint8 array of `size` bytes on a page boundary, or None when the memory
    is not there. Its pages go back to the system when the last view of it goes."""
    if size < 0:
        return None
    try:
        pages = mmap.mmap(-1, max(size, 1))  # private anonymous; zero pages until written
    except (OSError, OverflowError, ValueError):
        return None
    return np.frombuffer(pages, np.uint8, size)


class SharedPages(mmap.mmap):
    """A memfd mapped shared: the daemon's buffer, which a compute worker maps by the same fd.
    The fd closes when the mapping's last user lets go (a worker being handed it holds a view)."""

    fd: int


def shared_pages(size: int, name: str = "fleetd-buffer") -> np.ndarray | None:
    """Like host_pages, over a memfd (MAP_SHARED: what a worker writes, the daemon reads); the
    same page size, zero pages until written, no huge pages (shmem THP is off by default)."""
    if size < 0:
        return None
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        os.ftruncate(fd, max(size, 1))
        pages = SharedPages(fd, max(size, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, OverflowError, ValueError):
        os.close(fd)
        return None
    pages.fd = fd
    weakref.finalize(pages, os.close, fd)
    return np.frombuffer(pages, np.uint8, size)


def memfd_of(array) -> int | None:
    """The memfd behind an array made by shared_pages (or a view of one), else None."""
    base = array
    while base is not None and not isinstance(base, SharedPages):
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    return base.fd if base is not None else None
