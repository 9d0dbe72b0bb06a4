"""The same command sequences to the stock ggml-rpc-server and to fleetd, identical answers.

Each scenario runs against an endpoint through the Python client and returns what it observed,
with server-chosen values (buffer handles, base addresses) reduced to the properties the protocol
fixes (non-zero, aligned, relative offsets). The stock server serves one connection at a time, so
every scenario closes its connection before the next one starts.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest
from helpers import HELLO_FRAME, Conn, connection_closed, endpoint, frame, hello, needs_tool, rpc_tensor

from fleetd.client import GraphBuilder, RpcClient
from fleetd.transport import free_port
from fleetd.wire import Cmd, GgmlType, fnv1a_64

pytestmark = needs_tool("ggml-rpc-server")


@pytest.fixture
def pair(stock_server, fleetd_server, tmp_path):
    """(stock endpoint, fleetd endpoint), both with a cache directory."""
    stock = stock_server(cache=True)
    ours = endpoint(fleetd_server(cache_dir=tmp_path / "fleetd-cache"))
    return stock, ours


def both(pair, scenario, *args):
    stock, ours = pair
    a = scenario(stock, *args)
    b = scenario(ours, *args)
    assert a == b, f"stock answered {a!r}, fleetd answered {b!r}"
    return a


# -- scenarios -------------------------------------------------------------------------------


def hello_and_device(ep):
    with RpcClient(ep) as c:
        free, total = c.get_device_memory(0)
        return {
            "version": c.version,
            "device_count": c.device_count(),
            "alignment": c.get_alignment(0),
            "max_size": c.get_max_size(0),
            # stock reports all physical memory free; fleetd what ALLOC_BUFFER would grant
            # under its memory limit (90% of it by default, fleetd(8) LIMITS)
            "free_at_most_total": 0 < free <= total,
            "total": total,
        }


def alloc_sizes(ep):
    out = {}
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(1 << 16)
        base = c.buffer_get_base(ptr)
        cases = {
            "f32 4x3": rpc_tensor(GgmlType.F32, (4, 3)),
            "f16 64x7": rpc_tensor(GgmlType.F16, (64, 7)),
            "q4_0 4096x3": rpc_tensor(GgmlType.Q4_0, (4096, 3)),
            "q8_0 96x2": rpc_tensor(GgmlType.Q8_0, (96, 2)),
            "q4_K 512x2": rpc_tensor(GgmlType.Q4_K, (512, 2)),
            "q6_K 256x5": rpc_tensor(GgmlType.Q6_K, (256, 5)),
            "iq4_xs 256x1": rpc_tensor(GgmlType.IQ4_XS, (256, 1)),
            "transposed view": rpc_tensor(GgmlType.F32, (3, 5, 2), nb=(20, 4, 60, 120)),
            "in buffer": rpc_tensor(GgmlType.F32, (8, 8), buffer=ptr, data=base + 64),
        }
        for name, t in cases.items():
            out[name] = c.get_alloc_size(t)
        w = rpc_tensor(GgmlType.Q8_0, (64, 4), id=2)
        x = rpc_tensor(GgmlType.F32, (64, 3), id=3)
        mm = rpc_tensor(GgmlType.F32, (4, 3), id=4, op=29, src=(2, 3) + (0,) * 8)
        out["mul_mat with srcs"] = c.get_alloc_size(mm, srcs=(w, x))
        ptr0, size0 = c.alloc_buffer(0)
        out["zero buffer"] = (ptr0 != 0, size0, c.buffer_get_base(ptr0))
        out["base aligned"] = base % 32 == 0
    return out


def set_get_offsets(ep):
    rng = np.random.default_rng(1)
    data = rng.standard_normal(1024).astype("<f4")
    with RpcClient(ep) as c:
        ptr, size = c.alloc_buffer(8192)
        base = c.buffer_get_base(ptr)
        t = rpc_tensor(GgmlType.F32, (1024,), buffer=ptr, data=base + 1024)
        c.set_tensor(t, data)
        c.set_tensor(t, np.full(16, 7, "<f4"), offset=100 * 4)
        whole = np.frombuffer(c.get_tensor(t), "<f4")
        part = np.frombuffer(c.get_tensor(t, offset=96 * 4, size=32 * 4), "<f4")
        empty = c.get_tensor(t, offset=0, size=0)
    expected = data.copy()
    expected[100:116] = 7
    return {
        "size": size,
        "whole ok": bool(np.array_equal(whole, expected)),
        "part": part.tolist(),
        "empty": bytes(empty),
    }


def hash_miss_then_hit(ep, cache_dir_of):
    payload = np.arange(256, dtype="<f4")
    h = fnv1a_64(payload.tobytes())
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(4096)
        base = c.buffer_get_base(ptr)
        t = rpc_tensor(GgmlType.F32, (256,), buffer=ptr, data=base)
        miss = c.set_tensor_hash(t, h)
        c.set_tensor(t, payload, cache=True)  # stores <cache>/<fnv1a %016x>
        c.buffer_clear(ptr, 0)
        hit = c.set_tensor_hash(t, h)
        back = np.frombuffer(c.get_tensor(t), "<f4")
    files = sorted(p.name for p in cache_dir_of(ep).iterdir() if not p.name.startswith("."))
    return {"miss": miss, "hit": hit, "restored": bool(np.array_equal(back, payload)), "files": files}


def hash_of_nothing(ep, cache_dir_of):
    """SET_TENSOR of 0 bytes with the cache flag: stock stores an empty file under the FNV-1a
    offset basis, and SET_TENSOR_HASH of that hash then hits."""
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(4096)
        base = c.buffer_get_base(ptr)
        t = rpc_tensor(GgmlType.F32, (256,), buffer=ptr, data=base)
        c.set_tensor(t, np.zeros(0, "<f4"), cache=True)
        hit = c.set_tensor_hash(t, fnv1a_64(b""))
    files = sorted(p.name for p in cache_dir_of(ep).iterdir() if not p.name.startswith("."))
    return {
        "hit": hit,
        "files": files,
        "empty": (cache_dir_of(ep) / files[0]).stat().st_size if files else None,
    }


def copy_memset_clear(ep):
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(1024)
        base = c.buffer_get_base(ptr)
        a = rpc_tensor(GgmlType.F32, (16,), buffer=ptr, data=base, id=1)
        b = rpc_tensor(GgmlType.F32, (16,), buffer=ptr, data=base + 256, id=2)
        c.set_tensor(a, np.arange(16, dtype="<f4"))
        copied = c.copy_tensor(a, b)
        after_copy = np.frombuffer(c.get_tensor(b), "<f4").tolist()
        c.memset_tensor(b, 8, 16, 0xFF)
        after_memset = bytes(c.get_tensor(b)).hex()
        c.buffer_clear(ptr, 0xAB)
        after_clear = bytes(c.get_tensor(a)).hex()
        c.init_tensor(a)  # CPU: a no-op that must not close the connection
        still_open = c.get_alignment()
    return {
        "copied": copied,
        "copy": after_copy,
        "memset": after_memset,
        "clear": after_clear,
        "open": still_open,
    }


def compute_then_recompute(ep):
    """d = scale(mul_mat(w, x), 2) and e = (w2 + v) * v, then new inputs and GRAPH_RECOMPUTE."""
    g = GraphBuilder()
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(4096)
        base = c.buffer_get_base(ptr)
        w = g.tensor(GgmlType.F32, (4, 2), ptr, base)
        x = g.tensor(GgmlType.F32, (4, 3), ptr, base + 64)
        y = g.place(g.mul_mat(w, x), ptr, base + 128)
        d = g.place(g.scale(y, 2.0), ptr, base + 192)
        v = g.tensor(GgmlType.F32, (8,), ptr, base + 256)
        # src1 may be a strided view (the CPU walks it element by element); src0 may not.
        s = g.place(g.add(g.tensor(GgmlType.F32, (2, 4), ptr, base + 512), g.transpose(w)), ptr, base + 320)
        e = g.place(g.mul(g.add(v, v), v), ptr, base + 384)
        add_node = e.src[0]
        g.place(add_node, ptr, base + 448)
        c.set_tensor(w.rpc(), np.array([1, 2, 3, 4, 5, 6, 7, 8], "<f4"))
        c.set_tensor(x.rpc(), np.array([1, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1], "<f4"))
        c.set_tensor(v.rpc(), np.arange(8, dtype="<f4"))
        c.set_tensor(s.src[0].rpc(), np.ones(8, "<f4"))
        c.graph_compute(g.serialize([y, d, add_node, e, s]))
        first = [np.frombuffer(c.get_tensor(t.rpc()), "<f4").tolist() for t in (d, e, s)]
        c.set_tensor(x.rpc(), np.array([2, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0], "<f4"))
        c.set_tensor(v.rpc(), np.full(8, 3, "<f4"))
        c.graph_recompute(0)
        second = [np.frombuffer(c.get_tensor(t.rpc()), "<f4").tolist() for t in (d, e, s)]
    return {"first": first, "second": second}


def free_drops_stored_graph(ep):
    """FREE_BUFFER discards the stored graph: a following GRAPH_RECOMPUTE closes the connection."""
    g = GraphBuilder()
    c = RpcClient(ep).open()
    try:
        ptr, _ = c.alloc_buffer(256)
        other, _ = c.alloc_buffer(64)
        base = c.buffer_get_base(ptr)
        a = g.tensor(GgmlType.F32, (4,), ptr, base)
        s = g.place(g.add(a, a), ptr, base + 32)
        c.graph_compute(g.serialize([s]))
        c.sync()
        c.free_buffer(other)
        c.graph_recompute(0)
        return {"closed": connection_closed(c.sock)}
    finally:
        c.close()


# -- helpers for malformed input -------------------------------------------------------------


def raw(ep, data: bytes, hello_first: bool = True) -> socket.socket:
    """A raw connection that sent `data` (after a HELLO answered, unless told not to)."""
    host, port = ep.split(":")
    conn = Conn(int(port), host)
    if hello_first:
        hello(conn)
    conn.send(data)
    return conn.sock


def malformed_cases(ep):
    """Requests the stock server closes on (without dying). Built per endpoint because some
    need a buffer of that server."""
    return {
        "no hello first": (frame(Cmd.DEVICE_COUNT, b""), False),
        "hello size 20": (b"\x0e" + struct.pack("<Q", 20) + bytes(20), False),
        "second hello": (HELLO_FRAME, True),
        "get_alignment size 8": (frame(Cmd.GET_ALIGNMENT, bytes(8)), True),
        "device_count size 1": (frame(Cmd.DEVICE_COUNT, b"\0"), True),
        "command NONE (18)": (frame(18, b""), True),
        "unknown command 0x30": (frame(0x30, b""), True),
        "device out of range": (frame(Cmd.GET_ALIGNMENT, struct.pack("<I", 5)), True),
        "unknown buffer base": (frame(Cmd.BUFFER_GET_BASE, struct.pack("<Q", 0xDEAD)), True),
        "set_tensor unknown buffer": (
            frame(
                Cmd.SET_TENSOR,
                rpc_tensor(GgmlType.F32, (4,), buffer=0xDEAD, data=0x1000).pack() + bytes(9) + bytes(16),
            ),
            True,
        ),
        "bad tensor type 4": (
            frame(
                Cmd.GET_ALLOC_SIZE,
                struct.pack("<I", 0)
                + rpc_tensor(GgmlType.F32, (4,)).pack()[:8]
                + struct.pack("<I", 4)
                + rpc_tensor(GgmlType.F32, (4,)).pack()[12:]
                + bytes(2960),
            ),
            True,
        ),
        "graph_recompute without graph": (frame(Cmd.GRAPH_RECOMPUTE, struct.pack("<I", 0)), True),
        "graph truncated": (frame(Cmd.GRAPH_COMPUTE, struct.pack("<II", 0, 3) + bytes(8)), True),
    }


def observe_malformed(ep):
    out = {}
    for name, (data, hello_first) in malformed_cases(ep).items():
        s = raw(ep, data, hello_first)
        out[name] = connection_closed(s)
        s.close()
        out[name + " / server alive"] = hello_and_device(ep)["device_count"] == 1
    return out


# -- tests -----------------------------------------------------------------------------------


def test_hello_and_device_answers(pair):
    got = both(pair, hello_and_device)
    assert got["version"] == (7, 0, 0) and got["alignment"] == 32 and got["max_size"] == 2**64 - 1


def test_alloc_sizes(pair):
    got = both(pair, alloc_sizes)
    assert got["q4_0 4096x3"] == 6912 and got["transposed view"] == 120
    assert got["zero buffer"] == (True, 0, 0)


def test_set_get_round_trips_at_offsets(pair):
    got = both(pair, set_get_offsets)
    assert got["whole ok"] and got["empty"] == b""


def test_set_tensor_hash_miss_then_hit(pair, tmp_path):
    stock, ours = pair
    dirs = {stock: tmp_path / "stock-cache" / "rpc", ours: tmp_path / "fleetd-cache"}
    got = both(pair, hash_miss_then_hit, dirs.__getitem__)
    assert got["miss"] is False and got["hit"] is True and got["restored"]
    assert got["files"] == [f"{fnv1a_64(np.arange(256, dtype='<f4').tobytes()):016x}"]


def test_set_tensor_of_nothing_with_the_cache_flag(pair, tmp_path):
    stock, ours = pair
    dirs = {stock: tmp_path / "stock-cache" / "rpc", ours: tmp_path / "fleetd-cache"}
    got = both(pair, hash_of_nothing, dirs.__getitem__)
    assert got == {"hit": True, "files": ["cbf29ce484222325"], "empty": 0}


def test_copy_memset_clear(pair):
    got = both(pair, copy_memset_clear)
    assert got["copied"] is True and got["clear"] == "ab" * 64


def copy_on_zero_byte_buffer(ep):
    with RpcClient(ep) as c:
        ptr, size = c.alloc_buffer(0)
        empty = rpc_tensor(GgmlType.F32, (0,), buffer=ptr, data=c.buffer_get_base(ptr))
        real, _ = c.alloc_buffer(64)
        into_real = rpc_tensor(GgmlType.F32, (0,), buffer=real, data=c.buffer_get_base(real))
        return {
            "size": size,
            "into_empty": c.copy_tensor(empty, empty),
            "into_real": c.copy_tensor(empty, into_real),
        }


def test_copy_tensor_on_zero_byte_buffer(pair):
    # fleetd once hit an internal error here (issue 11). Stock: 0 into the zero-byte buffer
    # (it has no copy hook), 1 for copying nothing into a real one.
    assert both(pair, copy_on_zero_byte_buffer) == {"size": 0, "into_empty": False, "into_real": True}


def test_graph_compute_then_recompute(pair):
    got = both(pair, compute_then_recompute)
    assert got["first"][0] == [2, 10, 4, 12, 20, 52]


def test_free_buffer_drops_stored_graph(pair):
    assert both(pair, free_drops_stored_graph) == {"closed": True}


def test_malformed_requests_close_only_that_connection(pair):
    stock, ours = pair
    got = both(pair, observe_malformed)
    assert all(got.values()), got
    # fleetd: a session opened before the bad ones is still served afterwards.
    # (The stock server serves one connection at a time, so it has no "other session".)


def test_fleetd_other_sessions_survive_malformed_input(fleetd_server):
    ep = endpoint(fleetd_server())
    with RpcClient(ep) as keeper:
        ptr, _ = keeper.alloc_buffer(64)
        base = keeper.buffer_get_base(ptr)
        t = rpc_tensor(GgmlType.F32, (16,), buffer=ptr, data=base)
        keeper.set_tensor(t, np.arange(16, dtype="<f4"))
        for name, (data, hello_first) in malformed_cases(ep).items():
            s = raw(ep, data, hello_first)
            assert connection_closed(s), name
            s.close()
        assert np.frombuffer(keeper.get_tensor(t), "<f4").tolist() == list(range(16))


def out_of_bounds_tensor(ep):
    """A 128-byte tensor in a 64-byte buffer: the stock deserializer asserts (process dies)."""
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(64)
        base = c.buffer_get_base(ptr)
        bad = rpc_tensor(GgmlType.F32, (32,), buffer=ptr, data=base)
        c.send_raw(frame(Cmd.GET_TENSOR, bad.pack() + struct.pack("<QQ", 0, 4)))
        return connection_closed(c.sock)


def test_out_of_bounds_tensor_kills_stock_but_not_fleetd(stock_server, fleetd_server):
    stock = stock_server()
    assert out_of_bounds_tensor(stock)
    stock_server.proc.wait(timeout=10)
    assert stock_server.proc.returncode != 0  # recorded: the stock server aborts
    ours = endpoint(fleetd_server())
    assert out_of_bounds_tensor(ours)
    assert hello_and_device(ours)["device_count"] == 1  # fleetd keeps serving


def vanishing_clients(ep):
    """Clients that disappear mid-message or before reading a big response."""
    s = raw(ep, frame(Cmd.SET_TENSOR, bytes(305 + 100))[: 9 + 200])  # header promises more
    s.close()
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(32 << 20)
        base = c.buffer_get_base(ptr)
        big = rpc_tensor(GgmlType.F32, (8 << 20,), buffer=ptr, data=base)
        c.send_raw(frame(Cmd.GET_TENSOR, big.pack() + struct.pack("<QQ", 0, 32 << 20)))
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return hello_and_device(ep)["device_count"]


def test_vanishing_clients(pair):
    assert both(pair, vanishing_clients) == 1


def test_two_clients_progress_at_once_on_fleetd_not_on_stock(stock_server, fleetd_server):
    ours = endpoint(fleetd_server())
    with RpcClient(ours) as a, RpcClient(ours) as b:
        pa, _ = a.alloc_buffer(64)
        pb, _ = b.alloc_buffer(64)
        ta = rpc_tensor(GgmlType.F32, (4,), buffer=pa, data=a.buffer_get_base(pa))
        tb = rpc_tensor(GgmlType.F32, (4,), buffer=pb, data=b.buffer_get_base(pb))
        for i in range(20):  # interleaved: each needs the other to have been served
            a.set_tensor(ta, np.full(4, i, "<f4"))
            b.set_tensor(tb, np.full(4, -i, "<f4"))
            assert np.frombuffer(a.get_tensor(ta), "<f4")[0] == i
            assert np.frombuffer(b.get_tensor(tb), "<f4")[0] == -i

    stock = stock_server()
    first = RpcClient(stock).open()
    host, port = stock.split(":")
    second = Conn(int(port), host).sock
    second.sendall(HELLO_FRAME)
    second.settimeout(1.0)
    with pytest.raises(socket.timeout):  # recorded: stock serves one client, the second waits
        second.recv(36)
    first.close()
    second.settimeout(10)
    answer = b""
    while len(answer) < 36:  # bounded by the 10 s timeout: recv raises rather than loop forever
        chunk = second.recv(36 - len(answer))
        assert chunk, "stock server closed the waiting connection"
        answer += chunk
    assert answer[:12] == struct.pack("<Q", 28) + b"\x07\x00\x00\x00"
    second.close()


def test_session_frees_its_buffers_on_disconnect(fleetd_server):
    srv = fleetd_server()
    ep = endpoint(srv)
    with RpcClient(ep) as keep:
        keep.alloc_buffer(128)
        for _ in range(5):
            with RpcClient(ep) as c:
                c.alloc_buffer(1 << 20)
                c.alloc_buffer(64)
        with RpcClient(ep) as c:
            c.sync()  # sessions are torn down by their own threads; one more round trip
        deadline = 50
        while len(srv.state.registry) != 1 and deadline:
            import time

            time.sleep(0.05)
            deadline -= 1
        assert len(srv.state.registry) == 1


def _probe(ep: str) -> tuple[int, dict]:
    p = subprocess.run(
        [sys.executable, "-m", "fleetd.client.probe", ep, "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = p.stdout.splitlines()
    assert len(lines) == 1, p.stdout + p.stderr
    return p.returncode, json.loads(lines[0])


def test_probe_prints_hello_of_stock_and_fleetd_and_fails_on_a_closed_port(stock_server, fleetd_server):
    assert _probe(stock_server()) == (0, {"version": "7.0.0", "features": 0})
    assert _probe(endpoint(fleetd_server())) == (0, {"version": "7.0.0", "features": 7})
    assert _probe(endpoint(fleetd_server(p2p=False))) == (0, {"version": "7.0.0", "features": 0})
    rc, doc = _probe(f"127.0.0.1:{free_port()}")
    assert rc == 1 and set(doc) == {"error"} and "refused" in doc["error"]
