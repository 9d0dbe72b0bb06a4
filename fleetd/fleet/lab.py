"""An emulated network on this machine: N fleetd nodes in network namespaces, the coordinator
(this process, the root namespace) reaching each over a link of its own, the nodes reaching each
other over a switch, every link rate-limited with `tc tbf` in both directions.

    root namespace (coordinator: fleetctl, the llama tools)
      fl<L>c<j>  10.211.L.4j+1/30 ──veth, --coordinator-link──  coord0 10.211.L.4j+2/30  ┐
                                                                                       │ fl<L>n<j>
      fl<L>sw: bridge sw0, ports p<j> ──veth, --peer-link──  peer0 10.210.L.11+j/24      ┘

Each node's fleetd binds its peer address 10.210.L.11+j; the root namespace routes that /32
over the node's coordinator link, so the coordinator's traffic takes the coordinator links and
node-to-node traffic (COPY_TENSOR_TO) the switch. The switch lives in a namespace of its own:
nothing in the root namespace is attached to it, nothing is forwarded anywhere else.

The control API stays on each namespace's 127.0.0.1 (fleetd binds it to loopback only), and
the nodes file says `via_netns=fl<L>n<j>`: fleetd.fleet.node opens the control connection
inside that namespace (fleetd/fleet/netns.py). The RPC endpoints are plain addresses.

The coordinator links may differ per node (`--coordinator-link 1gbit,1gbit,100mbit`: a node
behind a slower link); `Lab.up` also takes extra fleetd flags and the cores per node. Lab nodes
run with `--no-pin-workers` (see `_start_fleetd`).

With `restart_s` (`fleetctl lab up --restart S`) each fleetd runs under a supervisor in its
namespace (`python -m fleetd.supervise`), as the deploy's systemd unit runs it in production
(fleetd.fleet.agent.unit_text, ansible's fleetd.service.j2: Restart=always, RestartSec=2,
StartLimitBurst=10 in StartLimitIntervalSec=60): a fleetd that dies, however, is started again
`restart_s` seconds later, at most RESTART_BURST starts within RESTART_INTERVAL_S (then the
supervisor gives up, as systemd marks the unit failed). Each exit and restart is a line with the
time in the node's log; fleetd's current pid is in `<dir>/<node>.pid`. `Lab.fleetd_pid` and
`Lab.kill_fleetd` are how a test or a benchmark crashes a node.

Everything is recorded in `<dir>/lab.json` before it is made, so `down` (idempotent) removes
all of it, also after a failed `up`: the supervisors first (SIGTERM: they pass it on to fleetd
and do not restart it), then any fleetd left, then the namespaces. Needs root, iproute2 and the
sch_tbf module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetd.client import RpcClient
from fleetd.errors import FleetError
from fleetd.fleet.local import PROBE_TIMEOUT, wait_answering
from fleetd.fleet.node import Fleet
from fleetd.ports import DEFAULT_CONTROL_PORT, DEFAULT_RPC_PORT

MAX_NODES = 16
MAX_LABS = 50
RATE_RANGE_BIT = (1_000_000, 40_000_000_000)  # 1 mbit .. 40 gbit
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
CMD_TIMEOUT_S = 30.0
STATE_FILE = "lab.json"
PEER_NET, COORD_NET = "10.210", "10.211"
# tbf's queue: long enough that TCP at the full rate does not lose packets to it.
TBF_LATENCY = "100ms"
# The token bucket: two full-size Ethernet frames, or 100 us at the rate where that is more.
# A physical line of the rate serialises a frame at a time, so an 8 KiB hidden state takes its
# 0.33 ms on a 200 Mbit/s link (tbf cuts GSO packets into frames that fit). The bucket of
# 4 ms at the rate (at least 64 KiB) used before let a decode step's few KiB through at memory
# speed: an 8 KiB GET came back in ~0.1 ms, so decode never paid the link it crossed
# (benchmarks/lab_bucket.py). Bulk transfers keep the rate: 191 of 200 Mbit/s, 921 of 1000.
FRAME_BYTES = 1514
LINK_BURST_FRAMES = 2
LINK_BURST_S = 100e-6
# The supervisor's limits, as the deploy's unit (StartLimitBurst=10, StartLimitIntervalSec=60).
RESTART_BURST, RESTART_INTERVAL_S = 10, 60.0
MAX_RESTART_S = 3600.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
# a 10 ms period: a node over its quota stalls for milliseconds (at the default 100 ms it stalled
# for most of a period: decode over 3 nodes of 0.4 cores scattered 49..133 t/s, now 136..172)
CFS_PERIOD_US = 10_000
MIN_NODE_CORES = 0.1  # the kernel's smallest quota, 1 ms, of that period

_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|k|m|g)?$", re.I)
_UNITS = {"bit": 1, "kbit": 1e3, "k": 1e3, "mbit": 1e6, "m": 1e6, "gbit": 1e9, "g": 1e9}


def parse_rate(text: str) -> int:
    """ "200mbit", "2gbit", "2g" -> bits per second; ValueError (one line) outside 1 mbit..40 gbit."""
    m = _RATE.match(text.strip())
    if not m:
        raise ValueError(f"rate {text!r}: expected e.g. 200mbit or 2gbit")
    bits = int(float(m.group(1)) * _UNITS[(m.group(2) or "bit").lower()])
    low, high = RATE_RANGE_BIT
    if not low <= bits <= high:
        raise ValueError(f"rate {text!r}: must be in 1mbit..40gbit")
    return bits


def per_node_rates(bits: int | Sequence[int], nodes: int) -> list[int]:
    """One coordinator-link rate per node: a single rate for all, or exactly one each."""
    rates = [int(bits)] * nodes if isinstance(bits, int) else [int(b) for b in bits]
    if len(rates) != nodes:
        raise ValueError(f"coordinator link rates: {len(rates)} given for {nodes} nodes")
    low, high = RATE_RANGE_BIT
    if not all(low <= b <= high for b in rates):
        raise ValueError("coordinator link rates: each must be in 1mbit..40gbit")
    return rates


def per_node_cores(cores: float | Sequence[float | None] | None, nodes: int) -> list[float | None]:
    """One CPU quota per node (None: none): a single value for all, or exactly one each."""
    quotas = list(cores) if isinstance(cores, Sequence) else [cores] * nodes
    if len(quotas) != nodes:
        raise ValueError(f"node_cores: {len(quotas)} given for {nodes} nodes")
    for q in quotas:
        if q is not None and not MIN_NODE_CORES <= q <= (os.cpu_count() or 1):
            raise ValueError(f"node_cores {q:g}: must be in {MIN_NODE_CORES:g}..{os.cpu_count()}")
    return quotas


def parse_rates(text: str, nodes: int) -> list[int]:
    """ "200mbit" (every node) or "1gbit,1gbit,100mbit" (one per node, in order) -> bits per
    second per node; ValueError (one line) on a bad rate or a count that is not `nodes`."""
    rates = [parse_rate(x) for x in text.split(",")]
    if len(rates) == 1:
        return rates * nodes
    if len(rates) != nodes:
        raise ValueError(f"rates {text!r}: {len(rates)} given for {nodes} nodes (give one, or one per node)")
    return rates


def fmt_rate(bits: int) -> str:
    return f"{bits / 1e9:g}gbit" if bits >= 1e9 else f"{bits / 1e6:g}mbit"


@dataclass
class LabNode:
    """One node of the lab: its network namespace, address and the root end of its coordinator link."""

    name: str
    netns: str
    address: str
    coordinator_link: str  # the root namespace's end
    cpu_group: str = ""  # the cgroup holding the node's CPU quota ("": no quota)

    def join_cpu_group(self) -> None:
        """Move the calling process into the node's CPU quota (a preexec_fn: what the node
        runs besides its fleetd, the stock server of a benchmark, shares the quota)."""
        if self.cpu_group:
            Path(self.cpu_group, "cgroup.procs").write_text(str(os.getpid()))


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    p = subprocess.run(full, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if check and p.returncode != 0:
        raise FleetError(f"lab: {' '.join(full)}: {(p.stderr or p.stdout).strip() or f'exit {p.returncode}'}")
    return p


def _tbf(dev: str, bits: int, ns: str | None) -> None:
    burst = max(LINK_BURST_FRAMES * FRAME_BYTES, int(bits / 8 * LINK_BURST_S))
    _sh(
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        str(bits),
        "burst",
        str(burst),
        "latency",
        TBF_LATENCY,
        ns=ns,
    )


class Lab:
    """The lab described by `<dir>/lab.json`; `up()` builds it, `down()` removes it."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.state_path = self.dir / STATE_FILE
        self.nodes_file = self.dir / "nodes.txt"
        self.state: dict = {}
        self._procs: list[subprocess.Popen] = []  # the fleetd this process started (up)

    # -- state -------------------------------------------------------------------------------

    def _load(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as exc:
            raise FleetError(f"lab state {self.state_path}: unreadable: {exc}") from None

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        tmp.replace(self.state_path)

    def _record(self, kind: str, value) -> None:
        """Written down before it is made: a crash between the two leaves nothing unlisted."""
        self.state.setdefault(kind, []).append(value)
        self._save()

    @property
    def exists(self) -> bool:
        return self.state_path.exists()

    # -- up ----------------------------------------------------------------------------------

    def up(
        self,
        nodes: int,
        coordinator_bits: int | Sequence[int],
        peer_bits: int,
        threads: int = 1,
        python: str = sys.executable,
        node_args: Sequence[Sequence[str]] | None = None,
        node_cpus: Sequence[Sequence[int] | None] | None = None,
        restart_s: float | None = None,
        node_cores: float | Sequence[float | None] | None = None,
    ) -> list[LabNode]:
        """Build the namespaces and rated links and start a fleetd in each; each step is recorded
        first, so a failure part way is undone by `down()` before it re-raises.

        `coordinator_bits`: one rate for every node's coordinator link, or one per node (a
        node behind a slower link). `node_args`: extra fleetd flags per node (`--max-memory`);
        `node_cpus`: the cores each node's fleetd may run on (None: all), set before it starts,
        so its fork server and compute workers inherit them. `restart_s`: run each fleetd under
        a supervisor that starts it again that many seconds after it dies (None: unsupervised, a
        fleetd that dies stays down). `node_cores`: the CPU time each node may use, in cores (a
        CFS quota per node, its fork server and workers included): the nodes stand for
        machines, and without it they all share this one's cores, so a fourth node can add
        work but never compute (None: no quota); one value for all, or one per node (None for a
        node without a quota: a fleet with one slower node)."""
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes {nodes}: must be in 1..{MAX_NODES}")
        if restart_s is not None and not 0 <= restart_s <= MAX_RESTART_S:
            raise ValueError(f"restart_s {restart_s}: must be in 0..{MAX_RESTART_S:g}")
        quotas = per_node_cores(node_cores, nodes)
        rates = per_node_rates(coordinator_bits, nodes)
        for name, given in (("node_args", node_args), ("node_cpus", node_cpus)):
            if given is not None and len(given) != nodes:
                raise ValueError(f"{name}: {len(given)} entries for {nodes} nodes")
        if os.geteuid() != 0:
            raise FleetError("lab: network namespaces need root")
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.exists:
            raise FleetError(f"lab: {self.state_path} exists: run fleetctl lab down --dir {self.dir} first")
        index = self._free_index()
        self.state = {
            "index": index,
            "coordinator_bits": rates[0] if len(set(rates)) == 1 else rates,
            "peer_bits": peer_bits,
            "namespaces": [],
            "links": [],
            "pids": [],
            "supervisors": [],
            "restart_s": restart_s,
            "node_cores": quotas if any(quotas) else None,
            "cpu_groups": [],
            "nodes": [],
        }
        self._save()
        try:
            lab_nodes = self._build(
                index, nodes, rates, peer_bits, threads, python, node_args or [()] * nodes, node_cpus
            )
        except BaseException:
            self.down()
            raise
        return lab_nodes

    @staticmethod
    def _free_index() -> int:
        names = _netns_names()
        links = _sh("ip", "-o", "link", "show").stdout
        for i in range(MAX_LABS):
            if f"fl{i}sw" not in names and f" fl{i}c0@" not in links:
                return i
        raise FleetError(f"lab: {MAX_LABS} labs already up on this machine")

    def _build(
        self,
        i: int,
        count: int,
        coord_rates: list[int],
        peer_bits: int,
        threads: int,
        python: str,
        node_args: Sequence[Sequence[str]],
        node_cpus: Sequence[Sequence[int] | None] | None,
    ) -> list[LabNode]:
        switch = f"fl{i}sw"
        self._record("namespaces", switch)
        _sh("ip", "netns", "add", switch)
        _sh("ip", "link", "add", "sw0", "type", "bridge", ns=switch)
        _sh("ip", "link", "set", "sw0", "up", ns=switch)
        subnet = f"{PEER_NET}.{i}.0/24"
        lab_nodes = []
        for j in range(count):
            ns, root_end = f"fl{i}n{j}", f"fl{i}c{j}"
            address = f"{PEER_NET}.{i}.{11 + j}"
            coord_root, coord_node = f"{COORD_NET}.{i}.{4 * j + 1}", f"{COORD_NET}.{i}.{4 * j + 2}"
            self._record("namespaces", ns)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "set", "lo", "up", ns=ns)
            # the coordinator link: root end here, the other end moved into the node
            self._record("links", root_end)
            _sh("ip", "link", "add", root_end, "type", "veth", "peer", "name", "coord0", "netns", ns)
            _sh("ip", "addr", "add", f"{coord_root}/30", "dev", root_end)
            _sh("ip", "link", "set", root_end, "up")
            _sh("ip", "addr", "add", f"{coord_node}/30", "dev", "coord0", ns=ns)
            _sh("ip", "link", "set", "coord0", "up", ns=ns)
            _sh("ip", "route", "replace", f"{address}/32", "via", coord_node, "dev", root_end)
            # the peer link: node end "peer0", switch end p<j> on the bridge
            _sh("ip", "link", "add", f"p{j}", "type", "veth", "peer", "name", "peer0", "netns", ns, ns=switch)
            _sh("ip", "link", "set", f"p{j}", "master", "sw0", "up", ns=switch)
            _sh("ip", "addr", "add", f"{address}/24", "dev", "peer0", ns=ns)
            _sh("ip", "link", "set", "peer0", "up", ns=ns)
            coord_bits = coord_rates[j]
            for dev, where, bits in (
                (root_end, None, coord_bits),
                ("coord0", ns, coord_bits),
                ("peer0", ns, peer_bits),
                (f"p{j}", switch, peer_bits),
            ):
                _tbf(dev, bits, where)
            group = ""
            quota = (self.state.get("node_cores") or [None] * count)[j]
            if quota:
                group = _cpu_group_path(f"fleetd-lab{i}-{j}")
                self._record("cpu_groups", group)
                _make_cpu_group(group, quota)
            lab_nodes.append(LabNode(f"lab-{j}", ns, address, root_end, group))
        self.state["nodes"] = [n.__dict__ for n in lab_nodes]
        self._save()
        for j, n in enumerate(lab_nodes):
            cpus = node_cpus[j] if node_cpus is not None else None
            self._start_fleetd(j, n, subnet, threads, python, node_args[j], cpus, self.state["restart_s"])
        self.nodes_file.write_text(
            f"# fleetctl lab: {count} nodes, coordinator links {','.join(map(fmt_rate, coord_rates))}, "
            f"peer links {fmt_rate(peer_bits)}; control API inside each namespace\n"
            + "".join(
                f"{n.address} rpc_port={DEFAULT_RPC_PORT} control_port={DEFAULT_CONTROL_PORT} "
                f"via_netns={n.netns} name={n.name}\n"
                for n in lab_nodes
            )
        )
        self._wait_ready(lab_nodes)
        return lab_nodes

    def _start_fleetd(
        self,
        j: int,
        n: LabNode,
        subnet: str,
        threads: int,
        python: str,
        extra: Sequence[str] = (),
        cpus: Sequence[int] | None = None,
        restart_s: float | None = None,
    ) -> None:
        fleetd = [
            python,
            "-m",
            "fleetd.server",
            "--host",
            n.address,
            "--port",
            str(DEFAULT_RPC_PORT),
            "--control-port",
            str(DEFAULT_CONTROL_PORT),
            "--peer-allow",
            subnet,
            # RPC clients: the other nodes (peer copies) and the coordinator on its own links
            "--allow",
            f"{subnet},{subnet.replace(PEER_NET, COORD_NET, 1)}",
            "--threads",
            str(threads),
            "--log-level",
            "info",
            "--log-file",
            str((self.dir / f"{n.name}.log").absolute()),
            # The nodes stand for machines but share this one's cores, and each daemon places
            # its workers among the cores it sees as if it were alone: every node pinned its
            # worker to the first core, so their graphs queued there while the other cores
            # idled (3 nodes on 2 cores, 1 Gbit/s: prompt 0.96x a stock fleet pinned, 1.40x
            # unpinned; decode 0.84x -> 0.93x). The scheduler spreads them; on a real node
            # (one daemon) the pinning stays.
            "--no-pin-workers",
            *extra,
        ]
        if restart_s is None:
            supervisor = []
        else:  # the supervisor in the namespace, fleetd its child (inherits the namespace, cores)
            supervisor = [python, "-m", "fleetd.supervise", "--restart-sec", f"{restart_s:g}", "--always"]
            supervisor += ["--burst", str(RESTART_BURST), "--interval", f"{RESTART_INTERVAL_S:g}"]
            supervisor += ["--pid-file", str(self._pid_file(n.name).absolute()), "--"]
        args = ["ip", "netns", "exec", n.netns, *supervisor, *fleetd]
        pin = set(cpus) if cpus else None

        def place_child() -> None:  # before exec: the fork server and workers inherit both
            n.join_cpu_group()
            if pin:
                os.sched_setaffinity(0, pin)

        with open(self.dir / f"{n.name}.log", "ab") as log:
            # its own session: the lab outlives `fleetctl lab up`; `ip netns exec` execs, so
            # the pid is fleetd's (or its supervisor's)
            proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                start_new_session=True,
                preexec_fn=place_child if (pin or n.cpu_group) else None,
            )
        self._procs.append(proc)
        self._record("pids" if restart_s is None else "supervisors", proc.pid)

    def _pid_file(self, name: str) -> Path:
        return self.dir / f"{name}.pid"

    def _wait_ready(self, lab_nodes: list[LabNode]) -> None:
        fleet = Fleet.load(self.nodes_file)
        deadline = time.monotonic() + START_TIMEOUT_S
        for node, n, proc in zip(fleet, lab_nodes, self._procs, strict=True):
            endpoint = f"{n.address}:{DEFAULT_RPC_PORT}"
            checks = [
                ("HELLO", lambda e=endpoint: RpcClient(e, PROBE_TIMEOUT).open().close()),
                ("the control API", node.status),
            ]
            log = self.dir / f"{n.name}.log"
            wait_answering(proc, checks, deadline, f"lab: {n.name}: fleetd on {endpoint}", log)

    # -- a node's fleetd (tests, benchmarks) ---------------------------------------------------

    def _node_index(self, node: int | str) -> int:
        self.state = self.state or self._load()
        names = [n["name"] for n in self.state.get("nodes", [])]
        if isinstance(node, str):
            if node not in names:
                raise FleetError(f"lab: no node {node!r} (nodes: {', '.join(names) or 'none'})")
            return names.index(node)
        if not 0 <= node < len(names):
            raise FleetError(f"lab: no node {node} ({len(names)} nodes)")
        return node

    def fleetd_pid(self, node: int | str) -> int | None:
        """The pid of node `node`'s fleetd now (by index or name), None when none runs (killed
        and not restarted yet, or its supervisor gave up)."""
        j = self._node_index(node)
        if self.state.get("supervisors"):
            try:
                pid = int(self._pid_file(self.state["nodes"][j]["name"]).read_text())
            except (OSError, ValueError):
                return None
        else:
            pids = self.state.get("pids", [])
            pid = pids[j] if j < len(pids) else 0
        return pid if pid and _alive(pid) and _is_lab_fleetd(pid) else None

    def kill_fleetd(self, node: int | str, sig: int = signal.SIGKILL) -> int:
        """Send `sig` (SIGKILL: a crash, the OOM killer) to node `node`'s fleetd; its pid. A
        supervised lab starts it again after restart_s; FleetError when none runs."""
        pid = self.fleetd_pid(node)
        if pid is None:
            raise FleetError(f"lab: node {node}: no fleetd runs")
        os.kill(pid, sig)
        return pid

    # -- down --------------------------------------------------------------------------------

    def down(self) -> list[str]:
        """Remove everything the state file lists (what is already gone is skipped): the
        supervisors (so none starts fleetd again), the fleetd, the namespaces and links; what was
        removed."""
        self.state = self.state or self._load()
        if self.state and os.geteuid() != 0:
            raise FleetError("lab: removing network namespaces needs root")
        removed = []
        # the fleetd the supervisors run now, read before they end (they remove the pid files)
        current = [
            pid
            for n in self.state.get("nodes", [])
            if (pid := _read_pid(self._pid_file(n["name"]))) is not None
        ]
        fleetd = [p for p in dict.fromkeys([*self.state.get("pids", []), *current]) if _is_lab_fleetd(p)]
        supervisors = [p for p in self.state.get("supervisors", []) if _cmdline_has(p, b"fleetd.supervise")]
        removed += _stop(supervisors, "supervisor")  # SIGTERM: each passes it on to its fleetd
        _stop([p for p in fleetd if _is_lab_fleetd(p)], "fleetd")  # any a supervisor did not end
        removed += [f"fleetd pid {pid}" for pid in fleetd]
        for proc in self._procs:
            _reap(proc)
        self._procs = []
        existing = _netns_names()
        for ns in reversed(self.state.get("namespaces", [])):
            if ns not in existing:
                continue
            # anything still running in our namespace is ours (a stray tool, a child)
            for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                _signal(int(pid), signal.SIGKILL)
            if _sh("ip", "netns", "del", ns, check=False).returncode == 0:
                removed.append(f"netns {ns}")
        for link in self.state.get("links", []):  # gone with their peers, unless the move failed
            if (
                _sh("ip", "link", "show", link, check=False).returncode == 0
                and _sh("ip", "link", "del", link, check=False).returncode == 0
            ):
                removed.append(f"link {link}")
        for group in self.state.get("cpu_groups", []):
            if _remove_cpu_group(group):
                removed.append(f"cgroup {group}")
        pid_files = [self._pid_file(n["name"]) for n in self.state.get("nodes", [])]
        for path in (self.state_path, self.nodes_file, *pid_files):
            path.unlink(missing_ok=True)
        self.state = {}
        return removed


