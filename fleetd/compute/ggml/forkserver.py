"""The fork server: a fresh interpreter with numpy and the ggml libraries loaded, which forks one
compute worker per request, so a session's first graph does not pay an interpreter start and no
worker inherits anything of the daemon (no buffer, no socket, no secret).

Run as `python -m fleetd.compute.ggml.forkserver CTL_FD EVENTS_FD THREADS USER`. On CTL_FD the
daemon sends SPAWN with the worker's end of a socket pair; the answer is the worker's pid. On
EVENTS_FD it reports every worker's exit (`pid status`). When the daemon goes (CTL_FD closes),
it kills its workers and exits.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import socket
import struct
import sys

SPAWN = 1
PID = struct.Struct("<q")
EXITED = struct.Struct("<qi")  # pid, wait status


def _child(sock: socket.socket, keep: int, lib, identity, seccomp_lib, threads: int, parent: int) -> None:
    from fleetd.compute import sandbox
    from fleetd.compute.ggml import worker

    # nothing but its socket, and stderr (the daemon's: a GGML_ASSERT's message lands in its log)
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    backend = lib.ggml_backend_cpu_init()
    lib.ggml_backend_cpu_set_n_threads(backend, threads)
    worker.warm_up(lib, backend)
    sandbox.drop_privileges(identity)
    sandbox.set_parent_death_signal(signal.SIGKILL)  # after setuid, which clears it
    if os.getppid() != parent:  # the fork server went before the line above
        os._exit(1)
    try:
        sandbox.install_seccomp(seccomp_lib)
        walls = "seccomp=on"
    except sandbox.SandboxError as exc:
        walls = f"seccomp=off ({exc.strerror})"
    ready = f"pid={os.getpid()} uid={os.getuid()} gid={os.getgid()} {walls}"
    worker.serve(sock, lib, backend, threads, ready)


def main(argv: list[str]) -> int:
    """Load the libraries, report READY on CTL_FD, then fork a worker per SPAWN and report each
    exit on EVENTS_FD until CTL_FD closes."""
    ctl_fd, events_fd, threads, user = int(argv[0]), int(argv[1]), int(argv[2]), argv[3] or None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle
    # `kill -USR1` on a worker: its Python stack into the daemon's log (workers inherit this)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    from fleetd.compute import native, sandbox
    from fleetd.compute.ggml import (
        channel,
        worker,  # noqa: F401 (imported once, before any fork)
    )
    from fleetd.compute.ggml import lib as ggml

    ctl = socket.socket(fileno=ctl_fd)
    events = socket.socket(fileno=events_fd)
    try:
        lib = ggml.load()
        native.worker_loop()  # fleetd's C loop mapped now: a sandboxed worker cannot open it
        identity = sandbox.worker_identity(user)
        seccomp_lib = sandbox.load_libseccomp()
    except OSError as exc:
        channel.send_message(ctl, channel.REPLY_FAILED, str(exc).encode())
        return 1
    channel.send_message(ctl, channel.REPLY_READY, str(lib.cpu_path).encode())
    children: dict[int, int] = {}  # pidfd -> pid
    me = os.getpid()
    try:
        while True:
            watched: list[socket.socket | int] = [ctl, *children]
            readable, _, _ = select.select(watched, [], [])
            for r in readable:
                if isinstance(r, socket.socket):  # ctl; the others are pidfds
                    try:
                        kind, _payload, fds = channel.recv_message(ctl, 64, max_fds=1)
                    except (EOFError, OSError):
                        return 0
                    if kind != SPAWN or len(fds) != 1:
                        for fd in fds:
                            os.close(fd)
                        return 1
                    pid = os.fork()
                    if pid == 0:
                        code = 1
                        try:
                            ctl.close()
                            events.close()
                            for pidfd in children:
                                os.close(pidfd)
                            _child(
                                socket.socket(fileno=fds[0]), fds[0], lib, identity, seccomp_lib, threads, me
                            )
                            code = 0
                        finally:
                            os._exit(code)
                    os.close(fds[0])
                    children[os.pidfd_open(pid)] = pid
                    ctl.sendall(PID.pack(pid))
                else:
                    pid = children.pop(r)
                    os.close(r)
                    _, status = os.waitpid(pid, 0)
                    events.sendall(EXITED.pack(pid, status))
    finally:
        for pid in children.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
