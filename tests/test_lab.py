"""fleetctl lab: namespaces, veth links rated with tc tbf, a fleetd answering in each namespace,
and nothing left behind by `down`, also after an `up` that failed half-way."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetd.client import RpcClient
from fleetd.ctl.main import main
from fleetd.errors import FleetError
from fleetd.fleet.lab import Lab, parse_rate, parse_rates, per_node_cores
from fleetd.fleet.node import Fleet
from fleetd.ports import DEFAULT_RPC_PORT

pytestmark = pytest.mark.timeout(120)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) missing: scripts/bootstrap.sh installs it"
    return None


needs_root = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout


def namespaces() -> set[str]:
    return {line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()}


def root_links() -> set[str]:
    return {line.split()[0].split("@")[0] for line in sh("ip", "-br", "link").splitlines()}


def fleetd_pids_in(state_pids) -> list[int]:
    return [
        p
        for p in state_pids
        if os.path.exists(f"/proc/{p}") and b"fleetd.server" in open(f"/proc/{p}/cmdline", "rb").read()
    ]


def test_rates_parse_and_bad_numbers_exit_2(capsys):
    assert parse_rate("200mbit") == 200_000_000
    assert parse_rate("2gbit") == parse_rate("2g") == 2_000_000_000
    for argv in (
        ["lab", "up", "--coordinator-link", "3furlongs"],
        ["lab", "up", "--peer-link", "100kbit"],
        ["lab", "up", "--nodes", "0"],
        ["lab", "up", "--threads", "0"],
        ["lab", "up", "--nodes", "3", "--coordinator-link", "1gbit,100mbit"],
        ["lab", "up", "--nodes", "2", "--coordinator-link", "1gbit,3furlongs"],
        ["lab", "up", "--node-cores", "0"],
        ["lab", "up", "--node-cores", "4096"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("fleetctl lab: error:") and "\n" not in err


def test_per_node_rates_parse():
    assert parse_rates("200mbit", 3) == [200_000_000] * 3
    assert parse_rates("1gbit,1gbit,100mbit", 3) == [1_000_000_000, 1_000_000_000, 100_000_000]
    with pytest.raises(ValueError, match="2 given for 3 nodes"):
        parse_rates("1gbit,100mbit", 3)


def test_per_node_cores_parse():
    assert per_node_cores(0.5, 3) == [0.5] * 3
    assert per_node_cores(None, 2) == [None, None]
    assert per_node_cores([None, 0.3], 2) == [None, 0.3]
    with pytest.raises(ValueError, match="1 given for 2 nodes"):
        per_node_cores([0.3], 2)
    with pytest.raises(ValueError, match="must be in"):
        per_node_cores([None, 0.01], 2)


@needs_root
def test_per_node_coordinator_links_flags_and_cores(tmp_path):
    """A node behind a slower coordinator link, extra fleetd flags and cores per node."""
    lab = Lab(tmp_path / "lab")
    before_ns = namespaces()
    nodes = lab.up(
        2,
        [parse_rate("1gbit"), parse_rate("50mbit")],
        parse_rate("1gbit"),
        node_args=[[], ["--max-memory", "64M"]],
        node_cpus=[None, [0]],
    )
    try:
        for n, rate in zip(nodes, ("1Gbit", "50Mbit"), strict=True):
            root_q = sh("tc", "qdisc", "show", "dev", n.coordinator_link)
            node_q = sh("ip", "netns", "exec", n.netns, "tc", "qdisc", "show", "dev", "coord0")
            assert re.search(rf"tbf .* rate {rate}", root_q), root_q
            assert re.search(rf"tbf .* rate {rate}", node_q), node_q
            # a bucket of a few frames: a small message pays the rate, as on a physical line
            burst = int(re.search(r"burst (\d+)b", root_q).group(1))
            assert 2 * 1500 <= burst <= max(2 * 1514, parse_rate(rate) // 8 // 10_000) + 64, root_q
        free = []
        for n in nodes:  # GET_DEVICE_MEMORY: what --max-memory leaves
            with RpcClient(f"{n.address}:{DEFAULT_RPC_PORT}").open() as c:
                free.append(c.get_device_memory(0)[0])
        assert free[1] <= 64 << 20 < free[0], free
        assert os.sched_getaffinity(lab.state["pids"][1]) == {0}
        # the nodes share this machine's cores: no daemon pins its workers as if it were alone
        for pid in lab.state["pids"]:
            assert b"--no-pin-workers" in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    finally:
        lab.down()
    assert namespaces() == before_ns


def cgroup_of(pid: int) -> str:
    """The cpu hierarchy's group of `pid` (v1 "N:cpu,...:/path", else v2 "0::/path")."""
    lines = open(f"/proc/{pid}/cgroup").read().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))


