"""SSH to fleet nodes with paramiko: connect with bounded timeouts, known_hosts respected, and
direct-tcpip channels to a node's loopback ports (fabric's TunnelManager does the same).

paramiko's exceptions are translated here, once, into ours (httpx's map_httpcore_exceptions):

    SshError(NodeError)          refused, unreachable, authentication failed, unknown host key
    ConnectTimeout               no TCP connect or SSH banner in time
    ControlUnreachable(NodeError) the node's sshd could not open the channel (nothing listening)
"""

from __future__ import annotations

import getpass
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import paramiko

from fleetd.errors import ConnectTimeout, FleetError
from fleetd.fleet.nodes_file import NodeSpec

# paramiko logs transport failures (with tracebacks) at ERROR: without a handler of its own, the
# logging module's last-resort handler would print them to stderr. Our errors say it in one line;
# `fleetctl --debug` configures logging and shows them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

KEEPALIVE_S = 30


class NodeError(FleetError):
    """One node failed an operation; `reason` is the one-line cause shown as the node's state."""


class SshError(NodeError):
    """SSH to the node failed: refused, unreachable, authentication, or an unknown host key."""


class ControlUnreachable(NodeError):
    """The node's control API or RPC port did not open (directly or through SSH) or gave no
    whole answer."""


@dataclass(frozen=True)
class SshOptions:
    """How fleetctl connects. Defaults: keys from the agent and ~/.ssh, host keys from
    ~/.ssh/known_hosts, unknown hosts refused (paramiko's RejectPolicy)."""

    connect_timeout: float = 10.0
    timeout: float = 30.0  # one control API request, once the channel is open
    identity: tuple[str, ...] = ()  # extra private key files, tried before ~/.ssh
    known_hosts: tuple[str, ...] = ()  # extra known_hosts files (e.g. a test sshd's host key)
    allow_agent: bool = True
    look_for_keys: bool = True
    system_known_hosts: bool = True


def _describe(spec: NodeSpec) -> str:
    return f"ssh {spec.user or getpass.getuser()}@{spec.host}:{spec.ssh_port}"


def open_ssh(spec: NodeSpec, options: SshOptions) -> paramiko.SSHClient:
    """An authenticated SSHClient for the node, or SshError / ConnectTimeout with the reason."""
    what = _describe(spec)
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        if options.system_known_hosts:
            client.load_system_host_keys()  # ~/.ssh/known_hosts when it exists
        for path in options.known_hosts:
            client.load_host_keys(str(Path(path).expanduser()))
    except (OSError, paramiko.SSHException) as exc:
        raise SshError(f"{what}: cannot read known_hosts: {exc}") from exc
    t = options.connect_timeout
    try:
        sock = _wait_for_banner(spec, what, t)
        client.connect(
            spec.host,
            spec.ssh_port,
            username=spec.user or getpass.getuser(),
            sock=sock,
            key_filename=[str(Path(p).expanduser()) for p in options.identity] or None,
            allow_agent=options.allow_agent,
            look_for_keys=options.look_for_keys,
            timeout=t,
            banner_timeout=t,
            auth_timeout=t,
            channel_timeout=t,
        )
    except BaseException as exc:
        client.close()
        if isinstance(exc, Exception):
            raise _translate(what, exc, t) from exc
        raise
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(KEEPALIVE_S)
    return client


def _wait_for_banner(spec: NodeSpec, what: str, timeout: float) -> socket.socket:
    """The TCP connection to sshd once its banner has begun to arrive: no banner in time and a
    connection closed before it are told apart here, where the cause is certain (paramiko's own
    banner wait can surface as "No existing session" when its thread fails first)."""
    sock = socket.create_connection((spec.host, spec.ssh_port), timeout=timeout)
    try:
        sock.settimeout(timeout)
        first = sock.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        sock.close()
        raise ConnectTimeout(f"{what}: no SSH banner within {timeout:g}s") from None
    except OSError:
        sock.close()
        raise
    if not first:
        sock.close()
        raise SshError(
            f"{what}: connection closed before the SSH banner (not an SSH server, "
            "or sshd refused it: MaxStartups, tcp wrappers?)"
        )
    return sock


def _translate(what: str, exc: Exception, timeout: float) -> Exception:
    if isinstance(exc, (ConnectTimeout, SshError)):
        return exc
    if isinstance(exc, paramiko.BadHostKeyException):
        return SshError(
            f"{what}: host key does not match known_hosts (got {exc.key.get_name()} "
            f"{exc.key.get_fingerprint().hex()}): possible man-in-the-middle, refusing"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return SshError(
            f"{what}: authentication failed ({exc}); keys come from the agent, ~/.ssh or --identity"
        )
    if isinstance(exc, TimeoutError):
        return ConnectTimeout(f"{what}: no answer within {timeout:g}s")
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        reasons = sorted({e.strerror or str(e) for e in exc.errors.values()})
        return SshError(f"{what}: {'; '.join(reasons).lower()}")
    if isinstance(exc, paramiko.SSHException):
        msg = str(exc)
        if "not found in known_hosts" in msg:
            return SshError(
                f"{what}: host key not in known_hosts (add it, e.g. ssh-keyscan, or pass --known-hosts FILE)"
            )
        if "banner" in msg.lower():
            # paramiko says "Error reading SSH protocol banner" for both; the cause tells them apart.
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, TimeoutError):
                return ConnectTimeout(f"{what}: no SSH banner within {timeout:g}s")
            if isinstance(cause, (EOFError, ConnectionError)):
                return SshError(
                    f"{what}: connection closed before the SSH banner (not an SSH server, "
                    "or sshd refused it: MaxStartups, tcp wrappers?)"
                )
            return SshError(f"{what}: bad SSH banner: {msg}")
        return SshError(f"{what}: {msg}")
    if isinstance(exc, socket.gaierror):
        return SshError(f"{what}: cannot resolve {spec_host(what)}: {exc.strerror or exc}")
    if isinstance(exc, OSError):
        return SshError(f"{what}: {(exc.strerror or str(exc)).lower()}")
    return SshError(f"{what}: {type(exc).__name__}: {exc}")


def spec_host(what: str) -> str:
    """The host of a `_describe` string ("ssh user@host:port")."""
    return what.split("@", 1)[-1].rsplit(":", 1)[0]


def open_tunnel(
    client: paramiko.SSHClient, spec: NodeSpec, port: int, timeout: float, host: str = "127.0.0.1"
) -> paramiko.Channel:
    """A direct-tcpip channel from the node's sshd to host:port as the node sees it (loopback
    by default: the control API listens nowhere else)."""
    transport = client.get_transport()
    if transport is None or not transport.is_active():
        raise SshError(f"{_describe(spec)}: connection lost")
    try:
        return transport.open_channel("direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=timeout)
    except paramiko.ChannelException as exc:
        hint = (
            f"is fleetd running there with --control-port {port}?"
            if host == "127.0.0.1"
            else "is fleetd running?"
        )
        raise ControlUnreachable(
            f"{_describe(spec)}: channel to {host}:{port} refused ({exc.text}): {hint}"
        ) from exc
    except paramiko.SSHException as exc:
        if "timeout" in str(exc).lower():
            raise ConnectTimeout(
                f"{_describe(spec)}: channel to {host}:{port}: no answer within {timeout:g}s"
            ) from exc
        raise SshError(f"{_describe(spec)}: channel to {host}:{port}: {exc}") from exc
    except (OSError, EOFError) as exc:
        raise SshError(f"{_describe(spec)}: connection lost opening a channel: {exc}") from exc
