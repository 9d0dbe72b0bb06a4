"""The daemon's side of contained compute: the fork server process, one worker per computing
session, and the pool that caps, shares and reaps them.

A worker is a cache of the session's compute state (its mappings and its built graph): the daemon
keeps every GraphSpec, so a reaped, evicted or killed worker is replaced by a new one that gets
the buffers and the spec again. What the daemon never does is trust a worker: it reads a kind
and a short text back, and a worker that dies, hangs past the deadline or computes for a client
that has gone is killed and costs that session its connection, nothing else.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import fleetd
from fleetd.compute.ggml.channel import (
    MAX_REPLY,
    MSG_COMPUTE,
    MSG_RUN,
    MSG_SERVE,
    REPLY_DONE,
    REPLY_FAILED,
    REPLY_READY,
    REPLY_REFUSED,
    REPLY_SERVED,
    RUN,
    SERVED,
    recv_exact,
    recv_message,
    send_message,
)
from fleetd.compute.ggml.forkserver import EXITED, PID, SPAWN

if TYPE_CHECKING:
    from fleetd.compute.buffers import Buffer
from fleetd.compute import native
from fleetd.compute.host_memory import memfd_of, shared_pages
from fleetd.errors import ComputeError, RemoteProtocolError
from fleetd.transport.stream import set_recv_timeout

log = logging.getLogger("fleetd.workers")

# Graphs a worker keeps built: llama.cpp alternates a few (a prompt's micro-batch, a decode
# step, a batch's tail), and a graph sent again (same bytes: the session's plan cache) then
# costs its key, not a rebuild.
HELD_PLANS = 4
_T = TypeVar("_T")
READY_TIMEOUT = 30.0  # a fork server or a worker that is not up by then is broken
REPLY_TIMEOUT = 10  # seconds: a reply is a few bytes once it starts


class WorkerDied(ComputeError):
    """The session's worker ended mid-graph (a signal, an abort) or was killed."""


class ClientGone(ConnectionError):
    """The client hung up while its graph computed: the compute was cancelled."""


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


