"""A graph a session sends again, byte for byte, runs the plan it had: llama.cpp sends a few
graphs in turn (a prompt's micro-batch, a decode step), each as a whole GRAPH_COMPUTE. The plan
is reused only over buffers none of which was freed; the worker keeps the graphs built."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import connection_closed, endpoint
from test_workers import Slab, start

from fleetd.client import RpcClient
from fleetd.compute.ggml import workers
from fleetd.compute.ggml.device import GgmlCpuDevice
from fleetd.server import session as session_module
from fleetd.wire import GgmlOp, GgmlType

F32 = GgmlType.F32


@pytest.fixture
def server():
    srv = start()
    yield srv
    srv.stop()


@pytest.fixture
def plans_built(monkeypatch):
    """How many plans the device built (each a GRAPH_COMPUTE checked and planned anew)."""
    built = []
    real = GgmlCpuDevice.build_plan

    def counting(self, graph, registry):
        built.append(len(graph.nodes))
        return real(self, graph, registry)

    monkeypatch.setattr(GgmlCpuDevice, "build_plan", counting)
    return built


class Shapes:
    """Graphs over one slab: y_k = a * k-th scale (MUL by a tensor per shape), each its own graph."""

    def __init__(self, client: RpcClient, n: int):
        self.client, self.slab = client, Slab(client, 1 << 16)
        self.a = self.slab.place(F32, (64,))
        self.scales = [self.slab.place(F32, (64,)) for _ in range(n)]
        self.outs = [self.slab.node(GgmlOp.MUL, F32, (64,), [self.a, s]) for s in self.scales]
        for k, s in enumerate(self.scales):
            client.set_tensor(s.rpc(), np.full(64, k + 1, np.float32).tobytes())

    def compute(self, k: int, seed: int) -> None:
        a = np.random.default_rng(seed).standard_normal(64).astype(np.float32)
        self.client.set_tensor(self.a.rpc(), a.tobytes())
        self.client.graph_compute(self.slab.g.serialize([self.outs[k]]))
        got = np.frombuffer(self.client.get_tensor(self.outs[k].rpc()), np.float32)
        np.testing.assert_array_equal(got, a * (k + 1))  # this call's data, not a stale result


def worker_of(srv, client: RpcClient):
    pool = srv.state.devices[0].workers
    port = client.sock.getsockname()[1]
    (s,) = [s for s in srv.state.sessions.live() if s.peer.endswith(f":{port}")]
    return pool._by_session[s.id], s


def test_a_graph_sent_again_runs_its_plan_and_its_worker_keeps_it_built(server, plans_built):
    with RpcClient(endpoint(server)) as c:
        shapes = Shapes(c, 2)
        for step in range(6):  # A, B, A, B, ...: what llama-bench's pp and tg tests send
            shapes.compute(step % 2, seed=step)
        assert len(plans_built) == 2, plans_built  # each planned once
        worker, s = worker_of(server, c)
        assert len(worker.held) == 2 and len(s.planned) == 2 and s.plans_reused == 4


def test_past_the_cap_the_least_recently_used_graph_is_planned_anew(server, plans_built):
    n = session_module.PLANNED_GRAPHS + 1
    assert workers.HELD_PLANS == session_module.PLANNED_GRAPHS
    with RpcClient(endpoint(server)) as c:
        shapes = Shapes(c, n)
        for k in range(n):
            shapes.compute(k, seed=k)
        shapes.compute(0, seed=100)  # evicted by the last one: planned again, built again
        shapes.compute(n - 1, seed=101)  # still there
        assert len(plans_built) == n + 1
        worker, s = worker_of(server, c)
        assert len(worker.held) == workers.HELD_PLANS and len(s.planned) == session_module.PLANNED_GRAPHS
        for k in range(n):  # and every graph still computes right, worker and all
            shapes.compute(k, seed=200 + k)


def test_a_graph_over_a_freed_buffer_is_not_run_from_its_old_plan(server, plans_built):
    with RpcClient(endpoint(server)) as c:
        shapes = Shapes(c, 1)
        other = Slab(c, 4096)
        b = other.place(F32, (64,))
        out = shapes.slab.node(GgmlOp.ADD, F32, (64,), [shapes.a, b])
        graph = shapes.slab.g.serialize([out])
        c.set_tensor(b.rpc(), np.ones(64, np.float32).tobytes())
        c.graph_compute(graph)
        shapes.compute(0, seed=1)
        c.graph_compute(graph)  # again: its plan
        assert len(plans_built) == 2
        _, s = worker_of(server, c)
        c.free_buffer(other.handle)
        c.get_alignment()  # FREE_BUFFER has no answer: this one comes after it
        assert all(all(buf.handle != other.handle for buf in g.buffers) for g in s.planned.values())
        c.graph_compute(graph)  # the same bytes, over a buffer that is gone: refused, as before
        assert connection_closed(c.sock, 10)
    assert len(plans_built) == 3  # checked anew, and refused there


def test_a_freed_buffer_of_another_graph_leaves_the_other_plans_in_use(server, plans_built):
    with RpcClient(endpoint(server)) as c:
        shapes = Shapes(c, 2)
        spare = Slab(c, 4096)
        shapes.compute(0, seed=1)
        shapes.compute(1, seed=2)
        c.free_buffer(spare.handle)  # a free by the session, of nothing these graphs reach
        c.get_alignment()
        shapes.compute(0, seed=3)
        shapes.compute(1, seed=4)
        assert len(plans_built) == 2
