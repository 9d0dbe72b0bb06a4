"""fleetctl deploy end to end on two test hosts (network namespaces with their own sshd, user and
home, no route to any package index, no compiler's output of ours): deploy with the portable ggml
build inside the wheel (the nodes compute with ggml, loaded from the release's own _lib), run a
2-stage pipeline over the deployed nodes, deploy again (no-op), deploy without the ggml build (a
warning, the nodes fall back to numpy and say so), deploy a broken build (rolled back, the
previous one keeps serving), tear down. Plus the Ansible role: syntax, lint, and one real
playbook run with `fleetctl wheels` followed by a HELLO and the device kind."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import netns
import pytest
from helpers import REPO

from fleetd.client import RpcClient
from fleetd.ctl import main as fleetctl
from fleetd.errors import TransportError
from fleetd.pipeline import Pipeline
from fleetd.ports import DEFAULT_CONTROL_PORT as CONTROL_PORT
from fleetd.ports import DEFAULT_RPC_PORT as RPC_PORT
from fleetd.tools import portable_ggml_dir

why_not = netns.available()


@pytest.fixture(scope="module")
def hosts():
    if why_not is not None:
        pytest.skip(why_not)
    with netns.TestHosts(2) as hs:
        yield hs


def run_fleetctl(capsys, *args) -> tuple[int, str]:
    return run_fleetctl_err(capsys, *args)[:2]


def run_fleetctl_err(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = fleetctl(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def portable_build() -> Path:
    """The operator's portable ggml build, which deploy ships; scripts/bootstrap.sh makes it."""
    d = portable_ggml_dir()
    if not list(d.glob("libggml-cpu-*.so")):
        pytest.fail(
            f"no portable ggml build in {d}: run FLEETD_GGML_PORTABLE=1 "
            'FLEETD_GGML_VARIANTS="x64 haswell" bash scripts/build-llama.sh ggml (bootstrap does)'
        )
    return d


def expected_variant() -> str:
    """The variant ggml scores best on this CPU, of the two bootstrap builds: haswell needs AVX2,
    FMA, F16C and BMI2 (ggml's cpu-feats-x86 for GGML_AVX2 etc.), x64 runs anywhere."""
    flags = set(
        next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        .split(":", 1)[1]
        .split()
    )
    have = {v for v in ("x64", "haswell") if (portable_build() / f"libggml-cpu-{v}.so").exists()}
    return "haswell" if "haswell" in have and {"avx2", "fma", "f16c", "bmi2"} <= flags else "x64"


def mapped_ggml_libs(user: str) -> set[str]:
    """Every libggml*.so mapped by a process of `user`: what the node's daemon really loaded."""
    uid = pwd.getpwnam(user).pw_uid
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != uid:
                continue
            maps = (proc / "maps").read_text()
        except OSError:  # gone meanwhile
            continue
        found |= {line.split()[-1] for line in maps.splitlines() if "/libggml" in line}
    return found


def ssh_args(hosts) -> list[str]:
    return ["--known-hosts", str(hosts.known_hosts), "--identity", str(hosts.identity), "--no-systemd"]


def hello(endpoint: str) -> tuple:
    with RpcClient(endpoint) as c:
        return c.version, int(c.features)


def broken_source(tmp: Path) -> Path:
    """A copy of this project whose daemon exits at start: a build that fails its health check."""
    src = tmp / "broken-src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "build", "__pycache__", "results"),
    )
    init = src / "fleetd" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "', '__version__ = "9.9.9+broken-'))
    daemon = src / "fleetd" / "server" / "daemon.py"
    daemon.write_text(
        daemon.read_text().replace(
            "def serve_forever(config: ServerConfig) -> int:\n",
            "def serve_forever(config: ServerConfig) -> int:\n"
            "    raise SystemExit('deliberately broken build')\n",
        )
    )
    return src


