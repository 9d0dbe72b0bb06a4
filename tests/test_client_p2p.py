"""The client half: the pinned llama.cpp tools with scripts/llama-extra/ggml-rpc-p2p.patch take
the direct path over a fleet of fleetd, and nothing else changes.

- `llama-completion -sm layer --rpc A,B[,C]`: the same greedy text with GGML_RPC_P2P=0, sync and
  1; with sync, one COPY_TENSOR_TO per RPC-to-RPC boundary per step (counted by the source
  nodes); with 1 (the default), one COPY_TENSOR_TO_ASYNC there and one PEER_GATE at the
  destination instead; either way as many GET_TENSOR and SET_TENSOR fewer at the coordinator's
  end (GGML_RPC_STATS=1).
- A mixed fleet (a stock ggml-rpc-server as source or destination): same text, never a copy.
- The runtime switch under a running `llama-server`: p2p off on the source -> fallbacks counted
  by reason and the hub path; on again -> copies again within seconds; every answer identical.
- Ordering: a destination whose coordinator connection is slowed on purpose (a delaying proxy)
  still computes on the copied data, never on stale data (both copies).
- Asynchronous copy under that switch: pushes refused at the source -> the destination's worker
  takes the bytes back (PEER_TAKE) and writes them itself before its next graph.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import endpoint, needs_tool, run_client

from fleetd.models import generate
from fleetd.tools import p2p_tools_dir
from fleetd.transport import free_port

pytestmark = [
    needs_tool("p2p/llama-completion", "p2p/llama-server", "ggml-rpc-server"),
    pytest.mark.timeout(300),
]

COMPLETION = p2p_tools_dir() / "llama-completion"
SERVER = p2p_tools_dir() / "llama-server"

PROMPT = "the time of their first new"
STATS_LINE = re.compile(r"^(\w+)\s+(\d+)\s+(\d+)\s+(\d+)$", re.M)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return generate("llama", "q8_0", tmp_path_factory.mktemp("models"))


def control(srv, method: str = "GET", path: str = "/v1/stats", doc=None) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.control.port}{path}",
        method=method,
        data=None if doc is None else json.dumps(doc).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def counts(srv) -> dict[str, int]:
    doc = control(srv)
    out = {name: c["count"] for name, c in doc["total"]["commands"].items()}
    out["copies_ok"] = doc["peer"]["copies_ok"]
    out["copies_taken"] = doc["peer"]["copies_taken"]
    out.update({f"fallback_{k}": v for k, v in doc["peer"]["fallbacks"].items()})
    return out


def client_stats(stderr: str) -> dict[str, int]:
    """The patched client's GGML_RPC_STATS=1 table: command -> count."""
    table = stderr[stderr.rindex("GGML_RPC_STATS client") :]
    return {m.group(1): int(m.group(2)) for m in STATS_LINE.finditer(table)}


def complete(model: Path, rpc: list[str], p2p: str, n: int = 64) -> tuple[bytes, dict[str, int]]:
    args = [
        str(COMPLETION),
        "-m",
        str(model),
        "--rpc",
        ",".join(rpc),
        "-ngl",
        "99",
        "-sm",
        "layer",
        "-p",
        PROMPT,
        "-n",
        str(n),
        "--temp",
        "0",
        "-t",
        "1",
        "-no-cnv",
        "--seed",
        "1",
    ]
    env = dict(os.environ, GGML_RPC_P2P=p2p, GGML_RPC_STATS="1")
    proc = run_client(args, timeout=240, env=env)
    # the text as bytes: a tiny model prints any byte
    return proc.stdout, client_stats(proc.stderr.decode(errors="replace"))


def servers_with_control(fleetd_server, n: int):
    return [fleetd_server(control_port=0) for _ in range(n)]


COPY_COMMAND = {"sync": "COPY_TENSOR_TO", "1": "COPY_TENSOR_TO_ASYNC"}
OTHER_COPY = {"sync": "COPY_TENSOR_TO_ASYNC", "1": "COPY_TENSOR_TO"}


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("p2p", ["sync", "1"], ids=["sync", "async"])
def test_direct_path_same_text_fewer_coordinator_commands(fleetd_server, model, nodes, p2p):
    servers = servers_with_control(fleetd_server, nodes)
    eps = [endpoint(s) for s in servers]
    hub_text, hub_client = complete(model, eps, "0")
    hub_nodes = [counts(s) for s in servers]
    direct_text, direct_client = complete(model, eps, p2p)
    direct_nodes = [{k: v - hub_nodes[i][k] for k, v in counts(s).items()} for i, s in enumerate(servers)]
    copy = COPY_COMMAND[p2p]

    assert direct_text == hub_text and len(hub_text) > len(PROMPT)
    assert all(c["COPY_TENSOR_TO"] == c["COPY_TENSOR_TO_ASYNC"] == 0 for c in hub_nodes)
    # Every boundary RPCi -> RPCi+1 is pushed by node i, once per graph its successor computes.
    for i in range(nodes - 1):
        src, dst = direct_nodes[i], direct_nodes[i + 1]
        steps = dst["GRAPH_COMPUTE"] + dst["GRAPH_RECOMPUTE"]
        assert steps > 0
        assert src[copy] == steps and src[OTHER_COPY[p2p]] == 0, (i, src, dst)
        assert src["copies_ok"] == steps
        if p2p == "1":  # the destination writes each copy at its PEER_GATE; one stream per pair
            assert dst["PEER_GATE"] == steps and dst["PEER_STREAM"] == 1, (i, dst)
            assert dst["PEER_PUSH"] == steps and src["PEER_TAKE"] == 0
    assert direct_nodes[-1][copy] == 0
    copies = sum(c[copy] for c in direct_nodes)
    assert direct_client.get(copy, 0) == copies
    assert direct_client.get(OTHER_COPY[p2p], 0) == 0
    assert direct_client.get("PEER_GATE", 0) == (copies if p2p == "1" else 0)
    assert hub_client["GET_TENSOR"] - direct_client["GET_TENSOR"] == copies
    assert hub_client["SET_TENSOR"] - direct_client["SET_TENSOR"] == copies


