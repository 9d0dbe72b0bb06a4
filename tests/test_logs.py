"""Every fleetd that fleetctl starts has a log fleetctl logs (and the TUI's log pane, through
the same Deployer.logs) shows: sessions opening and closing at INFO, the file /v1/status names."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from fleetd.client.rpc import RpcClient
from fleetd.ctl.main import main
from fleetd.fleet.deploy import Deployer
from fleetd.fleet.local import LocalFleet
from fleetd.transport import Timeout, free_port, wait_listening

BOUNDED = Timeout(connect=10, read=30)


def test_fleetctl_logs_shows_a_local_fleets_sessions(tmp_path, capsys):
    with LocalFleet(2, tmp_path, server_args=["--threads", "1"]) as local:
        with RpcClient(local.endpoints[0], BOUNDED) as c:
            c.get_alignment(0)
        statuses = local.fleet.map(lambda n: n.status())
        assert [s.log_file for s in statuses.values()] == [str(tmp_path / f"node-{i}.log") for i in range(2)]
        for _ in range(100):  # the session's close is logged by its own thread: bounded wait
            if "closed" in (tmp_path / "node-0.log").read_text():
                break
            time.sleep(0.05)
        assert main(["logs", str(local.nodes_file), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        node0 = doc["local-0"]
        assert node0["path"] == str(tmp_path / "node-0.log")
        text = "\n".join(node0["lines"])
        assert "accepted" in text and "closed" in text, text
        assert "not deployed here" not in json.dumps(doc)
        # the TUI's log pane reads the same
        lines = Deployer(local.fleet, None).logs(list(local.fleet)[1], 20)["lines"]
        assert any("listening" in line or "fleetd" in line for line in lines), lines


def test_fleetd_log_file_flag_and_a_bad_path(tmp_path):
    port = free_port()
    log = tmp_path / "fleetd.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "fleetd.server",
            "--port",
            str(port),
            "--control-port",
            "0",
            "--log-file",
            str(log),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_listening(port, 30)
        with RpcClient(f"127.0.0.1:{port}", BOUNDED) as c:
            c.get_alignment(0)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "accepted" in log.read_text()
    assert b"accepted" not in err  # the log went to the file, not to stderr
    bad = subprocess.run(
        [sys.executable, "-P", "-m", "fleetd.server", "--log-file", str(tmp_path / "no" / "x.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith(f"fleetd: error: --log-file {tmp_path / 'no' / 'x.log'}: ")


def test_ab_names_the_node_that_died_mid_run_and_what_to_do(tmp_path, capsys):
    """A real kill: node local-1 gets SIGKILL while the synthetic A/B runs through it."""
    import signal
    import threading

    with LocalFleet(2, tmp_path, server_args=["--threads", "1"]) as local:
        victim = local.processes[1]
        node = list(local.fleet)[1]

        def kill_when_computing() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if node.stats().total.graph_computes >= 3:
                        break
                except Exception:
                    pass
                time.sleep(0.05)
            victim.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_when_computing, daemon=True)
        killer.start()
        code = main(["ab", str(local.nodes_file), "--steps", "1000", "--n-embd", "1024", "--rows", "8"])
        killer.join(60)
        err = capsys.readouterr().err
    assert code == 1
    assert f"node local-1 ({node.spec.rpc_endpoint}) stopped answering during the" in err, err
    assert "fleetctl status NODES" in err and "fleetctl start NODES" in err