def test_deploy_pipeline_redeploy_rollback_teardown(hosts, tmp_path, capsys, monkeypatch):
    portable_build()
    # The test hosts really are offline: no name resolution, no route out of the bridge.
    probe = hosts[0].run("python3", "-c", "import socket; socket.create_connection(('pypi.org', 443), 3)")
    assert probe.returncode != 0

    nodes = tmp_path / "nodes.txt"
    nodes.write_text(
        "# two test hosts\n"
        + "".join(h.node_line(rpc_port=RPC_PORT, control_port=CONTROL_PORT) + "\n" for h in hosts)
    )
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
    with (
        Pipeline(endpoints, layers=4, rows=4, n_embd=64, p2p=True) as direct,
        Pipeline(endpoints, layers=4, rows=4, n_embd=64, p2p=False) as hub,
    ):
        d, h = direct.run(2), hub.run(2)
    assert [s.direct for s in d] == [1, 1] and [s.fallbacks for s in d] == [0, 0]
    assert [s.md5 for s in d] == [s.md5 for s in h]

    status_args = (str(nodes), "--known-hosts", str(hosts.known_hosts), "--identity", str(hosts.identity))
    rc, out = run_fleetctl(capsys, "status", *status_args, "--json")
    assert rc == 0, out
    # The nodes compute with ggml from the wheel's _lib: their homes have no build cache, and
    # the operator's (/root, 0700) is out of their reach.
    variant = f"libggml-cpu-{expected_variant()}.so"
    for h, doc in zip(hosts, json.loads(out).values()):
        (device,) = doc["status"]["devices"]
        lib_dir = h.home / ".local/share/fleetd/releases" / release
        assert device["kind"] == "ggml" and device["fallback"] is None, device
        assert device["library"].startswith(str(lib_dir)), device
        assert device["library"].endswith(f"/fleetd/compute/ggml/_lib/{variant}"), device
        mapped = mapped_ggml_libs(h.user)
        assert {Path(m).name for m in mapped} >= {"libggml-base.so", variant}, mapped
        assert all(m.startswith(str(lib_dir)) and "/_lib/" in m for m in mapped), mapped
    assert all(not o["warnings"] for o in first), first
    with monkeypatch.context() as m:
        m.setenv("COLUMNS", "200")  # one line per node: the table's cells unwrapped
        rc, out = run_fleetctl(capsys, "status", *status_args)
    assert rc == 0 and out.count("CPU (ggml)") == 2, out

    rc, out = run_fleetctl(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json")
    again = json.loads(out)
    assert rc == 0 and [o["status"] for o in again] == ["unchanged", "unchanged"], out
    assert all(o["steps"]["upload"] == "0 wheel(s)" for o in again)
    assert all(not o["warnings"] for o in again), again

    # No portable build on the operator's machine: one warning line, the deploy goes on, the
    # nodes come up on numpy and the outcome says so with the daemon's reason.
    with monkeypatch.context() as m:
        m.setenv("FLEETD_LLAMA_CACHE", str(tmp_path / "empty-cache"))
        rc, out, err = run_fleetctl_err(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json")
    assert rc == 0, out + err
    warning_lines = [line for line in err.splitlines() if "warning" in line]
    assert (
        len(warning_lines) == 1
        and "FLEETD_GGML_PORTABLE=1 bash scripts/build-llama.sh ggml" in warning_lines[0]
        and "numpy device" in warning_lines[0]
    ), err
    no_ggml = json.loads(out)
    numpy_release = no_ggml[0]["release"]
    assert numpy_release != release  # the libraries are part of what the release id hashes
    for o in no_ggml:
        assert o["status"] == "deployed" and o["steps"]["health"] == "ok", o
        (w,) = o["warnings"]
        assert w.startswith("device 0 (cpu) runs on numpy, not ggml: device cpu: ggml libraries not found"), w
    rc, out = run_fleetctl(capsys, "status", *status_args, "--json")
    for doc in json.loads(out).values():
        (device,) = doc["status"]["devices"]
        assert device["kind"] == "numpy" and device["library"] is None and "not found" in device["fallback"]
    with monkeypatch.context() as m:
        m.setenv("COLUMNS", "200")
        rc, out = run_fleetctl(capsys, "status", *status_args)
    assert out.count("CPU (numpy, fell back)") == 2 and out.count("device 0 is numpy: device cpu:") == 2, out

    rc, out = run_fleetctl(
        capsys, "deploy", str(nodes), *ssh_args(hosts), "--json", "--source", str(broken_source(tmp_path))
    )
    broken = json.loads(out)
    assert rc == 1
    for o in broken:
        assert o["status"] == "rolled-back", o
        assert o["release"].startswith("9.9.9") and o["previous"] == numpy_release
        assert "no HELLO" in o["steps"]["health"] and "rolled back to " + numpy_release in o["detail"]
    for ep in endpoints:
        assert hello(ep)[0] == (7, 0, 0)  # the previous release keeps serving
    rc, out = run_fleetctl(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json", "--dry-run")
    assert [o["previous"] for o in json.loads(out)] == [numpy_release, numpy_release]

    rc, out = run_fleetctl(capsys, "logs", str(nodes), *ssh_args(hosts), "--json", "-n", "5")
    assert rc == 0 and all(json.loads(out).values())

    rc, out = run_fleetctl(capsys, "uninstall", str(nodes), *ssh_args(hosts), "--json")
    assert rc == 0, out
    for h, ep in zip(hosts, endpoints):
        with pytest.raises(TransportError):  # nothing listens there any more
            hello(ep)
        assert not (h.home / ".local" / "share" / "fleetd").exists()


def fleetd_of(supervisor: int) -> int:
    """The fleetd process a supervisor started: its one child."""
    (child,) = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return int(child)


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in lines)}


def test_deploy_as_root_runs_fleetd_as_an_unprivileged_service_user(hosts, tmp_path, capsys):
    portable_build()
    host, svc = hosts[0], f"fs{hosts.tag}"  # a service user of this test only (<= 8 chars for ps)
    port, control = RPC_PORT + 3, CONTROL_PORT + 3
    root = hosts.dir / "root-node"  # the test hosts share one file system: not /opt/fleetd
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"root@{host.address} rpc_port={port} control_port={control}\n")
    # root's python3 here is pyenv's, below root's 0700 home: the service user could not read it
    args = (
        str(nodes),
        *ssh_args(hosts),
        "--root",
        str(root),
        "--service-user",
        svc,
        "--json",
        "--python",
        "/usr/bin/python3",
    )
    with pytest.raises(KeyError):
        pwd.getpwnam(svc)
    try:
        # A deploy that fails leaves the node as it was: no service user, no cache directory.
        rc, out = run_fleetctl(capsys, "deploy", *args, "--source", str(broken_source(tmp_path)))
        (o,) = json.loads(out)
        assert rc == 1 and o["status"] == "failed" and "no HELLO" in o["steps"]["health"], o
        with pytest.raises(KeyError):
            pwd.getpwnam(svc)
        assert not (root / "cache").exists() and not (root / "releases" / o["release"]).exists()
        assert not (root / "current").exists() and not (root / "fleetd.toml").exists()

        rc, out = run_fleetctl(capsys, "deploy", *args)
        (o,) = json.loads(out)
        assert rc == 0 and o["status"] == "deployed", o
        assert o["steps"]["configure"].endswith(f"runs as {svc}"), o
        entry = pwd.getpwnam(svc)
        assert entry.pw_shell.endswith("nologin") and entry.pw_dir == "/nonexistent", entry
        assert 0 < entry.pw_uid < 1000  # a system account
        assert hello(f"{host.address}:{port}")[0] == (7, 0, 0)
        assert f'user = "{svc}"' in (root / "fleetd.toml").read_text()
        rc, out = run_fleetctl(
            capsys,
            "status",
            str(nodes),
            "--known-hosts",
            str(hosts.known_hosts),
            "--identity",
            str(hosts.identity),
            "--json",
        )
        (doc,) = json.loads(out).values()  # ggml from the release, not from root's build cache
        assert doc["status"]["devices"][0]["library"].startswith(str(root / "releases")), doc

        # The supervisor (no systemd here) is root's; the daemon it runs dropped to the service
        # user once its port was bound: every uid and gid, no supplementary groups, no capability.
        supervisor = int((root / "fleetd.pid").read_text().split()[0])
        assert proc_status(supervisor)["Uid"].split()[0] == "0"
        pid = fleetd_of(supervisor)
        ps = subprocess.run(["ps", "-o", "user=", "-p", str(pid)], capture_output=True, text=True)
        assert ps.stdout.strip() == svc, ps
        st = proc_status(pid)
        assert st["Uid"].split() == [str(entry.pw_uid)] * 4, st["Uid"]
        assert st["Gid"].split() == [str(entry.pw_gid)] * 4, st["Gid"]
        assert st["Groups"] == "" and st["NoNewPrivs"] == "1", st
        assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0, st
        # It owns its cache directory and nothing else of the install.
        cache = (root / "cache").stat()
        assert (cache.st_uid, cache.st_gid, cache.st_mode & 0o777) == (entry.pw_uid, entry.pw_gid, 0o750)
        assert all(p.stat().st_uid == 0 for p in (root, root / "fleetd.toml", root / "releases"))
        assert (root / ".service-user").read_text().strip() == svc

        rc, out = run_fleetctl(capsys, "deploy", *args)  # again: nothing to do
        assert rc == 0 and [o["status"] for o in json.loads(out)] == ["unchanged"], out

        rc, out = run_fleetctl(capsys, "uninstall", *args)
        assert rc == 0, out
        assert not root.exists()
        with pytest.raises(KeyError):  # made by deploy, so gone with the install
            pwd.getpwnam(svc)
    finally:
        try:
            os.killpg(int((root / "fleetd.pid").read_text().split()[0]), signal.SIGKILL)
        except (OSError, ValueError):
            pass
        for cmd in (["pkill", "-KILL", "-u", svc], ["userdel", svc], ["groupdel", svc]):
            subprocess.run(cmd, capture_output=True, timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def test_deploy_reports_unreachable_node_without_touching_others(hosts, tmp_path, capsys):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"{hosts[0].user}@10.77.{hosts.subnet}.99 name=ghost\n")  # nobody there
    rc, out = run_fleetctl(capsys, "deploy", str(nodes), *ssh_args(hosts), "--json", "--dry-run")
    assert rc == 1
    (ghost,) = json.loads(out)
    assert ghost["status"] == "failed" and ghost["detail"]


