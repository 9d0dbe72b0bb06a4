"""What a daemon knows about peer copy beyond one connection: where it may push (PeerPolicy),
how long it waits (PeerTimeouts) and what happened (PeerCounters). Held by ServerState; the
allow-list rules are in fleetd.server.peer's docstring.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass

# Closed set of fallback reasons (Prometheus label values, /v1/stats keys).
FALLBACK_REASONS = (
    "disabled",  # P2P switched off on this (source) daemon
    "not_allowed",  # destination outside --peer-allow
    "unreachable",  # resolve or connect failed
    "refused",  # destination answered HELLO without Feature.PEER_COPY, or too old/new,
    # or (a fleetd) answered PEER_BARRIER 0 because its P2P is off now
    "write_rejected",  # destination closed the link on our SET_TENSOR (e.g. its bounds check)
    "timeout",  # connect, HELLO, push or barrier did not finish in time
)


@dataclass(frozen=True)
class PeerTimeouts:
    """Bounds on peer I/O. HELLO is short because a busy stock server accepts the connect from
    its listen backlog and then never answers; the transfer bound only guards against a hung peer."""

    connect: float = 2.0
    hello: float = 2.0
    transfer: float = 60.0
    # PEER_WAIT: how long a destination waits for an asynchronous copy that has not started
    # arriving (one that is arriving gets `transfer` more); then the client takes it.
    wait: float = 10.0


class PeerCounters:
    """Peer-copy counters of one daemon, totals across sessions; read by the control API."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._zero()

    def _zero(self) -> None:
        self.copies_ok = 0
        self.bytes_pushed = 0  # SET_TENSOR data written to destinations, landed or not
        self.bytes_confirmed = 0  # data whose PEER_BARRIER answered 1
        self.links_opened = 0
        self.copies_taken = 0  # asynchronous copies that failed and the client took (PEER_TAKE)
        self.gates_failed = 0  # PEER_GATEs answered 0 (the session then skips until PEER_RESUME)
        self.commands_skipped = 0  # commands read and not served after a failed PEER_GATE
        self.fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)

    def reset(self) -> None:
        with self._lock:
            self._zero()

    def ok(self, nbytes: int, copies: int = 1) -> None:
        with self._lock:
            self.copies_ok += copies
            self.bytes_confirmed += nbytes

    def pushed(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_pushed += nbytes

    def link_opened(self) -> None:
        with self._lock:
            self.links_opened += 1

    def taken(self) -> None:
        with self._lock:
            self.copies_taken += 1

    def gate_failed(self) -> None:
        with self._lock:
            self.gates_failed += 1

    def skipped(self) -> None:
        with self._lock:
            self.commands_skipped += 1

    def fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "copies_ok": self.copies_ok,
                "bytes_pushed": self.bytes_pushed,
                "bytes_confirmed": self.bytes_confirmed,
                "links_opened": self.links_opened,
                "copies_taken": self.copies_taken,
                "gates_failed": self.gates_failed,
                "commands_skipped": self.commands_skipped,
                "fallbacks": dict(self.fallbacks),
            }


# -- allow list ---------------------------------------------------------------------------------

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
ANSWERS_KEPT = 1024  # PeerPolicy.allows answers remembered


def _neighbourhood(addr: str) -> Network | None:
    ip = ipaddress.ip_address(addr)
    if ip.is_unspecified:
        return None
    return ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 64}", strict=False)


def listen_network(host: str) -> Network | None:
    try:
        return _neighbourhood(socket.gethostbyname(host)) if host else None
    except OSError:
        return None  # an unresolvable listen host fails at bind(), not here


def parse_allow(entries: list[str], flag: str = "--peer-allow") -> list[Network]:
    """IPs, CIDRs or host names (resolved now) as networks; a bad entry raises ValueError."""
    nets: list[Network] = []
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
            continue
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(entry, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ValueError(f"{flag}: cannot resolve {entry!r}: {exc}") from exc
        nets.extend(ipaddress.ip_network(info[4][0]) for info in infos)
    return nets


class PeerPolicy:
    """Which destinations this daemon may push to (see the module docstring for the default)."""

    def __init__(self, allow: list[str] | None, listen_host: str) -> None:
        self._answers: dict[tuple[str, str | None], bool] = {}
        self.default = allow is None
        if allow is None:
            self.networks = list(LOOPBACK)
            own = listen_network(listen_host)
            if own is not None:
                self.networks.append(own)
        else:
            self.networks = parse_allow(allow)

    def allows(self, ip: str, local_addr: str | None = None) -> bool:
        # The networks never change after start, so an answer holds: one dict lookup per copy
        # instead of parsing addresses (bounded: a client naming many hosts just refills it).
        key = (ip, local_addr)
        answer = self._answers.get(key)
        if answer is None:
            if len(self._answers) >= ANSWERS_KEPT:
                self._answers.clear()
            answer = self._answers[key] = self._allows(ip, local_addr)
        return answer

    def _allows(self, ip: str, local_addr: str | None) -> bool:
        addr = ipaddress.ip_address(ip)
        if any(addr in net for net in self.networks):
            return True
        # Default policy on a wildcard bind: the subnet of the interface the client came in on.
        if self.default and local_addr:
            own = _neighbourhood(local_addr)
            return own is not None and addr in own
        return False
