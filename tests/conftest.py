"""Shared fixtures: in-process fleetd servers, the pinned stock tools, free ports; the
needs_tool gate (tests/helpers.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import (
    BOUND_S,
    SESSION_MARK,
    TEST_ARCHS,
    TEST_TYPES,
    missing_tools,
    processes_left,
    seconds_since_boot,
    skip_unless_built,
    started_at,
)

from fleetd.server import Server, ServerConfig
from fleetd.tools import find_tool
from fleetd.transport import free_port, wait_listening

# (seconds since boot, test id) as each test starts: a process left running is named by the test
# that was running when it started.
TESTS_STARTED: list[tuple[float, str]] = []


def pytest_runtest_logstart(nodeid, location):
    TESTS_STARTED.append((seconds_since_boot(), nodeid))


def started_during(pid: int) -> str:
    start = started_at(pid)
    during = [nodeid for t, nodeid in TESTS_STARTED if start is not None and t <= start]
    return f"(started during {during[-1]})" if during else ""


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs_tool"):
        reason = missing_tools(*mark.args)
        if reason is not None:
            pytest.skip(reason)


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind(tmp_path_factory):
    """The suite fails, naming them, if processes it started outlive it (and they are killed)."""
    mark = f"{os.getpid()}-{time.time_ns()}"
    os.environ[SESSION_MARK] = mark
    basetemp = str(tmp_path_factory.getbasetemp()) + "/"
    yield
    deadline = time.monotonic() + BOUND_S  # a stop already under way gets its time
    while (left := processes_left(mark, os.getpid(), basetemp)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if left:
        pytest.fail(
            "processes the suite started are still running:\n"
            + "\n".join(f"  {pid} {cmd} {started_during(pid)}" for pid, cmd in sorted(left.items())),
            pytrace=False,
        )


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
def models(tmp_path_factory) -> Path:
    """A directory of the generated GGUF models, every arch and type of TEST_ARCHS x TEST_TYPES,
    named as fleetd.models.generate names them (made once per run)."""
    from fleetd.models import generate

    out = tmp_path_factory.mktemp("models")
    for arch in TEST_ARCHS:
        for type_name in TEST_TYPES:
            generate(arch, type_name, out)
    return out


@pytest.fixture(scope="session")
def ssh_server(tmp_path_factory):
    """A real sshd on a loopback port (tests/sshd.py): .port, .user, .identity, .known_hosts."""
    from sshd import SshServer  # tests/ is on sys.path, as for conftest itself

    with SshServer(tmp_path_factory.mktemp("sshd")) as server:
        yield server


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