def test_inventory_and_ansible_role(hosts, tmp_path, capsys):
    """The role run as root: fleetd runs as its service user, with fleetctl deploy's lists."""
    if shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("ansible-core not installed: pip install -e '.[ansible]' (scripts/bootstrap.sh does)")
    import tomllib

    from fleetd.fleet.deploy import node_config
    from fleetd.fleet.node import Fleet

    bin_dir = Path(sys.executable).parent
    nodes = tmp_path / "nodes.txt"
    host = hosts[1]
    port = RPC_PORT + 7
    svc = f"fa{hosts.tag}"  # this test's service user
    root = hosts.dir / "ansible-root"  # the test hosts share one file system: not /opt/fleetd
    nodes.write_text(f"root@{host.address} rpc_port={port} control_port={CONTROL_PORT + 7}\n")
    rc, inv = run_fleetctl(capsys, "inventory", str(nodes))
    assert rc == 0 and f'ansible_host: "{host.address}"' in inv
    (tmp_path / "hosts.yml").write_text(inv)

    portable_build()
    wheels = tmp_path / "wheels"
    rc, out = run_fleetctl(capsys, "wheels", str(wheels))
    assert rc == 0 and "libggml-base.so" in out, out
    version = out.split("fleetd_version=")[1].split()[0]
    env = {
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_SSH_ARGS": f"-o UserKnownHostsFile={hosts.known_hosts} -o IdentitiesOnly=yes",
        "ANSIBLE_PRIVATE_KEY_FILE": str(hosts.identity),
        "ANSIBLE_NOCOLOR": "1",
        "PATH": f"{bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(tmp_path),
    }
    common = [
        str(bin_dir / "ansible-playbook"),
        "-i",
        str(tmp_path / "hosts.yml"),
        str(REPO / "ansible" / "deploy.yml"),
        "-e",
        f"fleetd_wheel_dir={wheels}",
        "-e",
        f"fleetd_version={version}",
        "-e",
        f"fleetd_root={root}",
        "-e",
        f"fleetd_user={svc}",
        "-e",
        "fleetd_python=/usr/bin/python3",
        "-e",
        "ansible_python_interpreter=/usr/bin/python3",
    ]
    syntax = subprocess.run(common + ["--syntax-check"], capture_output=True, text=True, env=env, timeout=120)
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    lint = subprocess.run(
        [str(bin_dir / "ansible-lint"), "--offline", "deploy.yml"],
        cwd=REPO / "ansible",
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert lint.returncode == 0, lint.stdout[-2000:] + lint.stderr[-2000:]
    try:
        play = subprocess.run(common, capture_output=True, text=True, env=env, timeout=900)
        assert play.returncode == 0, play.stdout[-3000:] + play.stderr[-2000:]
        assert hello(f"{host.address}:{port}")[0] == (7, 0, 0)
        # the same wheel as fleetctl deploy's: the node computes with the shipped ggml build
        rc, out = run_fleetctl(
            capsys,
            "status",
            str(nodes),
            "--known-hosts",
            str(hosts.known_hosts),
            "--identity",
            str(hosts.identity),
            "--json",
        )
        (doc,) = json.loads(out).values()
        assert rc == 0 and [d["kind"] for d in doc["status"]["devices"]] == ["ggml"], out
        assert doc["status"]["devices"][0]["library"].startswith(f"{root}/releases/"), out
        assert "/fleetd/compute/ggml/_lib/libggml-cpu-" in doc["status"]["devices"][0]["library"], out
        # The same allow-lists as fleetctl deploy writes for this node, and the service user.
        written = tomllib.loads((root / "fleetd.toml").read_text())
        fleet = Fleet.load(nodes)
        ours = tomllib.loads(node_config(fleet[0], fleet))
        assert written["host"] == "0.0.0.0" and written["user"] == svc
        assert (written["peer_allow"], written["allow"]) == (ours["peer_allow"], ours["allow"]), (
            written,
            ours,
        )
        entry = pwd.getpwnam(svc)
        assert entry.pw_shell.endswith("nologin") and 0 < entry.pw_uid < 1000
        pid = fleetd_of(int((root / "fleetd.pid").read_text().split()[0]))
        ps = subprocess.run(["ps", "-o", "user=", "-p", str(pid)], capture_output=True, text=True)
        st = proc_status(pid)
        assert ps.stdout.strip() == svc and st["Uid"].split() == [str(entry.pw_uid)] * 4, (ps, st)
        assert st["Gid"].split() == [str(entry.pw_gid)] * 4 and int(st["CapEff"], 16) == 0, st
        assert (root / "cache").stat().st_uid == entry.pw_uid
    finally:
        try:
            os.killpg(int((root / "fleetd.pid").read_text().split()[0]), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        for cmd in (["pkill", "-KILL", "-u", svc], ["userdel", svc], ["groupdel", svc]):
            subprocess.run(cmd, capture_output=True, timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def test_the_ansible_unit_has_the_sandbox_of_fleetctls():
    from fleetd.fleet.agent import SANDBOX

    unit = (REPO / "ansible/roles/fleetd/templates/fleetd.service.j2").read_text().splitlines()
    start = unit.index("Group={{ fleetd_run_as }}") + 1
    end = next(i for i, line in enumerate(unit) if line.startswith("ReadWritePaths="))
    assert tuple(unit[start:end]) == SANDBOX
    assert "MemoryDenyWriteExecute" not in "\n".join(unit[start:end])


def test_the_wheel_leaves_out_what_an_earlier_build_left(tmp_path):
    # setuptools packs whatever build/lib holds: a module removed since an earlier build (here
    # the old fleetd/fleet/cli.py) would ship to every node.
    from fleetd.fleet.deploy import build, clean_build

    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", "results"),
    )
    stale = src / "build" / "lib" / "fleetd" / "fleet" / "cli.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("raise SystemExit('stale')\n")
    first, second = build(source=src), build(source=src)
    try:
        with zipfile.ZipFile(first.wheel) as whl:
            names = whl.namelist()
        assert "fleetd/fleet/node.py" in names and "fleetd/fleet/cli.py" not in names
        assert first.sha == second.sha  # the same source gives the same release
        # nodes install the distribution's own dependencies, none of the ctl extra's
        project = tomllib.loads((src / "pyproject.toml").read_text())["project"]
        assert first.requirements == tuple(project["dependencies"])
        assert not {"rich", "textual", "paramiko"} & {r.split(">")[0] for r in first.requirements}
    finally:
        clean_build(first)
        clean_build(second)


def test_the_wheel_carries_every_so_of_the_portable_build_and_never_a_native_one(tmp_path, monkeypatch):
    from fleetd.errors import FleetError
    from fleetd.fleet.deploy import WHEEL_LIB_DIR, build, clean_build

    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", "results"),
    )
    # a native build left in the tree's own _lib (a developer's copy) must not ship
    (src / WHEEL_LIB_DIR).mkdir(parents=True, exist_ok=True)
    (src / WHEEL_LIB_DIR / "libggml-cpu.so").write_bytes(b"native")
    portable = tmp_path / "lib-portable"
    shutil.copytree(portable_build(), portable, symlinks=True)
    (portable / "libfleetd-native.so").write_bytes(b"a helper built beside ggml")  # every *.so goes
    b = build(source=src, ggml_lib=portable)
    try:
        with zipfile.ZipFile(b.wheel) as whl:
            shipped = {
                n.rsplit("/", 1)[1]: whl.read(n) for n in whl.namelist() if n.startswith(WHEEL_LIB_DIR + "/")
            }
        assert set(shipped) == {p.name for p in portable.glob("*.so")} == set(b.ggml_libs)
        assert "libggml-cpu.so" not in shipped and "libfleetd-native.so" in shipped
        # links shipped as the files they name (a wheel holds no symlinks)
        assert shipped["libggml-base.so"] == (portable / "libggml-base.so").read_bytes()
        assert b.warning is None
        # --wheel-dir takes a built wheel as it is: what it carries is read from the wheel
        taken = build(wheel_dir=b.wheel.parent)
        assert taken.ggml_libs == b.ggml_libs and taken.warning is None and taken.sha == b.sha
        with pytest.raises(FleetError, match="--ggml-lib"):
            build(wheel_dir=b.wheel.parent, ggml_lib=portable)
    finally:
        clean_build(b)
    monkeypatch.setenv("FLEETD_LLAMA_CACHE", str(tmp_path / "empty-cache"))
    bare = build(source=src)
    try:
        assert bare.ggml_libs == () and "FLEETD_GGML_PORTABLE=1" in bare.warning
        assert "libggml-cpu" not in " ".join(zipfile.ZipFile(bare.wheel).namelist())
        assert "carries no ggml libraries" in build(wheel_dir=bare.wheel.parent).warning
    finally:
        clean_build(bare)
    native = tmp_path / "native"
    native.mkdir()
    for name in ("libggml-base.so", "libggml-cpu.so"):
        (native / name).write_bytes(b"x")
    with pytest.raises(FleetError, match="native ggml build"):
        build(source=src, ggml_lib=native)
    one = tmp_path / "native-one"  # scripts/build-llama.sh's native build today: one library
    one.mkdir()
    (one / "libggml-fleetd.so").write_bytes(b"x")
    with pytest.raises(FleetError, match="native ggml build"):
        build(source=src, ggml_lib=one)
    with pytest.raises(FleetError, match="no portable ggml build"):
        build(source=src, ggml_lib=tmp_path / "nothing-here")
