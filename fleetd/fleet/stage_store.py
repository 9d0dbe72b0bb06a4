"""A node's cache directory as `fleetctl stage` and `fleetctl status` reach it: a plain directory for
a node on this host (a local node, or a `fleetctl lab` node: its network namespace shares this
host's file system), SFTP (paramiko) for one over SSH. Same verbs either way:

    store.sizes()                 {file name: size} of what the directory holds now
    store.put(name, view, done)   write `view` as <dir>/<name>, atomically (below)
    store.read_text(name)         a small file (a manifest), or None
    store.write_text(name, text)  a small file, atomically

A file is written as fleetd's cache writes its own (fleetd/server/cache_dir.py): to a temp name
starting with `.store.` (fleetd removes such files older than an hour when it starts), fsync'd,
renamed to its name, so an interrupted stage never leaves part of a file under a name. Locally the
file also gets fleetd's size record (xattr user.fleetd.size), so fleetd trusts it without
re-hashing; over SFTP no xattr can be set and fleetd re-hashes each such file once, at its first hit.
"""

from __future__ import annotations

import logging
import os
import stat
import tomllib
from collections.abc import Callable
from pathlib import Path

import paramiko
from paramiko.sftp import CMD_EXTENDED

from fleetd.fleet.deploy import default_root
from fleetd.fleet.node import Node
from fleetd.fleet.ssh import NodeError

log = logging.getLogger("fleetd.stage")

CHUNK = 1 << 20  # bytes per write: the progress bar's step, and the one copy a write makes
TEMP_PREFIX = ".store.stage."  # fleetd's cache_dir removes stale ".store.*" temps at start
SIZE_XATTR = "user.fleetd.size"  # fleetd's size record (fleetd/server/cache_dir.py)
DEPLOYED_CONFIG = "fleetd.toml"  # under the deploy root: fleetctl deploy's config for fleetd

Progress = Callable[[int], None]  # called with the bytes just written


class NoCacheDir(NodeError):
    """The node has no cache directory fleetctl knows of (or it does not exist there)."""


def enable_hint(node: Node) -> str:
    return (
        f"{node.name}: no cache directory known: start its fleetd with -c DIR (or cache_dir in its "
        f"--config; fleetctl deploy sets one) and add cache_dir=DIR to its line in the nodes file"
    )


