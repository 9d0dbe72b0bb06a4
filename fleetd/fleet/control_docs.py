"""The control API's documents, parsed once into typed values (see fleetd/server/control.py).

    NodeStatus.parse(doc)   GET /v1/status: version, protocol, features, RPC address, devices,
                            uptime, sessions, P2P
    NodeStats.parse(doc)    GET /v1/stats: per command count and bytes, graph computes, peer
                            copies and fallbacks; in total and per session
    P2pState.parse(doc)     GET|PUT /v1/p2p

Renderers, the TUI and the A/B runner read the fields; `doc` keeps the answer as it came, for
`--json`. An answer of another shape raises ControlError naming the missing or bad field, so a
node that speaks something else shows down with that reason instead of crashing a renderer.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetd.fleet.control_client import ControlError


class _Doc:
    """Typed reads of one JSON object, with the path of a bad field in the error."""

    def __init__(self, doc: Any, where: str, path: str = "") -> None:
        if not isinstance(doc, Mapping):
            raise ControlError(f"{where}: {path or 'answer'}: expected an object, got {type(doc).__name__}")
        self.doc, self.where, self.path = doc, where, path

    def _field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str, types: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.doc or self.doc[key] is None:
            if default is ...:
                raise ControlError(f"{self.where}: no {self._field(key)}")
            return default
        value = self.doc[key]
        if not isinstance(value, types) or isinstance(value, bool) and bool not in _tuple(types):
            raise ControlError(
                f"{self.where}: {self._field(key)}: expected {_names(types)}, got {value!r:.60}"
            )
        return value

    def text(self, key: str, default: Any = ...) -> str:
        return self._get(key, str, default)

    def whole(self, key: str, default: Any = ...) -> int:
        return self._get(key, int, default)

    def number(self, key: str, default: Any = ...) -> float:
        return float(self._get(key, (int, float), default))

    def flag(self, key: str, default: Any = ...) -> bool:
        return self._get(key, bool, default)

    def obj(self, key: str, default: Any = ...) -> _Doc | None:
        value = self._get(key, Mapping, default)
        return None if value is None else _Doc(value, self.where, self._field(key))

    def objs(self, key: str, default: Any = ...) -> list[_Doc]:
        return [
            _Doc(v, self.where, f"{self._field(key)}[{i}]")
            for i, v in enumerate(self._get(key, list, default))
        ]


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _names(types) -> str:
    return " or ".join(t.__name__ for t in _tuple(types))


# -- /v1/status --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """One device of the node as /v1/status lists it: its index, name, free and total bytes."""

    index: int
    name: str
    free: int
    total: int
    kind: str | None = None  # "ggml", "numpy": what the device computes with, when the daemon says
    library: str | None = None  # the kernels' file it loaded (ggml: libggml-cpu[-variant].so)
    fallback: str | None = None  # why it stands in for the device asked for (cpu -> numpy)


@dataclass(frozen=True)
class Session:
    """One open RPC connection as /v1/status lists it."""

    id: int
    peer: str
    age_seconds: float
    commands: int
    request_bytes: int
    response_bytes: int
    allocated_bytes: int = 0  # buffers this session holds on the node
    layers: tuple[int, ...] = ()  # model layers whose weights it wrote there (blk.N.*)


@dataclass(frozen=True)
class P2pState:
    """Peer copy on one node (/v1/p2p, or the `p2p` part of /v1/status): on or off, and where
    COPY_TENSOR_TO may push."""

    enabled: bool
    served: bool = True  # False: this daemon does not serve COPY_TENSOR_TO at all
    was: bool | None = None  # PUT /v1/p2p only: the state before the switch
    doc: Mapping = field(default_factory=dict, repr=False, compare=False)
    # Where COPY_TENSOR_TO may push (CIDRs), None from a fleetd that does not say; complete:
    # False when the daemon also allows the subnet each client reaches it on (wildcard bind).
    peer_allow: tuple[str, ...] | None = None
    peer_allow_complete: bool = True

    @classmethod
    def parse(cls, doc: Any, where: str = "/v1/p2p", path: str = "") -> P2pState:
        d = _Doc(doc, where, path)
        allow = d._get("peer_allow", list, None)
        return cls(
            d.flag("enabled"),
            d.flag("served", True),
            d.flag("was", None),
            d.doc,
            tuple(map(str, allow)) if allow is not None else None,
            d.flag("peer_allow_complete", True),
        )

    def allows(self, ip: str) -> bool | None:
        """Whether a push to `ip` passes the allow-list; None when this state cannot tell."""
        if self.peer_allow is None:
            return None
        try:
            addr = ipaddress.ip_address(ip)
            inside = any(addr in ipaddress.ip_network(n, strict=False) for n in self.peer_allow)
        except ValueError:
            return None
        return True if inside else (False if self.peer_allow_complete else None)


@dataclass(frozen=True)
class NodeStatus:
    """A node's /v1/status answer: its version, RPC address, devices, uptime, P2P and open sessions."""

    version: str
    protocol: str
    features: int
    rpc_host: str
    rpc_port: int
    devices: tuple[Device, ...]
    uptime_seconds: float
    p2p: P2pState
    sessions: tuple[Session, ...]
    doc: Mapping = field(default_factory=dict, repr=False, compare=False)
    log_file: str | None = None  # where the daemon logs (--log-file); None: stderr/journal

    @classmethod
    def parse(cls, doc: Any, where: str = "/v1/status") -> NodeStatus:
        """The /v1/status document; fields added after the first release have defaults, anything of
        another shape raises ControlError naming the field."""
        d = _Doc(doc, where)
        rpc = d.obj("rpc")
        features = d.obj("features", None)
        return cls(
            version=d.text("version"),
            protocol=d.text("protocol", "?"),
            features=features.whole("bits", 0) if features is not None else 0,
            rpc_host=rpc.text("host", "?"),
            rpc_port=rpc.whole("port"),
            devices=tuple(
                Device(
                    x.whole("index", i),
                    x.text("name"),
                    x.whole("free"),
                    x.whole("total"),
                    x.text("kind", None),
                    x.text("library", None),
                    x.text("fallback", None),
                )
                for i, x in enumerate(d.objs("devices", []))
            ),
            uptime_seconds=d.number("uptime_seconds", 0.0),
            p2p=P2pState.parse(d.doc.get("p2p") or {"enabled": False, "served": False}, where, "p2p"),
            sessions=tuple(
                Session(
                    s.whole("id"),
                    s.text("peer"),
                    s.number("age_seconds"),
                    s.whole("commands"),
                    s.whole("request_bytes"),
                    s.whole("response_bytes"),
                    s.whole("allocated_bytes", 0),
                    tuple(x for x in s._get("layers", list, []) if isinstance(x, int)),
                )
                for s in d.objs("sessions", [])
            ),
            doc=d.doc,
            log_file=d.text("log_file", None),
        )


