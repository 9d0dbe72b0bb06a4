"""A real OpenSSH server on a loopback port for tests, with generated host and user keys.

    with SshServer(tmp_dir) as sshd:
        sshd.port, sshd.user, sshd.identity, sshd.known_hosts

`/usr/sbin/sshd -D -e -f <config>` runs as a child process: host key and user key are made with
ssh-keygen, authorized_keys holds the user key for the current user (root is allowed, by key
only), and known_hosts holds the host key under `[127.0.0.1]:port`, so clients can keep
paramiko's RejectPolicy. Nothing is read from or written to ~/.ssh or /etc/ssh.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
START_TIMEOUT = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_sshd() -> Path:
    """/usr/sbin/sshd, installed with apt-get when missing and we are root (CI bootstraps it too)."""
    if SSHD.exists():
        return SSHD
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "openssh-server"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=600,
            check=False,
        )
    if not SSHD.exists():
        raise FileNotFoundError(f"{SSHD} missing: apt-get install openssh-server (scripts/bootstrap.sh does)")
    return SSHD


def _keygen(path: Path, comment: str) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=30,
    )
    return path.with_suffix(".pub").read_text().strip()


class SshServer:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.user = getpass.getuser()
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> SshServer:
        exe = ensure_sshd()
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory
        host_key = self.root / "host_ed25519"
        host_pub = _keygen(host_key, "fleetd-test-host")
        self.identity = self.root / "id_ed25519"
        user_pub = _keygen(self.identity, "fleetd-test-user")
        (self.root / "authorized_keys").write_text(user_pub + "\n")
        self.port = _free_port()
        self.known_hosts = self.root / "known_hosts"
        key_type, key_b64 = host_pub.split()[:2]
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {key_type} {key_b64}\n")
        self.log = self.root / "sshd.log"
        config = self.root / "sshd_config"
        config.write_text(
            f"Port {self.port}\n"
            "ListenAddress 127.0.0.1\n"
            f"HostKey {host_key}\n"
            f"PidFile {self.root / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "AllowTcpForwarding yes\n"
            "PermitOpen any\n"
            "X11Forwarding no\n"
            "PrintMotd no\n"
            "MaxStartups 50\n"
            "MaxSessions 50\n"
            "LogLevel VERBOSE\n"
            "Subsystem sftp internal-sftp\n"
        )
        self.proc = subprocess.Popen(
            [str(exe), "-D", "-e", "-f", str(config)],
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self._wait_banner()
        return self

    def _wait_banner(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                    if s.recv(64).startswith(b"SSH-2.0-"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"sshd on 127.0.0.1:{self.port} sent no banner within {START_TIMEOUT}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def node_line(self, **keys) -> str:
        """A nodes-file line for this server: `user@127.0.0.1:port key=value...`."""
        extra = "".join(f" {k}={v}" for k, v in keys.items())
        return f"{self.user}@127.0.0.1:{self.port}{extra}"

    def __enter__(self) -> SshServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