def _cpu_group_path(name: str) -> str:
    """Where a CPU quota group goes: the cgroup v1 cpu hierarchy, else the unified one (v2)."""
    v1 = CGROUP_ROOT / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists():
        return str(v1 / name)
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text(errors="replace").split():
        return str(CGROUP_ROOT / name)
    raise FleetError("lab: --node-cores needs the cgroup cpu controller (v1 cpu or v2 cpu.max)")


def _make_cpu_group(path: str, cores: float) -> None:
    group = Path(path)
    try:
        group.mkdir(exist_ok=True)
        quota = int(cores * CFS_PERIOD_US)
        if (group / "cpu.cfs_quota_us").exists():
            (group / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (group / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
    except OSError as exc:
        raise FleetError(f"lab: CPU quota group {path}: {exc.strerror or exc}") from exc


def _remove_cpu_group(path: str) -> bool:
    """rmdir the group once its processes have exited (they were just stopped); False if gone."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError:  # EBUSY: a process still in it
            if time.monotonic() > deadline:
                raise FleetError(f"lab: CPU quota group {path} still holds processes") from None
            time.sleep(0.05)


def _netns_names() -> set[str]:
    """`ip netns list` prints "name (id: 3)" once a namespace has an id."""
    return {line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines() if line.strip()}


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline_has(pid: int, word: bytes) -> bool:
    try:
        return word in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _is_lab_fleetd(pid: int) -> bool:
    """The pid is still a fleetd we started (not a reused pid, not its supervisor)."""
    return _cmdline_has(pid, b"fleetd.server") and not _cmdline_has(pid, b"fleetd.supervise")


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _stop(pids: list[int], what: str) -> list[str]:
    """SIGTERM each, SIGKILL what is left after STOP_TIMEOUT_S; one entry per pid signalled."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    return [f"{what} pid {pid}" for pid in pids]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
