"""fleetctl status / stats / p2p against real daemons through a real sshd on loopback.

Two in-process fleetd servers with their own control ports; the nodes file names them as
`root@127.0.0.1:<sshd port>`, so every control request rides a paramiko direct-tcpip channel
through sshd (host key checked against a generated known_hosts, key auth with a generated key).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from fleetd.client import RpcClient
from fleetd.ctl import main
from fleetd.errors import FleetError
from fleetd.fleet.control_client import ControlError
from fleetd.fleet.control_docs import NodeStats, NodeStatus
from fleetd.fleet.local import LocalFleet
from fleetd.fleet.node import Fleet, FleetFailed, Node
from fleetd.fleet.nodes_file import NodeSpec, parse_nodes
from fleetd.fleet.render import down_text, stats_table, status_table
from fleetd.fleet.ssh import ControlUnreachable, SshOptions
from fleetd.transport import free_port
from fleetd.transport.tcp import Timeout
from fleetd.wire import Feature, GgmlType, RpcTensor, contiguous_strides

pytestmark = pytest.mark.timeout(120)

BOUNDED = Timeout(connect=5.0, read=30.0)


def ep(srv) -> str:
    return f"127.0.0.1:{srv.address[1]}"


@pytest.fixture
def fleet2(fleetd_server, ssh_server, tmp_path):
    """Two daemons (a, b) and a nodes file that reaches both through sshd; yields (a, b, args)."""
    a = fleetd_server(control_port=0)
    b = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(
        "# two fleetd daemons behind one sshd\n\n"
        f"{ssh_server.node_line(rpc_port=a.address[1], control_port=a.control.port, name='a')}\n"
        f"{ssh_server.node_line(rpc_port=b.address[1], control_port=b.control.port, name='b')}  # second\n"
    )
    args = [
        str(nodes),
        "-i",
        str(ssh_server.identity),
        "--known-hosts",
        str(ssh_server.known_hosts),
        "--connect-timeout",
        "5",
        "--timeout",
        "20",
    ]
    return a, b, args


def run_json(capsys, *argv) -> tuple[int, dict]:
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def put_tensor(client: RpcClient, nbytes: int = 4096) -> None:
    ptr, _ = client.alloc_buffer(nbytes)
    base = client.buffer_get_base(ptr)
    ne = (nbytes // 4, 1, 1, 1)
    t = RpcTensor(
        id=1, type=GgmlType.F32, buffer=ptr, ne=ne, nb=contiguous_strides(GgmlType.F32, ne), data=base
    )
    client.set_tensor(t, np.ones(nbytes // 4, dtype=np.float32))
    client.get_tensor(t, 0, 16)  # a response: the SET_TENSOR before it has been served and counted


# -- through sshd ------------------------------------------------------------------------------


def test_status_and_stats_of_two_nodes_through_ssh(fleet2, ssh_server, capsys):
    a, b, args = fleet2
    with RpcClient(ep(a), BOUNDED) as c:
        put_tensor(c)
        local = "{}:{}".format(*c.sock.getsockname()[:2])
        rc, doc = run_json(capsys, "status", *args)
        assert rc == 0, doc
        assert list(doc) == ["a", "b"]
        sa, sb = doc["a"]["status"], doc["b"]["status"]
        assert (sa["rpc"]["port"], sb["rpc"]["port"]) == (a.address[1], b.address[1])
        assert [s["peer"] for s in sa["sessions"]] == [local] and sb["sessions"] == []
        assert sa["p2p"]["enabled"] is True and sa["protocol"] == "7.0.0"

        rc, doc = run_json(capsys, "stats", *args)
        assert rc == 0
        ca, cb = doc["a"]["stats"]["total"]["commands"], doc["b"]["stats"]["total"]["commands"]
        assert ca["SET_TENSOR"]["count"] == 1 and ca["SET_TENSOR"]["request_bytes"] == 9 + 296 + 1 + 8 + 4096
        # status asked HELLO on each RPC port too (a closed RPC port is not "up"): counted apart,
        # as a probe connection, not as the client's HELLO.
        assert cb["SET_TENSOR"]["count"] == 0 and cb["HELLO"]["count"] == 0 and ca["HELLO"]["count"] == 1
        [session] = doc["a"]["stats"]["sessions"]
        assert session["peer"] == local and session["commands"]["SET_TENSOR"]["count"] == 1

        assert main(["status", *args]) == 0  # the rich tables
        out = capsys.readouterr().out
        assert "a" in out and "b" in out and out.count(" up ") >= 2 and local in out
        assert main(["stats", *args]) == 0
        out = capsys.readouterr().out
        assert "SET_TENSOR" in out and "down" not in out
    # It went through sshd: our key was accepted there.
    assert "Accepted publickey" in ssh_server.log.read_text()


def test_p2p_switch_through_ssh(fleet2, capsys):
    a, b, args = fleet2
    rc, doc = run_json(capsys, "p2p", "off", *args, "--node", "a")
    assert rc == 0 and list(doc) == ["a"]
    assert {k: doc["a"]["p2p"][k] for k in ("enabled", "served", "was")} == {
        "enabled": False,
        "served": True,
        "was": True,
    }
    assert a.p2p_enabled is False and b.p2p_enabled is True
    with RpcClient(ep(a), BOUNDED) as c:  # the HELLO bit is gone for new connections
        assert not c.features & Feature.PEER_COPY

    rc, doc = run_json(capsys, "p2p", "status", *args)
    assert rc == 0 and {n: v["p2p"]["enabled"] for n, v in doc.items()} == {"a": False, "b": True}

    assert main(["p2p", "on", *args]) == 0
    assert "on" in capsys.readouterr().out
    assert a.p2p_enabled is True and b.p2p_enabled is True

    assert main(["p2p", "off", *args, "--node", "nosuch"]) == 2  # a usage error
    assert "fleetctl p2p: error: --node nosuch: no such node (have: a, b)" in capsys.readouterr().err
    assert a.p2p_enabled is True


def test_metrics_through_ssh_match_stats(fleet2, ssh_server):
    a, _, args = fleet2
    with RpcClient(ep(a), BOUNDED) as c:
        put_tensor(c, 8192)
    fleet = Fleet.load(
        args[0],
        SshOptions(
            identity=(str(ssh_server.identity),),
            known_hosts=(str(ssh_server.known_hosts),),
            connect_timeout=5,
        ),
    )
    with fleet:
        node = fleet.select(["a"])[0]
        assert not node.is_local
        # Wait (bounded) until the closed session has been folded into the totals.
        for _ in range(200):
            stats = node.stats()
            if not stats.sessions:
                break
        text = node.metrics()
        assert node.stats().total == stats.total  # nothing moved in between
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    for cmd, v in stats.total.commands.items():
        assert samples[("fleetd_rpc_commands_total", (("command", cmd),))] == v.count
        assert samples[("fleetd_rpc_request_bytes_total", (("command", cmd),))] == v.request_bytes
        assert samples[("fleetd_rpc_response_bytes_total", (("command", cmd),))] == v.response_bytes
    assert stats.total.commands["SET_TENSOR"].count == 1
    for reason, n in stats.peer.fallbacks.items():
        assert samples[("fleetd_peer_copy_fallbacks_total", (("reason", reason),))] == n


def test_down_nodes_show_their_reason(fleetd_server, ssh_server, tmp_path, capsys):
    a = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(
        f"{ssh_server.node_line(rpc_port=a.address[1], control_port=a.control.port, name='good')}\n"
        f"{ssh_server.node_line(control_port=free_port(), name='nocontrol')}\n"
        f"{ssh_server.user}@127.0.0.1:{free_port()} name=nossh\n"
        f"{ssh_server.user}@localhost:{ssh_server.port} name=unknownkey\n"  # known_hosts has 127.0.0.1 only
    )
    args = [
        str(nodes),
        "-i",
        str(ssh_server.identity),
        "--known-hosts",
        str(ssh_server.known_hosts),
        "--connect-timeout",
        "5",
    ]
    rc, doc = run_json(capsys, "status", *args)
    assert rc == 1
    assert doc["good"]["up"] is True
    assert doc["nocontrol"]["up"] is False and doc["nocontrol"]["error"].startswith("ControlUnreachable:")
    assert "channel to 127.0.0.1:" in doc["nocontrol"]["error"]
    assert doc["nossh"]["up"] is False and doc["nossh"]["error"].startswith("SshError:")
    assert "refused" in doc["nossh"]["error"]
    assert doc["unknownkey"]["up"] is False and "not in known_hosts" in doc["unknownkey"]["error"]

    rc = main(["status", *args])
    captured = capsys.readouterr()
    assert rc == 1
    out = " ".join(captured.out.split())  # rich wraps at 80 columns without a terminal
    assert out.count("│ down ") == 3 and out.count(": down: ") == 3  # three rows, three reason lines
    assert "unknownkey: down: SshError: ssh root@localhost:" in out.replace(ssh_server.user + "@", "root@")
    assert "host key not in known_hosts" in out
    assert captured.err.strip() == (
        "FleetFailed: 3 of 4 nodes failed: nocontrol ControlUnreachable, nossh SshError, unknownkey SshError"
    )
    assert "Traceback" not in captured.out + captured.err


def test_fleetctl_as_a_subprocess(fleet2):
    a, b, args = fleet2
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="160")
    code = "import sys; from fleetd.ctl import main; sys.exit(main())"
    proc = subprocess.run(
        [sys.executable, "-c", code, "status", *args, "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["b"]["status"]["rpc"]["port"] == b.address[1]
    proc = subprocess.run(
        [sys.executable, "-c", code, "p2p", "off", *args, "--node", "b"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert b.p2p_enabled is False and a.p2p_enabled is True


# rich and paramiko load with fleetctl itself, textual only with `fleetctl tui`.
@pytest.mark.parametrize("missing, command", [("rich", "status"), ("paramiko", "status"), ("textual", "tui")])
def test_fleetctl_without_the_ctl_extra_says_how_to_install_it(missing, command, tmp_path):
    # A None in sys.modules makes `import <missing>` fail as an uninstalled package would.
    code = f"import sys; sys.modules[{missing!r}] = None; from fleetd.ctl import main; sys.exit(main())"
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("localhost\n")
    proc = subprocess.run(
        [sys.executable, "-c", code, command, str(nodes)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr == (
        f"fleetctl: {missing} is not installed: fleetctl needs the ctl extra (pip install 'fleetd[ctl]')\n"
    )


def test_stats_watch_is_bounded_by_count(fleet2, capsys):
    a, _, args = fleet2
    assert main(["stats", *args, "--watch", "--count", "3", "--interval", "0.05", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    assert all(set(json.loads(line)["nodes"]) == {"a", "b"} for line in lines)
    # Not a terminal (capsys): one text line per sample, the last one ended too.
    assert main(["stats", *args, "--watch", "--count", "2", "--interval", "0.05"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out.splitlines()) == 2
    assert all(
        re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ a [\d ]+ commands", line) for line in out.splitlines()
    )
    assert "/s" in out.splitlines()[1] and "; b " in out


def test_flip_p2p_while_a_pipeline_runs(fleet2, capsys):
    """The pipeline moves from the direct path to the hub path within one step, outputs unchanged."""
    pipeline = pytest.importorskip("fleetd.pipeline")
    a, b, args = fleet2
    rows, n_embd, steps = 4, 64, 6
    with pipeline.Pipeline([ep(a), ep(b)], 2, rows, n_embd, p2p=False, timeout=BOUNDED, stats=False) as p:
        reference = [r.md5 for r in p.run(steps)]
    results = []
    with pipeline.Pipeline([ep(a), ep(b)], 2, rows, n_embd, p2p=True, timeout=BOUNDED, stats=False) as p:
        results += p.run(2)
        assert main(["p2p", "off", *args, "--node", "a"]) == 0  # a is the source of the boundary
        results += p.run(2)
        assert main(["p2p", "on", *args, "--node", "a"]) == 0
        results += p.run(2)
    capsys.readouterr()
    assert [(r.direct, r.fallbacks) for r in results] == [(1, 0), (1, 0), (0, 1), (0, 1), (1, 0), (1, 0)]
    assert [r.md5 for r in results] == reference
    assert a.peer_stats.as_dict()["fallbacks"]["disabled"] == 2


# -- a local node, formatters, the nodes file --------------------------------------------------


def test_local_node_without_ssh(fleetd_server, tmp_path, capsys):
    a = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={a.address[1]} control_port={a.control.port}\n")
    node = Node(parse_nodes(nodes.read_text())[0])
    assert node.is_local
    assert node.status().rpc_port == a.address[1]
    assert node._client is None  # no SSH was opened
    rc, doc = run_json(capsys, "p2p", "off", str(nodes))
    assert rc == 0 and doc["localhost"]["p2p"]["enabled"] is False and a.p2p_enabled is False


def test_formatters_render_down_nodes_without_a_terminal(fleetd_server):
    a = fleetd_server(control_port=0)
    node = Node(NodeSpec("localhost", control_port=a.control.port, name="n1"))
    answers = {"n1": node.status(), "n2": FleetError("ssh root@10.9.9.9:22: no route to host")}
    console = Console(record=True, width=200, color_system=None)
    console.print(status_table(answers))
    text = console.export_text()
    assert "n1" in text and " up " in text and f":{a.address[1]}" in text
    assert [line.split()[:2] for line in text.splitlines() if "n2" in line] == [["│", "n2"]]
    assert "down" in text
    assert down_text(answers).plain == "n2: down: FleetError: ssh root@10.9.9.9:22: no route to host"
    assert down_text({"n1": answers["n1"]}) is None
    console.print(stats_table({"n1": node.stats(), "n2": answers["n2"]}))
    assert "all" in console.export_text()


def test_fleet_map_keeps_going_when_a_node_fails():
    specs = parse_nodes("h1 name=ok\nh2 name=bad\nh3 name=ok2\n")
    fleet = Fleet(Node(s) for s in specs)

    def fn(node):
        if node.name == "bad":
            raise FleetError("boom")
        return node.name.upper()

    result = fleet.map(fn)
    assert list(result.values())[0] == "OK" and list(result.values())[2] == "OK2"
    assert [n.name for n in result.failed] == ["bad"]
    with pytest.raises(FleetFailed, match=r"^1 of 3 nodes failed: bad FleetError$"):
        result.raise_on_failure()


def test_nodes_file_format():
    specs = parse_nodes(
        "# comment\n\n"
        "gpu1\n"
        "root@10.0.0.2:2222 rpc_port=50053 control_port=7000 devices=cpu,numpy  # trailing\n"
        "  [fe80::1]:22 name=edge\n"
        "10.0.0.3 rpc_port=1\n10.0.0.3 rpc_port=2\n"
        "localhost\n127.0.0.1:2200\n"
    )
    by = {s.name: s for s in specs}
    assert list(by) == [
        "gpu1",
        "10.0.0.2:2222",
        "edge",
        "10.0.0.3/1",
        "10.0.0.3/2",
        "localhost",
        "127.0.0.1:2200",
    ]
    s = by["10.0.0.2:2222"]
    assert (s.user, s.host, s.ssh_port, s.rpc_port, s.control_port, s.devices, s.line) == (
        "root",
        "10.0.0.2",
        2222,
        50053,
        7000,
        ("cpu", "numpy"),
        4,
    )
    assert by["gpu1"].ssh_port == 22 and by["gpu1"].rpc_port == 50052 and by["gpu1"].control_port == 50152
    assert by["edge"].host == "fe80::1" and by["edge"].target == "[fe80::1]"
    assert by["localhost"].is_local and not by["127.0.0.1:2200"].is_local and not by["gpu1"].is_local


@pytest.mark.parametrize(
    "line, message",
    [
        ("gpu1 rpc_port=70000", "nodes.txt:3: rpc_port '70000' is not a port in 1..65535"),
        ("gpu1 rpc_port", "nodes.txt:3: expected key=value after the host, got 'rpc_port'"),
        (
            "gpu1 colour=blue",
            "nodes.txt:3: unknown key 'colour' (known: rpc_port, control_port, devices, name, cache_dir)",
        ),
        ("@gpu1", "nodes.txt:3: empty user name before '@'"),
        ("gpu1:ssh", "nodes.txt:3: ssh port 'ssh' is not a port in 1..65535"),
        ("fe80::1", "nodes.txt:3: ssh port ':1' is not a port"),
        ("[fe80::1", "nodes.txt:3: unclosed '['"),
        ("gpu1 devices=", "nodes.txt:3: devices '': expected fleetd's devices, comma separated: cpu, numpy"),
        (
            "gpu1 devices=cuda:0",
            "nodes.txt:3: devices 'cuda:0': expected fleetd's devices, comma separated: cpu, numpy",
        ),
        ("gpu1 rpc_port=1 rpc_port=2", "nodes.txt:3: rpc_port given twice"),
        ("gpu0", "nodes.txt:3: gpu0 rpc_port=50052 already listed on line 1"),
        ("gpu1 name=gpu0", "nodes.txt:3: node name 'gpu0' already used on line 1 (add name=...)"),
    ],
)
def test_bad_nodes_file_line_names_the_line(tmp_path, capsys, line, message):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"gpu0\n# ok so far\n{line}\n")
    assert main(["status", str(nodes)]) == 2  # the operator's input: a usage error, fleetctl(1)
    err = capsys.readouterr().err
    assert (
        err.startswith("fleetctl status: error: ") and message in err and len(err.strip().splitlines()) == 1
    )


def test_missing_or_empty_nodes_file(tmp_path, capsys):
    assert main(["status", str(tmp_path / "nope.txt")]) == 2
    assert "fleetctl status: error: nodes file" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    assert main(["stats", str(tmp_path / "empty.txt")]) == 2
    assert "no nodes in it" in capsys.readouterr().err


# -- the control API client, the typed answers, the local launcher, the deploy probe -----------


def test_an_answer_that_is_not_http_says_so(fleetd_server):
    # A control_port that is really an RPC port: fleetd reads "GET ..." as a bad command and
    # closes the connection, so http.client gets nothing back.
    a = fleetd_server()
    node = Node(NodeSpec("localhost", control_port=a.address[1], name="rpc-port"))
    with pytest.raises(ControlUnreachable, match=r"^rpc-port: GET /v1/status: got nothing"):
        node.status()


def test_answers_of_another_shape_name_the_field():
    good = {"version": "0.1.0", "rpc": {"host": "127.0.0.1", "port": 50052}}
    assert NodeStatus.parse(good).rpc_port == 50052
    with pytest.raises(ControlError, match=r"^n1: GET /v1/status: no rpc\.port$"):
        NodeStatus.parse({"version": "0.1.0", "rpc": {}}, "n1: GET /v1/status")
    with pytest.raises(
        ControlError, match=r"^/v1/stats: total\.commands\.HELLO\.count: expected int, got 'x'$"
    ):
        NodeStats.parse(
            {"total": {"commands": {"HELLO": {"count": "x", "request_bytes": 0, "response_bytes": 0}}}}
        )


def test_local_fleet_reports_a_node_that_exits(tmp_path):
    with pytest.raises(
        FleetError, match=r"local-0 \(127\.0\.0\.1:\d+\) exited with 2: .*unrecognized arguments"
    ):
        with LocalFleet(1, tmp_path, server_args=["--no-such-flag"]):
            pass


def test_probe_prints_hello_as_one_json_line(fleetd_server):
    a = fleetd_server()
    probe = [sys.executable, "-m", "fleetd.client.probe"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([*probe, ep(a), "--timeout", "5"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {
        "version": "7.0.0",
        "features": int(Feature.ALL),
    }
    p = subprocess.run(
        [*probe, f"127.0.0.1:{free_port()}", "--timeout", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 1 and p.stdout.count("\n") == 1
    assert "127.0.0.1:" in json.loads(p.stdout)["error"]


# -- the operator's rough edges (issue 13) -----------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["stats", "N", "--interval", "-1"], "--interval -1: must be above 0"),
        (["stats", "N", "--watch", "--count", "0"], "--count 0: must be at least 1"),
        (["status", "N", "--timeout", "0"], "--timeout 0: must be above 0"),
        (["status", "N", "--connect-timeout", "-2"], "--connect-timeout -2: must be above 0"),
        (["ab", "N", "--rows", "0"], "--rows 0: must be at least 1"),
        (["ab", "N", "--rows", "-5"], "--rows -5: must be at least 1"),
        (["ab", "N", "--n-embd", "0"], "--n-embd 0: must be at least 1"),
        (["ab", "N", "--steps", "1"], "--steps 1: must be at least 2"),
        (["ab", "N", "--layers", "-1"], "--layers -1: must be at least 0"),
        (["logs", "N", "-n", "0"], "--lines 0: must be at least 1"),
        (["tui", "N", "--interval", "0"], "--interval 0: must be above 0"),
        (["tui", "N", "--ab-steps", "1"], "--ab-steps 1: must be at least 2"),
        (["demo", "--nodes", "0"], "--nodes 0: must be in 1..64"),
    ],
)
def test_numeric_options_are_range_checked(argv, message, capsys):
    assert main(argv) == 2  # before anything is read or reached: N is not even a file
    err = capsys.readouterr().err
    assert err == f"fleetctl {argv[0]}: error: {message}\n"


def test_tui_checks_its_paths_before_taking_the_terminal(tmp_path, capsys):
    """#18 item 9: a screenshot place that cannot be written, a missing A/B model: exit 2 at start."""
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("localhost rpc_port=1 control_port=2\n")
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [
        (["--screenshot", str(afile)], "not a directory, and not a file ending in .svg"),
        (["--screenshot", str(afile / "sub" / "x.svg")], f"{afile} is not a directory"),
        (["--screenshot", str(tmp_path)], None),  # fine: checked, then the model is
        (["--ab-model", str(tmp_path / "missing.gguf")], "no such file"),
    ]
    for extra, message in cases:
        argv = ["tui", str(nodes), *extra]
        if message is None:
            argv += ["--ab-model", str(tmp_path / "missing.gguf")]
            message = "--ab-model"
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("fleetctl tui: error: ") and message in err and err.count("\n") == 1, err