@pytest.fixture
def cpu_quotas():
    """Skips where the kernel has no cgroup cpu controller for the lab's quotas."""
    from fleetd.fleet import lab as lab_module

    try:
        lab_module._cpu_group_path("probe")
    except FleetError as exc:  # pragma: no cover - depends on the machine's kernel
        pytest.skip(str(exc))


@needs_root
def test_node_cores_put_each_node_and_its_workers_under_a_quota(tmp_path, cpu_quotas):
    lab = Lab(tmp_path / "lab")
    nodes = lab.up(2, parse_rate("1gbit"), parse_rate("1gbit"), node_cores=0.25)
    groups = [n.cpu_group for n in nodes]
    try:
        assert len(set(groups)) == 2 and all(groups)
        for n, pid in zip(nodes, lab.state["pids"], strict=True):
            group = Path(n.cpu_group)
            quota = group / "cpu.cfs_quota_us"
            if quota.exists():
                assert int(quota.read_text()) * 4 == int((group / "cpu.cfs_period_us").read_text())
            else:
                q, period = (group / "cpu.max").read_text().split()
                assert int(q) * 4 == int(period)
            # the daemon and what it started (its compute fork server) are in the node's group
            assert group.name in cgroup_of(pid)
            children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
            assert children and all(group.name in cgroup_of(c) for c in children)
            # and so is a process the benchmark starts in the node (a stock server)
            probe = subprocess.Popen(["sleep", "30"], preexec_fn=n.join_cpu_group)
            try:
                assert group.name in cgroup_of(probe.pid)
            finally:
                probe.kill()
                probe.wait()
    finally:
        lab.down()
    assert not any(os.path.exists(g) for g in groups)


@needs_root
def test_a_quota_on_one_node_only(tmp_path, cpu_quotas):
    """One slower node (a quota) beside one without: only the slow one is in a group."""
    lab = Lab(tmp_path / "lab")
    nodes = lab.up(2, parse_rate("1gbit"), parse_rate("1gbit"), node_cores=[None, 0.5])
    try:
        assert nodes[0].cpu_group == "" and nodes[1].cpu_group
        assert len(lab.state["cpu_groups"]) == 1
        pids = lab.state["pids"]
        assert Path(nodes[1].cpu_group).name in cgroup_of(pids[1])
        assert Path(nodes[1].cpu_group).name not in cgroup_of(pids[0])
    finally:
        lab.down()
    assert not Path(nodes[1].cpu_group).exists()


@needs_root
def test_up_rates_answers_and_down_removes_everything(tmp_path):
    lab = Lab(tmp_path / "lab")
    before_ns, before_links = namespaces(), root_links()
    nodes = lab.up(2, parse_rate("100mbit"), parse_rate("1gbit"))
    try:
        state = lab.state
        made_ns = namespaces() - before_ns
        assert made_ns == {n.netns for n in nodes} | {f"fl{state['index']}sw"}
        assert {n.coordinator_link for n in nodes} <= root_links() - before_links
        for n in nodes:
            root_q = sh("tc", "qdisc", "show", "dev", n.coordinator_link)
            node_q = sh("ip", "netns", "exec", n.netns, "tc", "qdisc", "show")
            assert re.search(r"tbf .* rate 100Mbit", root_q), root_q
            assert re.search(r"tbf \S+ dev coord0 .* rate 100Mbit", node_q), node_q
            assert re.search(r"tbf \S+ dev peer0 .* rate 1Gbit", node_q), node_q
        switch_q = sh("ip", "netns", "exec", f"fl{state['index']}sw", "tc", "qdisc", "show")
        assert len(re.findall(r"tbf .* rate 1Gbit", switch_q)) == 2, switch_q
        # a fleetd in each namespace, on its own address, control API reached inside it
        with Fleet.load(lab.nodes_file) as fleet:
            answers = fleet.map(lambda node: node.status())
            assert answers.ok, answers.failed
            assert sorted(s.rpc_host for s in answers.values()) == sorted(n.address for n in nodes)
        # what `lab up` prints as the next step: status (control API and HELLO on the RPC port,
        # which listens on the node's own address inside its namespace, never on loopback)
        assert main(["status", str(lab.nodes_file), "--json"]) == 0
        assert (
            main(["ab", str(lab.nodes_file), "--json", "--steps", "2", "--n-embd", "256", "--rows", "4"]) == 0
        )
        # the coordinator reaches the nodes over its own links only: no route to the switch
        assert "via" in sh("ip", "route", "get", nodes[0].address)
        assert nodes[0].coordinator_link in sh("ip", "route", "get", nodes[0].address)
        pids = list(state["pids"])
        assert len(fleetd_pids_in(pids)) == 2
        with pytest.raises(Exception, match="exists"):
            Lab(lab.dir).up(1, parse_rate("100mbit"), parse_rate("1gbit"))
    finally:
        assert main(["lab", "down", "--dir", str(lab.dir)]) == 0
    assert namespaces() == before_ns
    assert root_links() == before_links
    assert fleetd_pids_in(pids) == []
    assert not (lab.dir / "lab.json").exists() and not lab.nodes_file.exists()
    assert main(["lab", "down", "--dir", str(lab.dir)]) == 0  # idempotent


