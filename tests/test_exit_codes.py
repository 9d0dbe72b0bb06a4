"""fleetctl(1)'s exit codes are the contract: 2 for what the operator typed (a bad value, a
name that is not there, flags that do not go together), 1 for what failed, 130 for Ctrl-C.
fleetd(8) the same for its flags."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from fleetd.ctl import main

ENV = dict(os.environ, PYTHONPATH=str(REPO))
FLEETCTL = [sys.executable, "-c", "import sys; from fleetd.ctl import main; sys.exit(main())"]


@pytest.fixture
def local_node(fleetd_server, tmp_path) -> Path:
    srv = fleetd_server(control_port=0)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"localhost rpc_port={srv.address[1]} control_port={srv.control.port}\n")
    return nodes


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_timeout_that_is_not_a_finite_number_is_a_usage_error(local_node, capsys, value):
    assert main(["status", str(local_node), f"--timeout={value}"]) == 2
    err = capsys.readouterr().err
    assert f"--timeout {float(value)}: must be a finite number" in err and "FleetError" not in err


def test_lab_nodes_is_checked_against_the_labs_own_range(capsys):
    assert main(["lab", "up", "--nodes", "17"]) == 2
    assert "--nodes 17: must be in 1..16" in capsys.readouterr().err
    assert main(["lab", "up", "--nodes", "0"]) == 2
    assert "--nodes 0: must be in 1..16" in capsys.readouterr().err
    assert main(["demo", "--nodes", "65"]) == 2  # the demo's range stays its own
    assert "--nodes 65: must be in 1..64" in capsys.readouterr().err


def test_stats_count_without_watch_is_refused_not_ignored(local_node, capsys):
    assert main(["stats", str(local_node), "--count", "3"]) == 2
    err = capsys.readouterr().err
    assert "usage: fleetctl stats" in err and "--count 3 counts --watch samples: add --watch" in err


def test_p2p_without_an_action_says_the_action_comes_first(local_node, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["p2p", str(local_node)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "is not on, off or status: the action comes before the nodes file" in err
    assert "invalid choice" not in err


def test_an_unknown_node_name_is_a_usage_error(local_node, capsys):
    assert main(["status", str(local_node), "--node", "nosuch"]) == 2
    assert "--node nosuch: no such node (have: localhost" in capsys.readouterr().err


def test_output_to_a_full_device_is_one_line_not_a_traceback(local_node):
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [*FLEETCTL, "status", str(local_node), "--json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            timeout=60,
        )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "fleetctl: error: cannot write the output: No space left on device"


def test_ctrl_c_on_stats_watch_exits_130(local_node):
    proc = subprocess.Popen(
        [*FLEETCTL, "stats", str(local_node), "--watch", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        first = proc.stdout.readline()  # a sample was printed: it is watching
        assert first.strip(), proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-d", "cuda:0"], "device 'cuda:0': unknown (known: cpu, numpy)"),
        (["--port", "0"], "port 0 outside 1..65535"),
    ],
)
def test_fleetd_bad_flags_exit_2_with_one_line(argv, message):
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "fleetd.server", *argv],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"fleetd: error: {message}"
