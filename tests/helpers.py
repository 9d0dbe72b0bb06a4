"""What many test files share: the one gate for tests that need a built llama.cpp tool, a
server's endpoint, and the protocol oracle: frames, tensors and a raw connection written from the
protocol document (shared/docs/ggml-rpc-protocol.md), not from fleetd's own encoders, so that a
mistake in fleetd.wire cannot hide itself in the tests that use them. Fixtures are in conftest.py.

    pytestmark = needs_tool("ggml-rpc-server")            # a whole file
    @needs_tool("p2p/llama-completion", "ggml-rpc-server")  # one test: the patched client, stock server
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from fleetd.tools import find_p2p_tool, find_tool
from fleetd.wire import RpcTensor, contiguous_strides

REPO = Path(__file__).resolve().parent.parent  # the checkout under test

# A tool name is a stock tool (scripts/build-llama.sh), or p2p/<name>: the client half with the
# P2P patch (scripts/build-llama-p2p.sh), whose llama-completion differs from the stock one.
P2P_PREFIX = "p2p/"
BUILD_SCRIPT = {False: "scripts/build-llama.sh", True: "scripts/build-llama-p2p.sh"}


# The generated models the llama.cpp end-to-end tests run (conftest.py's `models`), and their prompt.
TEST_ARCHS = ["llama", "qwen3", "qwen3moe", "gemma3"]
TEST_TYPES = ["f32", "f16", "q8_0", "q4_k"]
PROMPT = "the time of their first new"


def missing_tools(*names: str) -> str | None:
    """Why a test needing `names` cannot run ("needs llama-bench (scripts/build-llama.sh)"),
    or None when every one is built."""
    missing: dict[bool, list[str]] = {False: [], True: []}
    for name in names:
        p2p = name.startswith(P2P_PREFIX)
        try:
            if p2p:
                find_p2p_tool(name[len(P2P_PREFIX) :])
            else:
                find_tool(name)
        except FileNotFoundError:
            missing[p2p].append(name)
    parts = [f"{', '.join(tools)} ({BUILD_SCRIPT[p2p]})" for p2p, tools in missing.items() if tools]
    return f"needs {' and '.join(parts)}" if parts else None


def needs_tool(*names: str) -> pytest.MarkDecorator:
    """The mark of a test that runs built llama.cpp tools: conftest.py skips it, naming the
    missing tools and the script that builds them. `pytest -m "not needs_tool"` runs the rest."""
    return pytest.mark.needs_tool(*names)


def skip_unless_built(*names: str) -> None:
    """For fixtures that start a tool (the tests that use them may not carry the mark)."""
    reason = missing_tools(*names)
    if reason is not None:
        pytest.skip(reason)


def wait_until(predicate, timeout: float = 5.0, every: float = 0.005) -> bool:
    """Whether predicate() turns true within `timeout` seconds (polled; bounded). For what a
    server thread does just after its reply left, e.g. a session folding the counts of the
    requests its C loop served into its counters."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)
    return True


def endpoint(srv) -> str:
    """host:port of an in-process fleetd (conftest.py's fleetd_server, ggml_server)."""
    return f"{srv.address[0]}:{srv.address[1]}"


