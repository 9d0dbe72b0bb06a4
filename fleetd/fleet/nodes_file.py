"""The nodes file: one fleetd node per line.

    # comment lines and blank lines are ignored; a # after the fields starts a comment too
    [user@]host[:ssh_port] [rpc_port=N] [control_port=N] [devices=D,D...] [name=NAME] [via_netns=NS]
                           [cache_dir=DIR]

    gpu1                                   # ssh as the current user, port 22, all defaults
    root@10.0.0.2:2222 rpc_port=50053 devices=cpu,numpy
    localhost rpc_port=50053                       # control_port 50153; no user, no ssh port: no SSH
    [fe80::1%eth0]:22 name=edge                    # IPv6 literals in brackets

Defaults: ssh_port 22, rpc_port 50052, control_port rpc_port + 100 (50152), devices cpu
(fleetd's devices: cpu, numpy). cache_dir=DIR: the node's fleetd cache directory (its -c), where
`fleetctl stage` puts tensors (default: the one `fleetctl deploy` configured, if any).
via_netns=NS is written by `fleetctl lab up`: the node's fleetd
runs in the network namespace NS on this host and is reached inside it. Which
nodes are reached without SSH: LOCAL_RULE below. A node is named by
`name=` or by its host (plus `:ssh_port` when not 22); two nodes on one host get `/rpc_port`
appended. A bad line raises FleetError naming the file, the line number and the bad value.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path

from fleetd.device_names import DEVICE_NAMES, unknown_devices
from fleetd.errors import FleetError
from fleetd.ports import CONTROL_PORT_OFFSET, DEFAULT_CONTROL_PORT, DEFAULT_RPC_PORT, control_port_for

DEFAULT_SSH_PORT = 22
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

# The one rule for which nodes are reached without SSH; the README and fleetctl(1) say the same.
LOCAL_RULE = (
    "localhost, 127.0.0.1 and [::1], written without a user and without an SSH port, "
    "are reached directly over loopback, without SSH; every other node (127.0.0.2, "
    "root@localhost, localhost:2222 too) goes through SSH."
)

NODES_FILE_HELP = f"""\
nodes file: one node per line, '#' starts a comment, blank lines are ignored:
  [user@]host[:ssh_port] [rpc_port=N] [control_port=N] [devices=D,D...] [name=NAME]
  [cache_dir=DIR]
e.g.
  gpu1
  root@10.0.0.2:2222 rpc_port=50053 devices=cpu,numpy
  localhost rpc_port=50053          (control_port 50153: rpc_port + 100)
defaults: ssh_port 22, rpc_port {DEFAULT_RPC_PORT}, control_port rpc_port + {CONTROL_PORT_OFFSET}, devices cpu
(devices: {", ".join(DEVICE_NAMES)}). cache_dir=DIR: the node's fleetd -c directory, for
`fleetctl stage` (default: the one `fleetctl deploy` configured). via_netns=NS: written by
`fleetctl lab up` (fleetd in network namespace NS on this host).
{textwrap.fill(LOCAL_RULE, 96)}
SSH keys come from the agent or ~/.ssh; host keys must be in ~/.ssh/known_hosts
(or --known-hosts FILE)."""

_NAME = re.compile(r"^[A-Za-z0-9_.:\-/]+$")
_HOST = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class NodeSpec:
    """One line of the nodes file: how to reach the node and the ports and devices its fleetd uses."""

    host: str
    user: str | None = None
    ssh_port: int = DEFAULT_SSH_PORT
    rpc_port: int = DEFAULT_RPC_PORT
    control_port: int = DEFAULT_CONTROL_PORT
    devices: tuple[str, ...] = ("cpu",)
    name: str = ""
    line: int = field(default=0, compare=False)
    via_netns: str = ""  # the control API is reached inside this network namespace (fleetctl lab)
    cache_dir: str = ""  # the node's fleetd cache directory (-c), as the node sees it; "" unknown

    @property
    def is_local(self) -> bool:
        """localhost with neither user nor SSH port: the control API is reached without SSH."""
        return self.user is None and self.host in LOCAL_HOSTS and self.ssh_port == DEFAULT_SSH_PORT

    @property
    def rpc_endpoint(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def target(self) -> str:
        """`[user@]host[:port]` as ssh would be given it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        at = f"{self.user}@" if self.user else ""
        port = f":{self.ssh_port}" if self.ssh_port != DEFAULT_SSH_PORT else ""
        return f"{at}{host}{port}"


class NodesFileError(FleetError):
    """A bad line in the nodes file; the message names the file, the line number and the value."""


