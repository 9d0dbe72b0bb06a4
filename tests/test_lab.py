"""fleetctl lab: namespaces, veth links rated with tc tbf, a fleetd answering in each namespace,
and nothing left behind by `down`, also after an `up` that failed half-way."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from fleetd.client import RpcClient
from fleetd.ctl.main import main
from fleetd.fleet.lab import Lab, parse_rate, parse_rates
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
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("fleetctl lab: error:") and "\n" not in err


def test_per_node_rates_parse():
    assert parse_rates("200mbit", 3) == [200_000_000] * 3
    assert parse_rates("1gbit,1gbit,100mbit", 3) == [1_000_000_000, 1_000_000_000, 100_000_000]
    with pytest.raises(ValueError, match="2 given for 3 nodes"):
        parse_rates("1gbit,100mbit", 3)


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
        free = []
        for n in nodes:  # GET_DEVICE_MEMORY: what --max-memory leaves
            with RpcClient(f"{n.address}:{DEFAULT_RPC_PORT}").open() as c:
                free.append(c.get_device_memory(0)[0])
        assert free[1] <= 64 << 20 < free[0], free
        assert os.sched_getaffinity(lab.state["pids"][1]) == {0}
    finally:
        lab.down()
    assert namespaces() == before_ns


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