def test_a_wrong_flag_prints_the_subcommands_usage(capsys):
    assert main(["status", "nodes.txt", "--colour"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fleetctl status ") and "--node NAME" in err
    assert err.rstrip().endswith("fleetctl status: error: unrecognized arguments: --colour")


def test_tui_does_not_offer_json(capsys):
    with pytest.raises(SystemExit):
        main(["tui", "--help"])
    assert "--json" not in capsys.readouterr().out
    assert main(["tui", "nodes.txt", "--json"]) == 2
    assert "unrecognized arguments: --json" in capsys.readouterr().err


def test_json_into_a_closed_pipe_is_quiet(fleetd_server, tmp_path):
    srv = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={srv.address[1]} control_port={srv.control.port}\n")
    read, write = os.pipe()
    os.close(read)  # `| head` that has already gone: the first write fails with EPIPE
    env = dict(os.environ, PYTHONPATH=str(REPO))
    code = "import sys; from fleetd.ctl import main; sys.exit(main())"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, "status", str(nodes), "--json"],
            cwd=REPO,
            env=env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 1


def test_status_checks_hello_on_the_rpc_port(fleetd_server, ssh_server, tmp_path, capsys):
    a = fleetd_server(control_port=0)
    closed = free_port()
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(
        f"{ssh_server.node_line(rpc_port=a.address[1], control_port=a.control.port, name='a')}\n"
        f"{ssh_server.node_line(rpc_port=closed, control_port=a.control.port, name='norpc')}\n"
    )
    args = [str(nodes), "-i", str(ssh_server.identity), "--known-hosts", str(ssh_server.known_hosts)]
    rc, doc = run_json(capsys, "status", *args)
    assert rc == 1 and doc["a"]["up"] is True
    # The control API answers for norpc (it is a's), but nothing serves RPC on its port.
    assert doc["norpc"]["up"] is False
    assert f"channel to 127.0.0.1:{closed} refused" in doc["norpc"]["error"]


def test_node_flag_on_status_and_stats_and_the_host_of_a_named_node(fleet2, ssh_server, capsys):
    a, b, args = fleet2
    rc, doc = run_json(capsys, "status", *args, "--node", "b")
    assert rc == 0 and list(doc) == ["b"]
    rc, doc = run_json(capsys, "stats", *args, "--node", "a")
    assert rc == 0 and list(doc) == ["a"]
    assert main(["status", *args, "--node", "a"]) == 0
    out = capsys.readouterr().out
    assert f"{ssh_server.user}@127.0.0.1:{ssh_server.port}" in out  # a named node shows its host
    assert main(["status", *args, "--node", "nope"]) == 2
    assert "--node nope: no such node (have: a, b)" in capsys.readouterr().err


def test_lifecycle_on_a_fleetd_that_fleetctl_did_not_deploy(fleetd_server, tmp_path, capsys):
    srv = fleetd_server(control_port=0)  # running, but started by hand (here: by the test)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={srv.address[1]} control_port={srv.control.port} name=byhand\n")
    root = tmp_path / "root"
    for command in ("stop", "start", "logs"):
        rc, doc = run_json(capsys, command, str(nodes), "--root", str(root))
        assert rc == 1, command
        err = doc["byhand"]["error"]
        assert f"fleetd is not deployed here by fleetctl: no {root}/current release link" in err, err
        assert f"RPC port {srv.address[1]} is held by a program fleetctl did not start" in err
    assert main(["logs", str(nodes), "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("==> byhand <==\n") and "not deployed here by fleetctl" in out


def test_deploy_plan_names_a_fleetd_it_did_not_deploy(fleetd_server, tmp_path):
    from fleetd.fleet.deploy import Deployer
    from fleetd.fleet.ssh import NodeError

    srv = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={srv.address[1]} control_port={srv.control.port}\n")
    with Fleet.load(nodes) as fleet:
        # The check comes first and fails, so the plan never needs a build.
        with pytest.raises(
            NodeError,
            match=rf"RPC port {srv.address[1]} is held by fleetd \S+, which "
            r"fleetctl did not deploy \(no release under .*root\)",
        ):
            Deployer(fleet, None, root=str(tmp_path / "root")).plan(fleet[0])


class _Listener:
    """A TCP port that accepts and then closes at once (`close=True`) or says nothing."""

    def __init__(self, close: bool) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held = []

        def serve():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                if close:
                    conn.close()
                else:
                    self.held.append(conn)

        threading.Thread(target=serve, daemon=True).start()

    def stop(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def test_ssh_errors_say_what_happened(tmp_path, capsys):
    closing, silent = _Listener(close=True), _Listener(close=False)
    try:
        nodes = tmp_path / "nodes.txt"
        nodes.write_text(
            f"me@127.0.0.1:{closing.port} name=closes\nme@127.0.0.1:{silent.port} name=silent\n"
            "me@nonexistent.invalid name=nodns\n"
        )
        rc, doc = run_json(capsys, "status", str(nodes), "--connect-timeout", "1")
    finally:
        closing.stop()
        silent.stop()
    assert rc == 1
    assert doc["closes"]["error"].startswith("SshError: ")
    assert "connection closed before the SSH banner" in doc["closes"]["error"]
    assert (
        doc["silent"]["error"] == f"ConnectTimeout: ssh me@127.0.0.1:{silent.port}: no SSH banner within 1s"
    )
    assert "cannot resolve nonexistent.invalid: " in doc["nodns"]["error"]


def test_one_rule_for_nodes_reached_without_ssh(capsys):
    from fleetd.fleet.nodes_file import LOCAL_RULE

    specs = {
        s.target: s.is_local
        for s in parse_nodes(
            "localhost\n127.0.0.1 rpc_port=1\n[::1] rpc_port=2\n127.0.0.2\nroot@localhost rpc_port=3\n"
            "localhost:2222 rpc_port=4\n"
        )
    }
    assert specs == {
        "localhost": True,
        "127.0.0.1": True,
        "[::1]": True,
        "127.0.0.2": False,
        "root@localhost": False,
        "localhost:2222": False,
    }

    def words(text: str) -> str:
        return " ".join(text.replace("\\-", "-").replace("\\fB", "").replace("\\fR", "").split())

    with pytest.raises(SystemExit):
        main(["status", "--help"])
    help_text = capsys.readouterr().out
    readme = (REPO / "README.md").read_text()
    page = (REPO / "man" / "fleetctl.1").read_text()
    for where, text in (("--help", help_text), ("README.md", readme), ("fleetctl.1", page)):
        assert words(LOCAL_RULE) in words(text), where


def test_fleetctl_page_has_an_options_section():
    page = (REPO / "man" / "fleetctl.1").read_text()
    options = page.split(".SH OPTIONS", 1)[1].split("\n.SH ", 1)[0]
    for flag in (
        r"\-i",
        r"\-\-known\-hosts",
        r"\-\-connect\-timeout",
        r"\-\-timeout",
        r"\-V",
        r"\-\-debug",
        r"\-\-json",
        r"\-\-node",
    ):
        assert flag in options, flag
    assert "rpc_port + 100" in page.replace(r"\(pl", "+")


def test_tables_share_one_number_format_and_header_case(fleetd_server):
    from fleetd.fleet.control_docs import NodeStats as Stats
    from fleetd.fleet.deploy import NodeOutcome
    from fleetd.fleet.render import activity_table, lifecycle_table, outcome_table, p2p_table, sessions_table

    srv = fleetd_server(control_port=0)
    node = Node(NodeSpec("localhost", rpc_port=srv.address[1], control_port=srv.control.port, name="n1"))
    with RpcClient(ep(srv), BOUNDED) as c:
        for _ in range(3):
            put_tensor(c, 1 << 20)  # 3 MiB of SET_TENSOR: a request-bytes count with thousands
        st, stats = node.status(), node.stats()
        doc = dict(stats.doc)
        doc["total"] = dict(doc["total"], graph_computes=2_622_752)
        big = Stats.parse(doc)
        tables = [
            status_table({"n1": st}),
            sessions_table({"n1": st}),
            stats_table({"n1": big}),
            activity_table({"n1": big}),
            p2p_table({"n1": node.p2p()}),
            outcome_table([NodeOutcome("n1", "deployed")]),
            lifecycle_table("stop", {"n1": {"status": "x"}}),
        ]
    console = Console(width=200, record=True)
    for t in tables:
        console.print(t)
        for col in t.columns:
            header = str(col.header)
            assert not header or header[0].isupper() or not header[0].isalpha(), header
    text = console.export_text()
    assert "2 622 752" in text and "2,622,752" not in text


def test_the_control_port_follows_the_rpc_port():
    from fleetd.ports import DEFAULT_CONTROL_PORT, control_port_for
    from fleetd.server.main import _fleetd_parser, resolve_settings

    assert control_port_for(50053) == 50153 and DEFAULT_CONTROL_PORT == 50152
    by = {s.name: s for s in parse_nodes("gpu1\ngpu1 rpc_port=50053\ngpu2 rpc_port=7000 control_port=7001\n")}
    assert by["gpu1/50052"].control_port == 50152 and by["gpu1/50053"].control_port == 50153
    assert by["gpu2"].control_port == 7001
    assert resolve_settings(_fleetd_parser().parse_args(["--port", "50060"]))["control_port"] == 50160
    assert (
        resolve_settings(_fleetd_parser().parse_args(["--port", "50060", "--control-port", "0"]))[
            "control_port"
        ]
        == 0
    )
    with pytest.raises(FleetError, match=r"rpc_port 65500 \+ 100 is past 65535: give control_port= too"):
        parse_nodes("gpu1 rpc_port=65500\n")


@pytest.mark.parametrize("stop_signal", ["SIGINT", "SIGTERM"])
def test_demo_keep_leaves_the_fleet_running_until_a_stop_signal(tmp_path, stop_signal):
    import signal

    env = dict(os.environ, PYTHONPATH=str(REPO))
    # The demo starts with SIGINT and SIGTERM ignored, as under a non-interactive parent: the kept
    # fleet must still stop on either, whatever disposition it inherited.
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); from fleetd.ctl import main; sys.exit(main())"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "demo",
            "--no-llama",
            "--keep",
            "--n-embd",
            "64",
            "--steps",
            "2",
            "--rows",
            "2",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = []
        for line in proc.stdout:  # bounded by the test's timeout
            seen.append(line)
            if "Ctrl-C stops the fleet" in line:
                break
        out = "".join(seen)
        nodes = Path(re.search(r"nodes file (\S+) \(kept\)", out).group(1))
        with Fleet.load(nodes) as fleet:  # the fleet is still up after the report
            statuses = fleet.map(lambda n: n.status())
            assert all(not isinstance(v, Exception) for v in statuses.values())
            pids = [v.doc["pid"] for v in statuses.values()]
        proc.send_signal(getattr(signal, stop_signal))
        assert proc.wait(60) == 0
        assert "stopping the fleet" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert nodes.is_file()  # the nodes file stays
    for pid in pids:  # and the fleet's daemons are gone
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_ab_names_a_down_node_and_checks_layers_against_the_stages(fleetd_server, tmp_path, capsys):
    srv = fleetd_server(control_port=0)
    dead = free_port()
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(
        f"localhost rpc_port={srv.address[1]} control_port={srv.control.port} name=up\n"
        f"127.0.0.1 rpc_port={dead} control_port={free_port()} name=gone\n"
    )
    assert main(["ab", str(nodes), "--layers", "1"]) == 2  # 2 nodes + the local stage: 3 stages
    assert (
        capsys.readouterr().err
        == "fleetctl ab: error: --layers 1: must be at least the number of stages (3)\n"
    )
    assert main(["ab", str(nodes), "--steps", "2", "--rows", "2", "--n-embd", "8"]) == 1
    err = capsys.readouterr().err
    assert "node gone is down" in err and f":{dead}" in err and "Traceback" not in err


def test_synthetic_ab_runs_the_rounds_asked_in_abba_order(fleetd_server, tmp_path, capsys):
    """#18 item 9: --rounds drives the synthetic A/B too (it was the model's only)."""
    srv = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={srv.address[1]} control_port={srv.control.port} name=n\n")
    rc, doc = run_json(
        capsys, "ab", str(nodes), "--steps", "2", "--rows", "2", "--n-embd", "8", "--rounds", "3"
    )
    assert rc == 0, doc
    assert [r["arm"] for r in doc["runs"]] == ["hub", "direct", "direct", "hub", "hub", "direct"]
    assert doc["rounds"] == 3