class ForkServer:
    """`python -m fleetd.compute.ggml.forkserver` and the two sockets to it."""

    def __init__(self, threads: int, user: str | None) -> None:
        ctl, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        events, events_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The fork server imports the very fleetd this daemon runs (-P: not the working
        # directory's, which may hold another checkout; this package's parent first).
        package_root = str(Path(fleetd.__file__).resolve().parent.parent)
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "fleetd.compute.ggml.forkserver",
                str(ctl_child.fileno()),
                str(events_child.fileno()),
                str(threads),
                user or "",
            ],
            pass_fds=(ctl_child.fileno(), events_child.fileno()),
            stdin=subprocess.DEVNULL,
            # ggml's backtrace on an abort opens /proc and forks a debugger: under seccomp the
            # fopen fails and it dereferences NULL. The assert's own message is what matters.
            env=dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONPATH=path),
            start_new_session=True,  # Ctrl-C on the daemon's terminal is the daemon's alone
        )
        ctl_child.close()
        events_child.close()
        self._ctl, self._events = ctl, events
        self._lock = threading.Lock()
        self._exits: dict[int, Worker] = {}
        self._exits_lock = threading.Lock()
        set_recv_timeout(ctl, READY_TIMEOUT)
        try:
            kind, payload, _ = recv_message(ctl, MAX_REPLY)
        except (OSError, EOFError) as exc:
            self.close()
            raise OSError(f"compute fork server did not start: {exc}") from exc
        if kind != REPLY_READY:
            self.close()
            raise OSError(f"compute fork server: {payload.decode(errors='replace')}")
        self.library = payload.decode()
        set_recv_timeout(ctl, None)
        self._reader = threading.Thread(target=self._read_exits, name="fleetd-worker-exits", daemon=True)
        self._reader.start()

    def spawn(self, threads: int) -> Worker:
        """A new worker, forked by the fork server and up (READY received); ComputeError if not."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self._lock:
                send_message(self._ctl, SPAWN, b"", [theirs.fileno()])
                set_recv_timeout(self._ctl, READY_TIMEOUT)
                try:
                    (pid,) = PID.unpack(recv_exact(self._ctl, PID.size))
                finally:
                    set_recv_timeout(self._ctl, None)
                worker = Worker(pid, mine, threads)
                with self._exits_lock:
                    self._exits[pid] = worker
        except (OSError, EOFError) as exc:
            mine.close()
            raise ComputeError(f"cannot start a compute worker: {exc}") from exc
        finally:
            theirs.close()
        worker.wait_ready()
        return worker

    def _read_exits(self) -> None:
        while True:
            try:
                pid, status = EXITED.unpack(recv_exact(self._events, EXITED.size))
            except (OSError, EOFError):
                return
            with self._exits_lock:
                worker = self._exits.pop(pid, None)
            if worker is not None:
                worker.exited(status)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        for s in (self._ctl, self._events):
            try:
                s.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Worker:
    """One contained process and what the daemon knows it holds."""

    def __init__(self, pid: int, sock: socket.socket, threads: int) -> None:
        self.pid, self.sock = pid, sock
        self.threads = threads
        self.lock = threading.Lock()  # held while a session uses it; the reaper only try-locks
        self.mapped: dict[int, Buffer] = {}  # handle -> Buffer
        self.built: Any = None  # the plan it computes now (a RUN's)
        # plans it holds built, by key, least recently used first (the worker keeps the same)
        self.held: OrderedDict[int, Any] = OrderedDict()  # device.GgmlPlan (a circle to import)
        self.last_used = time.monotonic()
        self.dead = False
        self.status: int | None = None
        self.walls = ""
        self.thread_cores: tuple[int, ...] = ()  # where its session thread was pinned with it
        # the pool's clean-up (its cores), called once
        self.on_kill: Callable[[Worker], None] | None = None
        self._exited = threading.Event()
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._client_fd = -1  # the client socket the poller also watches for a hang-up
        self._stint_page = None  # stint_page()
        self.yield_asked = False  # another session computes: its stint is to end (ask_yield)

    def wait_ready(self) -> None:
        """Wait for the worker's READY and keep what it says of its walls; WorkerDied if it does not come."""
        set_recv_timeout(self.sock, READY_TIMEOUT)
        try:
            kind, payload, _ = recv_message(self.sock, MAX_REPLY)
        except (OSError, EOFError) as exc:
            self.kill()
            raise WorkerDied(f"compute worker {self.pid} did not start: {self._why(exc)}") from None
        finally:
            set_recv_timeout(self.sock, None)
        if kind != REPLY_READY:
            self.kill()
            raise WorkerDied(f"compute worker {self.pid}: unexpected first message {kind}")
        self.walls = payload.decode(errors="replace")
        # A reply is a few bytes once it starts: bounded, kernel-side (no fcntl per graph).
        set_recv_timeout(self.sock, REPLY_TIMEOUT)

    def exited(self, status: int) -> None:
        self.status = status
        self.dead = True
        self._exited.set()

    def _why(self, exc: BaseException | None = None) -> str:
        self._exited.wait(2.0)  # the fork server reports the status right after the close
        if self.status is not None:
            return describe_status(self.status)
        return f"its channel closed ({exc})" if exc else "its channel closed"

    def kill(self) -> None:
        """SIGKILL the worker and drop what it held; the pool's clean-up runs once."""
        if self.on_kill is not None:
            self.on_kill(self)
            self.on_kill = None
        self.dead = True
        self.mapped.clear()  # no reference of a dead worker keeps a buffer's memory alive
        self.built = None
        self.held.clear()
        self._stint_page = None  # its fd closes with the last view of it
        try:
            os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.sock.close()
        except OSError:
            pass

    def compute(self, plan, threads: int, deadline: float, client: socket.socket | None) -> None:
        """Hand the worker what it lacks of `plan` (buffers, the spec), run it, wait for the
        answer. Raises RemoteProtocolError (the data broke a rule: row ids), ComputeError (ggml
        failed, the worker died or ran past the deadline) or ClientGone."""
        maps, fds = [], []
        unmap = [h for h, b in self.mapped.items() if b.freed]
        for h in unmap:
            del self.mapped[h]
        for handle in plan.spec.handles:
            if handle not in self.mapped:
                buf = plan.buffers[handle]
                fd = memfd_of(buf.array)
                if fd is None:
                    raise ComputeError(f"buffer {handle:#x} is not shared memory")
                maps.append((handle, buf.base, buf.size))
                fds.append(fd)
                self.mapped[handle] = buf
        if unmap:  # the worker drops the graphs over them, as this
            gone = set(unmap)
            for key in [k for k, p in self.held.items() if gone.intersection(p.spec.handles)]:
                del self.held[key]
            if self.built is not None and self.built.key not in self.held:
                self.built = None
        if maps or unmap or self.built is not plan:
            # A graph it holds built goes by its key alone; a new one evicts the least recently
            # used beyond HELD_PLANS (never the one it computes now).
            spec = None if plan.key in self.held else plan.spec
            forget = []
            if spec is not None:
                while len(self.held) >= HELD_PLANS:
                    forget.append(self.held.popitem(last=False)[0])
            self.held[plan.key] = plan
            self.held.move_to_end(plan.key)
            message = {
                "key": plan.key,
                "spec": spec,
                "maps": maps,
                "unmap": unmap,
                "threads": threads,
                "forget": forget,
            }
            kind, payload = MSG_COMPUTE, pickle.dumps(message, protocol=5)
        else:  # the same graph over the same buffers: a decode step
            kind, payload = MSG_RUN, RUN.pack(threads)
        self.last_used = time.monotonic()
        try:
            send_message(self.sock, kind, payload, fds)
        except OSError as exc:
            self.kill()
            raise WorkerDied(f"compute worker {self.pid} died: {self._why(exc)}") from None
        self.built = plan
        self.finish(deadline, client)

    def finish(self, deadline: float, client: socket.socket | None) -> None:
        """Wait for the answer to the graph handed over last (by compute() or by a session's
        fast loop in C) and act on it, as compute() says."""
        kind, payload = self._wait_reply(deadline, client, MAX_REPLY)
        text = payload.decode(errors="replace")[:1000]
        self.last_used = time.monotonic()
        if kind == REPLY_DONE:
            return
        if kind == REPLY_REFUSED:
            raise RemoteProtocolError(text)
        if kind == REPLY_FAILED:
            raise ComputeError(text)
        self.kill()
        raise WorkerDied(f"compute worker {self.pid}: unexpected reply {kind}")

    def stint_page(self):
        """The page (a shared numpy array) the worker's stints count in as they serve: a reader
        of the session's counters sees them live (FastPath.begin_stint)."""
        if self._stint_page is None:
            self._stint_page = shared_pages(STINT_PAGE, "fleetd-stint")
            if self._stint_page is None:
                raise ComputeError("no memory for a stint's counters")
        return self._stint_page

    def stint_page_fd(self) -> int:
        fd = memfd_of(self.stint_page())
        assert fd is not None
        return fd

    def ask_yield(self) -> None:
        """End the stint it serves (or is about to) at its next request or idle wait: a word in
        its page the loop reads between requests. The daemon only writes it."""
        self.yield_asked = True
        page = self._stint_page  # kill() may let go of it meanwhile
        if page is not None:
            native.FastContext.from_buffer(page).rc.yield_asked = 1

    def stint(
        self, client: socket.socket, request: bytes, graph_timeout: float, longest: float
    ) -> StintResult:
        """Hand the worker the client's connection for a stint (MSG_SERVE, `request` its
        payload) and wait for it back (see _wait_stint). Raises WorkerDied (it died, or its
        answer does not parse: it is killed), ComputeError (past a deadline: killed),
        ClientGone."""
        self.last_used = time.monotonic()
        if self.yield_asked:  # asked after the page was zeroed for this stint, or before
            native.FastContext.from_buffer(self.stint_page()).rc.yield_asked = 1
        try:
            send_message(self.sock, MSG_SERVE, request, [client.fileno(), self.stint_page_fd()])
        except OSError as exc:
            self.kill()
            raise WorkerDied(f"compute worker {self.pid} died: {self._why(exc)}") from None
        kind, payload = self._wait_stint(client, graph_timeout, longest)
        self.last_used = time.monotonic()
        try:
            if kind != REPLY_SERVED:
                raise ValueError(f"reply {kind}")
            return StintResult.parse(payload)
        except (ValueError, struct.error) as exc:
            self.kill()
            raise WorkerDied(f"compute worker {self.pid}: a stint's answer does not parse ({exc})") from None

    def _wait_reply(self, deadline: float, client: socket.socket | None, max_reply: int) -> tuple[int, bytes]:
        poller = self._poller
        self._watch_client(client)
        sock_fd = self.sock.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise ComputeError(f"graph still computing at the deadline: worker {self.pid} killed")
            for fd, ev in poller.poll(min(left, 1.0) * 1000):
                if fd == sock_fd:
                    return self._read_reply(max_reply)
                if ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                    self.kill()
                    raise ClientGone("the client hung up while its graph computed: cancelled")

    def _watch_client(self, client: socket.socket | None) -> None:
        """Have the poller watch `client` (None: no client) for a hang-up besides the channel."""
        client_fd = client.fileno() if client is not None else -1
        if client_fd != self._client_fd:
            if self._client_fd >= 0:
                self._poller.unregister(self._client_fd)
            if client_fd >= 0:
                self._poller.register(client_fd, select.POLLRDHUP)
            self._client_fd = client_fd

    def _read_reply(self, max_reply: int) -> tuple[int, bytes]:
        try:
            kind, payload, _ = recv_message(self.sock, max_reply)
            return kind, payload
        except (OSError, EOFError, ValueError) as exc:
            self.kill()
            raise WorkerDied(f"compute worker {self.pid} died mid-graph: {self._why(exc)}") from None

    def _wait_stint(self, client: socket.socket, graph_timeout: float, longest: float) -> tuple[int, bytes]:
        """A stint's answer. The worker is killed when its client hung up and it does not
        answer within STINT_HANGUP_GRACE (ClientGone: it was computing), when it made no
        progress (its live counts, a graph's start) for graph_timeout while a graph computes or
        the client's bytes wait unread (ComputeError), or after `longest` in all."""
        view = native.FastContext.from_buffer(self.stint_page())

        def progress() -> tuple[int, ...]:
            s = view.served  # the count first: C sets a graph's start before, the count after
            return (s.recompute_count, s.set_count, s.get_count, s.align_count, view.rc.started_ns)

        self._watch_client(client)
        sock_fd = self.sock.fileno()
        start = since = time.monotonic()
        seen, hung_up = progress(), 0.0
        finished = seen[4]  # the start of the last graph counted done
        tick = min(1.0, max(graph_timeout / 4, 0.05)) * 1000
        while True:
            for fd, ev in self._poller.poll(tick):
                if fd == sock_fd:
                    return self._read_reply(STINT_REPLY_MAX)
                if ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                    hung_up = time.monotonic()  # the worker sees it too, and answers
                    self._watch_client(None)
            now = time.monotonic()
            if hung_up and now - hung_up > STINT_HANGUP_GRACE:
                self.kill()
                raise ClientGone("the client hung up while its graph computed: cancelled")
            now_seen = progress()
            if now_seen[0] != seen[0]:
                finished = now_seen[4]
            if now_seen != seen:
                seen, since = now_seen, now
            if (now - since > graph_timeout and (seen[4] != finished or _readable(client))) or (
                now - start > longest
            ):
                self.kill()
                raise ComputeError(f"graph still computing at the deadline: worker {self.pid} killed")


