"""fleetctl lab: namespaces, veth links rated with tc tbf, a fleetd answering in each namespace,
and nothing left behind by `down`, also after an `up` that failed half-way."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from fleetd.ctl.main import main
from fleetd.fleet.lab import Lab, parse_rate
from fleetd.fleet.node import Fleet

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
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("fleetctl lab: error:") and "\n" not in err


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
