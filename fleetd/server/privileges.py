"""Running as a service user: `fleetd --user NAME` (config key `user`) started as root.

The supervisor without systemd (fleetd.supervise, started by fleetctl deploy or the Ansible role
as root) starts fleetd as root; fleetd then binds its sockets and, before it serves anything,
drops to NAME for good:

    no_new_privs()   PR_SET_NO_NEW_PRIVS, as early as possible (threads started later inherit it;
                     it only affects execve, so set*id below still works)
    drop(user)       setgroups([]), setgid, setuid: every uid and gid becomes NAME's, so the
                     kernel clears the permitted and effective capabilities

Under systemd the unit's User= has done this already: fleetd starts as NAME, and `user` is a
no-op. Started by anyone but root, `user` is ignored with one warning when it names another
user (fleetd cannot switch users then).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pwd

from fleetd.errors import FleetdError

log = logging.getLogger("fleetd.privileges")

PR_SET_NO_NEW_PRIVS = 38  # <linux/prctl.h>


class PrivilegeError(FleetdError):
    """The service user is missing, or switching to it failed."""


def service_user(name: str | None) -> pwd.struct_passwd | None:
    """The passwd entry to drop to: None when there is nothing to do (no user named, or not
    started as root). Raises PrivilegeError for a user that does not exist (as root: running on
    as root instead would be the opposite of what was asked) or that is root itself."""
    if not name:
        return None
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid()).pw_name if _has_uid(os.geteuid()) else str(os.geteuid())
        if me != name:
            log.warning("user %s ignored: fleetd was started as %s, not root, and cannot switch", name, me)
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise PrivilegeError(
            f"user {name}: no such user; refusing to run as root "
            f"(create it: useradd --system --shell /usr/sbin/nologin {name})"
        ) from None
    if entry.pw_uid == 0:
        raise PrivilegeError(f"user {name}: has uid 0; name an unprivileged user")
    return entry


def _has_uid(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def no_new_privs() -> None:
    """PR_SET_NO_NEW_PRIVS for this thread and every one it starts from now on."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise PrivilegeError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")


def drop(entry: pwd.struct_passwd) -> None:
    """Become `entry` for good (all threads: glibc applies set*id to every thread)."""
    no_new_privs()
    try:
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)
    except OSError as exc:
        raise PrivilegeError(
            f"user {entry.pw_name}: switching to uid {entry.pw_uid} gid {entry.pw_gid} "
            f"failed: {exc.strerror or exc}"
        ) from exc
    if os.getuid() != entry.pw_uid or os.geteuid() != entry.pw_uid or os.getegid() != entry.pw_gid:
        raise PrivilegeError(
            f"user {entry.pw_name}: still uid {os.geteuid()} gid {os.getegid()} after switching"
        )
    os.environ["HOME"] = entry.pw_dir
    os.environ["USER"] = os.environ["LOGNAME"] = entry.pw_name
    log.info("running as %s (uid %d, gid %d)", entry.pw_name, entry.pw_uid, entry.pw_gid)


def check_writable(entry: pwd.struct_passwd, path) -> None:
    """After drop(): `path` (the cache directory) must be writable, or the cache would fail on
    every store with a warning. One line naming the owner instead."""
    if path is not None and not os.access(path, os.W_OK | os.X_OK):
        st = os.stat(path)
        raise PrivilegeError(
            f"user {entry.pw_name}: cannot write the cache directory {path} "
            f"(owner uid {st.st_uid}, mode {st.st_mode & 0o7777:o}): chown it to {entry.pw_name}"
        )