def _port(where: str, key: str, value: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise NodesFileError(f"{where}: {key} {value!r} is not a port in 1..65535")
    return int(value)


def parse_target(where: str, text: str) -> tuple[str | None, str, int]:
    """`[user@]host[:port]` -> (user, host, port); `[v6addr]:port` for IPv6 literals."""
    user, at, rest = text.rpartition("@")
    if at and not user:
        raise NodesFileError(f"{where}: empty user name before '@' in {text!r}")
    if user and not re.fullmatch(r"[A-Za-z0-9_.\-]+", user):
        raise NodesFileError(f"{where}: bad user name {user!r}")
    port = DEFAULT_SSH_PORT
    if rest.startswith("["):
        host, close, tail = rest[1:].partition("]")
        if not close or not host:
            raise NodesFileError(f"{where}: unclosed '[' in host {rest!r}")
        if tail:
            if not tail.startswith(":"):
                raise NodesFileError(f"{where}: expected ':port' after ']' in {rest!r}")
            port = _port(where, "ssh port", tail[1:])
    else:
        host, colon, p = rest.partition(":")
        if colon:
            port = _port(where, "ssh port", p)
        if not host or not _HOST.match(host):
            raise NodesFileError(f"{where}: bad host {host!r} (IPv6 literals go in brackets: [::1]:22)")
    return user or None, host, port


def parse_line(text: str, lineno: int = 0, source: str = "nodes file") -> NodeSpec | None:
    """One line of a nodes file; None for blank and comment lines."""
    where = f"{source}:{lineno}" if lineno else source
    fields = text.split("#", 1)[0].split()
    if not fields:
        return None
    user, host, ssh_port = parse_target(where, fields[0])
    kw: dict = {}
    for f in fields[1:]:
        key, eq, value = f.partition("=")
        if not eq:
            raise NodesFileError(f"{where}: expected key=value after the host, got {f!r}")
        if key in kw:
            raise NodesFileError(f"{where}: {key} given twice")
        if key in ("rpc_port", "control_port"):
            kw[key] = _port(where, key, value)
        elif key == "devices":
            devs = tuple(d for d in value.split(",") if d)
            bad = unknown_devices(devs)
            if not devs or bad:
                raise NodesFileError(
                    f"{where}: devices {value!r}: expected fleetd's devices, "
                    f"comma separated: {', '.join(DEVICE_NAMES)}"
                )
            kw[key] = devs
        elif key == "via_netns":
            if not _HOST.match(value):
                raise NodesFileError(f"{where}: via_netns {value!r}: not a namespace name")
            kw[key] = value
        elif key == "cache_dir":
            if not value.startswith(("/", "~/")):
                raise NodesFileError(f"{where}: cache_dir {value!r}: an absolute path or ~/path")
            kw[key] = value
        elif key == "name":
            if not _NAME.match(value):
                raise NodesFileError(f"{where}: name {value!r}: use letters, digits and _ . : - /")
            kw[key] = value
        else:
            raise NodesFileError(
                f"{where}: unknown key {key!r} (known: rpc_port, control_port, devices, name, cache_dir)"
            )
    if "control_port" not in kw:  # two fleetd on one host (one per GPU) need no control_port= each
        kw["control_port"] = control_port_for(kw.get("rpc_port", DEFAULT_RPC_PORT))
        if kw["control_port"] > 65535:
            raise NodesFileError(
                f"{where}: rpc_port {kw['rpc_port']} + {CONTROL_PORT_OFFSET} is past "
                "65535: give control_port= too"
            )
    return NodeSpec(host=host, user=user, ssh_port=ssh_port, line=lineno, **kw)


def parse_nodes(text: str, source: str = "nodes file") -> list[NodeSpec]:
    specs = [s for n, line in enumerate(text.splitlines(), 1) if (s := parse_line(line, n, source))]
    return _name(specs, source)


def load_nodes(path: str | Path) -> list[NodeSpec]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise NodesFileError(f"nodes file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise NodesFileError(f"nodes file {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    specs = parse_nodes(text, str(path))
    if not specs:
        raise NodesFileError(f"nodes file {path}: no nodes in it")
    return specs


def _name(specs: list[NodeSpec], source: str) -> list[NodeSpec]:
    """Fill in default names; /rpc_port tells apart nodes that share a host."""

    def base(s: NodeSpec) -> str:
        host = f"[{s.host}]" if ":" in s.host else s.host
        return host if s.ssh_port == DEFAULT_SSH_PORT else f"{host}:{s.ssh_port}"

    counts: dict[str, int] = {}
    for s in specs:
        if not s.name:
            counts[base(s)] = counts.get(base(s), 0) + 1
    out, seen, endpoints = [], {}, {}
    for s in specs:
        name = s.name or (base(s) if counts[base(s)] == 1 else f"{base(s)}/{s.rpc_port}")
        ep = (s.host, s.ssh_port, s.rpc_port)
        if ep in endpoints:
            raise NodesFileError(
                f"{source}:{s.line}: {s.target} rpc_port={s.rpc_port} already listed on line {endpoints[ep]}"
            )
        if name in seen:
            raise NodesFileError(
                f"{source}:{s.line}: node name {name!r} already used on line {seen[name]} (add name=...)"
            )
        seen[name], endpoints[ep] = s.line, s.line
        out.append(replace(s, name=name))
    return out
