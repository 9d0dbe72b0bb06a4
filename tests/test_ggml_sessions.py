"""Sessions on the ggml device: many at once leave RSS, threads and fds where they were, and a
graph without nodes computes nothing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ggml_cases import F32, Slab
from helpers import endpoint

from fleetd.client.graph import f32_bits
from fleetd.client.rpc import RpcClient
from fleetd.wire import GgmlOp

try:
    from fleetd.compute.ggml.device import load_device

    load_device()
except OSError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"ggml libraries: {exc}", allow_module_level=True)


def _proc_counts() -> tuple[int, int, int]:
    status = Path("/proc/self/status").read_text()
    rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    threads = int(next(line for line in status.splitlines() if line.startswith("Threads")).split()[1])
    return rss, threads, len(os.listdir("/proc/self/fd"))


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# Threads of this process that are not Python threads (BLAS, the ggml library): counted once.
NATIVE_ONLY = native_threads() - threading.active_count()


def settle() -> None:
    """Wait until every session the clients closed has ended and its OS thread exited."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sessions = [t for t in threading.enumerate() if t.name.startswith("fleetd-session")]
        if not sessions and native_threads() - threading.active_count() <= NATIVE_ONLY:
            return
        time.sleep(0.05)
    raise AssertionError(f"sessions still running: {threading.enumerate()}")


def test_concurrent_sessions_do_not_leak(ggml_server):
    ep = endpoint(ggml_server)

    def session(n: int, errors: list) -> None:
        try:
            with RpcClient(ep).open() as c:
                s = Slab(c, 1 << 22)
                w, x = s.leaf(F32, (256, 256)), s.leaf(F32, (256, 8))
                y = s.node(GgmlOp.MUL_MAT, F32, (256, 8), [w, x])
                z = s.node(GgmlOp.SOFT_MAX, F32, (256, 8), [y], [f32_bits(1.0), 0])
                for i in range(n):
                    # a new plan (ggml context, graph) every time: another scale, other bytes
                    # (a graph sent again would run the plan the session kept)
                    z.op_params[0] = f32_bits(1.0 + i / 1024)
                    s.compute(z)
                c.get_tensor(z.rpc())
                c.free_buffer(s.handle)
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    def run(n: int) -> None:
        errors: list = []
        threads = [threading.Thread(target=session, args=(n, errors)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        settle()

    run(5)  # warm up: backends, work buffers, allocator pools
    rss0, threads0, fds0 = _proc_counts()
    run(25)  # 100 graph computes
    rss1, threads1, fds1 = _proc_counts()
    assert threads1 == threads0 and fds1 == fds0, (threads0, threads1, fds0, fds1)
    assert rss1 - rss0 < 16 * 1024, f"RSS grew {rss1 - rss0} KiB over 100 graph computes"
    device = ggml_server.state.devices[0]
    assert device.workers.live() == 0, f"{device.workers.live()} compute workers outlived their sessions"


def test_a_graph_without_nodes_computes_nothing_and_the_session_goes_on(fleetd_server):
    # Found by tests/test_fuzz.py: zero nodes made the graph builder raise (an internal error).
    from fleetd.client import RpcClient
    from fleetd.wire import RPC_TENSOR_DTYPE, GraphCompute

    srv = fleetd_server()
    with RpcClient(f"127.0.0.1:{srv.address[1]}") as c:
        c.graph_compute(GraphCompute(0, (), np.zeros(0, RPC_TENSOR_DTYPE)))
        c.graph_recompute()
        assert c.get_alignment() == 32