class LocalStore:
    """The cache directory of a node on this host."""

    def __init__(self, path: str) -> None:
        self.path = Path(path).expanduser()
        self.where = str(self.path)

    def exists(self) -> bool:
        return self.path.is_dir()

    def sizes(self) -> dict[str, int]:
        out = {}
        for entry in os.scandir(self.path):
            if entry.is_file(follow_symlinks=False):
                out[entry.name] = entry.stat(follow_symlinks=False).st_size
        return out

    def put(self, name: str, view: memoryview, done: Progress) -> None:
        tmp = self.path / f"{TEMP_PREFIX}{os.getpid()}.{name}"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                for at in range(0, len(view), CHUNK):
                    piece = view[at : at + CHUNK]
                    _write_all(fd, piece)
                    done(len(piece))
                _record_size(fd, len(view))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path / name)
            _fsync_dir(self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read_text(self, name: str) -> str | None:
        try:
            return (self.path / name).read_text()
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        data = memoryview(text.encode())
        tmp = self.path / f"{TEMP_PREFIX}{os.getpid()}.{name}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)

    def close(self) -> None:
        pass


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def _record_size(fd: int, size: int) -> None:
    try:
        os.setxattr(fd, SIZE_XATTR, str(size).encode())
    except OSError:  # no user xattrs here: fleetd re-hashes the file at its first hit instead
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SftpStore:
    """The cache directory of a node over SSH, through one SFTP session."""

    def __init__(self, node: Node, path: str) -> None:
        self.node = node
        self.where = f"{node.name}:{path}"
        self.path = path[2:] if path.startswith("~/") else path  # SFTP is relative to the login dir
        try:
            self.sftp = node.ssh().open_sftp()
        except (paramiko.SSHException, OSError) as exc:
            raise NodeError(f"{node.name}: SFTP: {exc}") from exc
        self._fsync_ok = True

    def _at(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}" if self.path else name

    def exists(self) -> bool:
        try:
            return stat.S_ISDIR(self.sftp.stat(self.path or ".").st_mode or 0)
        except OSError:
            return False

    def sizes(self) -> dict[str, int]:
        return {
            a.filename: a.st_size or 0
            for a in self.sftp.listdir_attr(self.path or ".")
            if stat.S_ISREG(a.st_mode or 0)
        }

    def put(self, name: str, view: memoryview, done: Progress) -> None:
        tmp = self._at(f"{TEMP_PREFIX}{os.getpid()}.{name}")
        try:
            with self.sftp.open(tmp, "wb") as f:
                f.set_pipelined(True)
                for at in range(0, len(view), CHUNK):
                    piece = view[at : at + CHUNK]
                    f.write(bytes(piece))  # paramiko packs bytes only: one chunk's copy
                    done(len(piece))
                f.flush()
                self._fsync(f)
            self.sftp.posix_rename(tmp, self._at(name))
        except BaseException:
            try:
                self.sftp.remove(tmp)
            except (OSError, paramiko.SSHException, EOFError):
                pass
            raise

    def _fsync(self, f: paramiko.SFTPFile) -> None:
        """OpenSSH's fsync@openssh.com extension (paramiko has no call for it): the content is on
        the node's disk before the rename gives it its name."""
        if not self._fsync_ok:
            return
        try:
            self.sftp._request(CMD_EXTENDED, "fsync@openssh.com", f.handle)
        except OSError as exc:
            self._fsync_ok = False
            log.warning("%s: SFTP server has no fsync (%s): files renamed without it", self.where, exc)

    def read_text(self, name: str) -> str | None:
        try:
            with self.sftp.open(self._at(name), "rb") as f:
                return f.read().decode()
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        tmp = self._at(f"{TEMP_PREFIX}{os.getpid()}.{name}")
        with self.sftp.open(tmp, "wb") as f:
            f.write(text.encode())
            f.flush()
            self._fsync(f)
        self.sftp.posix_rename(tmp, self._at(name))

    def close(self) -> None:
        self.sftp.close()


def on_this_host(node: Node) -> bool:
    """The node's files are this host's: a local node, or a lab node (fleetctl lab: a network
    namespace of this host, reached without SSH, sharing its file system)."""
    return node.is_local or bool(node.spec.via_netns)


def deployed_cache_dir(node: Node) -> str | None:
    """The cache_dir of the fleetd.toml that `fleetctl deploy` wrote on the node, if any."""
    if node.spec.via_netns:  # a lab node: started by fleetctl lab with its own flags, never deployed
        return None
    root = default_root(node.spec.user)
    path = f"{root}/{DEPLOYED_CONFIG}"
    if node.is_local:
        try:
            text = Path(path).expanduser().read_text()
        except OSError:
            return None
    else:
        try:
            with node.ssh().open_sftp() as sftp, sftp.open(path.removeprefix("~/"), "rb") as f:
                text = f.read().decode()
        except (OSError, paramiko.SSHException):
            return None
    try:
        value = tomllib.loads(text).get("cache_dir")
    except tomllib.TOMLDecodeError:
        return None
    return value if isinstance(value, str) and value else None


def open_store(node: Node) -> LocalStore | SftpStore:
    """The node's cache directory (its nodes-file cache_dir=, else the deployed one); NoCacheDir
    when neither names one or it is not there."""
    path = node.spec.cache_dir or deployed_cache_dir(node)
    if not path:
        raise NoCacheDir(enable_hint(node))
    store = LocalStore(path) if on_this_host(node) else SftpStore(node, path)
    if not store.exists():
        store.close()
        raise NoCacheDir(
            f"{node.name}: cache directory {path} does not exist there: is its fleetd running with -c {path}?"
        )
    return store
