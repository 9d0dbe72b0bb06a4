"""Node (one fleetd host: lazy SSH, its control API) and Fleet (a list of nodes, run in parallel).

    fleet = Fleet.load("nodes.txt")
    result = fleet.map(lambda node: node.status())    # FleetResult: node -> value or exception
    for node, value in result.items(): ...
    result.raise_on_failure()                         # FleetFailed, whole result inside

fabric's shapes: `Group(list)` / `GroupResult(dict)` / `GroupException`. One node failing never
stops the others; per-node outcomes are data and the CLI or TUI renders them.

The control API is reached through an SSH direct-tcpip channel to 127.0.0.1:<control_port>;
a local node (localhost without a user) is reached over plain loopback TCP. Either way the
standard library's HTTP client runs over that stream (fleetd/fleet/control_client.py), and the
answers come back typed (fleetd/fleet/control_docs.py).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fleetd.errors import ConnectTimeout, FleetError, ProtocolError, ReadTimeout, TransportError, UsageError
from fleetd.fleet.control_client import ControlConnection, ControlError, exchange, json_answer
from fleetd.fleet.control_docs import NodeStats, NodeStatus, P2pState
from fleetd.fleet.nodes_file import NodeSpec, load_nodes
from fleetd.fleet.ssh import ControlUnreachable, SshOptions, open_ssh, open_tunnel
from fleetd.transport import ChannelStream, RpcChannel, TcpStream

# Parallel SSH sessions at once: enough for a rack, few enough not to trip sshd's MaxStartups
# (default 10:30:100 drops unauthenticated connections beyond 10).
MAX_WORKERS = 8


class Node:
    """One fleetd host. SSH connects on first use (fabric's lazy `open()`), once, under a lock."""

    def __init__(self, spec: NodeSpec, ssh: SshOptions | None = None) -> None:
        self.spec = spec
        self.ssh_options = ssh or SshOptions()
        self._client = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.spec.name or self.spec.target

    @property
    def is_local(self) -> bool:
        return self.spec.is_local

    def __repr__(self) -> str:
        s = self.spec
        extra = f" user={s.user}" if s.user else ""
        extra += f" port={s.ssh_port}" if s.ssh_port != 22 else ""
        return f"<Node {self.name} host={s.host}{extra} control_port={s.control_port}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    # -- connections ------------------------------------------------------------------------

    def ssh(self):
        """The connected paramiko SSHClient (connects on first use, reconnects when lost)."""
        with self._lock:
            c = self._client
            if c is not None and (c.get_transport() is None or not c.get_transport().is_active()):
                c.close()
                c = self._client = None
            if c is None:
                c = self._client = open_ssh(self.spec, self.ssh_options)
            return c

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _open_control(self):
        return self._open_port(
            self.spec.control_port,
            "control API",
            f"is fleetd running with --control-port {self.spec.control_port}?",
        )

    def _open_port(self, port: int, what: str, hint: str, host: str = "127.0.0.1"):
        """A stream to host:port as the node sees it: plain TCP for a local node, else an SSH
        direct-tcpip channel."""
        t = self.ssh_options.connect_timeout
        if self.spec.via_netns:  # a lab node (fleetctl lab): `host` as seen inside its namespace
            from fleetd.fleet.netns import connect_in_netns

            return connect_in_netns(self.spec.via_netns, (host, port), t)
        if self.is_local:
            try:
                return socket.create_connection((host, port), timeout=t)
            except TimeoutError as exc:
                raise ConnectTimeout(f"{what} {host}:{port}: no answer within {t:g}s") from exc
            except OSError as exc:
                raise ControlUnreachable(
                    f"{what} {host}:{port}: {(exc.strerror or str(exc)).lower()}: {hint}"
                ) from exc
        return open_tunnel(self.ssh(), self.spec, port, t, host)

    def hello(self, bound: str | None = None) -> tuple[int, int, int]:
        """HELLO on the node's RPC port, asked from the node's side (through SSH for a remote
        node), so `status` says up only when the port clients use answers too. `bound` is the
        address fleetd reports it listens on; a wildcard is asked on loopback. Without it: a
        lab node (via_netns) on the address of its nodes-file line, where it listens (never on
        loopback), any other node on loopback."""
        if bound is None:
            bound = self.spec.host if self.spec.via_netns else "0.0.0.0"
        port = self.spec.rpc_port
        host = "127.0.0.1" if bound in ("0.0.0.0", "", "?") else "::1" if bound == "::" else bound
        where = f"{self.name}: RPC port {host}:{port}"
        opened = self._open_port(port, "RPC port", f"is fleetd serving RPC on port {port}?", host)
        name = f"{self.name} RPC port {host}:{port}"
        stream = TcpStream(opened, name) if isinstance(opened, socket.socket) else ChannelStream(opened, name)
        try:
            reply = RpcChannel(stream, self.ssh_options.timeout).hello()
            return tuple(reply.version)
        except ReadTimeout as exc:
            raise ReadTimeout(f"{where}: no HELLO answer within {self.ssh_options.timeout:g}s") from exc
        except (TransportError, ProtocolError) as exc:
            raise ControlUnreachable(f"{where}: no HELLO answer: {exc}") from exc
        finally:
            stream.close()

    # -- the control API --------------------------------------------------------------------

    def request(self, method: str, path: str, doc: Any = None) -> tuple[int, str, bytes]:
        """One control API exchange: (status, content type, body)."""
        body = None if doc is None else json.dumps(doc).encode()
        conn = ControlConnection(self.spec.control_port, self._open_control, self.ssh_options.timeout)
        return exchange(conn, method, path, body, self.name)

    def call(self, method: str, path: str, doc: Any = None) -> dict:
        """A JSON request; an error status raises ControlError with the daemon's message."""
        return json_answer(*self.request(method, path, doc), f"{self.name}: {method} {path}")

    def status(self) -> NodeStatus:
        return NodeStatus.parse(self.call("GET", "/v1/status"), f"{self.name}: GET /v1/status")

    def stats(self) -> NodeStats:
        return NodeStats.parse(self.call("GET", "/v1/stats"), f"{self.name}: GET /v1/stats")

    def reset_stats(self) -> dict:
        return self.call("POST", "/v1/stats/reset")

    def p2p(self) -> P2pState:
        return P2pState.parse(self.call("GET", "/v1/p2p"), f"{self.name}: GET /v1/p2p")

    def set_p2p(self, enabled: bool) -> P2pState:
        """Switch peer copy; the answer says what it was (`was`)."""
        return P2pState.parse(
            self.call("PUT", "/v1/p2p", {"enabled": bool(enabled)}), f"{self.name}: PUT /v1/p2p"
        )

    def metrics(self) -> str:
        status, _, data = self.request("GET", "/metrics")
        if status != 200:
            raise ControlError(f"{self.name}: GET /metrics: HTTP {status}", status)
        return data.decode()


class FleetResult(dict):
    """node -> value, or node -> the exception its call raised (fabric's GroupResult)."""

    @property
    def succeeded(self) -> dict:
        return {n: v for n, v in self.items() if not isinstance(v, BaseException)}

    @property
    def failed(self) -> dict:
        return {n: v for n, v in self.items() if isinstance(v, BaseException)}

    @property
    def ok(self) -> bool:
        return not self.failed

    def raise_on_failure(self) -> FleetResult:
        if self.failed:
            raise FleetFailed(self)
        return self


class FleetFailed(FleetError):
    """Raised at the edge with the whole result inside: "2 of 5 nodes failed: n3 ConnectTimeout"."""

    def __init__(self, result: FleetResult) -> None:
        self.result = result
        failed = result.failed
        parts = ", ".join(f"{n.name} {type(e).__name__}" for n, e in failed.items())
        super().__init__(f"{len(failed)} of {len(result)} nodes failed: {parts}")


class Fleet(list):
    """A list of Nodes; `map` runs a function on every node in a bounded thread pool."""

    def __init__(self, nodes: Iterable[Node] = ()) -> None:
        super().__init__(nodes)

    @classmethod
    def load(cls, path: str | Path, ssh: SshOptions | None = None) -> Fleet:
        return cls(Node(spec, ssh) for spec in load_nodes(path))

    def select(self, names: Iterable[str]) -> Fleet:
        """The nodes named (by name, host or [user@]host[:port]); UsageError for unknown names."""
        out = []
        for want in names:
            hits = [n for n in self if want in (n.name, n.spec.host, n.spec.target)]
            if not hits:
                have = ", ".join(n.name for n in self)
                raise UsageError(f"--node {want}: no such node (have: {have})")
            out += [n for n in hits if n not in out]
        return Fleet(out)

    def map(self, fn: Callable[[Node], Any], workers: int = MAX_WORKERS) -> FleetResult:
        """fn(node) on every node at once (at most `workers` threads); never raises for a node."""

        def one(node: Node):
            try:
                return fn(node)
            except Exception as exc:  # kept in the result, rendered by the caller
                return _Failed(exc)

        if not self:
            return FleetResult()
        with ThreadPoolExecutor(
            max_workers=max(1, min(workers, len(self))), thread_name_prefix="fleet"
        ) as pool:
            values = list(pool.map(one, self))
        return FleetResult(
            (n, v.exc if isinstance(v, _Failed) else v) for n, v in zip(self, values, strict=True)
        )

    def close(self) -> None:
        for n in self:
            n.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