# -- /v1/stats ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandCount:
    """One command's count and bytes each way, as /v1/stats reports it."""

    count: int
    request_bytes: int
    response_bytes: int


@dataclass(frozen=True)
class Counters:
    """Per command (upstream names: "SET_TENSOR") and graph computes, in total or per session."""

    commands: Mapping[str, CommandCount]
    graph_computes: int
    compute_seconds: float
    probe_connections: int = 0  # HELLO-only connections (status polls, health checks): not traffic

    @classmethod
    def parse(cls, d: _Doc) -> Counters:
        """The counters of /v1/stats `total` or of one session; a key added later (probe_connections)
        is 0 from an older daemon."""
        cmds = d.obj("commands")
        commands = {}
        for name in cmds.doc:
            c = cmds.obj(name)
            commands[name] = CommandCount(
                c.whole("count"), c.whole("request_bytes"), c.whole("response_bytes")
            )
        return cls(
            commands,
            d.whole("graph_computes", 0),
            d.number("compute_seconds", 0.0),
            d.whole("probe_connections", 0),
        )

    @property
    def command_count(self) -> int:
        return sum(c.count for c in self.commands.values())

    @property
    def bytes_moved(self) -> int:
        """Request and response bytes of every command, together."""
        return sum(c.request_bytes + c.response_bytes for c in self.commands.values())

    def used(self) -> dict[str, CommandCount]:
        """The commands that were served at least once, in the daemon's order."""
        return {name: c for name, c in self.commands.items() if c.count}


@dataclass(frozen=True)
class PeerCopyTotals:
    """COPY_TENSOR_TO as the source counted it: pushes confirmed, bytes, fallbacks by reason."""

    copies_ok: int = 0
    bytes_pushed: int = 0
    bytes_confirmed: int = 0
    links_opened: int = 0
    fallbacks: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, d: _Doc | None) -> PeerCopyTotals:
        if d is None:  # a daemon without the peer extension
            return cls()
        fb = d.obj("fallbacks", None)
        return cls(
            d.whole("copies_ok", 0),
            d.whole("bytes_pushed", 0),
            d.whole("bytes_confirmed", 0),
            d.whole("links_opened", 0),
            {r: fb.whole(r) for r in fb.doc} if fb is not None else {},
        )

    @property
    def fallback_count(self) -> int:
        return sum(self.fallbacks.values())


@dataclass(frozen=True)
class SessionCounters:
    """The counters of one open RPC connection (/v1/stats `sessions`)."""

    id: int
    peer: str
    counters: Counters


@dataclass(frozen=True)
class NodeStats:
    """A node's /v1/stats answer: totals since `since`, the peer copy totals, per-session counters."""

    since: float  # when the counters were last reset (the daemon's clock)
    total: Counters
    peer: PeerCopyTotals
    sessions: tuple[SessionCounters, ...]
    doc: Mapping = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def parse(cls, doc: Any, where: str = "/v1/stats") -> NodeStats:
        d = _Doc(doc, where)
        return cls(
            since=d.number("since", 0.0),
            total=Counters.parse(d.obj("total")),
            peer=PeerCopyTotals.parse(d.obj("peer", None)),
            sessions=tuple(
                SessionCounters(s.whole("id"), s.text("peer"), Counters.parse(s))
                for s in d.objs("sessions", [])
            ),
            doc=d.doc,
        )