@pytest.mark.parametrize("stock_at", [0, 1], ids=["stock-source", "stock-destination"])
def test_mixed_fleet_falls_back_and_matches(fleetd_server, stock_server, model, stock_at):
    ours = fleetd_server(control_port=0)
    eps = [endpoint(ours)]
    eps.insert(stock_at, stock_server())
    hub_text, _ = complete(model, eps, "0")
    direct_text, client = complete(model, eps, "1")
    assert direct_text == hub_text
    # a stock server never advertises the features
    assert client.get("COPY_TENSOR_TO", 0) == client.get("COPY_TENSOR_TO_ASYNC", 0) == 0
    assert counts(ours)["COPY_TENSOR_TO"] == counts(ours)["COPY_TENSOR_TO_ASYNC"] == 0


class SlowProxy:
    """TCP proxy in front of a server: the FIRST connection (the coordinator's) gets its
    client->server bytes delayed by `delay` seconds per chunk; later ones (peer links) pass at
    once. Without a barrier, a peer write would overtake the coordinator's queued commands."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target, self.delay = target, delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted = 0
        self.stopping = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            upstream = socket.create_connection(self.target)
            slow = self.delay if self.accepted == 1 else 0.0
            threading.Thread(target=self._pump, args=(conn, upstream, slow), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, 0.0), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while not self.stopping.is_set():
                r, _, _ = select.select([src], [], [], 0.2)
                if not r:
                    continue
                data = src.recv(1 << 20)
                if not data:
                    break
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stopping.set()
        self.listener.close()


@pytest.mark.parametrize("p2p", ["sync", "1"], ids=["sync", "async"])
def test_peer_write_never_overtakes_a_slow_destination(fleetd_server, model, p2p):
    a, b = servers_with_control(fleetd_server, 2)
    proxy = SlowProxy(b.address[:2], delay=0.02)
    try:
        eps = [endpoint(a), f"127.0.0.1:{proxy.port}"]
        hub_text, _ = complete(model, eps, "0", n=24)
        direct_text, client = complete(model, eps, p2p, n=24)
    finally:
        proxy.close()
    # The direct path did run, through the proxy. Sync: the client fences the destination with
    # a PEER_BARRIER only when it left commands there unanswered (llama's decode usually ends a
    # step with a GET_TENSOR, which answers for everything before it). Async: pushes arrive
    # long before the slowed commands and wait, staged, for their PEER_GATE. Either way no push
    # may land before the destination ran what was queued, so the text is the hub's.
    assert client.get(COPY_COMMAND[p2p], 0) > 0
    assert counts(a)["copies_ok"] == client[COPY_COMMAND[p2p]]
    assert direct_text == hub_text


@pytest.mark.parametrize("p2p", ["sync", "1"], ids=["sync", "async"])
def test_runtime_switch_under_llama_server(fleetd_server, model, tmp_path, p2p):
    a, b = servers_with_control(fleetd_server, 2)
    port = free_port()
    log = open(tmp_path / "llama-server.log", "wb")
    proc = subprocess.Popen(
        [
            str(SERVER),
            "-m",
            str(model),
            "--rpc",
            f"{endpoint(a)},{endpoint(b)}",
            "-ngl",
            "99",
            "-sm",
            "layer",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            "1",
            "-np",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, GGML_RPC_P2P=p2p),
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "llama-server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "llama-server did not come up"
            time.sleep(0.2)

        def ask() -> str:
            body = json.dumps(
                {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "cache_prompt": False}
            ).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.load(r)["content"]

        def until(cond, what: str, limit: int = 500, seconds: float = 30.0) -> list[str]:
            # Bounded in count and time. The client pauses a pair for 2 s after a copy answered
            # 0, so the direct path comes back after that pause, however fast requests are.
            texts, deadline = [], time.monotonic() + seconds
            for _ in range(limit):
                texts.append(ask())
                if cond():
                    return texts
                if time.monotonic() > deadline:
                    break
            raise AssertionError(f"{what}: not seen after {len(texts)} requests: {counts(a)}")

        first = until(lambda: counts(a)["copies_ok"] > 0, "direct copies")
        control(a, "PUT", "/v1/p2p", {"enabled": False})
        off = until(lambda: counts(a)["fallback_disabled"] > 0, "fallbacks while off")
        hub_steps_before = counts(b)["SET_TENSOR"]
        off += [ask(), ask()]
        assert counts(b)["SET_TENSOR"] > hub_steps_before  # the hidden state came through the hub
        if p2p == "1":  # refused pushes: the client took the source's bytes back to write them
            assert counts(a)["copies_taken"] > 0 and counts(a)["PEER_TAKE"] == counts(a)["copies_taken"]
        control(a, "PUT", "/v1/p2p", {"enabled": True})
        copies_at_on = counts(a)["copies_ok"]
        t_on = time.monotonic()
        on = until(lambda: counts(a)["copies_ok"] > copies_at_on, "copies after p2p on")
        assert time.monotonic() - t_on < 30
        texts = first + off + on
        assert len(set(texts)) == 1 and texts[0], texts
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