@needs_root
def test_failed_up_leaves_nothing(tmp_path):
    before_ns, before_links = namespaces(), root_links()
    lab = Lab(tmp_path / "lab")
    with pytest.raises(Exception, match=r"lab: \S+: fleetd on \S+ exited with 1"):
        lab.up(2, parse_rate("100mbit"), parse_rate("1gbit"), python="/bin/false")
    assert namespaces() == before_ns
    assert root_links() == before_links
    assert not (lab.dir / "lab.json").exists()


@needs_root
def test_a_supervised_fleetd_killed_comes_back_and_down_leaves_nothing(tmp_path):
    """`lab up --restart`: SIGKILL a node's fleetd, as a crash would; its supervisor starts it
    again after restart_s (a line with the time in the node's log) and the control API answers
    with the new pid within RESTART_BOUND_S; `lab down` then leaves no supervisor, no fleetd and
    no namespace, and no supervisor starts one meanwhile."""
    restart_s = 0.5
    # restart_s, then fleetd's start (imports, ggml, listen: ~1-3 s on two busy cores)
    bound_s = restart_s + 10.0
    lab = Lab(tmp_path / "lab")
    before_ns = namespaces()
    nodes = lab.up(2, parse_rate("100mbit"), parse_rate("1gbit"), restart_s=restart_s)
    try:
        supervisors = list(lab.state["supervisors"])
        assert len(supervisors) == 2 and lab.state["pids"] == []
        old = [lab.fleetd_pid(j) for j in range(2)]
        assert all(old) and fleetd_pids_in(old) == old
        with Fleet.load(lab.nodes_file) as fleet:
            assert fleet[1].status().doc["pid"] == old[1]
            killed_at = time.monotonic()
            assert lab.kill_fleetd(nodes[1].name) == old[1]
            new_pid, answered_s = None, None
            while time.monotonic() - killed_at < bound_s:
                try:
                    new_pid = fleet[1].status().doc["pid"]
                except Exception:  # down, or not listening yet  # noqa: BLE001
                    new_pid = None
                if new_pid not in (None, old[1]):
                    answered_s = time.monotonic() - killed_at
                    break
                time.sleep(0.1)
            assert answered_s is not None, f"no answer with a new pid within {bound_s}s"
            assert answered_s >= restart_s
            assert lab.fleetd_pid(1) == new_pid and lab.fleetd_pid(0) == old[0]
            assert fleet[0].status().doc["pid"] == old[0]  # the other node untouched
        log = (lab.dir / f"{nodes[1].name}.log").read_text()
        assert re.search(rf"\d\d:\d\d:\d\d,\d{{3}} fleetd.supervise: .*pid {old[1]}\) killed by SIGKILL", log)
        assert f"started python -m fleetd.server again, pid {new_pid}" in log.replace(
            os.path.basename(sys.executable), "python"
        )
    finally:
        removed = lab.down()
    assert {f"supervisor pid {p}" for p in supervisors} <= set(removed)
    assert f"fleetd pid {new_pid}" in removed
    time.sleep(restart_s + 0.5)  # a supervisor that survived would have started fleetd again
    assert namespaces() == before_ns
    assert fleetd_pids_in([*supervisors, *old, new_pid]) == []
    assert not any(os.path.exists(f"/proc/{p}") for p in supervisors)
    assert not list(lab.dir.glob("*.pid"))
