"""fleetctl deploy end to end on two test hosts (network namespaces with their own sshd, user and
home, no route to any package index): deploy, run a 2-stage pipeline over the deployed nodes,
deploy again (no-op), deploy a broken build (rolled back, the previous one keeps serving),
tear down. Plus the Ansible role: syntax, lint, and one real playbook run followed by a HELLO."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import netns
from fleetd.client import RpcClient
from fleetd.ctl import main as fleetctl
from fleetd.pipeline import Pipeline
from fleetd.ports import DEFAULT_CONTROL_PORT as CONTROL_PORT
from fleetd.ports import DEFAULT_RPC_PORT as RPC_PORT

REPO = Path(__file__).resolve().parent.parent

why_not = netns.available()


@pytest.fixture(scope="module")
def hosts():
    if why_not is not None:
        pytest.skip(why_not)
    with netns.TestHosts(2) as hs:
        yield hs


def run_fleetctl(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = fleetctl(list(args))
    return rc, capsys.readouterr().out


def ssh_args(hosts) -> list[str]:
    return ["--known-hosts", str(hosts.known_hosts), "--identity", str(hosts.identity), "--no-systemd"]


def hello(endpoint: str) -> tuple:
    with RpcClient(endpoint) as c:
        return c.version, int(c.features)


def broken_source(tmp: Path) -> Path:
    """A copy of this project whose daemon exits at start: a build that fails its health check."""
    src = tmp / "broken-src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "build",
                                                             "__pycache__", "results"))
    init = src / "fleetd" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "', '__version__ = "9.9.9+broken-'))
    daemon = src / "fleetd" / "server" / "daemon.py"
    daemon.write_text(daemon.read_text().replace(
        "def serve_forever(config: ServerConfig) -> int:\n",
        "def serve_forever(config: ServerConfig) -> int:\n    raise SystemExit('deliberately broken build')\n",
    ))
    return src


def test_deploy_pipeline_redeploy_rollback_teardown(hosts, tmp_path, capsys):
    # The test hosts really are offline: no name resolution, no route out of the bridge.
    probe = hosts[0].run("python3", "-c",
                         "import socket; socket.create_connection(('pypi.org', 443), 3)")
    assert probe.returncode != 0

    nodes = tmp_path / "nodes.txt"
    nodes.write_text("# two test hosts\n" + "".join(
        h.node_line(rpc_port=RPC_PORT, control_port=CONTROL_PORT) + "\n" for h in hosts))
    endpoints = [f"{h.address}:{RPC_PORT}" for h in hosts]

    rc, out = run_fleetctl(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json")
    first = json.loads(out)
    assert rc == 0, out
    assert [o["status"] for o in first] == ["deployed", "deployed"]
    release = first[0]["release"]
    for ep in endpoints:
        assert hello(ep)[0] == (7, 0, 0)

    # A 2-stage pipeline over the deployed nodes; the boundary goes direct (the allow-list is
    # the fleet's own hosts) and gives the same bytes as the hub path.
    with Pipeline(endpoints, layers=4, rows=4, n_embd=64, p2p=True) as direct, \
         Pipeline(endpoints, layers=4, rows=4, n_embd=64, p2p=False) as hub:
        d, h = direct.run(2), hub.run(2)
    assert [s.direct for s in d] == [1, 1] and [s.fallbacks for s in d] == [0, 0]
    assert [s.md5 for s in d] == [s.md5 for s in h]

    rc, out = run_fleetctl(capsys, "status", str(nodes), "--known-hosts", str(hosts.known_hosts),
                           "--identity", str(hosts.identity), "--json")
    assert rc == 0, out

    rc, out = run_fleetctl(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json")
    again = json.loads(out)
    assert rc == 0 and [o["status"] for o in again] == ["unchanged", "unchanged"], out
    assert all(o["steps"]["upload"] == "0 wheel(s)" for o in again)

    rc, out = run_fleetctl(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json",
                           "--source", str(broken_source(tmp_path)))
    broken = json.loads(out)
    assert rc == 1
    for o in broken:
        assert o["status"] == "rolled-back", o
        assert o["release"].startswith("9.9.9") and o["previous"] == release
        assert "no HELLO" in o["steps"]["health"] and "rolled back to " + release in o["detail"]
    for ep in endpoints:
        assert hello(ep)[0] == (7, 0, 0)  # the previous release keeps serving
    rc, out = run_fleetctl(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json", "--dry-run")
    assert [o["previous"] for o in json.loads(out)] == [release, release]

    rc, out = run_fleetctl(capsys, "logs", str(nodes), *ssh_args(hosts), "--json", "-n", "5")
    assert rc == 0 and all(json.loads(out).values())

    rc, out = run_fleetctl(capsys, "uninstall", str(nodes), *ssh_args(hosts), "--json")
    assert rc == 0, out
    for h, ep in zip(hosts, endpoints):
        with pytest.raises(Exception):
            hello(ep)
        assert not (h.home / ".local" / "share" / "fleetd").exists()


def test_deploy_reports_unreachable_node_without_touching_others(hosts, tmp_path, capsys):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"{hosts[0].user}@10.77.{hosts.subnet}.99 name=ghost\n")  # nobody there
    rc, out = run_fleetctl(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json", "--dry-run")
    assert rc == 1
    (ghost,) = json.loads(out)
    assert ghost["status"] == "failed" and ghost["detail"]


def test_inventory_and_ansible_role(hosts, tmp_path, capsys):
    if shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("ansible-core not installed: pip install -e '.[ansible]' (scripts/bootstrap.sh does)")
    bin_dir = Path(sys.executable).parent
    nodes = tmp_path / "nodes.txt"
    host = hosts[1]
    port = RPC_PORT + 7
    nodes.write_text(host.node_line(rpc_port=port, control_port=CONTROL_PORT + 7) + "\n")
    rc, inv = run_fleetctl(capsys, "inventory", str(nodes))
    assert rc == 0 and f"ansible_host: \"{host.address}\"" in inv
    (tmp_path / "hosts.yml").write_text(inv)

    from fleetd.fleet.deploy import build

    b = build()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for f in b.files:
        shutil.copy(f, wheels)
    env = {"ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_SSH_ARGS":
           f"-o UserKnownHostsFile={hosts.known_hosts} -o IdentitiesOnly=yes",
           "ANSIBLE_PRIVATE_KEY_FILE": str(hosts.identity), "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    common = [str(bin_dir / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(REPO / "ansible" / "deploy.yml"),
              "-e", f"fleetd_wheel_dir={wheels}", "-e", f"fleetd_version={b.version}",
              "-e", "fleetd_python=/usr/bin/python3", "-e", "ansible_python_interpreter=/usr/bin/python3"]
    syntax = subprocess.run(common + ["--syntax-check"], capture_output=True, text=True, env=env, timeout=120)
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    lint = subprocess.run([str(bin_dir / "ansible-lint"), "--offline", "deploy.yml"], cwd=REPO / "ansible",
                          capture_output=True, text=True, env=env, timeout=600)
    assert lint.returncode == 0, lint.stdout[-2000:] + lint.stderr[-2000:]
    play = subprocess.run(common, capture_output=True, text=True, env=env, timeout=900)
    assert play.returncode == 0, play.stdout[-3000:] + play.stderr[-2000:]
    try:
        assert hello(f"{host.address}:{port}")[0] == (7, 0, 0)
    finally:
        host.run("/bin/sh", "-c", "pkill -u $(id -u) -f fleetd.supervise; pkill -u $(id -u) -f bin/fleetd")


def test_the_wheel_leaves_out_what_an_earlier_build_left(tmp_path):
    # setuptools packs whatever build/lib holds: a module removed since an earlier build (here
    # the old fleetd/fleet/cli.py) would ship to every node.
    from fleetd.fleet.deploy import build, clean_build

    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info",
                                                             "__pycache__", "results"))
    stale = src / "build" / "lib" / "fleetd" / "fleet" / "cli.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("raise SystemExit('stale')\n")
    first, second = build(source=src), build(source=src)
    try:
        with zipfile.ZipFile(first.wheel) as whl:
            names = whl.namelist()
        assert "fleetd/fleet/node.py" in names and "fleetd/fleet/cli.py" not in names
        assert first.sha == second.sha  # the same source gives the same release
    finally:
        clean_build(first)
        clean_build(second)
