"""fleetd --user: started as root it binds, then serves as the named user with no capabilities
and no_new_privs; a user that does not exist is refused with one line, before serving."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import REPO

from fleetd.client import RpcClient

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fleetd(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleetd.server",
            "-H",
            "127.0.0.1",
            "--control-port",
            "0",
            "-d",
            "numpy",
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def open_dir():
    """A directory the dropped user can reach (pytest's tmp_path sits below a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="fleetd-priv-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in lines)}


def test_root_drops_to_the_named_user_after_binding(open_dir):
    nobody = pwd.getpwnam("nobody")
    cache = open_dir / "cache"
    cache.mkdir()
    os.chown(cache, nobody.pw_uid, nobody.pw_gid)
    port = _free_port()
    proc = _fleetd("-p", str(port), "--user", "nobody", "-c", str(cache))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with RpcClient(f"127.0.0.1:{port}") as c:
                    assert c.version == (7, 0, 0)
                break
            except Exception:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline
                time.sleep(0.2)
        st = proc_status(proc.pid)
        assert st["Uid"].split() == [str(nobody.pw_uid)] * 4, st["Uid"]
        assert st["Gid"].split() == [str(nobody.pw_gid)] * 4, st["Gid"]
        assert st["Groups"] == ""
        assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0, st
        assert st["NoNewPrivs"] == "1"
        ps = subprocess.run(["ps", "-o", "user=", "-p", str(proc.pid)], capture_output=True, text=True)
        assert ps.stdout.strip() == "nobody"
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=20)
    assert "running as nobody" in err, err


def test_a_missing_user_is_refused_as_root_with_one_line():
    proc = _fleetd("-p", str(_free_port()), "--user", "no-such-fleetd-user")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    lines = [line for line in err.splitlines() if "error" in line]
    assert lines == [
        "fleetd: error: user no-such-fleetd-user: no such user; refusing to run as root "
        "(create it: useradd --system --shell /usr/sbin/nologin no-such-fleetd-user)"
    ], err


def test_a_cache_directory_the_user_cannot_write_is_refused(open_dir):
    cache = open_dir / "cache"
    cache.mkdir(mode=0o755)  # root's
    proc = _fleetd("-p", str(_free_port()), "--user", "nobody", "-c", str(cache))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"fleetd: error: user nobody: cannot write the cache directory {cache} (owner uid 0" in err, err
