"""Test hosts as network namespaces: each has its own address on a private bridge, its own user
and home, and its own sshd; none has a route anywhere but the bridge (no package index).

    with TestHosts(2) as hosts:
        hosts[0].address, hosts[0].user, hosts.identity, hosts.known_hosts

Needs root, iproute2 and openssh-server (scripts/bootstrap.sh installs them). Everything made
here is removed on exit: processes of the test users, users, namespaces, links, files.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sshd import _keygen, ensure_sshd

START_TIMEOUT = 20.0


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def available() -> str | None:
    """None when test hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) missing: scripts/bootstrap.sh installs it"
    try:
        ensure_sshd()
    except FileNotFoundError as exc:
        return str(exc)
    return None


@dataclass
class TestHost:
    name: str  # namespace and user name
    address: str
    home: Path
    sshd: subprocess.Popen | None = None

    @property
    def user(self) -> str:
        return self.name

    def node_line(self, **keys) -> str:
        extra = "".join(f" {k}={v}" for k, v in keys.items())
        return f"{self.user}@{self.address}{extra}"

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A command inside this host's namespace, as its user."""
        return subprocess.run(
            ["ip", "netns", "exec", self.name, "runuser", "-u", self.user, "--", *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


class TestHosts(list):
    def __init__(self, count: int) -> None:
        super().__init__()
        tag = os.getpid() % 10000
        self.subnet = 10 + os.getpid() % 200
        self.bridge = f"fbr{tag}"
        self.count = count
        self.tag = tag
        self.dir = Path(tempfile.mkdtemp(prefix=f"fleetd-hosts-{tag}-", dir="/tmp"))
        self.dir.chmod(0o755)  # the test users must reach their homes below it

    def __enter__(self) -> TestHosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        sshd = ensure_sshd()
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"10.77.{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        host_pub = _keygen(self.dir / "host_ed25519", "fleetd-test-host")
        self.identity = self.dir / "id_ed25519"
        user_pub = _keygen(self.identity, "fleetd-test-user")
        keys = self.dir / "authorized_keys"
        keys.write_text(user_pub + "\n")
        self.known_hosts = self.dir / "known_hosts"
        lines = []
        for i in range(self.count):
            name = f"fh{self.tag}n{i}"
            host = TestHost(name, f"10.77.{self.subnet}.{11 + i}", self.dir / f"home-{i}")
            self.append(host)
            subprocess.run(
                [
                    "useradd",
                    "--home-dir",
                    str(host.home),
                    "--create-home",
                    "--shell",
                    "/bin/bash",
                    "--user-group",
                    name,
                ],
                check=True,
                capture_output=True,
                timeout=30,
            )
            # useradd leaves the account locked ("!"), and sshd without PAM refuses locked
            # accounts even for keys: "*" means no password, not locked.
            subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True, timeout=30)
            _ip("netns", "add", name)
            _ip("link", "add", f"fv{self.tag}n{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", f"fv{self.tag}n{i}", "master", self.bridge, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", "eth0", ns=name)
            _ip("link", "set", "eth0", "up", ns=name)
            _ip("link", "set", "lo", "up", ns=name)
            config = self.dir / f"sshd_config-{i}"
            config.write_text(
                f"ListenAddress {host.address}\nPort 22\nHostKey {self.dir / 'host_ed25519'}\n"
                f"PidFile {self.dir / f'sshd-{i}.pid'}\nAuthorizedKeysFile {keys}\n"
                "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "UsePAM no\nStrictModes no\nAllowTcpForwarding yes\nX11Forwarding no\nPrintMotd no\n"
                "MaxStartups 50\nMaxSessions 50\nSubsystem sftp internal-sftp\n"
            )
            host.sshd = subprocess.Popen(
                ["ip", "netns", "exec", name, str(sshd), "-D", "-e", "-f", str(config)],
                stdout=open(self.dir / f"sshd-{i}.log", "wb"),
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            key_type, key_b64 = host_pub.split()[:2]
            lines.append(f"{host.address} {key_type} {key_b64}")
        self.known_hosts.write_text("\n".join(lines) + "\n")
        for host in self:
            self._wait_banner(host)

    def _wait_banner(self, host: TestHost) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((host.address, 22), timeout=1.0) as s:
                    if s.recv(64).startswith(b"SSH-2.0-"):
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"sshd of {host.name} on {host.address}:22 sent no banner")

    def close(self) -> None:
        for i, host in enumerate(self):
            if host.sshd is not None and host.sshd.poll() is None:
                host.sshd.terminate()
                host.sshd.wait(timeout=10)
            subprocess.run(["pkill", "-KILL", "-u", host.user], capture_output=True, timeout=30)
            subprocess.run(["userdel", host.user], capture_output=True, timeout=30)
            subprocess.run(["groupdel", host.user], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", f"fv{self.tag}n{i}"], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)