def connection_closed(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True when the server closed this connection (EOF or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def whole_text(stdout: bytes, _stderr: bytes) -> bool:
    """A llama-completion run printed all of its text: it ends with its blank line."""
    return stdout.endswith(b"\n\n")


def run_client(args: list[str], finished=whole_text, timeout: float = 600, env=None):
    """A llama.cpp tool run to the end (its CompletedProcess, bytes). It prints through an
    asynchronous log thread that can lose the tail at exit on a busy machine: rerun (at most
    twice) until `finished(stdout, stderr)`."""
    for _ in range(3):
        proc = subprocess.run(args, capture_output=True, timeout=timeout, env=env, check=False)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
        if finished(proc.stdout, proc.stderr):
            break
    return proc


# -- the protocol oracle: the wire as the protocol document lays it out -------------------------

BOUND_S = 10.0  # every raw read ends by this bound: no answer and no close is a hang

TENSOR = struct.Struct("<QIQ4I4II16iI10QQQQ64si")  # 296 bytes, section 5
assert TENSOR.size == 296
HELLO, DEVICE_COUNT = 14, 15
ALLOC_BUFFER, GET_ALIGNMENT, GET_MAX_SIZE, BUFFER_GET_BASE, FREE_BUFFER, BUFFER_CLEAR = 0, 1, 2, 3, 4, 5
SET_TENSOR, SET_TENSOR_HASH, GET_TENSOR, COPY_TENSOR, GRAPH_COMPUTE, GET_DEVICE_MEMORY = 6, 7, 8, 9, 10, 11
INIT_TENSOR, GET_ALLOC_SIZE, GRAPH_RECOMPUTE, MEMSET_TENSOR = 12, 13, 16, 17
COPY_TENSOR_TO, PEER_BARRIER = 0x40, 0x41

# Response payload size per command (None: no response; "req": the requested size).
RESPONSE_SIZE = {
    ALLOC_BUFFER: 16,
    GET_ALIGNMENT: 8,
    GET_MAX_SIZE: 8,
    BUFFER_GET_BASE: 8,
    FREE_BUFFER: None,
    BUFFER_CLEAR: None,
    SET_TENSOR: None,
    SET_TENSOR_HASH: 1,
    GET_TENSOR: "req",
    COPY_TENSOR: 1,
    GRAPH_COMPUTE: None,
    GET_DEVICE_MEMORY: 16,
    INIT_TENSOR: None,
    GET_ALLOC_SIZE: 8,
    HELLO: 28,
    DEVICE_COUNT: 4,
    GRAPH_RECOMPUTE: None,
    MEMSET_TENSOR: None,
    COPY_TENSOR_TO: 1,
    PEER_BARRIER: 1,
}
F32, F16, Q8_0 = 0, 1, 8
U32, U64 = (1 << 32) - 1, (1 << 64) - 1


def frame(cmd: int, payload: bytes, size: int | None = None) -> bytes:
    return struct.pack("<BQ", cmd, len(payload) if size is None else size) + payload


def tensor(
    id=1,
    type=F32,
    buffer=0,
    ne=(1, 1, 1, 1),
    nb=None,
    op=0,
    params=(0,) * 16,
    flags=0,
    src=(0,) * 10,
    view_src=0,
    view_offs=0,
    data=0,
    name=b"t",
    use_count=0,
) -> bytes:
    """The tests' one tensor factory: a tensor record packed as section 5 lays it out (any value
    fits, a hostile one included); f32 strides unless `nb` is given."""
    if nb is None:
        nb = (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2])
    return TENSOR.pack(
        id, type, buffer, *ne, *nb, op, *params, flags, *src, view_src, view_offs, data, name, use_count
    )


def rpc_tensor(type, ne, buffer=0, data=0, nb=None, id=1, **fields) -> RpcTensor:
    """The same factory for code that takes fleetd's RpcTensor (RpcClient): `ne` padded to four
    dims, contiguous strides of `type` unless `nb` is given, the record decoded by fleetd.wire."""
    ne = tuple(ne) + (1,) * (4 - len(ne))
    nb = nb or contiguous_strides(type, ne)
    return RpcTensor.unpack_from(tensor(id=id, type=type, buffer=buffer, ne=ne, nb=nb, data=data, **fields))


HELLO_FRAME = frame(HELLO, bytes(24))


class Closed(Exception):
    """The daemon closed the connection: an allowed outcome for any bad request."""


class Conn:
    """One raw client connection with bounded reads: for requests fleetd's own client would not
    send (tests of well-formed traffic use fleetd.client.RpcClient)."""

    def __init__(self, port: int, host: str = "127.0.0.1", source_address=None) -> None:
        self.sock = socket.create_connection((host, port), timeout=BOUND_S, source_address=source_address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise Closed from exc

    def recv_exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                chunk = self.sock.recv(n - len(out))
            except ConnectionResetError as exc:
                raise Closed from exc
            except TimeoutError:
                raise AssertionError(f"no answer and no close within {BOUND_S}s (a hang)") from None
            if not chunk:
                if out:
                    raise AssertionError(f"connection closed inside a response ({len(out)} of {n} bytes)")
                raise Closed
            out += chunk
        return bytes(out)

    def call(self, cmd: int, payload: bytes, expect: int | None) -> bytes | None:
        """Send one request; return its response payload (checked for size), None when the
        command has no response. Raises Closed when the daemon closed the connection."""
        self.send(frame(cmd, payload))
        if expect is None:
            return None
        (size,) = struct.unpack("<Q", self.recv_exact(8))
        assert size == expect, f"command {cmd}: response of {size} bytes, expected {expect}"
        return self.recv_exact(size)

    def no_response_then_probe(self) -> None:
        """After a command without a response: the next answer must be the probe's (a stray
        response would show up here as a wrong size)."""
        answer = self.call(GET_ALIGNMENT, struct.pack("<I", 0), 8)
        assert struct.unpack("<Q", answer)[0] == 32

    def closed_by_daemon(self) -> bool:
        """Wait (bounded) until the daemon closes this connection, reading what it sends; True if
        it did."""
        self.sock.settimeout(BOUND_S)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hello(conn: Conn) -> None:
    """HELLO answered with protocol 7.0.0."""
    answer = conn.call(HELLO, bytes(24), 28)
    assert answer[:3] == bytes([7, 0, 0])


# -- processes the suite started ----------------------------------------------------------------

SESSION_MARK = "FLEETD_TEST_SESSION"  # in the environment of every process the suite starts


def _proc_text(pid: int, name: str) -> str:
    try:
        return (Path("/proc") / str(pid) / name).read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile, or not ours to read
        return ""


def seconds_since_boot() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def started_at(pid: int) -> float | None:
    """When process `pid` started, in seconds since boot (/proc/PID/stat field 22)."""
    fields = _proc_text(pid, "stat").rsplit(")", 1)[-1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK") if len(fields) > 19 else None


def processes_left(mark: str, root_pid: int, basetemp: str) -> dict[int, str]:
    """Live processes (pid: command line) the test session started: those that inherited its
    mark, those descended from `root_pid`, and those started from its temporary directory (a
    daemon deployed over SSH to a test host inherits neither)."""
    parents, found = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == root_pid:
            continue
        pid = int(entry.name)
        stat = _proc_text(pid, "stat")
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) < 2 or fields[0] == "Z":  # gone, or a zombie: nothing runs
            continue
        parents[pid] = int(fields[1])
        cmdline = _proc_text(pid, "cmdline").strip()
        if f"{SESSION_MARK}={mark}" in _proc_text(pid, "environ") or basetemp in cmdline:
            found[pid] = cmdline
    for pid in parents:
        ancestor, hops = parents.get(pid), 0
        while ancestor and ancestor != root_pid and hops < 64:
            ancestor, hops = parents.get(ancestor), hops + 1
        if ancestor == root_pid:
            found[pid] = _proc_text(pid, "cmdline").strip()
    return found
