"""Shared fixtures: in-process fleetd servers, the pinned stock tools, free ports; the
needs_tool gate (tests/helpers.py)."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
from pathlib import Path

import pytest

from helpers import missing_tools, skip_unless_built

from fleetd.server import Server, ServerConfig
from fleetd.tools import find_tool
from fleetd.transport import free_port, wait_listening

REPO = Path(__file__).resolve().parent.parent


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_tool"):
        reason = missing_tools(*mark.args)
        if reason is not None:
            pytest.skip(reason)


@pytest.fixture
def fleetd_server():
    """A fleetd server in this process on a free loopback port; yields its endpoint."""
    servers = []

    def start(**kw) -> Server:
        kw.setdefault("control_port", None)  # control_port=0: the control API on a free port
        cfg = ServerConfig(host="127.0.0.1", port=0, **kw)
        srv = Server(cfg)
        srv.start()
        servers.append(srv)
        return srv

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def ggml_server():
    """A fleetd in this process with the ggml device (tests that need it skip first when the
    ggml libraries do not load)."""
    from fleetd.compute.ggml.device import GgmlCpuDevice

    srv = Server(ServerConfig(host="127.0.0.1", port=0, control_port=None, devices=["cpu"]))
    srv.start()
    assert isinstance(srv.state.devices[0], GgmlCpuDevice)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def ssh_server(tmp_path_factory):
    """A real sshd on a loopback port (tests/sshd.py): .port, .user, .identity, .known_hosts."""
    from sshd import SshServer  # tests/ is on sys.path, as for conftest itself

    with SshServer(tmp_path_factory.mktemp("sshd")) as server:
        yield server


def frame(cmd: int, payload: bytes) -> bytes:
    """A request as it goes on the wire: | cmd u8 | payload_size u64 | payload |."""
    return struct.pack("<BQ", cmd, len(payload)) + payload


def connection_closed(sock: socket.socket, timeout: float = 10.0) -> bool:
    """True when the server closed this connection (EOF or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def endpoint(srv: Server) -> str:
    return f"{srv.address[0]}:{srv.address[1]}"


@pytest.fixture
def stock_server(tmp_path):
    """The pinned stock ggml-rpc-server as a subprocess; yields a starter returning its endpoint."""
    skip_unless_built("ggml-rpc-server")
    exe = find_tool("ggml-rpc-server")
    procs = []

    def start(cache: bool = False) -> str:
        port = free_port()
        env = dict(os.environ, LLAMA_CACHE=str(tmp_path / "stock-cache"))
        args = [str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", "1"]
        if cache:
            args.append("-c")
        log = open(tmp_path / f"stock-{port}.log", "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        wait_listening(port)
        start.proc = proc
        return f"127.0.0.1:{port}"

    yield start
    for p in procs:
        p.kill()
        p.wait()

