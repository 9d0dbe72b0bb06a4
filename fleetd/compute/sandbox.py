"""The walls around a compute worker: its own user, no capabilities, no new privileges, and a
seccomp filter that lets it compute and talk over the one socket it has, nothing else.

The filter is built with libseccomp (libseccomp2, on every systemd distribution: it resolves
syscall names per architecture, where a hand-written BPF program would carry a number table per
architecture), called through ctypes like the ggml library, so there is no Python dependency.
Everything not on ALLOWED fails with EPERM: a worker cannot open a file, create or connect a
socket, exec, fork a process (clone only with CLONE_THREAD), ptrace or signal another process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import pwd

# What ggml's CPU compute (threads, futexes, memory) and the worker's loop (recvmsg/sendmsg on
# its socket, mmap of the buffers it is handed) need, and what CPython does while running.
ALLOWED = (
    "read",
    "write",
    "readv",
    "writev",
    "pread64",
    "pwrite64",
    "recvmsg",
    "sendmsg",
    "recvfrom",
    "sendto",
    "close",
    "fstat",
    "newfstatat",
    "lseek",
    "fcntl",
    "dup",
    "mmap",
    "munmap",
    "mremap",
    "mprotect",
    "madvise",
    "brk",
    "msync",
    "mincore",
    "futex",
    "futex_waitv",
    "set_robust_list",
    "get_robust_list",
    "rseq",
    "membarrier",
    "exit",
    "exit_group",
    "rt_sigaction",
    "rt_sigprocmask",
    "rt_sigreturn",
    "sigaltstack",
    "sched_yield",
    "sched_getaffinity",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "getpid",
    "gettid",
    "getppid",
    "getuid",
    "geteuid",
    "getgid",
    "getegid",
    "getrandom",
    "clock_gettime",
    "clock_getres",
    "clock_nanosleep",
    "nanosleep",
    "gettimeofday",
    "time",
    "poll",
    "ppoll",
    "select",
    "pselect6",
    "restart_syscall",
    "prlimit64",
    "getrusage",
    "sysinfo",
    "uname",
)
CLONE_THREAD = 0x00010000
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4
SCMP_CMP_MASKED_EQ = 7
PR_SET_NO_NEW_PRIVS = 38
PR_SET_DUMPABLE = 4
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
# ggml-cpu asks for the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
# ggml_amx_init) whenever it looks at a MUL_MAT on a CPU with AMX, once its AMX buffer type is
# registered (in the fork server, before the filter): refused, the worker wrote "AMX is not ready
# to be used!" to stderr for every matmul of every graph (a write a matmul, the logs flooded).
# Only this request: it lets the process use the tile registers, nothing else.
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def SCMP_ACT_ERRNO(e: int) -> int:  # noqa: N802 (libseccomp's macro name)
    return 0x00050000 | (e & 0xFFFF)


class ScmpArgCmp(ctypes.Structure):
    """`struct scmp_arg_cmp`: a condition on one syscall argument in a seccomp rule."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class SandboxError(OSError):
    """A wall could not go up: the worker user is missing or root, or prctl or libseccomp failed."""


_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int = 0) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise SandboxError(err, f"prctl({option}): {os.strerror(err)}")


def load_libseccomp():
    """libseccomp through ctypes, or None where it is not installed."""
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ScmpArgCmp),
    ]
    lib.seccomp_load.restype = ctypes.c_int
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def worker_identity(user: str | None) -> tuple[int, int] | None:
    """(uid, gid) a worker started by root drops to: `user`, else `fleetd` if it exists, else
    `nobody`. None when the daemon is not root (the worker keeps the daemon's unprivileged uid)."""
    if os.geteuid() != 0:
        return None
    for name in [user] if user else ["fleetd", "nobody"]:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_uid == 0:
            raise SandboxError(errno.EPERM, f"worker user {name!r} is root")
        return pw.pw_uid, pw.pw_gid
    raise SandboxError(errno.ENOENT, f"worker user {user or 'fleetd/nobody'!r} does not exist")


def drop_privileges(identity: tuple[int, int] | None) -> None:
    """No capabilities (bounding set emptied while root), no supplementary groups, the worker's
    uid and gid, no new privileges, not dumpable (no ptrace by the same uid)."""
    if identity is not None:
        last = _last_cap()
        for cap in range(last + 1):
            _prctl(PR_CAPBSET_DROP, cap)
        uid, gid = identity
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_DUMPABLE, 0)


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 40


def install_seccomp(lib=None) -> None:
    """Load the filter into this process (every thread it starts inherits it). Raises
    SandboxError when libseccomp is missing or refuses; the caller decides what that means."""
    lib = lib or load_libseccomp()
    if lib is None:
        raise SandboxError(errno.ENOSYS, "libseccomp is not installed (apt install libseccomp2)")
    ctx = lib.seccomp_init(SCMP_ACT_ERRNO(errno.EPERM))
    if not ctx:
        raise SandboxError(errno.ENOMEM, "seccomp_init failed")
    try:

        def add(action: int, name: str, *cmps: ScmpArgCmp) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:  # not a syscall of this architecture
                return
            arr = (ScmpArgCmp * max(1, len(cmps)))(*cmps)
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if rc < 0:
                raise SandboxError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")

        for name in ALLOWED:
            add(SCMP_ACT_ALLOW, name)
        # threads yes, processes no; clone3 hides its flags in memory: ENOSYS makes glibc use clone
        add(SCMP_ACT_ALLOW, "clone", ScmpArgCmp(0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, CLONE_THREAD))
        add(SCMP_ACT_ERRNO(errno.ENOSYS), "clone3")
        # abort() signals its own process only (a GGML_ASSERT must still end the worker)
        pid = os.getpid()
        add(SCMP_ACT_ALLOW, "tgkill", ScmpArgCmp(0, SCMP_CMP_EQ, pid, 0))
        add(SCMP_ACT_ALLOW, "kill", ScmpArgCmp(0, SCMP_CMP_EQ, pid, 0))
        tile = ScmpArgCmp(1, SCMP_CMP_EQ, XFEATURE_XTILEDATA, 0)
        add(SCMP_ACT_ALLOW, "arch_prctl", ScmpArgCmp(0, SCMP_CMP_EQ, ARCH_REQ_XCOMP_PERM, 0), tile)
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise SandboxError(-rc, f"seccomp_load: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)


def set_parent_death_signal(sig: int) -> None:
    """This process gets `sig` when the thread that forked it ends (no orphan workers)."""
    _prctl(PR_SET_PDEATHSIG, sig)


def proc_status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as a dict (Uid, Gid, CapEff, NoNewPrivs, Seccomp, ...)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out
