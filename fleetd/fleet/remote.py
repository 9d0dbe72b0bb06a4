"""Run commands and move files on a node: over SSH (paramiko exec + SFTP) or, for a local node,
with subprocess and shutil. Outcomes are data (exit code, output), never prints."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import paramiko

from fleetd.fleet.node import Node
from fleetd.fleet.ssh import NodeError


@dataclass(frozen=True)
class Completed:
    """A finished command on a node: its exit code and output."""

    command: str
    rc: int
    stdout: str
    stderr: str

    def check(self, what: str) -> Completed:
        if self.rc != 0:
            tail = (self.stderr or self.stdout).strip().splitlines()[-3:]
            raise NodeError(f"{what}: exit {self.rc}: {' | '.join(tail) or 'no output'}")
        return self


class Shell:
    """A way to run things on one node."""

    def run(self, command: str, stdin: str | None = None, timeout: float = 300) -> Completed:
        raise NotImplementedError

    def put(self, local: Path, remote: str) -> None:
        """Copy a file to the node, atomically (written aside, then renamed). "~/" is home."""
        raise NotImplementedError

    def python(self, script: str, *args: str, python: str = "python3", timeout: float = 120) -> Completed:
        """Run a stdlib-only Python script on the node (script on stdin, args after '-')."""
        cmd = " ".join([shlex.quote(python), "-"] + [shlex.quote(a) for a in args])
        return self.run(cmd, stdin=script, timeout=timeout)


def _read_to_end(recv) -> bytes:
    """Everything a channel's stdout or stderr gives until its end (recv returns b"")."""
    parts = []
    while chunk := recv(65536):
        parts.append(chunk)
    return b"".join(parts)


class SshShell(Shell):
    """Runs commands over SSH exec channels and puts files by SFTP."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def run(self, command: str, stdin: str | None = None, timeout: float = 300) -> Completed:
        """`command` on an SSH exec channel, `stdin` written then closed; an SSH failure is a
        NodeError, a non-zero exit only the Completed's `rc`."""
        # The channel itself, not exec_command's three files: a ChannelFile left to the garbage
        # collector closes itself in __del__, which takes its channel's lock, and when that
        # runs on paramiko's transport thread while it holds the same lock (closing the
        # channel), the deploy hangs for good (seen under load: a deploy stuck in open_session).
        client = self.node.ssh()
        try:
            transport = client.get_transport()
            if transport is None:
                raise paramiko.SSHException("the SSH connection is closed")
            chan = transport.open_session(timeout=timeout)
        except (paramiko.SSHException, OSError, TimeoutError) as exc:
            raise NodeError(f"{self.node.name}: {command.split()[0]}: {exc}") from exc
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin.encode())
            chan.shutdown_write()
            out = _read_to_end(chan.recv).decode(errors="replace")
            err = _read_to_end(chan.recv_stderr).decode(errors="replace")
            rc = chan.recv_exit_status()
        except (paramiko.SSHException, OSError, TimeoutError) as exc:
            raise NodeError(f"{self.node.name}: {command.split()[0]}: {exc}") from exc
        finally:
            chan.close()
        return Completed(command, rc, out, err)

    def put(self, local: Path, remote: str) -> None:
        if remote.startswith("~/"):
            remote = remote[2:]  # SFTP paths are relative to the login directory
        try:
            with self.node.ssh().open_sftp() as sftp:
                tmp = remote + ".part"
                sftp.put(str(local), tmp)
                sftp.posix_rename(tmp, remote)
        except (paramiko.SSHException, OSError) as exc:
            raise NodeError(f"{self.node.name}: upload {local.name}: {exc}") from exc


class LocalShell(Shell):
    """Runs commands with /bin/sh and copies files on this machine, for a local node."""

    def run(self, command: str, stdin: str | None = None, timeout: float = 300) -> Completed:
        try:
            p = subprocess.run(
                ["/bin/sh", "-c", command], input=stdin, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            raise NodeError(f"local: {command.split()[0]}: timed out after {timeout}s") from exc
        return Completed(command, p.returncode, p.stdout, p.stderr)

    def put(self, local: Path, remote: str) -> None:
        remote_path = Path(remote).expanduser()
        tmp = remote_path.with_name(remote_path.name + ".part")
        shutil.copyfile(local, tmp)
        tmp.replace(remote_path)


def shell_for(node: Node) -> Shell:
    return LocalShell() if node.is_local else SshShell(node)