STINT_PAGE = 4096  # the worker's loop context lies at its start (worker.Stint), counts and all
STINT_HANGUP_GRACE = 0.2  # seconds a stint's worker has to answer once its client hung up
STINT_LEFT_MAX = 64 * 1024  # the worker's receive buffer (worker.STINT_CAPACITY)
STINT_REPLY_MAX = 1 << 20
_LOOP_ANSWERS = range(native.LOOP_PYTHON, native.LOOP_BODY + 1)


def _readable(sock: socket.socket) -> bool:
    """Bytes wait in `sock` (a client's requests that nobody reads)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(0))


class StintResult:
    """What a worker says of a stint (REPLY_SERVED), checked as far as the daemon can: it trusts
    no worker, so a malformed answer kills it (the stint's parser raises ValueError)."""

    def __init__(self, answer: int, failed: int, error: int, written: bytes, left: bytes, text: str):
        self.answer, self.failed, self.error = answer, failed, error
        self.written, self.left, self.text = written, left, text

    @classmethod
    def parse(cls, payload: bytes) -> StintResult:
        answer, failed, error, n_left, n_regions, n_text = SERVED.unpack_from(payload)
        if answer not in _LOOP_ANSWERS or failed not in (0, REPLY_REFUSED, REPLY_FAILED):
            raise ValueError(f"answer {answer}, failed {failed}")
        if n_left > STINT_LEFT_MAX or len(payload) != SERVED.size + n_regions + n_left + n_text:
            raise ValueError(f"{len(payload)} bytes")
        at = SERVED.size
        written = payload[at : at + n_regions]
        at += n_regions
        left = payload[at : at + n_left]
        text = payload[at + n_left :].decode(errors="replace")[:1000]
        return cls(answer, failed, error, written, left, text)


class CpuPlacer:
    """Which cores a session's worker and its daemon thread run on.

    A decode step crosses daemon -> worker -> daemon once per token. Left to the scheduler, each
    wake-up lands on whichever core is idle, and waking an idle core costs an interrupt (on a VM,
    an exit to the host): measured on a 2-core VM, single-token decode through a worker was 0.87x
    of the in-process device unpinned, 0.96x with the daemon thread and its worker on one core.
    So both are pinned to the same `share` cores, the least used ones among those the daemon may
    run on; a share of every core is no pin at all."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.cores = sorted(os.sched_getaffinity(0))
        self._lock = threading.Lock()
        self._held: dict[int, tuple[int, ...]] = {}  # worker pid -> its cores

    def place(self, worker: Worker, share: int) -> None:
        """Pin `worker` and the calling (session) thread to `share` cores, if that changed."""
        if not self.enabled or len(self.cores) < 2:
            return
        with self._lock:
            current = self._held.get(worker.pid, ())
            if share >= len(self.cores):
                want = tuple(self.cores)
            elif len(current) == share:
                want = current  # stay: moving costs the caches
            else:
                use = {c: 0 for c in self.cores}
                for pid, cores in self._held.items():
                    if pid != worker.pid:
                        for c in cores:
                            use[c] = use.get(c, 0) + 1
                want = tuple(sorted(sorted(self.cores, key=lambda c: (use[c], c))[:share]))
            self._held[worker.pid] = want
        if want == current and worker.thread_cores == want:
            return
        try:
            os.sched_setaffinity(worker.pid, want)
            # The caller too (on Linux, 0 is this thread, not the process), unless it is the
            # main thread (a tool or a test computing without a server): what it starts later,
            # a fork server among them, would inherit the pin.
            if threading.current_thread() is not threading.main_thread():
                os.sched_setaffinity(0, want)
            worker.thread_cores = want
        except OSError as exc:  # a cpuset changed under us, or the worker is gone: unpinned
            log.debug("cannot pin worker %d to cores %s: %s", worker.pid, want, exc)

    def forget(self, worker: Worker) -> None:
        with self._lock:
            self._held.pop(worker.pid, None)


class WorkerPool:
    """At most `max_workers` workers, one per session that computes; idle ones are reaped after
    `idle_timeout`, and at the cap the least recently used idle one makes room. Threads are
    shared out among the sessions computing at the same moment: each graph gets
    max(1, threads // computing), so two sessions on a node with 4 compute threads get 2 each
    and the cores are not oversubscribed."""

    def __init__(
        self, threads: int, user: str | None, max_workers: int, idle_timeout: float, pin: bool = True
    ) -> None:
        self.threads, self.user = threads, user
        self.placer = CpuPlacer(pin)
        self.max_workers, self.idle_timeout = max_workers, idle_timeout
        self._server: ForkServer | None = None
        self._server_lock = threading.Lock()
        self._by_session: dict[int, Worker | _Reserved] = {}
        self._cond = threading.Condition()
        # sessions computing now; C's fast loops count theirs in the same cell
        self.computing = native.SharedCount()
        self._stinting: set[Worker] = set()  # workers serving a stint (begin_stint)
        self.deaths = 0  # workers that died or were killed mid-graph
        self.spawned = 0
        self.sandbox = ""  # what the last worker reported of its walls (uid, seccomp)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def start(self) -> None:
        self._server = ForkServer(self.threads, self.user)
        self._reaper = threading.Thread(target=self._reap, name="fleetd-worker-reaper", daemon=True)
        self._reaper.start()

    @property
    def library(self) -> str:
        return self._server.library if self._server else ""

    def live(self) -> int:
        with self._cond:
            return len(self._by_session)

    def worker_pids(self) -> dict[int, int]:
        """session id -> pid of its worker (tests and /v1/status)."""
        with self._cond:
            return {sid: w.pid for sid, w in self._by_session.items() if isinstance(w, Worker)}

    def compute(self, session_id: int, plan, deadline: float, client: socket.socket | None) -> None:
        """Run `plan` on the session's worker (spawned when it has none) with its share of the threads;
        a worker that died on the way is forgotten and the error re-raised."""
        worker = self._acquire(session_id, deadline)
        try:
            share = max(1, self.threads // self.computing.add(1))
            # under the pool's lock, after the count: a stint is either refused by that count
            # (begin_stint) or registered already, and asked
            self._ask_stints_to_yield()
            try:
                self.placer.place(worker, share)
                self._settle(session_id, worker, lambda: worker.compute(plan, share, deadline, client))
            finally:
                self.computing.add(-1)
        finally:
            worker.lock.release()

    def _settle(self, session_id: int, worker: Worker, run: Callable[[], _T]) -> _T:
        """run()'s result; a worker it left dead is counted and forgotten, and the error re-raised."""
        try:
            return run()
        except (ComputeError, ClientGone):
            if worker.dead:
                with self._cond:
                    self.deaths += 1
                    if self._by_session.get(session_id) is worker:
                        del self._by_session[session_id]
                    self._cond.notify_all()
            raise

    # -- a session's fast loop (fleetd.server.fast_path) hands GRAPH_RECOMPUTE over in C ------------

    def hold_for_fast(self, session_id: int, plan) -> Worker | None:
        """The session's worker, locked, when it holds `plan` built over buffers still live and
        mapped (so a GRAPH_RECOMPUTE is one MSG_RUN and nothing else) and runs with the share of
        a session computing alone; None otherwise (Python serves the recompute). The caller
        gives it back with release_fast()."""
        with self._cond:
            w = self._by_session.get(session_id)
        if not isinstance(w, Worker) or w.built is not plan or not w.lock.acquire(blocking=False):
            return None
        if (
            w.dead
            or w.built is not plan
            or any(b.freed for b in w.mapped.values())
            or any(h not in w.mapped for h in plan.spec.handles)
        ):
            w.lock.release()
            return None
        self.placer.place(w, self.threads)
        return w

    def finish_fast(self, session_id: int, worker: Worker, deadline: float, client) -> None:
        """A GRAPH_RECOMPUTE the fast loop handed over whose answer was not a plain DONE: wait
        for it and decide as compute() does (worker held by hold_for_fast)."""
        self._settle(session_id, worker, lambda: worker.finish(deadline, client))

    def stint(
        self, session_id: int, worker: Worker, request: bytes, graph_timeout: float, longest: float, client
    ) -> StintResult:
        """The session's connection served by its worker for a stint (worker held by
        hold_for_fast); the worker's answer, or what Worker.stint raises."""
        return self._settle(session_id, worker, lambda: worker.stint(client, request, graph_timeout, longest))

    def begin_stint(self, worker: Worker) -> bool:
        """Whether the session's worker (held by hold_for_fast) may take its connection for a
        stint: its session the only one with a worker and computing alone. Then it counts as
        computing until end_stint(), and a session that starts computing meanwhile asks it to
        end (Worker.ask_yield): so it runs as long as it is alone, not for a fixed budget."""
        with self._cond:  # a check and a registration that compute()'s ask cannot fall between
            if self.computing.add(1) == 1 and len(self._by_session) == 1:
                self._stinting.add(worker)  # its yield_asked is False: end_stint cleared it
                return True
            self.computing.add(-1)
            return False

    def end_stint(self, worker: Worker) -> None:
        with self._cond:  # outside _stinting no ask reaches it, so it starts the next one clear
            self._stinting.discard(worker)
            worker.yield_asked = False
        self.computing.add(-1)

    def _ask_stints_to_yield(self) -> None:
        with self._cond:
            for worker in self._stinting:
                worker.ask_yield()

    def release_fast(self, worker: Worker, used: bool) -> None:
        if used:
            worker.last_used = time.monotonic()
        worker.lock.release()
        with self._cond:  # a session waiting at the cap may evict it now, if it stays idle
            self._cond.notify_all()

    def _acquire(self, session_id: int, deadline: float) -> Worker:
        """This session's worker, locked; spawned (after evicting an idle one at the cap) when
        it has none."""
        with self._cond:
            while True:
                w = self._by_session.get(session_id)
                if w is not None and not w.dead:
                    break
                if w is not None:
                    del self._by_session[session_id]
                if len(self._by_session) < self.max_workers or self._evict_idle():
                    w = None
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ComputeError(f"all {self.max_workers} compute workers busy until the deadline")
                self._cond.wait(min(left, 1.0))
            if w is None:
                self._by_session[session_id] = placeholder = _Reserved()
        if w is not None:
            # a session computes one graph at a time: its own _Reserved only while this call spawns
            assert isinstance(w, Worker)
            w.lock.acquire()
            if not w.dead:
                return w
            w.lock.release()
            return self._acquire(session_id, deadline)
        try:
            w = self._spawn()
        except BaseException:
            with self._cond:
                if self._by_session.get(session_id) is placeholder:
                    del self._by_session[session_id]
                self._cond.notify_all()
            raise
        w.lock.acquire()
        with self._cond:
            self.spawned += 1
            self._by_session[session_id] = w
            self.sandbox = w.walls.split(" ", 1)[1] if " " in w.walls else w.walls
        if self.spawned == 1:  # what the walls are, once: an operator checks it in the log
            level = logging.WARNING if "seccomp=off" in w.walls else logging.INFO
            log.log(level, "compute workers contained: %s", self.sandbox)
        log.debug("session %d: compute worker %s", session_id, w.walls)
        return w

    def _spawn(self) -> Worker:
        """A new worker; a fork server that died (killed by the OOM killer, say) is restarted
        once, so one lost process does not cost every later session its compute."""
        with self._server_lock:
            if self._server is None:
                raise ComputeError("compute workers closed")
            if not self._server.alive():
                rc = self._server.proc.returncode
                log.warning(
                    "compute fork server %s: starting another",
                    f"killed by signal {-rc}" if rc < 0 else f"exited with status {rc}",
                )
                self._server.close()
                self._server = ForkServer(self.threads, self.user)
            server = self._server
        worker = server.spawn(self.threads)
        worker.on_kill = self.placer.forget
        return worker

    def _evict_idle(self) -> bool:
        """Kill the least recently used idle worker (caller holds _cond). False: none idle."""
        idle = [
            (w.last_used, sid, w)
            for sid, w in self._by_session.items()
            if isinstance(w, Worker) and w.lock.acquire(blocking=False)
        ]
        if not idle:
            return False
        idle.sort(key=lambda x: x[0])
        _, sid, victim = idle[0]
        for _, _, w in idle:
            if w is not victim:
                w.lock.release()
        del self._by_session[sid]
        victim.kill()
        victim.lock.release()
        return True

    def release(self, session_id: int) -> None:
        """The session ended: its worker goes (it holds nothing the daemon needs)."""
        with self._cond:
            w = self._by_session.pop(session_id, None)
            self._cond.notify_all()
        if isinstance(w, Worker):
            w.kill()

    def _reap(self) -> None:
        while not self._stop.wait(min(self.idle_timeout, 5.0)):
            now = time.monotonic()
            with self._cond:
                for sid, w in list(self._by_session.items()):
                    if (
                        isinstance(w, Worker)
                        and now - w.last_used > self.idle_timeout
                        and w.lock.acquire(blocking=False)
                    ):
                        del self._by_session[sid]
                        w.kill()
                        w.lock.release()
                self._cond.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            workers = list(self._by_session.values())
            self._by_session.clear()
        for w in workers:
            if isinstance(w, Worker):
                w.kill()
        if self._server is not None:
            self._server.close()
            self._server = None


class _Reserved:
    """A slot taken while its worker starts (counts against the cap)."""

    dead = False
